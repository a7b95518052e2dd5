//! The store's error type.

use std::path::PathBuf;

use stasis_core::ManifestError;

/// Everything that can go wrong in the store. Messages are lower-case and name the object, file
/// or path involved, so a CLI can print them as they are.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key file is missing, unreadable, too open, or not a key.
    #[error("key file {path}: {reason}")]
    KeyFile { path: PathBuf, reason: String },

    /// The checkpoint was written with another key. Key ids are public; keys are not.
    #[error("checkpoint {reference} was written with key {manifest_key_id}, but the key in use is {this_key_id}: use the key the checkpoint was written with")]
    WrongKey {
        reference: String,
        manifest_key_id: String,
        this_key_id: String,
    },

    /// The manifest's MAC does not match: it was modified, corrupted, or not written by stasis.
    #[error("manifest {path} failed its integrity check ({reason}): it was modified or corrupted; refusing to use it")]
    ManifestTampered { path: String, reason: String },

    /// A manifest read without its key (a prefetch) is not one: not an envelope of a known
    /// format, a malformed key id, a manifest that does not parse or does not match its name.
    #[error("manifest {path} cannot be read ({reason}): it is not a manifest stasis wrote, or it was damaged in the store")]
    ManifestUnreadable { path: String, reason: String },

    /// A prefetch of a checkpoint whose chunk objects could take more than the node's chunk
    /// cache holds: fetching it would only evict its own first chunks.
    #[error("checkpoint {reference} names up to {bytes} bytes of chunk objects, more than the chunk cache's bound of {limit} bytes; not prefetched")]
    ExceedsCache {
        reference: String,
        bytes: u64,
        limit: u64,
    },

    /// The manifest is authentic but describes something this build refuses (schema, paths).
    #[error("manifest {path} is not usable: {source}")]
    ManifestInvalid {
        path: String,
        #[source]
        source: ManifestError,
    },

    /// A chunk a manifest names is not in the store.
    #[error("chunk {chunk} of file {file:?} is missing from the store (object {path})")]
    ChunkMissing {
        chunk: String,
        file: String,
        path: String,
    },

    /// A chunk is in the store but does not decrypt, decompress or hash to its id.
    #[error("chunk {chunk} of file {file:?} is corrupt (object {path}): {reason}")]
    ChunkCorrupt {
        chunk: String,
        file: String,
        path: String,
        reason: String,
    },

    /// No checkpoint at all for `<workload>/latest`.
    #[error("checkpoint {reference} not found in the store")]
    NotFound { reference: String },

    /// The manifest of an exact checkpoint id is not in the store. For a checkpoint that was
    /// published (a caller that recorded it knows), this means someone deleted it: a caller
    /// must not quietly fall back to an older checkpoint (older memory) because of it.
    #[error("checkpoint {reference} not found in the store (no manifest object {path})")]
    ManifestMissing { reference: String, path: String },

    /// An object is larger than its format allows: refused before its body is read.
    #[error("object {path} is {size} bytes, more than the {limit} bytes its format allows; refusing to read it (was it replaced in the store?)")]
    ObjectTooLarge { path: String, size: u64, limit: u64 },

    /// The backend ran out of space (ENOSPC / EDQUOT) while writing an object.
    #[error("store is out of space while writing {path}: {source}")]
    NoSpace {
        path: String,
        #[source]
        source: object_store::Error,
    },

    /// An `s3://` store used without credentials in the environment.
    #[error("store backend failed at {path}: no AWS credentials are set (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a web identity), so the instance metadata service was asked, and: {source}")]
    NoCredentials {
        path: String,
        #[source]
        source: object_store::Error,
    },

    /// The backend did not answer in time (an endpoint that accepts connections and is silent).
    #[error("store backend at {path} did not answer within {secs} s (the request timed out; --store-timeout or STASIS_STORE_TIMEOUT sets the limit): {source}")]
    Unanswered {
        path: String,
        secs: f64,
        #[source]
        source: object_store::Error,
    },

    /// A local store's directory does not exist (a reader never creates one).
    #[error("no store at {}: the directory does not exist (a typo? the first checkpoint creates it)", path.display())]
    NoSuchStore { path: PathBuf },

    /// The operation was cancelled (the process is stopping).
    #[error("cancelled")]
    Cancelled,

    /// Any other backend failure.
    #[error("store backend failed at {path}: {source}")]
    Backend {
        path: String,
        #[source]
        source: object_store::Error,
    },

    /// A local file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The store URL is not one this build understands.
    #[error("store url {url:?} is not usable: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// Another garbage collection holds the GC lock.
    #[error("garbage collection is already running (lock {path}, held by {holder} until {expires}); retry later")]
    GcBusy {
        path: String,
        holder: String,
        expires: String,
    },

    /// A file under the image directory cannot be stored (too large a chunk count, odd name).
    #[error("cannot store {path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },

    /// A worker task failed (panicked or was cancelled).
    #[error("internal store error: {0}")]
    Internal(String),
}

