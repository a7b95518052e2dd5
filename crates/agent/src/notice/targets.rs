//! Which pods a notice checkpoints, most valuable first.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use stasis_api::CheckpointPolicy;
use stasis_core::notice::{self, Candidate};

use crate::status::PodKey;

/// Memory of a pod's containers (limits, else requests), bytes.
fn pod_memory(pod: &Pod) -> u64 {
    let qty = |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| {
        notice::memory_quantity_bytes(&q.0).unwrap_or(0)
    };
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .filter_map(|c| c.resources.as_ref())
        .map(|r| {
            r.limits
                .as_ref()
                .and_then(|l| l.get("memory"))
                .or_else(|| r.requests.as_ref().and_then(|l| l.get("memory")))
                .map(qty)
                .unwrap_or(0)
        })
        .sum()
}

fn pod_uses_gpu(pod: &Pod) -> bool {
    pod.spec.iter().flat_map(|s| s.containers.iter()).any(|c| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.keys().any(|k| k.ends_with("/gpu")))
    })
}

/// The pods of `node` a notice checkpoints, most valuable first: running, opted in through the
/// RuntimeClass, selected by a policy of their namespace that wants notices.
pub fn notice_targets(
    pods: &[Arc<Pod>],
    policies: &[Arc<CheckpointPolicy>],
    node: &str,
    runtime_class: &str,
) -> Vec<PodKey> {
    let candidates = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_deref())
                == Some(runtime_class)
        })
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| {
            let ns = p.namespace().unwrap_or_default();
            policies.iter().any(|pol| {
                pol.metadata.namespace.as_deref() == Some(ns.as_str())
                    && pol.spec.triggers.spot_notice
                    && crate::selector::matches(&pol.spec.selector, p.labels())
            })
        })
        .map(|p| Candidate {
            key: PodKey {
                namespace: p.namespace().unwrap_or_default(),
                name: p.name_any(),
                uid: p.metadata.uid.clone().unwrap_or_default(),
            },
            uses_gpu: pod_uses_gpu(p),
            memory_bytes: pod_memory(p),
            started_unix_ms: p
                .status
                .as_ref()
                .and_then(|s| s.start_time.as_ref())
                .map(|t| t.0.as_millisecond())
                .unwrap_or(0),
        })
        .collect();
    notice::most_valuable_first(candidates)
        .into_iter()
        .map(|c| c.key)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notice::ProviderChoice;
    use serde_json::json;
    use stasis_core::notice::Provider;

    fn pod(name: &str, node: &str, rc: &str, phase: &str, mem: &str, gpu: bool) -> Arc<Pod> {
        let mut limits = json!({"memory": mem});
        if gpu {
            limits["nvidia.com/gpu"] = json!("1");
        }
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                             "labels": {"app": "serve"}},
                "spec": {"nodeName": node, "runtimeClassName": rc,
                         "containers": [{"name": "c", "image": "i",
                                         "resources": {"limits": limits}}]},
                "status": {"phase": phase, "startTime": "2026-12-01T10:00:00Z"}
            }))
            .unwrap(),
        )
    }

    fn policy(ns: &str, spot_notice: bool) -> Arc<CheckpointPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": "p", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": "serve"}}, "interval": "5m",
                         "triggers": {"spotNotice": spot_notice}}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn targets_are_this_nodes_opted_in_running_pods_gpu_and_large_first() {
        let pods = vec![
            pod("small", "w1", "stasis", "Running", "256Mi", false),
            pod("gpu", "w1", "stasis", "Running", "1Gi", true),
            pod("large", "w1", "stasis", "Running", "16Gi", false),
            pod("elsewhere", "w2", "stasis", "Running", "64Gi", false),
            pod("not-opted-in", "w1", "runc", "Running", "64Gi", false),
            pod("pending", "w1", "stasis", "Pending", "64Gi", false),
        ];
        let names = |ks: Vec<PodKey>| ks.into_iter().map(|k| k.name).collect::<Vec<_>>();
        assert_eq!(
            names(notice_targets(&pods, &[policy("ml", true)], "w1", "stasis")),
            ["gpu", "large", "small"]
        );
        assert!(
            notice_targets(&pods, &[policy("ml", false)], "w1", "stasis").is_empty(),
            "a policy with spotNotice: false"
        );
        assert!(
            notice_targets(&pods, &[policy("other", true)], "w1", "stasis").is_empty(),
            "a policy of another namespace"
        );
    }

    #[test]
    fn notices_are_on_by_default_in_a_policy() {
        let p: CheckpointPolicy = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"selector": {}, "interval": "5m"}
        }))
        .unwrap();
        assert!(p.spec.triggers.spot_notice);
    }

    #[test]
    fn provider_choice_parses() {
        assert_eq!("auto".parse(), Ok(ProviderChoice::Auto));
        assert_eq!("none".parse(), Ok(ProviderChoice::Off));
        assert_eq!("gke".parse(), Ok(ProviderChoice::Given(Provider::Gcp)));
        assert!("ibm".parse::<ProviderChoice>().is_err());
    }
}
