//! Condition types and reasons used in the status of stasis resources, and a helper that keeps a
//! condition list with one entry per type (the Kubernetes convention for `listType=map`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// `Ready`: a `PodCheckpoint` is complete and verified (KEP-5823's condition), a `PodRestore`
/// has restored, a `CheckpointPolicy` is valid and active.
pub const READY: &str = "Ready";

/// Reasons of the `Ready` condition (defined in [`crate::names`]).
pub use crate::names::reason;

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