impl StoreError {
    /// Maps an `object_store` error at `path`, recognising out-of-space conditions.
    pub(crate) fn backend(path: impl Into<String>, source: object_store::Error) -> Self {
        let path = path.into();
        if is_no_space(&source) {
            StoreError::NoSpace { path, source }
        } else {
            StoreError::Backend { path, source }
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            path: path.into(),
            source,
        }
    }

    /// True when the store's content is not what stasis wrote: a missing manifest of an exact
    /// checkpoint, a manifest that fails its MAC (or, read without the key, is not a manifest),
    /// a missing, corrupt or oversized chunk. Callers
    /// treat these as an alarm (an Event, a metric), not as a reason to fall back to an older
    /// checkpoint: a writer to the bucket without the keys can cause each of them.
    pub fn is_integrity_failure(&self) -> bool {
        matches!(
            self,
            StoreError::ManifestMissing { .. }
                | StoreError::ManifestTampered { .. }
                | StoreError::ManifestUnreadable { .. }
                | StoreError::ChunkMissing { .. }
                | StoreError::ChunkCorrupt { .. }
                | StoreError::ObjectTooLarge { .. }
        )
    }

    /// True when the store refused a write because it cannot be written by this process: a
    /// read-only filesystem, no permission, credentials that may only read.
    pub fn is_read_only(&self) -> bool {
        let source: &(dyn std::error::Error + 'static) = match self {
            StoreError::Backend { source, .. } | StoreError::NoSpace { source, .. } => {
                if matches!(
                    source,
                    object_store::Error::PermissionDenied { .. }
                        | object_store::Error::Unauthenticated { .. }
                ) {
                    return true;
                }
                source
            }
            StoreError::Io { source, .. } => source,
            _ => return false,
        };
        let mut cur = Some(source);
        while let Some(err) = cur {
            if let Some(io) = err.downcast_ref::<std::io::Error>() {
                if matches!(
                    io.raw_os_error(),
                    Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM)
                ) || io.kind() == std::io::ErrorKind::PermissionDenied
                {
                    return true;
                }
            }
            cur = err.source();
        }
        // S3 answers a write with 403 when the credentials may only read.
        self.to_string().contains("403 Forbidden") || self.to_string().contains("AccessDenied")
    }

    /// True when the error means the store (or the local disk) is full.
    pub fn is_no_space(&self) -> bool {
        match self {
            StoreError::NoSpace { .. } => true,
            StoreError::Io { source, .. } => io_is_no_space(source),
            _ => false,
        }
    }
}

fn io_is_no_space(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    ) || matches!(e.raw_os_error(), Some(28) | Some(122))
}

/// Walks the source chain of an error looking for an ENOSPC/EDQUOT `io::Error`.
fn is_no_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io_is_no_space(io) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
