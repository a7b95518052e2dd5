//! Heartbeat scheduling, pure: which policy selects a pod, and what to do about its next
//! heartbeat checkpoint (docs/design.md §10.5, §13).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::core::{Selector, SelectorExt};
use kube::ResourceExt;
use stasis_api::{CheckpointPhase, CheckpointPolicy, CheckpointReason, PodCheckpoint};
use stasis_core::policy::{freeze_verdict, next_checkpoint_at, FreezeVerdict, LivenessProbe};

use crate::time_ms;

/// True when `selector` selects `labels` (an empty selector selects everything; an invalid
/// one nothing).
pub fn selects(
    selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    match Selector::try_from(selector.clone()) {
        Ok(s) => s.matches(labels),
        Err(_) => false,
    }
}

/// The policy that governs a pod: among the policies of its namespace whose selector selects
/// it, the first by name (deterministic when several match).
pub fn policy_for<'a>(
    policies: impl IntoIterator<Item = &'a CheckpointPolicy>,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Option<&'a CheckpointPolicy> {
    policies
        .into_iter()
        .filter(|p| p.namespace().as_deref() == Some(namespace))
        .filter(|p| selects(&p.spec.selector, labels))
        .min_by_key(|p| p.name_any())
}

/// What a pod's checkpoints say, reduced to what scheduling needs.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointView {
    pub reason: CheckpointReason,
    pub phase: Option<CheckpointPhase>,
    /// Creation of the object, Unix ms.
    pub created_unix_ms: u64,
    /// When the agent started it (Unix ms), if it did.
    pub started_unix_ms: Option<u64>,
    /// Its measured freeze, for a succeeded one.
    pub freeze_millis: Option<u64>,
}

impl CheckpointView {
    pub fn of(c: &PodCheckpoint) -> Self {
        let s = c.status.as_ref();
        Self {
            reason: c.spec.reason,
            phase: s.and_then(|s| s.phase),
            created_unix_ms: c.metadata.creation_timestamp.as_ref().map_or(0, time_ms),
            started_unix_ms: s.and_then(|s| s.start_time.as_ref()).map(time_ms),
            freeze_millis: s
                .and_then(|s| s.freeze_millis)
                .and_then(|m| u64::try_from(m).ok()),
        }
    }

    /// Not finished: pending (no phase yet, or `Pending`) or `Running`.
    pub fn in_flight(&self) -> bool {
        matches!(
            self.phase,
            None | Some(CheckpointPhase::Pending) | Some(CheckpointPhase::Running)
        )
    }
}

/// The next step for a pod's heartbeat.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// A checkpoint of the pod is pending or running: never two at once.
    InFlight,
    /// Not due before this time (Unix ms).
    NotDue { at_unix_ms: u64 },
    /// Create a heartbeat checkpoint now (`due_unix_ms` names it).
    Create { due_unix_ms: u64 },
    /// Due, but the expected freeze does not fit the liveness probe's budget: skip with an
    /// Event, try again one interval later.
    Skip { reason: String },
}

/// Inputs of [`next_heartbeat`].
#[derive(Debug, Clone)]
pub struct HeartbeatInputs<'a> {
    pub interval: Duration,
    /// When the pod started (status.startTime), Unix ms.
    pub pod_started_unix_ms: u64,
    /// The pod's own checkpoints (this pod UID only).
    pub checkpoints: &'a [CheckpointView],
    /// When a heartbeat of this pod was last skipped (freeze budget), Unix ms.
    pub last_skip_unix_ms: Option<u64>,
    /// Per-pod spread ([`jitter_ms`]).
    pub jitter_ms: u64,
    pub probes: &'a [LivenessProbe],
    pub max_freeze_fraction: f64,
    /// A pending/running checkpoint older than this no longer blocks the next one (a lost
    /// agent must not stop heartbeats forever).
    pub in_flight_timeout: Duration,
    pub now_unix_ms: u64,
}

