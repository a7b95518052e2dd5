//! Pure facts about pods and the stasis objects naming them: what the agent reads from a
//! `Pod` and the `CheckpointPolicy`s, which objects are still pending.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Pod;
use stasis_api::{CheckpointPhase, CheckpointPolicy, PodCheckpoint, PodRestore, RestorePhase};

use crate::node::{FinalNotWanted, PodInfo};
use crate::selector;
use crate::status::PodKey;

pub(crate) fn to_system_time(
    t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> SystemTime {
    let ms = t.0.as_millisecond();
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH
    }
}

/// What the agent needs to know about a pod, from the pod and the policies (pure).
pub fn pod_info(pod: &Pod, policies: &[Arc<CheckpointPolicy>]) -> PodInfo {
    let m = &pod.metadata;
    let ns = m.namespace.clone().unwrap_or_default();
    let name = m.name.clone().unwrap_or_default();
    let uid = m.uid.clone().unwrap_or_default();
    let empty = BTreeMap::new();
    let labels = m.labels.as_ref().unwrap_or(&empty);
    let annotations = m.annotations.as_ref().unwrap_or(&empty);
    let selecting: Vec<&Arc<CheckpointPolicy>> = policies
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(&ns))
        .filter(|p| selector::matches(&p.spec.selector, labels))
        .collect();
    let final_wanted = if selecting.is_empty() {
        Err(FinalNotWanted::NoPolicy)
    } else if selecting.iter().any(|p| p.spec.on_termination) {
        Ok(())
    } else {
        Err(FinalNotWanted::OnTerminationOff)
    };
    let restart_policy = pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref());
    PodInfo {
        key: PodKey {
            namespace: ns,
            name,
            uid,
        },
        spec_hash: stasis_api::pod::spec_hash(pod).map(|h| h.to_string()),
        declared: stasis_api::lineage::declared(labels, annotations),
        deletion_deadline: m.deletion_timestamp.as_ref().map(to_system_time),
        final_wanted,
        restarts_in_place: restart_policy != Some("Never"),
        clean_exit_finishes: matches!(restart_policy, Some("Never" | "OnFailure")),
        layout: crate::executor::PodLayout::of(pod),
        hold_until_evicted: selecting.iter().any(|p| p.spec.hold_until_evicted),
        liveness: stasis_api::pod::liveness_probes(pod),
    }
}

/// The image digest of a pod's container, when the pod says it: an image named by digest
/// (`…@sha256:…`), else the running container's `imageID` (a restart in place).
pub fn image_digest(pod: &Pod, container: &str) -> Option<String> {
    let digest_of = |s: &str| {
        s.rsplit_once('@')
            .map(|(_, d)| d.to_owned())
            .filter(|d| d.starts_with("sha256:"))
    };
    let spec = pod.spec.as_ref()?;
    if let Some(d) = spec
        .containers
        .iter()
        .find(|c| c.name == container)
        .and_then(|c| c.image.as_deref())
        .and_then(digest_of)
    {
        return Some(d);
    }
    pod.status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .find(|s| s.name == container)
        .and_then(|s| digest_of(&s.image_id))
}

/// Why the agent must not checkpoint `pod` (`None`: it may): only pods that opted in, with
/// `runtimeClassName` set to stasis's RuntimeClass, are ever frozen or dumped.
pub fn not_opted_in(pod: &Pod, runtime_class: &str) -> Option<String> {
    let class = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    (class != Some(runtime_class)).then(|| {
        format!(
            "pod {} did not opt in to checkpoints: its runtimeClassName is {}, not {runtime_class}",
            pod.metadata.name.as_deref().unwrap_or_default(),
            class.map_or("unset".to_owned(), |c| format!("{c:?}"))
        )
    })
}

