//! What `status` and `list` show, computed from the objects a namespace user can read (pods,
//! `PodCheckpoint`s, `CheckpointPolicy`s): pure functions over them, so they are tested without
//! an API server. stasis's own lineage records live in its namespace, which users usually cannot
//! read, so a pod's lineage comes from the annotation the webhook writes on it (for display only;
//! nothing trusts it) and from the checkpoints' status.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::core::{Selector, SelectorExt};
use kube::ResourceExt;
use serde::Serialize;
use stasis_api::names::{DECISION, DECISION_REASON, LINEAGE, RESTORE_FROM};
use stasis_api::{CheckpointPhase, CheckpointPolicy, PodCheckpoint};

// The pod annotations stasis's webhook and controller write (`stasis_api::names`) are for people
// to read; nothing in stasis trusts them, and neither does this plugin: it only shows them.
/// [`stasis_api::names::LINEAGE`] and [`stasis_api::names::DECISION`], as `advise` names them.
pub use stasis_api::names::{DECISION as DECISION_ANNOTATION, LINEAGE as LINEAGE_ANNOTATION};

/// Unix milliseconds of a Kubernetes time.
pub fn ms(t: &Time) -> i64 {
    t.0.as_millisecond()
}

/// One opted-in pod's protection, as `status` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    pub namespace: String,
    pub pod: String,
    pub node: Option<String>,
    pub lineage: Option<String>,
    pub policy: Option<String>,
    pub interval: Option<String>,
    /// Succeeded checkpoints of the pod's lineage (or of the pod, without a lineage).
    pub checkpoints: usize,
    pub last_checkpoint: Option<LastCheckpoint>,
    /// Seconds until the next heartbeat is due (0: due now); none without a policy.
    pub next_due_seconds: Option<u64>,
    /// `Restore` or `ColdStart`.
    pub decision: Option<String>,
    /// Why it cold-started.
    pub cold_start_reason: Option<String>,
    /// The checkpoint it resumed from.
    pub restored_from: Option<String>,
}

/// The newest succeeded checkpoint of a lineage.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LastCheckpoint {
    pub name: String,
    pub reference: Option<String>,
    pub reason: String,
    pub source_pod: String,
    /// When the agent froze the pod for it (RFC 3339).
    pub taken: Option<String>,
    pub age_seconds: u64,
    pub size_bytes: Option<i64>,
    pub freeze_millis: Option<i64>,
}

/// When a checkpoint froze its pod (its start, else the object's creation), Unix ms.
fn started_ms(c: &PodCheckpoint) -> i64 {
    c.status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(c.metadata.creation_timestamp.as_ref())
        .map_or(0, ms)
}

fn succeeded(c: &PodCheckpoint) -> bool {
    c.status.as_ref().and_then(|s| s.phase) == Some(CheckpointPhase::Succeeded)
}

/// True when the checkpoint belongs to the pod's history: its lineage when the pod names one,
/// else the pod itself (by UID, or by name for checkpoints that have no UID yet).
pub(crate) fn of_pod(c: &PodCheckpoint, pod: &Pod, lineage: Option<&str>) -> bool {
    let st = c.status.as_ref();
    if let (Some(l), Some(cl)) = (lineage, st.and_then(|s| s.lineage.as_deref())) {
        return l == cl;
    }
    let uid = pod.metadata.uid.as_deref();
    match st.and_then(|s| s.source_pod_uid.as_deref()) {
        Some(u) => Some(u) == uid,
        None => c.spec.source_pod_name == pod.name_any(),
    }
}

/// The policy that governs a pod: the first by name among those of its namespace whose selector
/// selects it (the controller's rule).
pub fn policy_for<'a>(policies: &'a [CheckpointPolicy], pod: &Pod) -> Option<&'a CheckpointPolicy> {
    policies
        .iter()
        .filter(|p| p.namespace() == pod.namespace())
        .filter(|p| label_selects(&p.spec.selector, pod.labels()))
        .min_by_key(|p| p.name_any())
}

/// True when `selector` selects `labels` (an invalid selector selects nothing).
pub fn label_selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(labels))
}

