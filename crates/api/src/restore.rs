//! `PodRestore`: the decision to restore a checkpoint into a pod, recorded so every restore is
//! auditable. The admission webhook creates one per restoring pod; creating one by hand needs
//! the restore permission (RBAC on `podrestores`), separate from creating pods or checkpoints.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
