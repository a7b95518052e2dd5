//! `PodRestore`: the decision to restore a checkpoint into a pod, recorded so every restore is
//! auditable. The admission webhook creates one per restoring pod; creating one by hand needs
//! the restore permission (RBAC on `podrestores`), separate from creating pods or checkpoints.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::names::reason;

/// Which checkpoint goes into which pod. Immutable once created.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "stasis.dev",
    version = "v1alpha1",
    kind = "PodRestore",
    namespaced,
    status = "PodRestoreStatus",
    shortname = "prestore",
    category = "stasis",
    selectable = ".spec.targetPodName",
    printcolumn = r#"{"name":"Target Pod","type":"string","jsonPath":".spec.targetPodName"}"#,
    printcolumn = r#"{"name":"Checkpoint","type":"string","jsonPath":".spec.checkpointRef"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.node"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Source Pod","type":"string","priority":1,"jsonPath":".spec.sourcePodName"}"#,
    printcolumn = r#"{"name":"Fetch (ms)","type":"integer","priority":1,"jsonPath":".status.fetchMillis"}"#,
    printcolumn = r#"{"name":"Restore (ms)","type":"integer","priority":1,"jsonPath":".status.restoreMillis"}"#,
    printcolumn = r#"{"name":"Failure","type":"string","priority":1,"jsonPath":".status.failure"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.message"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a PodRestore's spec is immutable"
}]))]
pub struct PodRestoreSpec {
    /// `<lineage>/<checkpoint id>` of the checkpoint to restore (a `PodCheckpoint`'s
    /// `status.checkpointRef`).
    #[schemars(length(min = 1))]
    pub checkpoint_ref: String,
    /// The pod that resumes from it, in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub target_pod_name: String,
    /// The target pod's UID, when known (the webhook sees the pod before it has one).
    #[serde(
        default,
        rename = "targetPodUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub target_pod_uid: Option<String>,
    /// The pod the checkpoint was taken from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pod_name: Option<String>,
    /// The lineage the target pod claimed and continues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
    /// The lineage generation of the claim (bumped by it): checkpoints from older generations can
    /// no longer become the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
}

/// Where a restore is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum RestorePhase {
    /// Decided at admission; the pod is not on a node yet.
    Pending,
    /// The node's agent is fetching and verifying the archive.
    Fetching,
    /// The archive is on the node, verified and compatible: `create` will restore.
    Ready,
    /// The pod continues from the checkpoint.
    Restored,
    /// The restore failed after the container was created from it.
    Failed,
    /// The pod started from zero instead; `message` says why.
    ColdStart,
}

/// Why a restore did not happen: the restore-loop guard counts equal causes.
// A type, so that the guard never depends on the wording of an error message. The agent sets it
// with phase `Failed` or `ColdStart` and uses `reason()` as the `Ready` condition's reason. From
// its preparation: FetchFailed (a store error), CheckpointDamaged (an integrity failure),
// Incompatible, KeyUnavailable, InvalidRestore, Timeout; from stasis-runc's cold start (its
// `ColdStartCause`): RestoreFailed, PlanRefused, Unsupported, NoPlan, ColdStartRequested.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum RestoreFailure {
    /// The store could not deliver the checkpoint (network, permissions, a missing bucket).
    FetchFailed,
    /// The checkpoint's objects are gone or damaged in the store, or its manifest is not the
    /// one the controller published: an alarm, never a reason to restore older memory.
    CheckpointDamaged,
    /// The checkpoint does not fit the node, the pod spec or the declared versions.
    Incompatible,
    /// The namespace's data key could not be obtained.
    KeyUnavailable,
    /// The `PodRestore` does not fit its pod or lineage (another pod, a checkpoint never
    /// published, a malformed `checkpointRef`).
    InvalidRestore,
    /// The preparation did not finish in time.
    Timeout,
    /// The restore was attempted and failed (rootfs diff, `runc restore`).
    RestoreFailed,
    /// The runtime refused the plan at create (another pod, expired, not verified).
    PlanRefused,
    /// The runtime could not turn the create call into a restore (flags it does not know).
    Unsupported,
    /// The container was created before the agent had a plan for it.
    NoPlan,
    /// The pod asked for a cold start (`stasis.dev/cold-start`).
    ColdStartRequested,
    /// The controller does not count it: it names a lineage of another namespace, or a
    /// checkpoint of another lineage.
    Refused,
    /// A cause this version does not know (written by a newer agent).
    #[serde(other)]
    Other,
}

