//! Every `stasis.dev/*` label and annotation key, and every condition and Event reason, of the
//! project: defined once, here, because the processes that write a name and those that read it
//! must agree to the byte (docs/design.md §13). stasis-runc reads some of them and does not link
//! the API crate, so they live in core; `stasis_api::names` re-exports this module and adds the
//! Kubernetes-only ones.
//!
//! One constant per key string: where one key serves several roles (a pod annotation, a label on a
//! lineage record, a manifest label), its doc lists them all.

/// The prefix of every key stasis owns (`declare.stasis.dev/` keys are the user's).
pub const PREFIX: &str = "stasis.dev/";

/// Pod annotation `stasis.dev/cold-start: "true"`: the pod asks to start from zero (the only
/// `stasis.dev/` key a user may set; the webhook and stasis-runc both honour it).
pub const COLD_START: &str = "stasis.dev/cold-start";

/// The lineage: a pod annotation (the lineage the webhook claimed for it, for people to read), the
/// annotation of a lineage record ConfigMap holding its id, and a manifest label.
pub const LINEAGE: &str = "stasis.dev/lineage";
/// The lineage generation (decimal): a pod annotation (the generation of its claim) and a
/// manifest label (the generation its writer held).
pub const GENERATION: &str = "stasis.dev/generation";
/// Label on every lineage record ConfigMap (`true`).
pub const LINEAGE_RECORD: &str = "stasis.dev/lineage-record";
/// Label on a lineage record ConfigMap: the UID of the pod holding the lineage.
pub const HOLDER_UID: &str = "stasis.dev/holder-uid";
/// A namespace: the label and annotation of a lineage record ConfigMap (its workload's
/// namespace), the label of a data-key Secret, and a manifest label.
pub const NAMESPACE: &str = "stasis.dev/namespace";
/// The node: the label of `PodCheckpoint`s and `PodRestore`s (whose agent alone may write them)
/// and a manifest label (the node that wrote the checkpoint).
pub const NODE: &str = "stasis.dev/node";
/// The workload: on a lineage record ConfigMap, the label holds 16 hex digits of its key's
/// BLAKE3 hash, the annotation the key itself.
pub const WORKLOAD: &str = "stasis.dev/workload";
/// Annotation on a lineage record ConfigMap: when its holder was last seen gone (Unix ms).
pub const ORPHANED_SINCE: &str = "stasis.dev/orphaned-since";
/// The webhook's claim token: a pod annotation and a pod label (the holder of the pod's lineage
/// until the controller sees the pod's UID).
pub const CLAIM_TOKEN: &str = "stasis.dev/claim-token";
/// Pod annotation: `Restore` or `ColdStart`, what the webhook decided.
pub const DECISION: &str = "stasis.dev/decision";
/// Pod annotation: why a cold start (the `ColdStart` Event's text).
pub const DECISION_REASON: &str = "stasis.dev/decision-reason";
/// Pod annotation set by the controller once the decision became a `PodRestore` or an Event.
pub const DECISION_REPORTED: &str = "stasis.dev/decision-reported";
/// Pod annotation: the checkpoint (`<lineage>/<id>`) a restoring pod resumes from.
pub const RESTORE_FROM: &str = "stasis.dev/restore-from";
/// Pod annotation set by the webhook: the `PodRestore` (its name) made by hand for this pod before
/// it existed, which the pod waits for. Only a pod that carries it is prepared for a `PodRestore`
/// without a target UID, so a pod created by someone who may not restore never receives one.
pub const RESTORE_REQUEST: &str = "stasis.dev/restore-request";
/// Label on `PodCheckpoint`s: the `CheckpointPolicy` that asked for them (retention counts
/// only the ones the controller created).
pub const POLICY: &str = "stasis.dev/policy";
/// Annotation on a `PodRestore` whose outcome the restore-loop guard has counted.
pub const ACCOUNTED: &str = "stasis.dev/accounted";
/// The source pod's UID: a label on the `PodCheckpoint`s the controller creates, and a manifest
/// label.
pub const POD_UID: &str = "stasis.dev/pod-uid";
/// Label on objects the agent creates: which agent (`stasisd`).
pub const CREATED_BY: &str = "stasis.dev/created-by";
/// Annotation on the cluster key Secret: a note for people.
pub const NOTE: &str = "stasis.dev/note";
/// Annotation on a data-key Secret: the id of the cluster key that wraps it.
pub const CLUSTER_KEY_ID: &str = "stasis.dev/cluster-key-id";

