//! The store: put, get, list, delete, garbage collection.

mod gc;
mod get;
mod lease;
mod prefetch;
mod put;
mod range;
mod read;

pub use prefetch::PrefetchReport;

use lease::LeaseDoc;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::Serialize;
use stasis_core::time::now_ms;
use stasis_core::{CheckpointId, CheckpointRef, WorkloadName};
use tokio::sync::Semaphore;

use crate::cache::ChunkCache;
use crate::error::{Result, StoreError};
use crate::local::DirectIo;

/// Tuning and safety knobs. The defaults suit a node agent and the CLI.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Chunks in flight at once (hashing, encoding, uploading, downloading). Each costs up to
    /// two max-size chunk buffers (8 MiB) of memory.
    pub concurrency: usize,
    /// CPU-bound chunk work (hash, compress, encrypt, decrypt) running at once; default: the
    /// number of CPUs.
    pub cpu_workers: usize,
    /// Try zstd on chunks (level 1). Incompressible chunks are stored raw either way.
    pub compress: bool,
    /// How long a writer's lease (and a reader's) lives without renewal. Writers renew at a
    /// third of it while they upload.
    pub lease_ttl: Duration,
    /// How long a GC lock lives without renewal.
    pub gc_lock_ttl: Duration,
    /// How long a writer waits for a running GC before it stops relying on existing chunks and
    /// uploads every chunk itself.
    pub gc_wait: Duration,
    /// For `file://` stores: write and read chunk objects with `O_DIRECT` (see the `local`
    /// module docs; falls back to buffered I/O where unsupported).
    pub direct_io: bool,
    /// For `file://` stores: create the directory when it does not exist. Off for readers, so
    /// that a mistyped path is "no such store", not an empty store made on the spot.
    pub create: bool,
    /// For `s3://` stores: the most one request may take, retries included (a connection takes
    /// at most 5 s of it). An endpoint that accepts connections and never answers fails after
    /// this long.
    pub request_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            concurrency: 12,
            cpu_workers: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            compress: true,
            lease_ttl: Duration::from_secs(600),
            gc_lock_ttl: Duration::from_secs(1800),
            gc_wait: Duration::from_secs(30),
            direct_io: true,
            create: true,
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// One checkpoint as seen in a listing (no key needed, nothing verified).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointSummary {
    pub workload: WorkloadName,
    pub id: CheckpointId,
    /// Size of the manifest object.
    pub manifest_bytes: u64,
    /// When the manifest was published (backend clock), Unix milliseconds.
    pub published_unix_ms: i64,
}

impl CheckpointSummary {
    pub fn reference(&self) -> CheckpointRef {
        CheckpointRef::exact(self.workload.clone(), self.id.clone())
    }
}

/// What a garbage collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GcReport {
    /// Checkpoints kept (newest `keep_last` of each workload).
    pub manifests_kept: u64,
    /// Checkpoints whose manifests were deleted, as `<workload>/<id>`.
    pub manifests_deleted: Vec<String>,
    /// Chunks (of this key) still referenced by a kept manifest.
    pub chunks_kept: u64,
    /// Unreferenced chunks deleted.
    pub chunks_deleted: u64,
    /// Stored bytes of the deleted chunks.
    pub bytes_deleted: u64,
    /// Unreferenced chunks spared because they are younger than the grace period.
    pub chunks_spared_young: u64,
    /// Why the chunk sweep did not run (a live lease, an unverifiable manifest), if it did not.
    pub sweep_skipped: Option<String>,
    /// Expired leases (of writers that died) removed.
    pub expired_leases_removed: u64,
    /// Staging files of interrupted chunk writes (local stores) removed.
    pub staging_files_removed: u64,
}

/// A checkpoint store on an object store (`file://` or `s3://`). See the crate docs for the
/// layout and the protocols.
pub struct Store {
    os: Arc<dyn ObjectStore>,
    url: String,
    opts: StoreOptions,
    cpu: Arc<Semaphore>,
    /// Direct I/O for chunk objects of a local store.
    direct: Option<Arc<DirectIo>>,
    /// The directory of a local store.
    local_root: Option<PathBuf>,
    /// An `s3://` store opened without credentials in the environment: backend errors say so.
    no_credentials: bool,
    /// The node's chunk cache: restores read it first and fill it, puts fill it. Set once
    /// (a store shared behind an `Arc` gets it after it was opened).
    cache: std::sync::OnceLock<Arc<ChunkCache>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("url", &self.url)
            .field("opts", &self.opts)
            .finish()
    }
}