/// The status of one pod, at `now_ms`.
pub fn pod_status(
    pod: &Pod,
    checkpoints: &[PodCheckpoint],
    policies: &[CheckpointPolicy],
    now_ms: i64,
) -> PodStatus {
    let ann = pod.annotations();
    let lineage = ann.get(LINEAGE).filter(|l| !l.is_empty()).cloned();
    let mine: Vec<&PodCheckpoint> = checkpoints
        .iter()
        .filter(|c| of_pod(c, pod, lineage.as_deref()))
        .collect();
    let done: Vec<&&PodCheckpoint> = mine.iter().filter(|c| succeeded(c)).collect();
    let last = done.iter().max_by_key(|c| started_ms(c)).map(|c| {
        let s = c.status.clone().unwrap_or_default();
        LastCheckpoint {
            name: c.name_any(),
            reference: s.checkpoint_ref,
            reason: format!("{:?}", c.spec.reason),
            source_pod: c.spec.source_pod_name.clone(),
            taken: s.start_time.as_ref().map(|t| t.0.to_string()),
            age_seconds: u64::try_from((now_ms - started_ms(c)) / 1000).unwrap_or(0),
            size_bytes: s.size_bytes,
            freeze_millis: s.freeze_millis,
        }
    });
    let policy = policy_for(policies, pod);
    let next_due_seconds = policy.and_then(|p| {
        let interval = p.spec.heartbeat().ok()?;
        // Due one interval after the pod's own newest checkpoint (any reason) or its start; the
        // controller adds a per-pod spread of up to a tenth of the interval.
        let own_last = mine
            .iter()
            .filter(|c| {
                c.status.as_ref().and_then(|s| s.source_pod_uid.as_deref())
                    == pod.metadata.uid.as_deref()
            })
            .map(|c| started_ms(c))
            .max();
        let started = pod.status.as_ref()?.start_time.as_ref().map(ms)?;
        Some(next_due(interval, started, own_last, now_ms))
    });
    let decision = ann.get(DECISION).cloned();
    PodStatus {
        namespace: pod.namespace().unwrap_or_default(),
        pod: pod.name_any(),
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        lineage: lineage.or_else(|| done.iter().find_map(|c| c.status.as_ref()?.lineage.clone())),
        policy: policy.map(|p| p.name_any()),
        interval: policy.map(|p| p.spec.interval.clone()),
        checkpoints: done.len(),
        last_checkpoint: last,
        next_due_seconds,
        cold_start_reason: (decision.as_deref() == Some("ColdStart"))
            .then(|| ann.get(DECISION_REASON).cloned())
            .flatten(),
        restored_from: (decision.as_deref() == Some("Restore"))
            .then(|| ann.get(RESTORE_FROM).cloned())
            .flatten(),
        decision,
    }
}

/// Seconds until a heartbeat is due: one interval after `last_ms` (or the pod's start), never
/// before now (stasis-core's rule, without the controller's per-pod spread).
pub fn next_due(interval: Duration, started_ms: i64, last_ms: Option<i64>, now_ms: i64) -> u64 {
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    let now = u(now_ms);
    let at =
        stasis_core::policy::next_checkpoint_at(interval, u(started_ms), last_ms.map(u), 0, now);
    (at - now) / 1000
}

