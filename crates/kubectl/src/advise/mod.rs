//! `advise`: for each opted-in workload in scope, stasis-core's eviction-readiness checks and the
//! arithmetic of an eviction with and without stasis, with where each figure came from.
//!
//! `read::advise` lists the objects once ([`Facts`]); [`report`] is pure over them, and
//! stasis-core's `advise` holds the checks and the model, so this module only maps objects to
//! its inputs and says which figures were measured, read from a policy or its status, estimated
//! here, or assumed.

mod facts;
mod figures;
mod render;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use serde::Serialize;
use stasis_api::policy::AutoIntervalStatus;
use stasis_api::{CheckpointPolicy, PodCheckpoint, PodRestore};
use stasis_core::advise::{self, CostFacts, Finding, Goodput, PoolFacts};
use stasis_core::interval::NodePool;
use stasis_core::workload::WorkloadKind;

pub use figures::Figure;
pub use render::render;

/// Everything `advise` reads, listed once.
#[derive(Debug)]
pub struct Facts {
    /// `namespace prod` or `all namespaces`.
    pub scope: String,
    /// The opted-in pods in scope.
    pub pods: Vec<Pod>,
    pub budgets: Vec<PodDisruptionBudget>,
    /// The cluster's nodes, or why they could not be read (namespace users usually may not).
    pub nodes: Result<Vec<Node>, String>,
    /// Every policy in scope (status included).
    pub policies: Vec<CheckpointPolicy>,
    pub checkpoints: Vec<PodCheckpoint>,
    pub restores: Vec<PodRestore>,
    pub now_ms: i64,
}

/// What `advise` prints (`-o json|yaml`: this shape).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub scope: String,
    /// What limited the advice (nodes not readable, say).
    pub notes: Vec<String>,
    pub workloads: Vec<WorkloadAdvice>,
}

/// One workload's advice.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadAdvice {
    pub namespace: String,
    /// `deployment/web`, `statefulset/db`, `job/train`, `pod/x`.
    pub workload: String,
    pub pods: Vec<String>,
    /// The node pool (`<name>` or `<name>/spot`), when its nodes or a policy's status say.
    pub node_pool: Option<String>,
    pub spot: bool,
    /// `aws`, `gcp`, `azure`, when its nodes say.
    pub provider: Option<String>,
    pub policy: Option<String>,
    /// The heartbeat interval; none without a policy (or with an invalid one).
    pub interval_seconds: Option<Figure>,
    /// One checkpoint from the freeze to the upload's end.
    pub checkpoint_seconds: Figure,
    pub freeze_seconds: Figure,
    pub restore_seconds: Figure,
    pub cold_start_seconds: Figure,
    /// Work an eviction throws away without stasis beyond the cold start.
    pub lost_work_without_seconds: Figure,
    pub evictions_per_hour: Figure,
    /// The arithmetic at that rate; none without an interval.
    pub goodput: Option<Goodput>,
    pub findings: Vec<Finding>,
}

/// How kubectl names a workload: `deployment/web`; a pod whose owner cannot be told: `pod/x`.
fn workload_name(pod: &Pod) -> (String, bool) {
    let Ok(id) = stasis_api::pod::workload_identity(pod) else {
        return (format!("pod/{}", pod.name_any()), false);
    };
    let kind = match &id.kind {
        WorkloadKind::Deployment => "deployment",
        WorkloadKind::ReplicaSet => "replicaset",
        WorkloadKind::StatefulSet => "statefulset",
        WorkloadKind::Job => "job",
        WorkloadKind::Pod => "pod",
        WorkloadKind::Other(k) => k.as_str(),
    };
    (format!("{kind}/{}", id.name), id.kind == WorkloadKind::Job)
}

/// The advice for every opted-in workload of `f`, by namespace and name.
pub fn report(f: &Facts) -> Report {
    let mut notes = Vec::new();
    let nodes = match &f.nodes {
        Ok(n) => facts::Nodes::of(n),
        Err(e) => {
            notes.push(format!(
                "nodes are not readable ({e}): the node pool comes from the policies' status where it is listed, the cloud is unknown, and the checks against its spot notice are left out; ask for read access to nodes for those"
            ));
            facts::Nodes::default()
        }
    };
    let mut groups: BTreeMap<(String, String), (bool, Vec<&Pod>)> = BTreeMap::new();
    // a pod that ended (a Job's finished one) is not evicted any more
    let ended = |p: &Pod| {
        matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
    };
    for p in f.pods.iter().filter(|p| !ended(p)) {
        let (name, job) = workload_name(p);
        let g = groups
            .entry((p.namespace().unwrap_or_default(), name))
            .or_insert((job, Vec::new()));
        g.1.push(p);
    }
    let statuses: Vec<(&CheckpointPolicy, &AutoIntervalStatus)> = f
        .policies
        .iter()
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(move |s| s.auto_intervals.iter().map(move |a| (p, a)))
        })
        .collect();
    let workloads = groups
        .into_iter()
        .map(|((ns, name), (job, mut pods))| {
            pods.sort_by_key(|p| p.name_any());
            workload(f, &nodes, &statuses, ns, name, job, &pods)
        })
        .collect();
    Report {
        scope: f.scope.clone(),
        notes,
        workloads,
    }
}