/// Why a `PodRestore` must not be prepared (`None`: it may): the lineage it names, when it
/// names one, is not the lineage of its `checkpointRef`.
pub fn restore_mismatch(r: &PodRestore) -> Option<String> {
    let named = r.spec.lineage.as_deref()?;
    let of_ref = r.spec.checkpoint_ref.rsplit_once('/').map(|(l, _)| l);
    (of_ref != Some(named)).then(|| {
        format!(
            "checkpointRef {} is not a checkpoint of lineage {named}",
            r.spec.checkpoint_ref
        )
    })
}

/// The one app container's name, when the pod has exactly one.
pub fn single_container(pod: &Pod) -> Option<String> {
    let cs = &pod.spec.as_ref()?.containers;
    (cs.len() == 1).then(|| cs[0].name.clone())
}

pub(crate) fn phase_is_pending_ckpt(c: &PodCheckpoint) -> bool {
    matches!(
        c.status.as_ref().and_then(|s| s.phase),
        None | Some(CheckpointPhase::Pending)
    )
}

pub(crate) fn phase_is_pending_restore(r: &PodRestore) -> bool {
    matches!(
        r.status.as_ref().and_then(|s| s.phase),
        None | Some(RestorePhase::Pending)
    )
}

/// A PodRestore this agent prepares: pending, and not one of the agent's own records of a
/// restart in place (`stasis.dev/created-by`). The restart prepares that one itself; the record
/// is created before its status says `Ready`, and preparing it again in between fetched the
/// checkpoint a second time into the directory the restart was restoring from, so CRIU read a
/// truncated image.
pub(crate) fn restore_to_prepare(r: &PodRestore) -> bool {
    phase_is_pending_restore(r)
        && r.metadata
            .labels
            .as_ref()
            .is_none_or(|l| !l.contains_key(stasis_api::names::CREATED_BY))
}

