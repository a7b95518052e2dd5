//! Pre-staging's facts of Kubernetes objects: what `stasis_core::prestage` decides from, read
//! of a Node and of a pod's spec. The agents decide which nodes pre-stage an at-risk pod's
//! checkpoint from them, and the webhook which nodes its replacement should prefer: the same
//! facts, so both name the same nodes.

use k8s_openapi::api::core::v1::{Node, PodSpec};
use kube::ResourceExt;
use stasis_core::prestage::{NodeFacts, Placement, Taint, Toleration};

/// What pre-staging reads of a Node.
pub fn node_facts(n: &Node) -> NodeFacts {
    let spec = n.spec.clone().unwrap_or_default();
    NodeFacts {
        name: n.name_any(),
        ready: n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        unschedulable: spec.unschedulable.unwrap_or(false),
        taints: spec
            .taints
            .unwrap_or_default()
            .into_iter()
            .map(|t| Taint {
                key: t.key,
                value: t.value,
                effect: t.effect,
            })
            .collect(),
        labels: n.labels().clone(),
    }
}

/// What decides where a pod's replacement can go (its spec's, which the replacement shares).
pub fn placement(spec: &PodSpec) -> Placement {
    Placement {
        node_selector: spec.node_selector.clone().unwrap_or_default(),
        tolerations: spec
            .tolerations
            .iter()
            .flatten()
            .map(|t| Toleration {
                key: t.key.clone(),
                operator: t.operator.clone(),
                value: t.value.clone(),
                effect: t.effect.clone(),
            })
            .collect(),
    }
}
