//! Names of labels and annotations the controller and its webhook write (docs/design.md §13).
//! Those the agent reads too live in `stasis_api::lineage` (the lineage and generation of a pod,
//! the lineage record's ConfigMap).

/// Pod annotation: the webhook's claim token, the holder of the pod's lineage until the
/// controller sees the pod (its UID then stands beside it in the record's holder).
pub const CLAIM_TOKEN_ANNOTATION: &str = "stasis.dev/claim-token";
/// Pod annotation: `Restore` or `ColdStart`, what the webhook decided.
pub const DECISION_ANNOTATION: &str = "stasis.dev/decision";
/// Pod annotation: why a cold start (the `ColdStart` Event's text).
pub const DECISION_REASON_ANNOTATION: &str = "stasis.dev/decision-reason";
/// Pod annotation: the checkpoint (`<lineage>/<id>`) a restoring pod resumes from.
pub const RESTORE_FROM_ANNOTATION: &str = "stasis.dev/restore-from";
/// Pod annotation set by the controller once the decision became a `PodRestore` or an Event.
pub const REPORTED_ANNOTATION: &str = "stasis.dev/decision-reported";

/// Label on lineage record ConfigMaps: BLAKE3 (16 hex digits) of the workload key, so the
/// lineages of one workload are listed with one label selector.
pub const WORKLOAD_LABEL: &str = "stasis.dev/workload";
/// Annotation on lineage record ConfigMaps: the workload key itself.
pub const WORKLOAD_ANNOTATION: &str = "stasis.dev/workload";
/// Annotation on lineage record ConfigMaps: the namespace of the workload.
pub const NAMESPACE_ANNOTATION: &str = "stasis.dev/namespace";
/// Data key of the holder (who holds the lineage, since when, the restore decided for it).
pub const HOLDER_KEY: &str = "holder.json";

/// Label on `PodCheckpoint`s the controller creates: the source pod's UID.
pub const POD_UID_LABEL: &str = "stasis.dev/pod-uid";
/// Label on `PodCheckpoint`s the controller creates: the node of the source pod (agents select
/// their own with it).
pub const NODE_LABEL: &str = stasis_api::lineage::NODE_LABEL;
/// Label on objects the controller creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "stasis-controller");

/// Node label the agents set when their node can restore.
pub const READY_NODE_LABEL: &str = "stasis.dev/ready";
/// Node label the agents set on GPU nodes: the NVIDIA driver branch (e.g. `580`).
pub const GPU_DRIVER_BRANCH_LABEL: &str = "stasis.dev/gpu-driver-branch";
/// Node label the agents set: the CPU architecture as the checkpoint records it.
pub const ARCH_LABEL: &str = "stasis.dev/cpu-arch";

/// Name of the injected init container that waits for the node's agent.
pub const WAIT_CONTAINER: &str = stasis_api::pod::RESTORE_WAIT_CONTAINER;

/// Label value form of a long key: the first 16 hex digits of its BLAKE3 hash.
pub fn short_hash(s: &str) -> String {
    blake3::hash(s.as_bytes()).to_hex()[..16].to_owned()
}