/// Whether the PodRestore `r` is for `pod`. One that names a target UID is for that pod only. One
/// without (a restore a user made with `kubectl stasis restore POD --from ...` before the pod
/// existed) is for a pod of that name only if the webhook marked it as waiting for exactly this
/// PodRestore (`stasis.dev/restore-request`), which it does only when the pod's creator may
/// restore: a pod created under that name by someone who may only create pods never receives
/// the checkpoint.
pub(crate) fn restore_is_for(r: &PodRestore, pod: &Pod) -> bool {
    match r.spec.target_pod_uid.as_deref() {
        Some(uid) => pod.metadata.uid.as_deref() == Some(uid),
        None => {
            let asked = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(stasis_api::names::RESTORE_REQUEST));
            asked.is_some() && asked == r.metadata.name.as_ref()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use stasis_api::PodCheckpointSpec;
    use std::time::{Duration, UNIX_EPOCH};

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn policy(ns: &str, app: &str, on_term: bool) -> Arc<CheckpointPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": "p", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": app}}, "interval": "10s",
                         "onTermination": on_term}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn pod_info_from_pod_and_policies() {
        let p = pod(json!({
            "metadata": {
                "name": "counter-7d9f-x2", "namespace": "default", "uid": "0b5c7e1a-1111",
                "labels": {"app": "counter", "pod-template-hash": "7d9f",
                           "declare.stasis.dev/engine": "v1"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "counter-7d9f", "uid": "rs", "controller": true}],
                "annotations": {"stasis.dev/lineage": "default_deployment_counter.aa",
                                "stasis.dev/generation": "3"},
                "deletionTimestamp": "2026-11-29T09:00:30Z"
            },
            "spec": {"containers": [{"name": "counter", "image": "stasis-counter:dev"}]}
        }));
        let i = pod_info(&p, &[policy("default", "counter", true)]);
        assert_eq!(i.key.uid, "0b5c7e1a-1111");
        assert!(i.spec_hash.as_deref().unwrap().starts_with("blake3:"));
        assert_eq!(i.declared["engine"], "v1");
        assert_eq!(
            i.deletion_deadline,
            Some(UNIX_EPOCH + Duration::from_secs(1_795_942_830))
        );
        assert!(i.final_wanted.is_ok());
        assert_eq!(single_container(&p).as_deref(), Some("counter"));
        assert_eq!(image_digest(&p, "counter"), None);
        let by_digest = pod(json!({
            "metadata": {"name": "d", "namespace": "n", "uid": "u"},
            "spec": {"containers": [{"name": "c", "image": "reg/x@sha256:abc"}]},
            "status": {"containerStatuses": [{"name": "c", "image": "x", "imageID": "reg/x@sha256:def",
                "ready": true, "restartCount": 0}]}
        }));
        assert_eq!(image_digest(&by_digest, "c").as_deref(), Some("sha256:abc"));
        let mut restarted = by_digest.clone();
        restarted.spec.as_mut().unwrap().containers[0].image = Some("reg/x:1".into());
        assert_eq!(image_digest(&restarted, "c").as_deref(), Some("sha256:def"));
        // Policy in another namespace, another app, or onTermination false.
        assert!(pod_info(&p, &[policy("other", "counter", true)])
            .final_wanted
            .is_err());
        assert_eq!(
            pod_info(&p, &[policy("default", "x", true)]).final_wanted,
            Err(FinalNotWanted::NoPolicy)
        );
        assert_eq!(
            pod_info(&p, &[policy("default", "counter", false)]).final_wanted,
            Err(FinalNotWanted::OnTerminationOff)
        );
        // Held after the responder's checkpoint only when a selecting policy asks.
        assert!(!pod_info(&p, &[policy("default", "counter", true)]).hold_until_evicted);
        let mut holding = (*policy("default", "counter", true)).clone();
        holding.spec.hold_until_evicted = true;
        assert!(
            pod_info(
                &p,
                &[
                    policy("default", "counter", true),
                    Arc::new(holding.clone())
                ]
            )
            .hold_until_evicted
        );
        holding.metadata.namespace = Some("other".into());
        assert!(!pod_info(&p, &[Arc::new(holding)]).hold_until_evicted);

        let bare = pod(json!({
            "metadata": {"name": "solo", "namespace": "ns1", "uid": "abcdef12-3"},
            "spec": {"containers": [{"name": "a", "image": "i"}, {"name": "b", "image": "i"}]}
        }));
        assert_eq!(single_container(&bare), None);
    }

    #[test]
    fn a_pod_whose_clean_exit_finishes_its_work_is_told_apart() {
        let with = |policy: Option<&str>| {
            let mut spec = json!({"containers": [{"name": "c", "image": "i"}]});
            if let Some(p) = policy {
                spec["restartPolicy"] = json!(p);
            }
            let p =
                pod(json!({"metadata": {"name": "j", "namespace": "n", "uid": "u"}, "spec": spec}));
            let i = pod_info(&p, &[]);
            (i.restarts_in_place, i.clean_exit_finishes)
        };
        // A Deployment's pod: restarted in place, a clean exit is not the end of its work.
        assert_eq!(with(None), (true, false));
        assert_eq!(with(Some("Always")), (true, false));
        // A Job's pods: the Job reads exit 0 as done.
        assert_eq!(with(Some("OnFailure")), (true, true));
        assert_eq!(with(Some("Never")), (false, true));
    }

    /// Review M7: a pod of another RuntimeClass (or none) is never checkpointed.
    #[test]
    fn only_opted_in_pods_are_checkpointed() {
        let mut p = pod(json!({
            "metadata": {"name": "web", "namespace": "default", "uid": "u"},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
        }));
        assert_eq!(not_opted_in(&p, "stasis"), None);
        p.spec.as_mut().unwrap().runtime_class_name = Some("gvisor".into());
        let why = not_opted_in(&p, "stasis").unwrap();
        assert!(
            why.contains("pod web did not opt in") && why.contains("\"gvisor\""),
            "{why}"
        );
        p.spec.as_mut().unwrap().runtime_class_name = None;
        assert!(not_opted_in(&p, "stasis").unwrap().contains("is unset"));
    }

    #[test]
    fn a_restore_names_the_lineage_of_its_checkpoint() {
        let r = |lineage: Option<&str>| -> PodRestore {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": "t", "namespace": "default"},
                "spec": {"checkpointRef": "default_pod_a.0a/20261129T083000.123Z-1a2b3c4d",
                         "targetPodName": "t", "lineage": lineage}
            }))
            .unwrap()
        };
        assert_eq!(restore_mismatch(&r(Some("default_pod_a.0a"))), None);
        assert_eq!(restore_mismatch(&r(None)), None);
        assert!(restore_mismatch(&r(Some("default_pod_b.0b")))
            .unwrap()
            .contains("is not a checkpoint of lineage default_pod_b.0b"));
    }

    #[test]
    fn pending_phases() {
        let mut c = PodCheckpoint::new(
            "c",
            PodCheckpointSpec {
                source_pod_name: "p".into(),
                source_pod_uid: None,
                reason: Default::default(),
                timeout_seconds: None,
            },
        );
        assert!(phase_is_pending_ckpt(&c));
        c.status = Some(stasis_api::PodCheckpointStatus {
            phase: Some(CheckpointPhase::Running),
            ..Default::default()
        });
        assert!(!phase_is_pending_ckpt(&c));
        let mut r = PodRestore::new(
            "r",
            stasis_api::PodRestoreSpec {
                checkpoint_ref: "l/x".into(),
                target_pod_name: "p".into(),
                target_pod_uid: None,
                source_pod_name: None,
                lineage: None,
                generation: None,
            },
        );
        assert!(phase_is_pending_restore(&r));
        r.status = Some(stasis_api::PodRestoreStatus {
            phase: Some(RestorePhase::Pending),
            ..Default::default()
        });
        assert!(phase_is_pending_restore(&r));
        r.status.as_mut().unwrap().phase = Some(RestorePhase::Ready);
        assert!(!phase_is_pending_restore(&r));
    }

    #[test]
    fn the_agents_own_restart_in_place_records_are_not_prepared_again() {
        let mut r = PodRestore::new(
            "p-oom-20261201t000000.000z-00000000",
            stasis_api::PodRestoreSpec {
                checkpoint_ref: "l/20261201T000000.000Z-00000000".into(),
                target_pod_name: "p".into(),
                target_pod_uid: Some("u".into()),
                source_pod_name: Some("p".into()),
                lineage: None,
                generation: None,
            },
        );
        assert!(
            restore_to_prepare(&r),
            "a webhook's pending PodRestore is prepared"
        );
        r.metadata.labels = Some(BTreeMap::from([(
            stasis_api::names::CREATED_BY.to_owned(),
            crate::k8s::MANAGER.to_owned(),
        )]));
        // Created, its status not yet Ready: still the restart's own.
        assert!(!restore_to_prepare(&r));
    }

    #[test]
    fn a_restore_without_a_target_uid_goes_only_to_a_pod_the_webhook_marked_for_it() {
        let r = |uid: Option<&str>| {
            PodRestore::new(
                "p",
                stasis_api::PodRestoreSpec {
                    checkpoint_ref: "l/x".into(),
                    target_pod_name: "p".into(),
                    target_pod_uid: uid.map(Into::into),
                    source_pod_name: None,
                    lineage: None,
                    generation: None,
                },
            )
        };
        let marked = |v: Option<&str>| {
            let mut m = json!({"metadata": {"name": "p", "namespace": "n", "uid": "u1"}});
            if let Some(v) = v {
                m["metadata"]["annotations"] = json!({ stasis_api::names::RESTORE_REQUEST: v });
            }
            pod(m)
        };
        // A pod created by someone who may only create pods carries no mark (the webhook and
        // the admission policies see to that): it never receives the checkpoint.
        assert!(!restore_is_for(&r(None), &marked(None)));
        assert!(!restore_is_for(&r(None), &marked(Some("other"))));
        assert!(restore_is_for(&r(None), &marked(Some("p"))));
        // With a target UID, the UID decides.
        assert!(restore_is_for(&r(Some("u1")), &marked(None)));
        assert!(!restore_is_for(&r(Some("u2")), &marked(Some("p"))));
    }
}