/// What to do about a pod's next heartbeat:
///
/// 1. a checkpoint of the pod in flight (younger than `in_flight_timeout`) → [`Next::InFlight`];
/// 2. due one interval (plus jitter) after the last checkpoint started (any reason: a final or
///    manual checkpoint counts), the last skip, or the pod's start;
/// 3. when due: the freeze budget against the liveness probes, with the last measured freeze of
///    this pod as the expected one (`stasis_core::policy::freeze_verdict`).
pub fn next_heartbeat(i: &HeartbeatInputs<'_>) -> Next {
    let timeout_ms = i.in_flight_timeout.as_millis() as u64;
    if i.checkpoints
        .iter()
        .any(|c| c.in_flight() && i.now_unix_ms.saturating_sub(c.created_unix_ms) < timeout_ms)
    {
        return Next::InFlight;
    }
    let last = i
        .checkpoints
        .iter()
        .map(|c| c.started_unix_ms.unwrap_or(c.created_unix_ms))
        .chain(i.last_skip_unix_ms)
        .max();
    let due = next_checkpoint_at(
        i.interval,
        i.pod_started_unix_ms,
        last,
        i.jitter_ms,
        i.now_unix_ms,
    );
    if due > i.now_unix_ms {
        return Next::NotDue { at_unix_ms: due };
    }
    let expected = i
        .checkpoints
        .iter()
        .filter(|c| c.phase == Some(CheckpointPhase::Succeeded) && c.freeze_millis.is_some())
        .max_by_key(|c| c.started_unix_ms.unwrap_or(c.created_unix_ms))
        .and_then(|c| c.freeze_millis)
        .unwrap_or(0);
    match freeze_verdict(
        Duration::from_millis(expected),
        i.probes,
        i.max_freeze_fraction,
    ) {
        FreezeVerdict::Proceed => Next::Create { due_unix_ms: due },
        FreezeVerdict::Skip(reason) => Next::Skip { reason },
    }
}

/// When the pod's newest succeeded checkpoint froze it (its start, else its creation; Unix ms),
/// or `pod_started_unix_ms` while it has none: what the checkpoint-age metric reports.
pub fn protected_since(checkpoints: &[CheckpointView], pod_started_unix_ms: u64) -> u64 {
    checkpoints
        .iter()
        .filter(|c| c.phase == Some(CheckpointPhase::Succeeded))
        .map(|c| c.started_unix_ms.unwrap_or(c.created_unix_ms))
        .max()
        .unwrap_or(pod_started_unix_ms)
}

/// A per-pod spread of heartbeats: BLAKE3 of the pod UID modulo a tenth of the interval.
pub fn jitter_ms(uid: &str, interval: Duration) -> u64 {
    let tenth = (interval.as_millis() / 10) as u64;
    if tenth == 0 {
        return 0;
    }
    let h = blake3::hash(uid.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b) % tenth
}

/// Name of a heartbeat `PodCheckpoint`: the pod's name (cut to fit) and the due time in Unix
/// seconds, so a retried reconcile creates the same object (AlreadyExists) rather than two.
pub fn heartbeat_name(pod: &str, due_unix_ms: u64) -> String {
    let suffix = format!("-{}", due_unix_ms / 1000);
    let keep = 253 - suffix.len();
    let head: String = pod.chars().take(keep).collect();
    format!("{}{suffix}", head.trim_end_matches(['-', '.']))
}

