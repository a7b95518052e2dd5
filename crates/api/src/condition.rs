//! Condition types and reasons used in the status of stasis resources, and a helper that keeps a
//! condition list with one entry per type (the Kubernetes convention for `listType=map`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// `Ready`: a `PodCheckpoint` is complete and verified (KEP-5823's condition), a `PodRestore`
/// has restored, a `CheckpointPolicy` is valid and active.
pub const READY: &str = "Ready";

/// Reasons of a `PodCheckpoint`'s `Ready` condition, as in KEP-5823.
pub mod reason {
    /// Not started yet.
    pub const PENDING: &str = "Pending";
    /// The agent is freezing, dumping or uploading.
    pub const CHECKPOINT_IN_PROGRESS: &str = "CheckpointInProgress";
    /// The manifest is written: the checkpoint exists.
    pub const CHECKPOINT_COMPLETED: &str = "CheckpointCompleted";
    /// The checkpoint failed; the message says why.
    pub const CHECKPOINT_FAILED: &str = "CheckpointFailed";
    /// `spec.sourcePodUID` names a pod that no longer exists under that name.
    pub const SOURCE_POD_REPLACED: &str = "SourcePodReplaced";
    /// Skipped: the freeze would not fit the liveness probe's budget.
    pub const FREEZE_BUDGET_EXCEEDED: &str = "FreezeBudgetExceeded";
    /// Refused: a newer claim fenced this lineage generation off.
    pub const FENCED: &str = "Fenced";
    /// A `PodRestore` whose pod continues from the checkpoint.
    pub const RESTORED: &str = "Restored";
    /// A `PodRestore` that ended in a cold start.
    pub const COLD_START: &str = "ColdStart";
    /// A `PodRestore` that failed because the checkpoint's objects are gone or damaged in the
    /// store: an alarm; the lineage cold-starts rather than restoring older memory.
    pub const CHECKPOINT_DAMAGED: &str = "CheckpointDamaged";
    /// A `CheckpointPolicy` whose spec was refused (e.g. `interval: auto`).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A `CheckpointPolicy` that is valid and applied.
    pub const ACTIVE: &str = "Active";
}

/// Sets (or replaces) the condition of `type_`, keeping `lastTransitionTime` when the status did
/// not change, so watchers can tell a transition from a refresh.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) {
    let status = if status { "True" } else { "False" }.to_owned();
    let message = message.into();
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != status {
            c.last_transition_time = now;
        }
        c.status = status;
        c.reason = reason.to_owned();
        c.message = message;
        c.observed_generation = observed_generation;
    } else {
        conditions.push(Condition {
            type_: type_.to_owned(),
            status,
            reason: reason.to_owned(),
            message,
            observed_generation,
            last_transition_time: now,
        });
    }
}

/// The condition of `type_`, if set.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}
