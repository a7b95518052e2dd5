//! From Kubernetes objects to what stasis-core's advisor takes: a pod's template
//! ([`WorkloadFacts`]), its nodes ([`Nodes`]), and the durations its checkpoints and restores
//! recorded. Pure: `read::advise` lists the objects once and hands them here.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use stasis_api::{CheckpointPhase, PodCheckpoint, PodRestore, RestorePhase};
use stasis_core::advise::{
    is_spot_node, SpotAffinity, WorkloadFacts, DO_NOT_DISRUPT, SPOT_NODE_LABELS,
};
use stasis_core::interval::{Measured, NodePool};
use stasis_core::notice::Provider;

use crate::view;

/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE_SECONDS: i64 = 30;

/// The template facts of a workload, read from one of its pods (`pods`: how many run) and the
/// disruption budgets of its namespace.
pub fn workload_facts(
    pod: &Pod,
    pods: u32,
    budgets: &[PodDisruptionBudget],
    has_policy: bool,
) -> WorkloadFacts {
    let spec = pod.spec.as_ref();
    let grace = spec
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(DEFAULT_GRACE_SECONDS);
    WorkloadFacts {
        opted_in: true,
        has_policy,
        replicas: pods,
        termination_grace: std::time::Duration::from_secs(u64::try_from(grace).unwrap_or(0)),
        tolerated_taint_keys: tolerated_taint_keys(pod),
        spot_affinity: spot_affinity(pod),
        has_disruption_budget: budgets.iter().any(|b| budget_selects(b, pod)),
        do_not_disrupt: pod.annotations().get(DO_NOT_DISRUPT).map(String::as_str) == Some("true"),
        spread: spec.is_some_and(|s| {
            s.topology_spread_constraints
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        }),
    }
}

/// The keys of the taints a pod tolerates (`*` for a toleration without a key, which with
/// `Exists` tolerates every taint). A toleration of `PreferNoSchedule` alone is left out: that
/// effect keeps no pod off a node.
pub fn tolerated_taint_keys(pod: &Pod) -> Vec<String> {
    let tolerations = pod.spec.as_ref().and_then(|s| s.tolerations.as_ref());
    let keys: BTreeSet<String> = tolerations
        .into_iter()
        .flatten()
        .filter(|t| t.effect.as_deref() != Some("PreferNoSchedule"))
        .map(|t| match t.key.as_deref() {
            None | Some("") => "*".to_owned(),
            Some(k) => k.to_owned(),
        })
        .collect();
    keys.into_iter().collect()
}

/// Whether a node selector requirement asks for a spot label's spot value.
fn selects_spot(r: &NodeSelectorRequirement) -> bool {
    r.operator == "In"
        && SPOT_NODE_LABELS
            .iter()
            .any(|(k, v)| *k == r.key && r.values.iter().flatten().any(|value| value == v))
}

/// How a pod's `nodeSelector` and node affinity draw it to spot nodes: required when its
/// `nodeSelector` or a required term asks for a spot label, preferred when only a preference
/// does.
pub fn spot_affinity(pod: &Pod) -> SpotAffinity {
    let Some(spec) = pod.spec.as_ref() else {
        return SpotAffinity::None;
    };
    let selector = spec.node_selector.iter().flatten();
    if selector
        .into_iter()
        .any(|(k, v)| is_spot_node([(k.as_str(), v.as_str())]))
    {
        return SpotAffinity::Required;
    }
    let Some(na) = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
    else {
        return SpotAffinity::None;
    };
    let required = na
        .required_during_scheduling_ignored_during_execution
        .iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_expressions.iter().flatten())
        .any(selects_spot);
    let preferred = na
        .preferred_during_scheduling_ignored_during_execution
        .iter()
        .flatten()
        .flat_map(|p| p.preference.match_expressions.iter().flatten())
        .any(selects_spot);
    match (required, preferred) {
        (true, _) => SpotAffinity::Required,
        (false, true) => SpotAffinity::Preferred,
        (false, false) => SpotAffinity::None,
    }
}

/// Whether a PodDisruptionBudget selects a pod (policy/v1: an empty selector selects every pod
/// of its namespace, none selects none).
pub fn budget_selects(b: &PodDisruptionBudget, pod: &Pod) -> bool {
    b.namespace() == pod.namespace()
        && b.spec
            .as_ref()
            .and_then(|s| s.selector.as_ref())
            .is_some_and(|sel| view::label_selects(sel, pod.labels()))
}

/// What the nodes say: per node its pool, cloud and whether it is spot capacity, and the taints
/// every spot node carries.
#[derive(Debug, Default)]
pub struct Nodes {
    nodes: Vec<NodeFacts>,
    /// Keys of the `NoSchedule`/`NoExecute` taints every spot node carries.
    pub spot_taint_keys: Vec<String>,
}

#[derive(Debug)]
struct NodeFacts {
    name: String,
    pool: NodePool,
    provider: Option<Provider>,
    spot: bool,
}

