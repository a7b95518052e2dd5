//! The agent's error type. Every variant has a short `kind()` used as the `kind` label of the
//! `stasis_agent_errors_total` metric, and a [`RestoreFailure`] cause ([`AgentError::restore_failure`])
//! written into a failed `PodRestore`'s status, which the controller's restore-loop guard counts.

use std::path::PathBuf;

use stasis_api::RestoreFailure;

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
    #[error("not every container of the pod is running ({0} is not): a pod is checkpointed with all its containers at one instant, so this checkpoint is not taken; the next one is, once they all run")]
    PodIncomplete(String),
    #[error("incompatible checkpoint: the pod's containers are not the checkpoint's ({0}); a pod restores all its containers or none")]
    ContainersDiffer(String),
    #[error("container {0} is unknown to runc or is a pod sandbox")]
    UnknownContainer(String),
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("deadline passed: {0}")]
    Deadline(String),
    /// A heartbeat whose upload a termination checkpoint of its pod stopped.
    #[error("superseded: {0}")]
    Superseded(String),
    #[error("key: {0}")]
    Key(#[from] crate::keys::KeyError),
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// No client for the API server could be made (no in-cluster service account, no
    /// kubeconfig).
    #[error("no Kubernetes client (in a pod: its service account; elsewhere: a kubeconfig): {0}")]
    NoClient(#[source] kube::Error),
    /// The data key of a namespace could not be had (its Secret, or the key broker).
    #[error("{0}")]
    KeyUnavailable(String),
    /// A lineage record in stasis's namespace cannot be read.
    #[error("lineage record: {0}")]
    Record(String),
    /// The checkpoint does not fit this node, image or declared versions (kept typed, as the
    /// compatibility rule gives them).
    #[error("incompatible checkpoint: {}", joined(.0))]
    Incompatible(Vec<stasis_core::fingerprint::Mismatch>),
    /// The checkpoint's pod spec hash is not the target pod's (or it records none).
    #[error("incompatible checkpoint: {0}")]
    SpecHash(String),
    #[error("{0}")]
    Invalid(String),
    /// The node's disk has no room for the restore's files, even after the chunk cache gave
    /// back what it held there (`freed`: none when it holds nothing or lives on another disk).
    #[error("no room on the node's disk for the restore: {needed} bytes needed under {}, {available} free, {freed} of them given back by the node's chunk cache", .dir.display())]
    NoRoom {
        dir: PathBuf,
        needed: u64,
        available: u64,
        freed: u64,
    },
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

    /// Whether the node's disk had no room: the room check's refusal, or a write that found
    /// none (`ENOSPC`, `EDQUOT`) anywhere down the chain of causes.
    pub fn is_out_of_space(&self) -> bool {
        if matches!(self, AgentError::NoRoom { .. }) {
            return true;
        }
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
                    return true;
                }
            }
            cause = e.source();
        }
        false
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
            AgentError::PodIncomplete(_) => "pod_incomplete",
            AgentError::Fenced(_) => "fenced",
            AgentError::Deadline(_) => "deadline",
            AgentError::Superseded(_) => "superseded",
            AgentError::Key(_) => "key",
            AgentError::Kube(_) | AgentError::NoClient(_) => "kube",
            AgentError::KeyUnavailable(_) => "key",
            AgentError::Record(_) => "record",
            AgentError::Incompatible(_)
            | AgentError::SpecHash(_)
            | AgentError::ContainersDiffer(_) => "incompatible",
            AgentError::Invalid(_) => "invalid",
            AgentError::NoRoom { .. } => "no_room",
            AgentError::ManifestMismatch { .. } => "integrity",
        }
    }
}