const GC_LOCK: &str = "locks/gc.json";
/// The largest lease or lock object read (they are about 200 bytes); a larger one is treated as
/// no lease, without being read.
pub const MAX_LEASE_OBJECT: u64 = 64 << 10;

fn chunk_rel(key_id: &str, id: &str) -> String {
    format!("chunks/{key_id}/{}/{id}", &id[..2])
}
fn io_backend(e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "LocalFileSystem",
        source: Box::new(e),
    }
}
fn manifest_path(w: &WorkloadName, id: &CheckpointId) -> ObjPath {
    ObjPath::from(format!("manifests/{w}/{id}.json"))
}
fn lease_path(w: &WorkloadName, id: &CheckpointId, suffix: &str) -> ObjPath {
    ObjPath::from(format!("leases/{w}/{id}{suffix}.json"))
}

fn rfc3339_ms(ms: u64) -> String {
    CheckpointId::from_parts(ms, 0).created_rfc3339()
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Internal(format!("worker task failed: {e}")))
}

impl Store {
    /// Runs `f` on the blocking pool once the CPU semaphore has a slot: hashing, compression,
    /// encryption and decryption are bounded to the cores, whatever the I/O concurrency.
    async fn on_cpu<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        let permit = self
            .cpu
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        blocking(move || {
            let _permit = permit;
            f()
        })
        .await
    }

    /// Opens a store: `file:///abs/path` or a plain path (created if missing, unless
    /// [`StoreOptions::create`] is off), or `s3://bucket/prefix` (endpoint, credentials and
    /// region from `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_REGION`; plain http allowed). A local store at `/` (`file://` with an empty path, as
    /// `file://$UNSET` gives) is refused.
    pub fn open(url: &str) -> Result<Self> {
        Self::open_with(url, StoreOptions::default())
    }

    /// [`Store::open`] with options.
    pub fn open_with(url: &str, opts: StoreOptions) -> Result<Self> {
        let invalid = |reason: String| StoreError::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        let local_root: Option<PathBuf>;
        let mut no_credentials = false;
        let os: Arc<dyn ObjectStore> = if !url.contains("://") {
            if url.is_empty() {
                return Err(invalid("empty".into()));
            }
            let p = PathBuf::from(url);
            let p = if p.is_absolute() {
                p
            } else {
                std::env::current_dir()
                    .map_err(|e| StoreError::io(".", e))?
                    .join(p)
            };
            check_local_root(&p).map_err(invalid)?;
            local_root = Some(p.clone());
            local_store(&p, opts.create)?
        } else {
            let u = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
            match u.scheme() {
                "file" => {
                    if u.path().trim_matches('/').is_empty() {
                        return Err(invalid(
                            "a file:// url needs a path (file:///var/lib/x); an empty one would make the host's root the store (an unset variable?)".into(),
                        ));
                    }
                    let p = u.to_file_path().map_err(|_| {
                        invalid("a file:// url needs an absolute path (file:///var/lib/x)".into())
                    })?;
                    check_local_root(&p).map_err(invalid)?;
                    local_root = Some(p.clone());
                    local_store(&p, opts.create)?
                }
                #[cfg(not(feature = "s3"))]
                "s3" => return Err(invalid("this build has no s3:// support (feature s3)".into())),
                #[cfg(feature = "s3")]
                "s3" => {
                    let bucket = u
                        .host_str()
                        .filter(|b| !b.is_empty())
                        .ok_or_else(|| invalid("no bucket (s3://bucket/prefix)".into()))?;
                    local_root = None;
                    no_credentials = !has_aws_credentials();
                    let t = opts.request_timeout.max(Duration::from_millis(100));
                    let client = object_store::ClientOptions::new()
                        .with_timeout(t)
                        .with_connect_timeout(t.min(Duration::from_secs(5)));
                    let retry = object_store::RetryConfig {
                        max_retries: 3,
                        retry_timeout: t,
                        ..Default::default()
                    };
                    let s3 = object_store::aws::AmazonS3Builder::from_env()
                        .with_bucket_name(bucket)
                        .with_client_options(client)
                        .with_retry(retry)
                        .with_allow_http(true)
                        .build()
                        .map_err(|e| invalid(e.to_string()))?;
                    let prefix = u.path().trim_matches('/');
                    if prefix.is_empty() {
                        Arc::new(s3)
                    } else {
                        Arc::new(object_store::prefix::PrefixStore::new(s3, prefix))
                    }
                }
                other => {
                    return Err(invalid(format!(
                        "unsupported scheme {other:?}; use file:///abs/path, /abs/path or s3://bucket/prefix"
                    )))
                }
            }
        };
        let direct = opts.direct_io;
        let mut store = Self::from_object_store(os, url, opts);
        if direct {
            store.direct = local_root.clone().map(|r| Arc::new(DirectIo::new(r)));
        }
        store.local_root = local_root;
        store.no_credentials = no_credentials;
        Ok(store)
    }

    /// A store over any `object_store` backend (tests use this to inject faults).
    pub fn from_object_store(
        os: Arc<dyn ObjectStore>,
        url: impl Into<String>,
        opts: StoreOptions,
    ) -> Self {
        let cpu = Arc::new(Semaphore::new(opts.cpu_workers.max(1)));
        Store {
            os,
            url: url.into(),
            opts,
            cpu,
            direct: None,
            local_root: None,
            no_credentials: false,
            cache: std::sync::OnceLock::new(),
        }
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn options(&self) -> &StoreOptions {
        &self.opts
    }

    /// Uses `cache` (the node's chunk cache, see [`ChunkCache`]): a restore reads cached chunk
    /// objects first (authenticated like fetched ones; one that fails is removed and fetched)
    /// and caches what it fetches; a put caches the chunks it writes, so a restore on the node
    /// that checkpointed finds them without the store.
    pub fn with_cache(self, cache: Arc<ChunkCache>) -> Self {
        self.set_cache(cache);
        self
    }

    /// [`Store::with_cache`] for a store already shared; `false` (and nothing changes) when it
    /// has a cache already.
    pub fn set_cache(&self, cache: Arc<ChunkCache>) -> bool {
        self.cache.set(cache).is_ok()
    }

    pub fn cache(&self) -> Option<&Arc<ChunkCache>> {
        self.cache.get()
    }

    fn be(&self, path: &ObjPath, e: object_store::Error) -> StoreError {
        let path = format!("{}/{path}", self.url.trim_end_matches('/'));
        if self.no_credentials {
            return StoreError::NoCredentials { path, source: e };
        }
        if self.local_root.is_none() && timed_out(&e) {
            return StoreError::Unanswered {
                path,
                secs: self.opts.request_timeout.as_secs_f64(),
                source: e,
            };
        }
        StoreError::backend(path, e)
    }

    /// Checks that the store can be written (an object put and deleted under `locks/`), so a
    /// checkpoint finds a read-only store, missing credentials or a full disk before it freezes
    /// anything.
    pub async fn check_writable(&self) -> Result<()> {
        let p = ObjPath::from(format!(
            "locks/write-check-{:08x}.json",
            rand::random::<u32>()
        ));
        let doc = LeaseDoc::new("write check", Duration::from_secs(60));
        self.os
            .put(&p, PutPayload::from_bytes(doc.to_bytes()))
            .await
            .map_err(|e| self.be(&p, e))?;
        self.os.delete(&p).await.map_err(|e| self.be(&p, e))
    }
}