impl Nodes {
    pub fn of(nodes: &[Node]) -> Self {
        let facts = nodes
            .iter()
            .map(|n| {
                let labels = || {
                    n.metadata
                        .labels
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                };
                let pool = stasis_api::policy::node_pool(n);
                let provider_id = n.spec.as_ref().and_then(|s| s.provider_id.as_deref());
                NodeFacts {
                    name: n.name_any(),
                    spot: pool.spot || is_spot_node(labels()),
                    provider: Provider::of_node(provider_id, labels()),
                    pool,
                }
            })
            .collect::<Vec<_>>();
        let mut common: Option<BTreeSet<String>> = None;
        for (n, f) in nodes.iter().zip(&facts) {
            if !f.spot {
                continue;
            }
            let keys: BTreeSet<String> = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
                .map(|t| t.key.clone())
                .collect();
            common = Some(match common {
                None => keys,
                Some(c) => c.intersection(&keys).cloned().collect(),
            });
        }
        Self {
            nodes: facts,
            spot_taint_keys: common.unwrap_or_default().into_iter().collect(),
        }
    }

    /// The pool, cloud and spot-ness of the nodes `pods` run on: the first node's pool and cloud,
    /// spot when any is; `None` when none of them is on a known node.
    pub fn of_pods(&self, pods: &[&Pod]) -> Option<(NodePool, Option<Provider>, bool)> {
        let mine: Vec<&NodeFacts> = pods
            .iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.as_deref())
            .filter_map(|n| self.nodes.iter().find(|f| f.name == n))
            .collect();
        let first = mine.first()?;
        Some((
            first.pool.clone(),
            mine.iter().find_map(|f| f.provider),
            mine.iter().any(|f| f.spot),
        ))
    }
}

/// The checkpoints that belong to `pods` (their lineages, else the pods themselves).
pub fn checkpoints_of<'a>(
    checkpoints: &'a [PodCheckpoint],
    pods: &[&Pod],
) -> Vec<&'a PodCheckpoint> {
    checkpoints
        .iter()
        .filter(|c| {
            pods.iter().any(|p| {
                let lineage = p
                    .annotations()
                    .get(view::LINEAGE_ANNOTATION)
                    .filter(|l| !l.is_empty());
                c.namespace() == p.namespace() && view::of_pod(c, p, lineage.map(String::as_str))
            })
        })
        .collect()
}

/// The freeze and upload of `checkpoints`' succeeded ones, oldest first (the controller's own
/// reading for `interval: auto`).
pub fn measured(checkpoints: &[&PodCheckpoint]) -> Vec<Measured> {
    stasis_api::policy::measured_costs(checkpoints.iter().copied())
}

/// The newest succeeded checkpoint's time from the freeze to the manifest written, in ms.
pub fn last_total_ms(checkpoints: &[&PodCheckpoint]) -> Option<u64> {
    checkpoints
        .iter()
        .filter_map(|c| {
            let s = c.status.as_ref()?;
            (s.phase == Some(CheckpointPhase::Succeeded)).then_some(())?;
            let total = s
                .total_millis
                .or_else(|| Some(s.freeze_millis? + s.upload_millis?))?;
            Some((
                s.start_time.as_ref().map(view::ms),
                u64::try_from(total).ok()?,
            ))
        })
        .max_by_key(|(start, _)| *start)
        .map(|(_, t)| t)
}

/// Durations of the restores into `pods`' lineages that restored, oldest first, in ms: from the
/// PodRestore's creation (the replacement's admission) to its completion, else the agent's fetch
/// and restore times.
pub fn restore_ms(restores: &[PodRestore], pods: &[&Pod]) -> Vec<u64> {
    let lineages: Vec<&String> = pods
        .iter()
        .filter_map(|p| p.annotations().get(view::LINEAGE_ANNOTATION))
        .collect();
    let names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    let mut v: Vec<(i64, u64)> = restores
        .iter()
        .filter(|r| pods.iter().any(|p| p.namespace() == r.namespace()))
        .filter(|r| {
            r.spec
                .lineage
                .as_ref()
                .is_some_and(|l| lineages.contains(&l))
                || names.contains(&r.spec.target_pod_name)
        })
        .filter_map(|r| {
            let s = r.status.as_ref()?;
            (s.phase == Some(RestorePhase::Restored)).then_some(())?;
            let created = r.metadata.creation_timestamp.as_ref().map(view::ms);
            let done = s.completion_time.as_ref().map(view::ms);
            let ms = match (created, done) {
                (Some(c), Some(d)) if d >= c => d - c,
                _ => s.fetch_millis.unwrap_or(0) + s.restore_millis?,
            };
            Some((created.unwrap_or(0), u64::try_from(ms).ok()?))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, ms)| ms).collect()
}

/// From creation to `Ready` of `pods` that started cold (stasis decided `ColdStart`), in ms,
/// with the pod's name.
pub fn cold_start_ms(pods: &[&Pod]) -> Vec<(String, u64)> {
    pods.iter()
        .filter(|p| {
            p.annotations()
                .get(view::DECISION_ANNOTATION)
                .map(String::as_str)
                == Some("ColdStart")
        })
        .filter_map(|p| {
            let created = p.metadata.creation_timestamp.as_ref().map(view::ms)?;
            let ready = p
                .status
                .as_ref()?
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Ready" && c.status == "True")?;
            let at = ready.last_transition_time.as_ref().map(view::ms)?;
            Some((p.name_any(), u64::try_from(at - created).ok()?))
        })
        .collect()
}
