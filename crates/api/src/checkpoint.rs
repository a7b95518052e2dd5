//! `PodCheckpoint`: a request for a checkpoint, and the record of every checkpoint taken.
//!
//! The spec follows KEP-5823's `PodCheckpoint` (`sourcePodName`, `sourcePodUID`,
//! `timeoutSeconds`, a `Ready` condition whose reasons say where it is), so a later move to the
//! built-in type keeps the same vocabulary. stasis adds a `phase` (the acceptance checks and
//! `kubectl get` read it), the lineage and the generation it was written under (fencing), and
//! where the archive is. One object per checkpoint; retention deletes it with its archive. The
//! store's manifests stay the source of truth for what exists.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The largest `timeoutSeconds` the CRD accepts (the schema's `maximum`; the agent clamps to it
/// as well, for objects created before the schema said so).
pub const MAX_TIMEOUT_SECONDS: i32 = 3600;

/// Which pod to checkpoint and why. Immutable once created.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "stasis.dev",
    version = "v1alpha1",
    kind = "PodCheckpoint",
    namespaced,
    status = "PodCheckpointStatus",
    shortname = "pckpt",
    category = "stasis",
    selectable = ".spec.sourcePodName",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.sourcePodName"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".spec.reason"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.sizeBytes","description":"Bytes of state captured, before deduplication and compression"}"#,
    printcolumn = r#"{"name":"Freeze (ms)","type":"integer","jsonPath":".status.freezeMillis","description":"How long the workload was frozen"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.node"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Uploaded","type":"integer","priority":1,"jsonPath":".status.uploadedBytes","description":"Bytes uploaded (new chunks, compressed)"}"#,
    printcolumn = r#"{"name":"Total (ms)","type":"integer","priority":1,"jsonPath":".status.totalMillis"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a PodCheckpoint's spec is immutable"
}]))]
pub struct PodCheckpointSpec {
    /// Name of the pod to checkpoint, in this namespace.
    #[schemars(length(min = 1, max = 253))]
    pub source_pod_name: String,
    /// Pins the pod instance: if the pod of that name has another UID, the checkpoint fails with
    /// reason `SourcePodReplaced` instead of checkpointing a different pod.
    #[serde(
        default,
        rename = "sourcePodUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub source_pod_uid: Option<String>,
    /// Why the checkpoint is taken. `Manual` for a request by a person.
    #[serde(default)]
    pub reason: CheckpointReason,
    /// Upper bound on the whole checkpoint (freeze, dump, upload); the agent's default when
    /// absent or 0. A termination checkpoint is also bounded by the grace period left. At most
    /// 3600 (one hour): a checkpoint holds its node's checkpoint worker while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub timeout_seconds: Option<i32>,
}

/// Why a checkpoint was taken.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum CheckpointReason {
    /// The policy's interval came round.
    Heartbeat,
    /// The pod is being stopped gracefully: the final checkpoint.
    Termination,
    /// Someone asked for it.
    #[default]
    Manual,
    /// Memory usage crossed the policy's `triggers.memoryPercent`.
    MemoryPressure,
    /// The cloud announced that it reclaims the node (spot interruption, preemption) or
    /// recommended moving off it (AWS rebalance recommendation).
    SpotNotice,
    /// The cloud announced maintenance that stops, reboots or pauses the node.
    MaintenanceNotice,
}

/// Where a checkpoint is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum CheckpointPhase {
    /// Accepted, not started.
    Pending,
    /// Freezing, dumping or uploading.
    Running,
    /// Complete and verified: the manifest is written.
    Succeeded,
    /// Failed or skipped; `Ready`'s reason and message say why.
    Failed,
}

/// What the agent reports about a checkpoint (written through the status subresource only).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodCheckpointStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<CheckpointPhase>,
    /// Node whose agent took the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// UID of the pod that was checkpointed.
    #[serde(
        default,
        rename = "sourcePodUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub source_pod_uid: Option<String>,
    /// Bytes of state captured (memory, files, GPU memory), before deduplication and compression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// Bytes actually uploaded (new chunks after deduplication, compressed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_bytes: Option<i64>,
    /// `<lineage>/<checkpoint id>`: the store reference of the archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_ref: Option<String>,
    /// Digest of the manifest written last (the archive's integrity anchor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_digest: Option<String>,
    /// Lineage (the pod's history of checkpoints) this checkpoint belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
    /// Lineage generation the writer held; a checkpoint from a fenced-off generation never
    /// becomes the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Normalised pod spec hash of the source (restores go only into pods with the same hash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_hash: Option<String>,
    /// When the agent started and finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// How long the workload was frozen (its downtime), in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_millis: Option<i64>,
    /// Dump (CRIU and files) time, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_millis: Option<i64>,
    /// Chunk, compress, encrypt and upload time, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_millis: Option<i64>,
    /// Start to manifest written, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_millis: Option<i64>,
    /// `Ready` with KEP-5823's reasons: `Pending`, `CheckpointInProgress`,
    /// `CheckpointCompleted`, `CheckpointFailed`, `SourcePodReplaced`, plus stasis's
    /// `FreezeBudgetExceeded` and `Fenced`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
