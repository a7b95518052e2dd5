//! stasis-controller: the cluster side of stasis (docs/design.md §13).
//!
//! - [`reconcile`]: heartbeat `PodCheckpoint`s per `CheckpointPolicy`, lineage bookkeeping
//!   (holders, orphaning, in-flight final checkpoints, publishing with fencing), retention, the
//!   restore-loop guard, `PodRestore`s and `ColdStart` Events for decisions made at admission,
//!   policy status;
//! - [`webhook`]: the mutating admission webhook that makes the restore decision
//!   (`stasis_core::decision::decide`) for a new `runtimeClassName: stasis` pod;
//! - [`record`]: where lineage records live (one ConfigMap per lineage in stasis's namespace);
//! - [`schedule`], [`webhook::patch`]: the pure parts (when a heartbeat is due, the JSONPatch);
//! - [`gc`]: the periodic chunk garbage collection of the store (leader only);
//! - [`leader`]: a `coordination.k8s.io/v1` Lease so one replica reconciles;
//! - [`server`], [`metrics`]: `/metrics`, `/healthz`, the webhook's HTTPS listener;
//! - [`wait`]: the injected init container's wait for the node agent.

pub mod app;
pub mod broker;
pub mod cache;
pub mod claim;
pub mod cluster_key;
pub mod gc;
pub mod holder;
pub mod leader;
pub mod metrics;
pub mod owners;
pub mod reconcile;
pub mod record;
pub mod schedule;
pub mod server;
pub mod telemetry;
#[cfg(test)]
mod testing;
pub mod wait;
pub mod webhook;

/// Everything that can go wrong in a reconcile or an admission.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A call to the API server failed.
    #[error("kubernetes api: {0}")]
    Kube(#[from] kube::Error),
    /// A lineage record changed under us (resourceVersion precondition); the caller retries.
    #[error("lineage record {0} changed concurrently")]
    Conflict(String),
    /// A lineage record ConfigMap could not be read.
    #[error("lineage record {name}: {source}")]
    Record {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    /// The store refused a delete.
    #[error("store: {0}")]
    Store(#[from] stasis_store::StoreError),
    /// A JSON value could not be (de)serialised.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// A pod's owners are not what its references say (absent, or another UID): it gets no
    /// lineage.
    #[error("its owners could not be verified: {0}")]
    UnverifiedIdentity(String),
    /// A namespace has as many lineage records as `--max-records-per-namespace` allows.
    #[error("namespace {namespace} has {cap} lineage records, the most allowed (--max-records-per-namespace): no new lineage is started; the sweep deletes those of workloads that are gone and hold no checkpoints")]
    RecordCap { namespace: String, cap: usize },
    /// A pod without a spec (only a malformed admission request has none).
    #[error("the pod has no spec")]
    PodWithoutSpec,
    /// A lineage record ConfigMap without its `lineage.json`.
    #[error("lineage record {0} has no lineage.json: repair or delete the ConfigMap")]
    RecordWithoutLineage(String),
    /// This replica no longer holds the leader lease.
    #[error("leader lease: {0}")]
    LeaseLost(&'static str),
    /// Something the code relies on did not hold (a bug, or a concurrent change it cannot
    /// resolve); the reconcile is retried.
    #[error("internal: {0}")]
    Invariant(&'static str),
}

impl Error {
    /// A short label for the `errors` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Conflict(_) => "conflict",
            Error::Record { .. } => "record",
            Error::Store(_) => "store",
            Error::Json(_) => "json",
            Error::PodWithoutSpec => "pod_without_spec",
            Error::RecordWithoutLineage(_) => "record",
            Error::LeaseLost(_) => "lease_lost",
            Error::Invariant(_) => "invariant",
            Error::RecordCap { .. } => "record_cap",
            Error::UnverifiedIdentity(_) => "unverified_identity",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub use stasis_core::time::now_ms;

/// A Kubernetes time in Unix milliseconds (0 before the epoch).
pub fn time_ms(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> u64 {
    u64::try_from(t.0.as_millisecond()).unwrap_or(0)
}

/// A Kubernetes time for `ms` Unix milliseconds.
pub fn k8s_time(ms: u64) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_millisecond(ms as i64).unwrap_or_default(),
    )
}