/// Whether a pod is one the controller checkpoints: `runtimeClassName` is stasis's, it runs
/// (phase `Running`, bound, not being deleted).
pub fn eligible(pod: &Pod, runtime_class: &str) -> Result<(), &'static str> {
    let spec = pod.spec.as_ref().ok_or("no spec")?;
    if spec.runtime_class_name.as_deref() != Some(runtime_class) {
        return Err("not runtimeClassName stasis");
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err("being deleted");
    }
    if spec.node_name.is_none() {
        return Err("not scheduled");
    }
    match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Running") => Ok(()),
        _ => Err("not running"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn view(phase: Option<CheckpointPhase>, created: u64, freeze: Option<u64>) -> CheckpointView {
        CheckpointView {
            reason: CheckpointReason::Heartbeat,
            phase,
            created_unix_ms: created,
            started_unix_ms: Some(created + 100),
            freeze_millis: freeze,
        }
    }

    fn inputs<'a>(
        cks: &'a [CheckpointView],
        probes: &'a [LivenessProbe],
        now: u64,
    ) -> HeartbeatInputs<'a> {
        HeartbeatInputs {
            interval: Duration::from_secs(10),
            pod_started_unix_ms: 1_000,
            checkpoints: cks,
            last_skip_unix_ms: None,
            jitter_ms: 0,
            probes,
            max_freeze_fraction: 0.5,
            in_flight_timeout: Duration::from_secs(600),
            now_unix_ms: now,
        }
    }

    #[test]
    fn first_heartbeat_one_interval_after_start() {
        assert_eq!(
            next_heartbeat(&inputs(&[], &[], 5_000)),
            Next::NotDue { at_unix_ms: 11_000 }
        );
        assert_eq!(
            next_heartbeat(&inputs(&[], &[], 11_000)),
            Next::Create {
                due_unix_ms: 11_000
            }
        );
    }

    #[test]
    fn never_two_in_flight_unless_stale() {
        let cks = [view(Some(CheckpointPhase::Running), 11_000, None)];
        assert_eq!(next_heartbeat(&inputs(&cks, &[], 30_000)), Next::InFlight);
        let cks = [view(None, 11_000, None)];
        assert_eq!(next_heartbeat(&inputs(&cks, &[], 30_000)), Next::InFlight);
        // Stale after the in-flight timeout: due again.
        assert!(matches!(
            next_heartbeat(&inputs(&cks, &[], 11_000 + 600_001)),
            Next::Create { .. }
        ));
    }

    #[test]
    fn next_after_the_last_start_of_any_checkpoint_or_skip() {
        let cks = [
            view(Some(CheckpointPhase::Succeeded), 11_000, Some(200)),
            view(Some(CheckpointPhase::Failed), 21_000, None),
        ];
        assert_eq!(
            next_heartbeat(&inputs(&cks, &[], 25_000)),
            Next::NotDue { at_unix_ms: 31_100 }
        );
        let mut i = inputs(&cks, &[], 32_000);
        i.last_skip_unix_ms = Some(31_500);
        assert_eq!(next_heartbeat(&i), Next::NotDue { at_unix_ms: 41_500 });
    }

    #[test]
    fn freeze_budget_skips() {
        // Liveness budget 5*3-1 = 14 s, half of it 7 s; the last freeze took 8 s.
        let probes = [LivenessProbe {
            period_seconds: Some(5),
            failure_threshold: Some(3),
            timeout_seconds: Some(1),
        }];
        let cks = [view(Some(CheckpointPhase::Succeeded), 11_000, Some(8_000))];
        match next_heartbeat(&inputs(&cks, &probes, 40_000)) {
            Next::Skip { reason } => assert!(reason.contains("liveness"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let cks = [view(Some(CheckpointPhase::Succeeded), 11_000, Some(2_000))];
        assert!(matches!(
            next_heartbeat(&inputs(&cks, &probes, 40_000)),
            Next::Create { .. }
        ));
    }

    #[test]
    fn protected_since_the_newest_succeeded_checkpoint_else_the_start() {
        assert_eq!(protected_since(&[], 1_000), 1_000);
        let cks = [
            view(Some(CheckpointPhase::Succeeded), 11_000, Some(200)),
            view(Some(CheckpointPhase::Succeeded), 21_000, Some(200)),
            view(Some(CheckpointPhase::Failed), 31_000, None),
            view(Some(CheckpointPhase::Running), 41_000, None),
        ];
        assert_eq!(protected_since(&cks, 1_000), 21_100);
        assert_eq!(protected_since(&cks[2..], 1_000), 1_000);
    }

    #[test]
    fn jitter_is_bounded_and_stable() {
        let j = jitter_ms("uid-1", Duration::from_secs(10));
        assert!(j < 1_000);
        assert_eq!(j, jitter_ms("uid-1", Duration::from_secs(10)));
        assert_eq!(jitter_ms("uid-1", Duration::from_millis(5)), 0);
    }

    #[test]
    fn names_fit() {
        assert_eq!(
            heartbeat_name("counter-abc", 1_700_000_000_999),
            "counter-abc-1700000000"
        );
        let long = "a".repeat(253);
        assert_eq!(heartbeat_name(&long, 1_000).len(), 253);
    }

    #[test]
    fn policy_selection_and_eligibility() {
        let p = |name: &str, ns: &str, sel: serde_json::Value| -> CheckpointPolicy {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"selector": sel, "interval": "10s"}
            }))
            .unwrap()
        };
        let policies = [
            p("zz", "prod", json!({})),
            p("aa", "prod", json!({"matchLabels": {"app": "counter"}})),
            p("00", "other", json!({})),
            p(
                "bb",
                "prod",
                json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["x"]}]}),
            ),
        ];
        let labels = BTreeMap::from([("app".to_owned(), "counter".to_owned())]);
        assert_eq!(
            policy_for(&policies, "prod", &labels).unwrap().name_any(),
            "aa"
        );
        let other = BTreeMap::from([("app".to_owned(), "y".to_owned())]);
        assert_eq!(
            policy_for(&policies, "prod", &other).unwrap().name_any(),
            "zz"
        );
        assert!(policy_for(&policies, "none", &labels).is_none());

        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "prod"},
            "spec": {"runtimeClassName": "stasis", "nodeName": "w1", "containers": [{"name": "c"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        assert_eq!(eligible(&pod, "stasis"), Ok(()));
        assert!(eligible(&pod, "other").is_err());
        pod.status.as_mut().unwrap().phase = Some("Pending".into());
        assert_eq!(eligible(&pod, "stasis"), Err("not running"));
    }
}
