//! `advise`: for each opted-in workload in scope, stasis-core's eviction-readiness checks and the
//! arithmetic of an eviction with and without stasis, with where each figure came from.
//!
//! `read::advise` lists the objects once ([`Facts`]); [`report`] is pure over them, and
//! stasis-core's `advise` holds the checks and the model, so this module only maps objects to
//! its inputs and says which figures were measured, read from a policy or its status, estimated
//! here, or assumed.

mod facts;
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
use stasis_core::interval::{self, NodePool};
use stasis_core::workload::WorkloadKind;

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

/// A number and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    pub value: f64,
    pub source: Source,
    /// Which object, or which assumption.
    pub from: String,
}

/// Where a figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// Recorded by stasis on this workload's checkpoints, restores or pods.
    Measured,
    /// A CheckpointPolicy's spec.
    Policy,
    /// A CheckpointPolicy's status (`interval: auto`: the controller's choice and inputs).
    PolicyStatus,
    /// Computed here from the other figures, as the controller would.
    Estimated,
    /// Assumed: nothing was recorded.
    Default,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Policy => "policy",
            Source::PolicyStatus => "policy status",
            Source::Estimated => "estimated",
            Source::Default => "default",
        }
    }
}

fn fig(value: f64, source: Source, from: impl Into<String>) -> Figure {
    Figure {
        value,
        source,
        from: from.into(),
    }
}

fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// `freeze of its last succeeded checkpoint`, `mean freeze of its last 3 succeeded checkpoints`.
fn of_checkpoints(what: &str, n: usize) -> String {
    match n {
        1 => format!("{what} of its last succeeded checkpoint"),
        n => format!("mean {what} of its last {n} succeeded checkpoints"),
    }
}

fn mean(v: &[u64]) -> Option<u64> {
    (!v.is_empty()).then(|| v.iter().sum::<u64>() / v.len() as u64)
}

/// The last [`interval::COST_SAMPLES`] of `v` (oldest first).
fn recent<T>(v: &[T]) -> &[T] {
    &v[v.len().saturating_sub(interval::COST_SAMPLES)..]
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
    for p in &f.pods {
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

    // the cost of a checkpoint, from this workload's checkpoints
    let mine = facts::checkpoints_of(&f.checkpoints, pods);
    let measured = facts::measured(&mine);
    let samples = recent(&measured);
    let (checkpoint_seconds, freeze_seconds) = match interval::checkpoint_cost(&measured) {
        Some(cost) => {
            let freeze = mean(&samples.iter().map(|m| m.freeze_ms).collect::<Vec<_>>());
            (
                fig(
                    cost.as_secs_f64(),
                    Source::Measured,
                    of_checkpoints("freeze + upload", samples.len()),
                ),
                fig(
                    secs(freeze.unwrap_or(0)),
                    Source::Measured,
                    of_checkpoints("freeze", samples.len()),
                ),
            )
        }
        None => (
            fig(
                interval::DEFAULT_COST.as_secs_f64(),
                Source::Default,
                "no succeeded checkpoint of it yet (interval: auto assumes the same)",
            ),
            fig(
                advise::DEFAULT_FREEZE.as_secs_f64(),
                Source::Default,
                "no succeeded checkpoint of it yet",
            ),
        ),
    };
    let restores = facts::restore_ms(&f.restores, pods);
    let restore_seconds = match mean(recent(&restores)) {
        Some(ms) => fig(
            secs(ms),
            Source::Measured,
            match recent(&restores).len() {
                1 => "its last restore (the PodRestore's creation to restored)".to_owned(),
                n => format!(
                    "mean of its last {n} restores (each PodRestore's creation to restored)"
                ),
            },
        ),
        None => fig(
            advise::DEFAULT_RESTORE.as_secs_f64(),
            Source::Default,
            "no restore of it recorded",
        ),
    };
    let colds = facts::cold_start_ms(pods);
    let cold_start_seconds = match mean(&colds.iter().map(|(_, ms)| *ms).collect::<Vec<_>>()) {
        Some(ms) => fig(
            secs(ms),
            Source::Measured,
            format!(
                "creation to Ready of its cold-started pods ({})",
                colds
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        None => fig(
            advise::DEFAULT_COLD_START.as_secs_f64(),
            Source::Default,
            "no cold start of it seen",
        ),
    };
    let lost_work_without_seconds = if job {
        let started = first
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map(crate::view::ms);
        let age = started.map_or(0, |s| u64::try_from(f.now_ms - s).unwrap_or(0));
        fig(
            secs(age),
            Source::Measured,
            format!(
                "a Job: the work of pod {} since its start",
                first.name_any()
            ),
        )
    } else {
        fig(
            0.0,
            Source::Default,
            "a server: nothing beyond the cold start",
        )
    };

    // the eviction rate of its pool
    let evictions_per_hour = match pool_status {
        Some((p, a)) if a.mtbf_seconds > 0 => fig(
            3600.0 / a.mtbf_seconds as f64,
            Source::PolicyStatus,
            format!(
                "policy {}'s status: pool {}, MTBF {} s, {} interruptions seen",
                p.name_any(),
                a.node_pool,
                a.mtbf_seconds,
                a.interruptions
            ),
        ),
        _ => {
            let p = pool.clone().unwrap_or(NodePool {
                name: "default".into(),
                spot,
            });
            fig(
                3600.0 / interval::prior_mtbf(&p).as_secs_f64(),
                Source::Default,
                format!(
                    "no policy status for pool {}: the controller's prior (one a day on demand, four a day on spot)",
                    p.key()
                ),
            )
        }
    };

    let interval_seconds = policy.and_then(|p| match p.spec.interval() {
        Ok(stasis_core::policy::Interval::Fixed(d)) => Some(fig(
            d.as_secs_f64(),
            Source::Policy,
            format!("policy {}", p.name_any()),
        )),
        Ok(stasis_core::policy::Interval::Auto) => Some(match own_status {
            Some((sp, a)) if sp.name_any() == p.name_any() => fig(
                a.interval_millis as f64 / 1000.0,
                Source::PolicyStatus,
                format!("policy {} (auto), its status for pod {}", p.name_any(), a.pod),
            ),
            _ => {
                let mtbf = Duration::from_secs_f64(3600.0 / evictions_per_hour.value.max(1e-9));
                let cost = (checkpoint_seconds.source == Source::Measured)
                    .then(|| Duration::from_secs_f64(checkpoint_seconds.value));
                let freeze = Duration::from_secs_f64(freeze_seconds.value);
                let a = interval::auto_interval(cost, Some(freeze), mtbf, p.spec.freeze_fraction());
                fig(
                    a.interval.as_secs_f64(),
                    Source::Estimated,
                    format!(
                        "policy {} (auto) lists none of its pods yet: chosen here as the controller would",
                        p.name_any()
                    ),
                )
            }
        }),
        Err(_) => None,
    });

    let d = |f: &Figure| Duration::from_secs_f64(f.value.max(0.0));
    let goodput = interval_seconds.as_ref().map(|i| {
        let cost = CostFacts {
            freeze: d(&freeze_seconds),
            checkpoint: d(&checkpoint_seconds),
            interval: d(i),
            restore: d(&restore_seconds),
            cold_start: d(&cold_start_seconds),
            lost_work_without: d(&lost_work_without_seconds),
        };
        advise::goodput(&cost, evictions_per_hour.value)
    });
    let wf = facts::workload_facts(
        first,
        u32::try_from(pods.len()).unwrap_or(u32::MAX),
        &f.budgets,
        policy.is_some(),
    );
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
