//! The agent's error type. Every variant has a short `kind()` used as the `kind` label of the
//! `stasis_agent_errors_total` metric.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("engine: {0}")]
    Engine(#[from] stasis_engine::EngineError),
    #[error("store: {0}")]
    Store(#[from] stasis_store::StoreError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no app container of pod {pod_uid} found in runc root {root}")]
    NoContainer { pod_uid: String, root: PathBuf },
    #[error("pod {pod_uid} has {count} app containers; stasis checkpoints pods with exactly one app container")]
    ManyContainers { pod_uid: String, count: usize },
    #[error("container {0} is unknown to runc or is a pod sandbox")]
    UnknownContainer(String),
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("deadline passed: {0}")]
    Deadline(String),
    #[error("key: {0}")]
    Key(#[from] crate::keys::KeyError),
    #[error("kubernetes: {0}")]
    Kube(String),
    #[error("incompatible checkpoint: {0}")]
    Incompatible(String),
    #[error("{0}")]
    Invalid(String),
    /// The manifest read from the store is not the one the controller published (its digest
    /// differs from the lineage record's): replaced by someone who holds the data key.
    #[error("the manifest of {reference} is not the one published: the controller recorded {recorded}, the store holds {found}")]
    ManifestMismatch {
        reference: String,
        recorded: String,
        found: String,
    },
}

impl AgentError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| AgentError::Io { path, source }
    }

    /// The checkpoint's objects are gone or damaged in the store (a deleted manifest, a missing
    /// or corrupt chunk, an oversized object): what a writer to the bucket without the keys can
    /// cause. The controller treats it as an alarm and cold-starts; it never falls back to an
    /// older checkpoint for it (docs/security.md).
    pub fn is_integrity_failure(&self) -> bool {
        match self {
            AgentError::Store(e) => e.is_integrity_failure(),
            AgentError::ManifestMismatch { .. } => true,
            _ => false,
        }
    }

    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            AgentError::Engine(_) => "engine",
            AgentError::Store(_) => "store",
            AgentError::Io { .. } => "io",
            AgentError::NoContainer { .. } | AgentError::UnknownContainer(_) => "no_container",
            AgentError::ManyContainers { .. } => "unsupported",
            AgentError::Fenced(_) => "fenced",
            AgentError::Deadline(_) => "deadline",
            AgentError::Key(_) => "key",
            AgentError::Kube(_) => "kube",
            AgentError::Incompatible(_) => "incompatible",
            AgentError::Invalid(_) => "invalid",
            AgentError::ManifestMismatch { .. } => "integrity",
        }
    }
}

impl From<kube::Error> for AgentError {
    fn from(e: kube::Error) -> Self {
        AgentError::Kube(e.to_string())
    }
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