/// Node labels the agents set.
/// The CRI annotations a container runtime writes into a container's OCI config (containerd's
/// `internal/cri/annotations` first; CRI-O's and the kubelet's `io.kubernetes.pod.*` as
/// fallbacks): who the container belongs to. Read by stasis-runc and the agent from bundles, and
/// written and read in Kubernetes checkpoint archives' `spec.dump`.
pub mod cri {
    pub const CONTAINER_TYPE: &[&str] = &[
        "io.kubernetes.cri.container-type",
        "io.kubernetes.cri-o.ContainerType",
    ];
    pub const POD_UID: &[&str] = &["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"];
    pub const POD_NAMESPACE: &[&str] = &[
        "io.kubernetes.cri.sandbox-namespace",
        "io.kubernetes.pod.namespace",
    ];
    pub const POD_NAME: &[&str] = &["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"];
    pub const CONTAINER_NAME: &[&str] = &[
        "io.kubernetes.cri.container-name",
        "io.kubernetes.container.name",
    ];
}

pub mod node {
    /// `true` while the node can restore.
    pub const READY: &str = "stasis.dev/ready";
    /// The CPU architecture as the checkpoint records it.
    pub const CPU_ARCH: &str = "stasis.dev/cpu-arch";
    /// On GPU nodes: the GPU model.
    pub const GPU_MODEL: &str = "stasis.dev/gpu-model";
    /// On GPU nodes: the number of GPUs.
    pub const GPU_COUNT: &str = "stasis.dev/gpu-count";
    /// On GPU nodes: the NVIDIA driver branch (e.g. `580`).
    pub const GPU_DRIVER_BRANCH: &str = "stasis.dev/gpu-driver-branch";
    /// Set once the node's cloud announced its end (the value: the notice's kind).
    pub const NOTICE: &str = "stasis.dev/notice";
}

/// Labels of a checkpoint's manifest (the store's format, read back by `prepare` and
/// `stasis inspect`); those that are also Kubernetes keys are the same constants.
pub mod manifest {
    pub use super::{GENERATION, LINEAGE, NAMESPACE, NODE, POD_UID};
    /// The source pod's name.
    pub const POD_NAME: &str = "stasis.dev/pod-name";
    /// The checkpointed container's name.
    pub const CONTAINER_NAME: &str = "stasis.dev/container-name";
    /// The normalised pod spec hash.
    pub const SPEC_HASH: &str = "stasis.dev/spec-hash";
    /// Whether the container held established TCP connections.
    pub const TCP_ESTABLISHED: &str = "stasis.dev/tcp-established";
    /// Why the checkpoint was taken (`Heartbeat`, `Termination`, ...).
    pub const REASON: &str = "stasis.dev/reason";
}