/// One workload's advice; `pods` sorted by name, the first read for its template.
fn workload(
    f: &Facts,
    nodes: &facts::Nodes,
    statuses: &[(&CheckpointPolicy, &AutoIntervalStatus)],
    namespace: String,
    workload: String,
    job: bool,
    pods: &[&Pod],
) -> WorkloadAdvice {
    let first = pods[0];
    let names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    let policy = crate::view::policy_for(&f.policies, first);
    // its pods' entries in the policies' status (interval: auto), else its pool's
    let own_status = statuses.iter().find(|(p, a)| {
        p.namespace().as_deref() == Some(namespace.as_str()) && names.contains(&a.pod)
    });
    let on_nodes = nodes.of_pods(pods);
    let pool: Option<NodePool> = on_nodes.as_ref().map(|(p, _, _)| p.clone()).or_else(|| {
        own_status.map(|(_, a)| {
            let (name, spot) = match a.node_pool.strip_suffix("/spot") {
                Some(n) => (n, true),
                None => (a.node_pool.as_str(), false),
            };
            NodePool {
                name: name.to_owned(),
                spot,
            }
        })
    });
    let provider = on_nodes.as_ref().and_then(|(_, p, _)| *p);
    let spot = on_nodes
        .as_ref()
        .map_or(pool.as_ref().is_some_and(|p| p.spot), |n| n.2);
    let pool_status = own_status.or_else(|| {
        let key = pool.as_ref()?.key();
        statuses.iter().find(|(_, a)| a.node_pool == key)
    });

    let wf = facts::workload_facts(
        first,
        u32::try_from(pods.len()).unwrap_or(u32::MAX),
        &f.budgets,
        policy.is_some(),
    );
    let mine = facts::checkpoints_of(&f.checkpoints, pods);
    let (checkpoint_seconds, freeze_seconds) = figures::cost(&facts::measured(&mine));
    let restore_seconds = figures::restore(&facts::restore_ms(&f.restores, pods));
    let cold_start_seconds = figures::cold_start(&facts::cold_start_ms(pods));
    let lost_work_without_seconds = figures::lost_work(job, first, f.now_ms);
    // a pod not on a node yet that requires spot capacity will be on it
    let evictions_per_hour = figures::evictions(
        pool_status,
        pool.as_ref(),
        spot || wf.spot_affinity == advise::SpotAffinity::Required,
    );
    let interval_seconds = policy.and_then(|p| {
        figures::heartbeat(
            p,
            own_status,
            &evictions_per_hour,
            &checkpoint_seconds,
            &freeze_seconds,
        )
    });
    let goodput = interval_seconds.as_ref().map(|i| {
        let cost = CostFacts {
            freeze: freeze_seconds.duration(),
            checkpoint: checkpoint_seconds.duration(),
            interval: i.duration(),
            restore: restore_seconds.duration(),
            cold_start: cold_start_seconds.duration(),
            lost_work_without: lost_work_without_seconds.duration(),
        };
        advise::goodput(&cost, evictions_per_hour.value)
    });
    let pf = PoolFacts {
        provider,
        spot,
        spot_taint_keys: nodes.spot_taint_keys.clone(),
    };
    let last_total = facts::last_total_ms(&mine).map(Duration::from_millis);
    let mut findings = advise::check(&wf, &pf, last_total);
    findings.sort_by(|a, b| b.severity.cmp(&a.severity).then(a.code.cmp(b.code)));
    WorkloadAdvice {
        namespace,
        workload,
        pods: names,
        node_pool: pool.map(|p| p.key()),
        spot,
        provider: provider.map(|p| p.name().to_owned()),
        policy: policy.map(|p| p.name_any()),
        interval_seconds,
        checkpoint_seconds,
        freeze_seconds,
        restore_seconds,
        cold_start_seconds,
        lost_work_without_seconds,
        evictions_per_hour,
        goodput,
        findings,
    }
}
