//! Who holds a lineage now, read from the pods and checkpoints the caches hold: the part of a
//! lineage record's bookkeeping that both the webhook (before a claim) and the reconcilers (on
//! every pod and sweep) need.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use stasis_api::{names, CheckpointReason, PodCheckpoint};

use crate::record::{HolderState, Record};
use crate::schedule::CheckpointView;
use crate::time_ms;

/// The state of a lineage's holder, from the pods carrying its token and the checkpoints of the
/// namespace. Returns the holder pod too (the source of a restore).
pub fn holder_state(
    record: &Record,
    pods: &[Pod],
    checkpoints: &[PodCheckpoint],
    on_termination: bool,
) -> (HolderState, Option<Pod>) {
    let holder = record.holder.as_ref();
    let token = record.lineage.holder.as_deref().unwrap_or_default();
    let want_uid = holder.and_then(|h| h.uid.as_deref());
    let pod = pods.iter().find(|p| {
        p.labels().get(names::CLAIM_TOKEN).map(String::as_str) == Some(token)
            && want_uid.is_none_or(|u| p.metadata.uid.as_deref() == Some(u))
    });
    let Some(pod) = pod else {
        let seen = holder.is_some_and(|h| h.uid.is_some());
        if !seen {
            return (HolderState::Unseen, None);
        }
        let uid = want_uid.unwrap_or_default();
        // Its termination checkpoint, or a heartbeat whose capture its agent gave as the final
        // one (the stop came during that capture: the pod ends while it uploads).
        let final_in_flight = checkpoints.iter().any(|c| {
            matches!(
                c.spec.reason,
                CheckpointReason::Termination | CheckpointReason::Heartbeat
            ) && checkpoint_pod_uid(c).as_deref() == Some(uid)
                && CheckpointView::of(c).in_flight()
        });
        return (HolderState::Gone { final_in_flight }, None);
    };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let state = if let Some(del) = &pod.metadata.deletion_timestamp {
        let deadline = time_ms(del);
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64;
        HolderState::Terminating {
            started_unix_ms: deadline.saturating_sub(grace * 1000),
            // Slack for the agent to report the checkpoint it finished at the deadline.
            deadline_unix_ms: deadline + 5_000,
            // A pod whose node is lost is not Ready: no agent will checkpoint it.
            final_expected: on_termination && phase == Some("Running") && pod_ready(pod),
        }
    } else if matches!(phase, Some("Failed" | "Succeeded")) {
        HolderState::Ended
    } else {
        HolderState::Running
    };
    (state, Some(pod.clone()))
}

/// The pod's `Ready` condition is `True`.
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The UID of a checkpoint's source pod (spec, label or status).
pub fn checkpoint_pod_uid(c: &PodCheckpoint) -> Option<String> {
    c.spec
        .source_pod_uid
        .clone()
        .or_else(|| c.labels().get(names::POD_UID).cloned())
        .or_else(|| c.status.as_ref().and_then(|s| s.source_pod_uid.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;
    use serde_json::json;

    #[test]
    fn holder_states() {
        let r = record_held_by("tok", Some("u1"));
        let running = pod(json!({
            "metadata": {"name": "c-1", "uid": "u1", "labels": {names::CLAIM_TOKEN: "tok"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }));
        assert_eq!(
            holder_state(&r, std::slice::from_ref(&running), &[], true).0,
            HolderState::Running
        );
        let mut deleting = running.clone();
        deleting.metadata.deletion_timestamp = Some(crate::k8s_time(40_000));
        deleting.metadata.deletion_grace_period_seconds = Some(30);
        assert_eq!(
            holder_state(&r, std::slice::from_ref(&deleting), &[], true).0,
            HolderState::Terminating {
                started_unix_ms: 10_000,
                deadline_unix_ms: 45_000,
                final_expected: true
            }
        );
        // Its node lost (not Ready): no final checkpoint is coming.
        let mut lost = deleting.clone();
        lost.status.as_mut().unwrap().conditions = Some(vec![serde_json::from_value(
            json!({"type": "Ready", "status": "False"}),
        )
        .unwrap()]);
        assert!(matches!(
            holder_state(&r, &[lost], &[], true).0,
            HolderState::Terminating {
                final_expected: false,
                ..
            }
        ));
        // Another pod with a copied token but another UID is not the holder.
        let mut impostor = running.clone();
        impostor.metadata.uid = Some("u2".into());
        assert_eq!(
            holder_state(&r, &[impostor], &[], true).0,
            HolderState::Gone {
                final_in_flight: false
            }
        );
        let fin: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "f", "namespace": "prod"},
            "spec": {"sourcePodName": "c-1", "sourcePodUID": "u1", "reason": "Termination"},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        assert_eq!(
            holder_state(&r, &[], std::slice::from_ref(&fin), true).0,
            HolderState::Gone {
                final_in_flight: true
            }
        );
        // A heartbeat still uploading keeps the wait too (its capture may be the final one);
        // one that ended, or a manual checkpoint, does not.
        let mut heartbeat = fin;
        heartbeat.spec.reason = CheckpointReason::Heartbeat;
        assert_eq!(
            holder_state(&r, &[], &[heartbeat.clone()], true).0,
            HolderState::Gone {
                final_in_flight: true
            }
        );
        let mut ended = heartbeat.clone();
        ended.status.as_mut().unwrap().phase = Some(stasis_api::CheckpointPhase::Succeeded);
        let mut manual = heartbeat;
        manual.spec.reason = CheckpointReason::Manual;
        assert_eq!(
            holder_state(&r, &[], &[ended, manual], true).0,
            HolderState::Gone {
                final_in_flight: false
            }
        );
        // A fresh claim whose pod is not there yet.
        let fresh = record_held_by("tok", None);
        assert_eq!(holder_state(&fresh, &[], &[], true).0, HolderState::Unseen);
        let mut failed = running;
        failed.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(holder_state(&r, &[failed], &[], true).0, HolderState::Ended);
    }
}