impl RestoreFailure {
    /// Every cause, in declaration order.
    pub const ALL: [RestoreFailure; 13] = [
        Self::FetchFailed,
        Self::CheckpointDamaged,
        Self::Incompatible,
        Self::KeyUnavailable,
        Self::InvalidRestore,
        Self::Timeout,
        Self::RestoreFailed,
        Self::PlanRefused,
        Self::Unsupported,
        Self::NoPlan,
        Self::ColdStartRequested,
        Self::Refused,
        Self::Other,
    ];

    /// The `Ready` condition's reason for this cause: its serialized name.
    pub fn reason(self) -> &'static str {
        match self {
            Self::FetchFailed => reason::FETCH_FAILED,
            Self::CheckpointDamaged => reason::CHECKPOINT_DAMAGED,
            Self::Incompatible => reason::INCOMPATIBLE,
            Self::KeyUnavailable => reason::KEY_UNAVAILABLE,
            Self::InvalidRestore => reason::INVALID_RESTORE,
            Self::Timeout => reason::TIMEOUT,
            Self::RestoreFailed => reason::RESTORE_FAILED,
            Self::PlanRefused => reason::PLAN_REFUSED,
            Self::Unsupported => reason::UNSUPPORTED,
            Self::NoPlan => reason::NO_PLAN,
            Self::ColdStartRequested => reason::COLD_START_REQUESTED,
            Self::Refused => reason::REFUSED,
            Self::Other => reason::OTHER,
        }
    }
}

impl std::fmt::Display for RestoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}

/// What the agent and the wrapper report about a restore.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRestoreStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RestorePhase>,
    /// Node the target pod landed on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Human-readable detail: why a cold start, what failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Why the restore did not happen (with phase `Failed` or `ColdStart`): what the
    /// restore-loop guard counts. Absent when written by an agent older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<RestoreFailure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Fetch and verify time, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetch_millis: Option<i64>,
    /// `runc restore` (and GPU restore) time, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_millis: Option<i64>,
    /// `Ready` (reasons `Restored`, `ColdStart`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serialized name, the condition reason and `Display` agree for every cause: the guard
    /// and people read the same word.
    #[test]
    fn failure_names_are_their_reasons() {
        for f in RestoreFailure::ALL {
            assert_eq!(serde_json::to_value(f).unwrap(), f.reason(), "{f:?}");
            assert_eq!(f.to_string(), f.reason());
            let back: RestoreFailure = serde_json::from_value(f.reason().into()).unwrap();
            assert_eq!(back, f);
        }
    }

    /// A cause a newer agent writes reads as `Other`; a status without `failure` (an older
    /// agent's) reads as `None`.
    #[test]
    fn unknown_and_absent_failures() {
        let s: PodRestoreStatus =
            serde_json::from_value(serde_json::json!({"phase": "Failed", "failure": "GpuLost"}))
                .unwrap();
        assert_eq!(s.failure, Some(RestoreFailure::Other));
        let s: PodRestoreStatus =
            serde_json::from_value(serde_json::json!({"phase": "Failed", "message": "x"})).unwrap();
        assert_eq!(s.failure, None);
        let v = serde_json::to_value(PodRestoreStatus {
            failure: Some(RestoreFailure::FetchFailed),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(v, serde_json::json!({"failure": "FetchFailed"}));
    }
}
