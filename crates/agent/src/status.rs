//! Pure builders of what the agent writes to the API server: `PodCheckpoint` and `PodRestore`
//! statuses (with their `Ready` condition) and pod Events.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use stasis_api::condition::{self, reason};
use stasis_api::{
    CheckpointPhase, PodCheckpointStatus, PodRestoreStatus, RestoreFailure, RestorePhase,
};

use crate::error::AgentError;
use crate::executor::CheckpointOutcome;
use crate::fence::Stamp;

pub fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn i(v: u64) -> Option<i64> {
    Some(i64::try_from(v).unwrap_or(i64::MAX))
}

/// The agent took the checkpoint on: phase `Running`.
pub fn checkpoint_running(
    prev: &PodCheckpointStatus,
    node: &str,
    source_uid: &str,
    stamp: &Stamp,
    now: Time,
) -> PodCheckpointStatus {
    let mut s = prev.clone();
    s.phase = Some(CheckpointPhase::Running);
    s.node = Some(node.into());
    s.source_pod_uid = Some(source_uid.into()).filter(|u: &String| !u.is_empty());
    s.lineage = Some(stamp.lineage.to_string());
    s.generation = i(stamp.generation);
    s.start_time = Some(now.clone());
    condition::set_condition(
        &mut s.conditions,
        condition::READY,
        false,
        reason::CHECKPOINT_IN_PROGRESS,
        "freezing, dumping and uploading",
        None,
        now,
    );
    s
}

/// A complete, published checkpoint: phase `Succeeded`, sizes, reference, durations.
pub fn checkpoint_succeeded(
    prev: &PodCheckpointStatus,
    o: &CheckpointOutcome,
    spec_hash: Option<&str>,
    now: Time,
) -> PodCheckpointStatus {
    let mut s = prev.clone();
    s.phase = Some(CheckpointPhase::Succeeded);
    s.size_bytes = i(o.logical_bytes);
    s.uploaded_bytes = i(o.uploaded_bytes);
    s.checkpoint_ref = Some(o.reference.clone());
    s.manifest_digest = Some(o.manifest_digest.clone());
    s.spec_hash = spec_hash.map(str::to_owned);
    s.freeze_millis = i(o.freeze_ms);
    s.dump_millis = i(o.dump_ms);
    s.upload_millis = i(o.upload_ms);
    s.total_millis = i(o.total_ms);
    s.completion_time = Some(now.clone());
    condition::set_condition(
        &mut s.conditions,
        condition::READY,
        true,
        reason::CHECKPOINT_COMPLETED,
        format!(
            "{} ({} bytes, {} uploaded, frozen {} ms)",
            o.reference, o.logical_bytes, o.uploaded_bytes, o.freeze_ms
        ),
        None,
        now,
    );
    s
}

/// The `Ready` reason of a failed checkpoint.
pub fn failure_reason(e: &AgentError) -> &'static str {
    match e {
        AgentError::Fenced(_) => reason::FENCED,
        AgentError::Superseded(_) => reason::SUPERSEDED,
        _ => reason::CHECKPOINT_FAILED,
    }
}

/// A failed (or fenced, or skipped) checkpoint: phase `Failed`, the reason in `Ready`.
pub fn checkpoint_failed(
    prev: &PodCheckpointStatus,
    node: &str,
    reason: &str,
    message: &str,
    now: Time,
) -> PodCheckpointStatus {
    let mut s = prev.clone();
    s.phase = Some(CheckpointPhase::Failed);
    s.node = Some(node.into());
    s.completion_time = Some(now.clone());
    condition::set_condition(
        &mut s.conditions,
        condition::READY,
        false,
        reason,
        message,
        None,
        now,
    );
    s
}

/// A `PodRestore` status at `phase` on `node`, with the message and the `Ready` condition.
/// `failure` (with `Failed` or `ColdStart`) is the typed cause the controller's restore-loop
/// guard counts; it is also the condition's reason.
pub fn restore(
    prev: &PodRestoreStatus,
    phase: RestorePhase,
    node: &str,
    message: Option<String>,
    failure: Option<RestoreFailure>,
    now: Time,
) -> PodRestoreStatus {
    let mut s = prev.clone();
    s.phase = Some(phase);
    s.node = Some(node.into());
    s.failure = failure;
    if message.is_some() {
        s.message = message.clone();
    }
    match phase {
        RestorePhase::Fetching | RestorePhase::Pending => {
            s.start_time.get_or_insert(now.clone());
        }
        _ => s.completion_time = Some(now.clone()),
    }
    let (ok, why) = match phase {
        RestorePhase::Pending => (false, reason::PENDING),
        RestorePhase::Fetching => (false, reason::FETCHING),
        RestorePhase::Ready => (false, reason::PREPARED),
        RestorePhase::Restored => (true, reason::RESTORED),
        RestorePhase::Failed | RestorePhase::ColdStart if failure.is_some() => {
            (false, failure.map_or(reason::OTHER, RestoreFailure::reason))
        }
        RestorePhase::Failed => (false, reason::RESTORE_FAILED),
        RestorePhase::ColdStart => (false, reason::COLD_START),
    };
    condition::set_condition(
        &mut s.conditions,
        condition::READY,
        ok,
        why,
        message.unwrap_or_default(),
        None,
        now,
    );
    s
}