/// Whether a backend error is a request that timed out (somewhere in its chain of causes).
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
            || err.to_string().contains("timed out")
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A local store's directory must not be the host's root (or an empty path resolving to it).
fn check_local_root(p: &Path) -> std::result::Result<(), String> {
    if p.parent().is_none() {
        return Err(format!(
            "{} is the host's root directory; a store needs a directory of its own",
            p.display()
        ));
    }
    Ok(())
}

/// Whether the environment names AWS credentials (keys, a web identity, a container endpoint
/// or a profile); without them the S3 client falls back to the instance metadata service.
#[cfg(feature = "s3")]
fn has_aws_credentials() -> bool {
    [
        "AWS_ACCESS_KEY_ID",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ]
    .iter()
    .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
}

fn local_store(p: &Path, create: bool) -> Result<Arc<dyn ObjectStore>> {
    if create {
        std::fs::create_dir_all(p).map_err(|e| StoreError::io(p, e))?;
    } else if !p.is_dir() {
        return Err(StoreError::NoSuchStore { path: p.to_owned() });
    }
    let fs = object_store::local::LocalFileSystem::new_with_prefix(p)
        .map_err(|e| StoreError::backend(p.display().to_string(), e))?
        .with_automatic_cleanup(true);
    Ok(Arc::new(fs))
}