/// Checkpoints of a namespace, newest first (what `list` prints).
pub fn newest_first(mut checkpoints: Vec<PodCheckpoint>) -> Vec<PodCheckpoint> {
    checkpoints.sort_by_key(|c| std::cmp::Reverse(started_ms(c)));
    checkpoints
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: i64 = 1_800_000_000_000;

    fn t(ms_ago: i64) -> String {
        let ts = k8s_openapi::jiff::Timestamp::from_millisecond(NOW - ms_ago).unwrap();
        ts.to_string()
    }

    fn pod(name: &str, uid: &str, ann: serde_json::Value, started_s_ago: i64) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "prod", "uid": uid, "labels": {"app": "web"},
                         "annotations": ann},
            "spec": {"nodeName": "node-1", "runtimeClassName": "stasis", "containers": [{"name": "c"}]},
            "status": {"startTime": t(started_s_ago * 1000)},
        }))
        .unwrap()
    }

    fn ckpt(
        name: &str,
        pod: &str,
        uid: &str,
        lineage: &str,
        phase: &str,
        s_ago: i64,
    ) -> PodCheckpoint {
        serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": name, "namespace": "prod", "creationTimestamp": t(s_ago * 1000 + 500)},
            "spec": {"sourcePodName": pod, "reason": "Heartbeat"},
            "status": {"phase": phase, "sourcePodUID": uid, "lineage": lineage,
                       "checkpointRef": format!("{lineage}/{name}"), "startTime": t(s_ago * 1000),
                       "sizeBytes": 1 << 20, "freezeMillis": 40},
        }))
        .unwrap()
    }

    fn policy(name: &str, interval: &str, app: &str) -> CheckpointPolicy {
        serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": name, "namespace": "prod"},
            "spec": {"selector": {"matchLabels": {"app": app}}, "interval": interval},
        }))
        .unwrap()
    }

    #[test]
    fn the_last_checkpoint_is_the_newest_succeeded_one_of_the_pods_lineage() {
        let p = pod(
            "web-2",
            "u2",
            json!({"stasis.dev/lineage": "L", "stasis.dev/decision": "Restore",
                                         "stasis.dev/restore-from": "L/a"}),
            100,
        );
        let cs = vec![
            ckpt("a", "web-1", "u1", "L", "Succeeded", 300), // the previous pod of the lineage
            ckpt("b", "web-2", "u2", "L", "Succeeded", 50),
            ckpt("c", "web-2", "u2", "L", "Failed", 20),
            ckpt("d", "other", "u9", "M", "Succeeded", 10), // another lineage
        ];
        let s = pod_status(&p, &cs, &[policy("every-30s", "30s", "web")], NOW);
        assert_eq!(s.checkpoints, 2);
        let last = s.last_checkpoint.unwrap();
        assert_eq!((last.name.as_str(), last.age_seconds), ("b", 50));
        assert_eq!(last.reference.as_deref(), Some("L/b"));
        assert_eq!(s.lineage.as_deref(), Some("L"));
        assert_eq!(s.policy.as_deref(), Some("every-30s"));
        // the newest of its own checkpoints (the failed one, 20 s ago) + 30 s
        assert_eq!(s.next_due_seconds, Some(10));
        assert_eq!(s.restored_from.as_deref(), Some("L/a"));
        assert_eq!(s.cold_start_reason, None);
    }

    #[test]
    fn a_cold_start_says_why_and_a_pod_without_policy_has_nothing_due() {
        let p = pod(
            "web-1",
            "u1",
            json!({"stasis.dev/decision": "ColdStart",
                                         "stasis.dev/decision-reason": "no checkpoint to restore"}),
            5,
        );
        let s = pod_status(&p, &[], &[policy("other", "10s", "db")], NOW);
        assert_eq!(
            s.cold_start_reason.as_deref(),
            Some("no checkpoint to restore")
        );
        assert_eq!(
            (s.policy, s.next_due_seconds, s.last_checkpoint),
            (None, None, None)
        );
    }

    #[test]
    fn without_a_lineage_a_pods_own_checkpoints_count_and_an_overdue_one_is_due_now() {
        let p = pod("web-1", "u1", json!({}), 600);
        let cs = vec![
            ckpt("a", "web-1", "u1", "L", "Succeeded", 120),
            ckpt("x", "web-1", "u0", "K", "Succeeded", 60),
        ];
        let s = pod_status(
            &p,
            &cs,
            &[policy("b", "1m", "web"), policy("a", "1h", "web")],
            NOW,
        );
        assert_eq!(
            s.checkpoints, 1,
            "the checkpoint of an earlier pod of that name is not this pod's"
        );
        assert_eq!(
            s.policy.as_deref(),
            Some("a"),
            "the first selecting policy by name"
        );
        let s = pod_status(&p, &cs, &[policy("b", "1m", "web")], NOW);
        assert_eq!(s.next_due_seconds, Some(0));
    }
}