/// The pod an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A core/v1 Event on a pod (`Restored`, `ColdStart`, `Checkpointed`, `CheckpointFailed`).
pub fn pod_event(
    pod: &PodKey,
    reason: &str,
    message: &str,
    warning: bool,
    node: &str,
    now: Time,
) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}.stasis-", pod.name)),
            namespace: Some(pod.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: Some(pod.uid.clone()).filter(|u| !u.is_empty()),
            ..Default::default()
        },
        reason: Some(reason.into()),
        message: Some(message.chars().take(1024).collect()),
        type_: Some(if warning { "Warning" } else { "Normal" }.into()),
        source: Some(EventSource {
            component: Some("stasisd".into()),
            host: Some(node.into()),
        }),
        reporting_component: Some("stasis.dev/stasisd".into()),
        reporting_instance: Some(node.into()),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::WorkloadName;

    fn t(s: &str) -> Time {
        serde_json::from_value(serde_json::json!(s)).unwrap()
    }

    fn stamp() -> Stamp {
        Stamp {
            lineage: WorkloadName::new("default_deployment_counter.aa").unwrap(),
            generation: 2,
            namespace: "default".into(),
            pod_uid: "u-1".into(),
        }
    }

    #[test]
    fn checkpoint_status_through_its_phases() {
        let s0 = PodCheckpointStatus::default();
        let s1 = checkpoint_running(
            &s0,
            "worker-1",
            "uid-1",
            &stamp(),
            t("2026-11-29T09:00:00Z"),
        );
        assert_eq!(s1.phase, Some(CheckpointPhase::Running));
        assert_eq!(s1.generation, Some(2));
        assert_eq!(s1.lineage.as_deref(), Some("default_deployment_counter.aa"));
        let c = condition::find(&s1.conditions, condition::READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "CheckpointInProgress")
        );
        let o = CheckpointOutcome {
            reference: "default_deployment_counter.aa/20261129T090001.000Z-0000abcd".into(),
            container_id: "c".into(),
            container_name: "counter".into(),
            pod_uid: "uid-1".into(),
            logical_bytes: 1 << 28,
            uploaded_bytes: 1 << 20,
            freeze_ms: 300,
            dump_ms: 900,
            upload_ms: 2000,
            total_ms: 3100,
            manifest_digest: format!("sha256:{}", "ab".repeat(32)),
            verdict: crate::fence::Verdict::Current,
        };
        let s2 = checkpoint_succeeded(&s1, &o, Some("blake3:x"), t("2026-11-29T09:00:03Z"));
        let v = serde_json::to_value(&s2).unwrap();
        assert_eq!(v["phase"], "Succeeded");
        assert_eq!(v["node"], "worker-1");
        assert_eq!(v["sizeBytes"], 268435456);
        assert_eq!(v["uploadedBytes"], 1048576);
        assert_eq!(v["checkpointRef"], o.reference.as_str());
        assert_eq!(v["manifestDigest"], o.manifest_digest.as_str());
        assert_eq!(v["freezeMillis"], 300);
        assert_eq!(v["totalMillis"], 3100);
        assert_eq!(v["specHash"], "blake3:x");
        assert_eq!(v["sourcePodUID"], "uid-1");
        assert_eq!(v["conditions"][0]["reason"], "CheckpointCompleted");
        assert_eq!(v["conditions"][0]["status"], "True");
        assert_eq!(v["startTime"], "2026-11-29T09:00:00Z");

        let f = checkpoint_failed(
            &s1,
            "worker-1",
            failure_reason(&AgentError::Fenced("gen 3".into())),
            "gen 3",
            t("2026-11-29T09:00:04Z"),
        );
        assert_eq!(f.phase, Some(CheckpointPhase::Failed));
        assert_eq!(
            condition::find(&f.conditions, "Ready").unwrap().reason,
            "Fenced"
        );
        assert_eq!(
            failure_reason(&AgentError::Invalid("x".into())),
            "CheckpointFailed"
        );
    }

    #[test]
    fn restore_status_and_events() {
        let s = restore(
            &PodRestoreStatus::default(),
            RestorePhase::Fetching,
            "worker-2",
            None,
            None,
            t("2026-11-29T09:00:00Z"),
        );
        assert_eq!(s.phase, Some(RestorePhase::Fetching));
        assert!(s.start_time.is_some() && s.completion_time.is_none());
        let s = restore(
            &s,
            RestorePhase::ColdStart,
            "worker-2",
            Some("incompatible checkpoint: declared.engine".into()),
            Some(RestoreFailure::Incompatible),
            t("2026-11-29T09:00:01Z"),
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["phase"], "ColdStart");
        assert_eq!(v["message"], "incompatible checkpoint: declared.engine");
        // The typed cause, and the condition's reason from it (not from the message).
        assert_eq!(v["failure"], "Incompatible");
        assert_eq!(v["conditions"][0]["reason"], "Incompatible");
        // Prepared again: no cause left over.
        let again = restore(&s, RestorePhase::Fetching, "worker-2", None, None, now());
        assert_eq!(again.failure, None);
        assert_eq!(again.conditions[0].reason, "Fetching");
        assert_eq!(v["startTime"], "2026-11-29T09:00:00Z");

        let pod = PodKey {
            namespace: "default".into(),
            name: "counter-x".into(),
            uid: "u".into(),
        };
        let e = pod_event(
            &pod,
            "Restored",
            "restored from l/1",
            false,
            "worker-2",
            t("2026-11-29T09:00:02Z"),
        );
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["reason"], "Restored");
        assert_eq!(v["type"], "Normal");
        assert_eq!(v["involvedObject"]["kind"], "Pod");
        assert_eq!(v["involvedObject"]["uid"], "u");
        assert_eq!(v["metadata"]["generateName"], "counter-x.stasis-");
        assert_eq!(v["source"]["host"], "worker-2");
        let w = pod_event(&pod, "ColdStart", "why", true, "n", now());
        assert_eq!(w.type_.as_deref(), Some("Warning"));
    }
}
