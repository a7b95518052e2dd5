//! Adapters from a Kubernetes [`Pod`] to stasis-core's pure inputs: the identity facts, the
//! normalised spec hash, volume facts, liveness probes and how the pod's previous instance ended.
//! The rules themselves live in stasis-core (docs/design.md §10); this module only reads fields.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use stasis_core::decision::LastExit;
use stasis_core::podspec::{self, SpecHash, VolumeFacts};
use stasis_core::policy::LivenessProbe;
use stasis_core::workload::{
    IdentityError, OwnerFacts, PodFacts, ReplicaSetOwner, WorkloadIdentity,
};

/// The identity facts of a pod: namespace, name, its controlling owner, labels, annotations.
/// A pod inside an admission request may carry neither namespace nor name (they are filled in
/// after mutating admission): set `namespace` from the request; a `generateName` pod of a
/// ReplicaSet or Job needs no name.
pub fn pod_facts(pod: &Pod) -> PodFacts {
    let m = &pod.metadata;
    PodFacts {
        namespace: m.namespace.clone().unwrap_or_default(),
        // The webhook may see a pod with only generateName; the caller fills the name in then.
        name: m.name.clone().unwrap_or_default(),
        controller: m
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| OwnerFacts {
                kind: o.kind.clone(),
                name: o.name.clone(),
                uid: o.uid.clone(),
            }),
        labels: m.labels.clone().unwrap_or_default(),
        annotations: m.annotations.clone().unwrap_or_default(),
        replicaset_owner: ReplicaSetOwner::Unknown,
    }
}

/// The workload a pod belongs to, from the pod alone (a ReplicaSet's Deployment from its name
/// shape). The webhook looks the owners up instead (docs/design.md §10.2).
pub fn workload_identity(pod: &Pod) -> Result<WorkloadIdentity, IdentityError> {
    WorkloadIdentity::of(&pod_facts(pod))
}

/// Name of the init container stasis's webhook injects into a restoring pod (it waits for the
/// node's agent to prepare the archive). Left out of the spec hash: a restored pod carries it,
/// its own replacement's spec does not (yet), and both must hash alike.
pub const RESTORE_WAIT_CONTAINER: &str = "stasis-restore-wait";

/// The normalised spec hash of a pod (`None` when it has no spec), leaving out the injected
/// [`RESTORE_WAIT_CONTAINER`].
pub fn spec_hash(pod: &Pod) -> Option<SpecHash> {
    let mut spec = serde_json::to_value(pod.spec.as_ref()?).ok()?;
    if let Some(inits) = spec
        .get_mut("initContainers")
        .and_then(|v| v.as_array_mut())
    {
        inits.retain(|c| c.get("name").and_then(|n| n.as_str()) != Some(RESTORE_WAIT_CONTAINER));
    }
    Some(podspec::spec_hash(&spec))
}

/// The pod's volumes, classified for the restore decision.
pub fn volume_facts(pod: &Pod) -> Vec<VolumeFacts> {
    pod.spec
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
        .map(|s| podspec::volume_facts(&s))
        .unwrap_or_default()
}

/// Liveness probes of the pod's app containers, for the freeze budget.
pub fn liveness_probes(pod: &Pod) -> Vec<LivenessProbe> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .filter_map(|c| c.liveness_probe.as_ref())
        .map(|p| LivenessProbe {
            period_seconds: p.period_seconds,
            failure_threshold: p.failure_threshold,
            timeout_seconds: p.timeout_seconds,
        })
        .collect()
}

/// The value of the cold-start annotation, if any.
pub fn cold_start_annotation(pod: &Pod) -> Option<String> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(crate::names::COLD_START)
        .cloned()
}