/// Reasons of the `Ready` condition of stasis resources (the `PodCheckpoint` ones as in
/// KEP-5823). A `PodRestore`'s failure reasons are also the names of `RestoreFailure` in the API.
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
    /// A heartbeat whose upload was stopped because its pod began to stop: the pod's final
    /// checkpoint, taken after it, replaces it. Nothing of it was published.
    pub const SUPERSEDED: &str = "Superseded";
    /// A `PodRestore` whose agent is fetching and verifying the checkpoint.
    pub const FETCHING: &str = "Fetching";
    /// A `PodRestore` whose checkpoint is on the node, verified: the container restores when
    /// it is created.
    pub const PREPARED: &str = "Prepared";
    /// A `PodRestore` whose pod continues from the checkpoint.
    pub const RESTORED: &str = "Restored";
    /// A `PodRestore` that ended in a cold start.
    pub const COLD_START: &str = "ColdStart";
    /// A `PodRestore` that failed (no more specific cause known).
    pub const RESTORE_FAILED: &str = "RestoreFailed";
    /// A `PodRestore` that failed because the checkpoint's objects are gone or damaged in the
    /// store: an alarm; the lineage cold-starts rather than restoring older memory.
    pub const CHECKPOINT_DAMAGED: &str = "CheckpointDamaged";
    /// A `PodRestore` the controller does not count: it names a lineage of another namespace or
    /// a checkpoint of another lineage.
    pub const REFUSED: &str = "Refused";
    /// A `PodRestore` whose checkpoint the store could not deliver (network, permissions).
    pub const FETCH_FAILED: &str = "FetchFailed";
    /// A `PodRestore` whose checkpoint does not fit the node, the pod spec or the declared
    /// versions.
    pub const INCOMPATIBLE: &str = "Incompatible";
    /// A `PodRestore` whose namespace's data key could not be obtained.
    pub const KEY_UNAVAILABLE: &str = "KeyUnavailable";
    /// A `PodRestore` that does not fit its pod or lineage (another pod, a checkpoint never
    /// published, a malformed `checkpointRef`).
    pub const INVALID_RESTORE: &str = "InvalidRestore";
    /// A `PodRestore` whose preparation did not finish in time.
    pub const TIMEOUT: &str = "Timeout";
    /// A `PodRestore` whose plan the runtime refused at create (another pod, expired, not
    /// verified).
    pub const PLAN_REFUSED: &str = "PlanRefused";
    /// A `PodRestore` the runtime could not carry out (a create call it cannot turn into a
    /// restore).
    pub const UNSUPPORTED: &str = "Unsupported";
    /// A `PodRestore` whose container was created before the agent had a plan for it.
    pub const NO_PLAN: &str = "NoPlan";
    /// A `PodRestore` whose pod asked for a cold start (`stasis.dev/cold-start`).
    pub const COLD_START_REQUESTED: &str = "ColdStartRequested";
    /// A `PodRestore` that failed for a cause this version does not name.
    pub const OTHER: &str = "Other";
    /// A `CheckpointPolicy` whose spec was refused (e.g. `interval: auto`).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A `CheckpointPolicy` that is valid and applied.
    pub const ACTIVE: &str = "Active";
}

/// Reasons of the Kubernetes Events stasis emits (beside the condition reasons they share:
/// `Restored`, `ColdStart`, `CheckpointFailed`, `CheckpointDamaged`).
pub mod event {
    /// The controller will not checkpoint a pod (record cap, unverifiable identity, freeze
    /// budget).
    pub const CHECKPOINT_SKIPPED: &str = "CheckpointSkipped";
    /// A pod claimed a lineage it may not hold.
    pub const CLAIM_REFUSED: &str = "ClaimRefused";
    /// The webhook decided a restore; the controller recorded it as a `PodRestore`.
    pub const RESTORE_DECIDED: &str = "RestoreDecided";
    /// A checkpoint was taken.
    pub const CHECKPOINTED: &str = "Checkpointed";
    /// The node's cloud announced its end.
    pub const CLOUD_NOTICE: &str = "CloudNotice";
    /// A container neared its memory limit, or its node reports memory pressure: a checkpoint
    /// started (the `PodCheckpoint` reason of the same name).
    pub const MEMORY_PRESSURE: &str = "MemoryPressure";
    /// A restored container's create was given up before the container started (the kubelet
    /// or containerd died or timed out): the agent prepares the same checkpoint again for the
    /// next create.
    pub const RESTORE_RETRIED: &str = "RestoreRetried";
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key is distinct and under the prefix: two constants for one key is the mistake this
    /// module exists to prevent.
    #[test]
    fn keys_are_distinct_and_prefixed() {
        let keys = [
            COLD_START,
            LINEAGE,
            GENERATION,
            LINEAGE_RECORD,
            HOLDER_UID,
            NAMESPACE,
            NODE,
            WORKLOAD,
            ORPHANED_SINCE,
            CLAIM_TOKEN,
            DECISION,
            DECISION_REASON,
            DECISION_REPORTED,
            RESTORE_FROM,
            RESTORE_REQUEST,
            POLICY,
            ACCOUNTED,
            POD_UID,
            CREATED_BY,
            NOTE,
            CLUSTER_KEY_ID,
            node::READY,
            node::CPU_ARCH,
            node::GPU_MODEL,
            node::GPU_COUNT,
            node::GPU_DRIVER_BRANCH,
            node::NOTICE,
            manifest::POD_NAME,
            manifest::CONTAINER_NAME,
            manifest::SPEC_HASH,
            manifest::TCP_ESTABLISHED,
            manifest::REASON,
        ];
        let mut seen = std::collections::BTreeSet::new();
        for k in keys {
            assert!(k.starts_with(PREFIX), "{k}");
            assert!(seen.insert(k), "{k} is defined twice");
        }
    }
}
