//! Engine errors: each names the cause and what to do about it.

use std::path::PathBuf;

use stasis_core::Mismatch;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{tool} not found: {hint}")]
    ToolMissing { tool: String, hint: String },

    #[error("CRIU {found} is too old: stasis needs CRIU >= 4.2 (4.1 cannot dump INET sockets on current kernels); run scripts/setup to install CRIU 4.2 into a private prefix")]
    CriuTooOld { found: String },

    #[error("container {id:?} does not exist under runc root {root}")]
    ContainerNotFound { id: String, root: PathBuf },

    #[error(
        "container {id:?} is {status}: only a running or paused container can be checkpointed"
    )]
    ContainerNotRunning { id: String, status: String },

    #[error("container id {id:?} is already in use under runc root {root}")]
    ContainerExists { id: String, root: PathBuf },

    #[error("process {pid} does not exist")]
    ProcessNotFound { pid: i32 },

    #[error("{what} failed: {detail}{}", log.as_ref().map(|l| format!(" (CRIU log: {})", l.display())).unwrap_or_default())]
    ToolFailed {
        what: String,
        detail: String,
        log: Option<PathBuf>,
    },

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("bundle {}: {reason}", bundle.display())]
    Bundle { bundle: PathBuf, reason: String },

    #[error("checkpoint image {}: {reason}", dir.display())]
    Image { dir: PathBuf, reason: String },

    #[error("restore refused, this node does not satisfy the checkpoint: {}", join(.0))]
    Incompatible(Vec<Mismatch>),

    #[error("{what} is in progress; try again when it has finished")]
    Busy { what: String },

    #[error("process {pid} cannot be checkpointed: {reason}")]
    ProcessRefused { pid: i32, reason: String },

    #[error("container {id:?} cannot be checkpointed: {reason}")]
    CheckpointRefused { id: String, reason: String },

    #[error("GPU: {0}")]
    Cuda(#[from] crate::cuda::CudaError),

    #[error("filesystem capture failed: {0}")]
    Rootfs(String),

    #[error("restoring the filesystem changes of {}: entry {entry:?}: {reason}", archive.display())]
    RootfsEntry {
        archive: PathBuf,
        entry: String,
        reason: String,
    },

    #[error("checkpoint archive {}: entry {entry:?}: {reason}", archive.display())]
    CheckpointArchive {
        archive: PathBuf,
        entry: String,
        reason: String,
    },
}

fn join(m: &[Mismatch]) -> String {
    m.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| EngineError::Io { path, source }
    }
}