/// How a (source) pod's last instance ended, from its status:
/// - pod `status.reason` `Evicted`, `Preempting`, `NodeLost`, `Terminated` (node shutdown) or a
///   `DisruptionTarget` condition → [`LastExit::Evicted`];
/// - a container terminated with reason `OOMKilled` (or now waiting after one) →
///   [`LastExit::OomKilled`];
/// - a deletion timestamp (graceful stop) → [`LastExit::Terminated`];
/// - a container terminated with a non-zero exit code → [`LastExit::Error`] (a crash), exit 0
///   with every container done → [`LastExit::Completed`];
/// - otherwise [`LastExit::Unknown`].
pub fn last_exit(pod: &Pod) -> LastExit {
    let status = pod.status.as_ref();
    let evicted_reason = status.and_then(|s| s.reason.as_deref()).is_some_and(|r| {
        matches!(
            r,
            "Evicted" | "Preempting" | "NodeLost" | "Terminated" | "NodeShutdown"
        )
    });
    let disruption = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "DisruptionTarget" && c.status == "True")
        });
    if evicted_reason || disruption {
        return LastExit::Evicted;
    }
    let statuses: Vec<&ContainerStatus> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .collect();
    let terminated = |c: &&ContainerStatus| {
        c.state
            .as_ref()
            .and_then(|s| s.terminated.clone())
            .or_else(|| c.last_state.as_ref().and_then(|s| s.terminated.clone()))
    };
    if statuses
        .iter()
        .filter_map(terminated)
        .any(|t| t.reason.as_deref() == Some("OOMKilled"))
    {
        return LastExit::OomKilled;
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return LastExit::Terminated;
    }
    let ended: Vec<_> = statuses.iter().filter_map(terminated).collect();
    if let Some(t) = ended.iter().find(|t| t.exit_code != 0) {
        return LastExit::Error {
            exit_code: t.exit_code,
        };
    }
    if !statuses.is_empty() && ended.len() == statuses.len() {
        return LastExit::Completed;
    }
    LastExit::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn deployment_pod(node: &str, token: &str) -> Pod {
        pod(json!({
            "metadata": {
                "name": "counter-7d9f8b6c5-abcde",
                "namespace": "prod",
                "uid": "3f2a9c10-0000-4000-8000-000000000001",
                "labels": {"app": "counter", "pod-template-hash": "7d9f8b6c5"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": "not-the-controller", "uid": "x"},
                    {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-7d9f8b6c5", "uid": "y", "controller": true}
                ]
            },
            "spec": {
                "nodeName": node,
                "runtimeClassName": "stasis",
                "volumes": [
                    {"name": "data", "emptyDir": {}},
                    // As the API server's ServiceAccount admission generates it.
                    {"name": token, "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}, "path": "namespace"}]}}
                    ]}}
                ],
                "containers": [{
                    "name": "counter",
                    "image": "stasis-counter:dev",
                    "livenessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 5},
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": token, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}
                    ]
                }]
            }
        }))
    }

    #[test]
    fn identity_through_the_controller_owner() {
        let p = deployment_pod("w1", "kube-api-access-aaaaa");
        assert_eq!(
            workload_identity(&p).unwrap().key().as_str(),
            "prod_deploy_counter"
        );
    }

    #[test]
    fn spec_hash_ignores_node_and_token_volume() {
        let a = spec_hash(&deployment_pod("w1", "kube-api-access-aaaaa")).unwrap();
        let b = spec_hash(&deployment_pod("w2", "kube-api-access-bbbbb")).unwrap();
        assert_eq!(a, b);
        let mut c = deployment_pod("w1", "kube-api-access-aaaaa");
        c.spec.as_mut().unwrap().containers[0].image = Some("other".into());
        assert_ne!(spec_hash(&c).unwrap(), a);
        // A token-named volume in another shape (here: without the namespace file) is hashed.
        let mut d = deployment_pod("w1", "kube-api-access-aaaaa");
        let projected = d.spec.as_mut().unwrap().volumes.as_mut().unwrap()[1]
            .projected
            .as_mut()
            .unwrap();
        projected.sources.as_mut().unwrap().pop();
        assert_ne!(spec_hash(&d).unwrap(), a);
    }

    #[test]
    fn spec_hash_ignores_the_injected_wait_container() {
        let a = spec_hash(&deployment_pod("w1", "kube-api-access-aaaaa")).unwrap();
        let mut b = deployment_pod("w1", "kube-api-access-aaaaa");
        b.spec.as_mut().unwrap().init_containers = Some(vec![serde_json::from_value(
            json!({"name": RESTORE_WAIT_CONTAINER, "image": "stasis-controller:dev"}),
        )
        .unwrap()]);
        assert_eq!(spec_hash(&b).unwrap(), a);
        b.spec.as_mut().unwrap().init_containers.as_mut().unwrap()[0].name = "other".into();
        assert_ne!(spec_hash(&b).unwrap(), a);
    }

    #[test]
    fn volumes_probes_annotation() {
        let mut p = deployment_pod("w1", "kube-api-access-aaaaa");
        let v = volume_facts(&p);
        assert_eq!(v.len(), 1);
        assert!(!v[0].is_unsafe());
        let probes = liveness_probes(&p);
        assert_eq!(probes.len(), 1);
        assert_eq!(probes[0].budget().as_secs(), 14); // 5*3-1
        assert_eq!(cold_start_annotation(&p), None);
        p.metadata.annotations =
            Some([("stasis.dev/cold-start".to_owned(), "true".to_owned())].into());
        assert_eq!(cold_start_annotation(&p).as_deref(), Some("true"));
    }

    #[test]
    fn last_exit_from_status() {
        let evicted = pod(json!({"status": {"phase": "Failed", "reason": "Evicted"}}));
        assert_eq!(last_exit(&evicted), LastExit::Evicted);
        let disrupted = pod(
            json!({"status": {"conditions": [{"type": "DisruptionTarget", "status": "True"}]}}),
        );
        assert_eq!(last_exit(&disrupted), LastExit::Evicted);
        let oom = pod(json!({"status": {"containerStatuses": [{
            "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
        }]}}));
        assert_eq!(last_exit(&oom), LastExit::OomKilled);
        let crash = pod(json!({"status": {"containerStatuses": [{
            "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
            "state": {"terminated": {"exitCode": 2, "reason": "Error"}}
        }]}}));
        assert_eq!(last_exit(&crash), LastExit::Error { exit_code: 2 });
        let done = pod(json!({"status": {"containerStatuses": [{
            "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}
        }]}}));
        assert_eq!(last_exit(&done), LastExit::Completed);
        let deleting = pod(json!({"metadata": {"deletionTimestamp": "2026-11-29T09:00:00Z"}}));
        assert_eq!(last_exit(&deleting), LastExit::Terminated);
        assert_eq!(last_exit(&pod(json!({}))), LastExit::Unknown);
    }
}