impl AgentError {
    /// Why a restore this error ended did not happen, as the `PodRestore` status records it
    /// (`failure`, and the `Ready` condition's reason).
    pub fn restore_failure(&self) -> RestoreFailure {
        match self {
            e if e.is_integrity_failure() => RestoreFailure::CheckpointDamaged,
            AgentError::Store(_) => RestoreFailure::FetchFailed,
            AgentError::Key(_) | AgentError::KeyUnavailable(_) => RestoreFailure::KeyUnavailable,
            AgentError::Incompatible(_)
            | AgentError::SpecHash(_)
            | AgentError::ContainersDiffer(_) => RestoreFailure::Incompatible,
            AgentError::Invalid(_) | AgentError::Record(_) => RestoreFailure::InvalidRestore,
            AgentError::Deadline(_) => RestoreFailure::Timeout,
            AgentError::Engine(_)
            | AgentError::Io { .. }
            | AgentError::NoContainer { .. }
            | AgentError::PodIncomplete(_)
            | AgentError::UnknownContainer(_)
            | AgentError::Fenced(_)
            | AgentError::Superseded(_)
            | AgentError::Kube(_)
            | AgentError::NoClient(_)
            | AgentError::NoRoom { .. }
            | AgentError::ManifestMismatch { .. } => RestoreFailure::Other,
        }
    }
}

/// The cause of a cold start stasis-runc reported, as the `PodRestore` status records it.
pub fn cold_start_failure(cause: stasis_node_api::ColdStartCause) -> RestoreFailure {
    use stasis_node_api::ColdStartCause as C;
    match cause {
        C::NoPlan => RestoreFailure::NoPlan,
        C::Forced => RestoreFailure::ColdStartRequested,
        C::Unsupported => RestoreFailure::Unsupported,
        C::PlanRefused => RestoreFailure::PlanRefused,
        C::RestoreFailed => RestoreFailure::RestoreFailed,
        C::Other => RestoreFailure::Other,
    }
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;

fn joined(mismatches: &[stasis_core::fingerprint::Mismatch]) -> String {
    mismatches
        .iter()
        .map(|m| m.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_room_is_told_apart_down_the_chain_of_causes() {
        let full = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(AgentError::io("/x")(full()).is_out_of_space());
        assert!(AgentError::Store(stasis_store::StoreError::Io {
            path: "/x".into(),
            source: full(),
        })
        .is_out_of_space());
        assert!(AgentError::NoRoom {
            dir: "/x".into(),
            needed: 2,
            available: 1,
            freed: 0,
        }
        .is_out_of_space());
        assert!(
            !AgentError::io("/x")(std::io::Error::from_raw_os_error(libc::EACCES))
                .is_out_of_space()
        );
        assert!(!AgentError::Invalid("no space left".into()).is_out_of_space());
    }

    /// Each error a restore's preparation can end with has its own cause, and the damaged
    /// checkpoint its alarm, whatever the messages say.
    #[test]
    fn restore_failures_are_typed() {
        let damaged = AgentError::ManifestMismatch {
            reference: "l/1".into(),
            recorded: "a".into(),
            found: "b".into(),
        };
        assert_eq!(damaged.restore_failure(), RestoreFailure::CheckpointDamaged);
        for (e, want) in [
            (
                AgentError::SpecHash("x".into()),
                RestoreFailure::Incompatible,
            ),
            (
                AgentError::Incompatible(Vec::new()),
                RestoreFailure::Incompatible,
            ),
            (
                AgentError::Invalid("x".into()),
                RestoreFailure::InvalidRestore,
            ),
            (AgentError::Deadline("x".into()), RestoreFailure::Timeout),
            (
                AgentError::KeyUnavailable("x".into()),
                RestoreFailure::KeyUnavailable,
            ),
            (
                AgentError::Record("x".into()),
                RestoreFailure::InvalidRestore,
            ),
        ] {
            assert_eq!(e.restore_failure(), want, "{e}");
        }
        assert_eq!(
            cold_start_failure(stasis_node_api::ColdStartCause::Forced),
            RestoreFailure::ColdStartRequested
        );
        assert_eq!(
            cold_start_failure(stasis_node_api::ColdStartCause::RestoreFailed),
            RestoreFailure::RestoreFailed
        );
    }

    /// The API server's error stays typed: a conflict is still recognisable upstream.
    #[test]
    fn kube_errors_keep_their_status() {
        let status = kube::core::Status::failure("exists", "AlreadyExists").with_code(409);
        let e = AgentError::from(kube::Error::Api(Box::new(status)));
        assert!(matches!(&e, AgentError::Kube(kube::Error::Api(s)) if s.code == 409));
        assert_eq!(e.kind(), "kube");
    }
}
