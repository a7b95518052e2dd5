//! The store: put, get, list, delete, garbage collection.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use stasis_core::{
    CheckpointId, CheckpointRef, ChunkRef, FileEntry, Manifest, Selector, StoreStats, WorkloadName,
};
use tokio::sync::Semaphore;

use crate::chunk::{self, ChunkBuf, Chunker, HEADER_LEN};
use crate::envelope::{self, MAX_MANIFEST_OBJECT};
use crate::error::{Result, StoreError};
use crate::key::Key;
use crate::local::{DirectIo, Fetched};
use crate::progress::Progress;

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

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn rfc3339_ms(ms: u64) -> String {
    CheckpointId::from_parts(ms, 0).created_rfc3339()
}

/// A lease or lock document.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseDoc {
    holder: String,
    purpose: String,
    started_unix_ms: u64,
    renewed_unix_ms: u64,
    ttl_ms: u64,
}

impl LeaseDoc {
    fn new(purpose: &str, ttl: Duration) -> Self {
        let now = now_ms();
        LeaseDoc {
            holder: holder(),
            purpose: purpose.to_owned(),
            started_unix_ms: now,
            renewed_unix_ms: now,
            ttl_ms: ttl.as_millis() as u64,
        }
    }
    fn expires_ms(&self) -> u64 {
        self.renewed_unix_ms.saturating_add(self.ttl_ms)
    }
    fn live(&self, now: u64) -> bool {
        now < self.expires_ms()
    }
    fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{host}/pid {}", std::process::id())
}

/// A file of the image directory to upload.
#[derive(Debug, Clone)]
struct SourceFile {
    rel: String,
    abs: PathBuf,
    mode: u32,
    size: u64,
}

/// Reads `[pos, end)` of a file with positioned reads (several threads share one file).
struct SegmentReader<'a> {
    file: &'a std::fs::File,
    pos: u64,
    end: u64,
}

impl std::io::Read for SegmentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.end {
            return Ok(0);
        }
        let n = (self.end - self.pos).min(buf.len() as u64) as usize;
        let r = self.file.read_at(&mut buf[..n], self.pos)?;
        self.pos += r as u64;
        Ok(r)
    }
}

/// One chunk on its way from a chunker: the `seq`-th chunk of segment `unit`.
struct Piece {
    unit: usize,
    seq: u32,
    buf: ChunkBuf,
}

/// What became of one chunk of a put.
struct PieceDone {
    unit: usize,
    seq: u32,
    chunk: ChunkRef,
    /// Stored bytes when this put wrote the chunk.
    written: Option<u64>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Internal(format!("worker task failed: {e}")))
}

impl Store {
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
        }
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn options(&self) -> &StoreOptions {
        &self.opts
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

    // ---------------------------------------------------------------- listing and resolving

    /// Checkpoints in the store (all workloads, or one), sorted by workload then id (oldest
    /// first). Nothing is verified; objects that are not manifests are ignored.
    pub async fn list(&self, workload: Option<&WorkloadName>) -> Result<Vec<CheckpointSummary>> {
        let prefix = match workload {
            Some(w) => ObjPath::from(format!("manifests/{w}")),
            None => ObjPath::from("manifests"),
        };
        let metas: Vec<_> = self
            .os
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&prefix, e))?;
        let mut out: Vec<CheckpointSummary> = metas
            .into_iter()
            .filter_map(|m| {
                let parts: Vec<_> = m.location.parts().collect();
                if parts.len() != 3 || parts[0].as_ref() != "manifests" {
                    return None;
                }
                let w = WorkloadName::new(parts[1].as_ref()).ok()?;
                let id = CheckpointId::parse(parts[2].as_ref().strip_suffix(".json")?).ok()?;
                Some(CheckpointSummary {
                    workload: w,
                    id,
                    manifest_bytes: m.size,
                    published_unix_ms: m.last_modified.timestamp_millis(),
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.workload, &a.id).cmp(&(&b.workload, &b.id)));
        Ok(out)
    }

    /// The id a reference names: `latest` is the greatest id with a manifest; an exact id must
    /// have a manifest.
    pub async fn resolve(&self, reference: &CheckpointRef) -> Result<CheckpointId> {
        let not_found = || StoreError::NotFound {
            reference: reference.to_string(),
        };
        match &reference.selector {
            Selector::Latest => self
                .list(Some(&reference.workload))
                .await?
                .into_iter()
                .map(|s| s.id)
                .max()
                .ok_or_else(not_found),
            Selector::Id(id) => {
                let p = manifest_path(&reference.workload, id);
                match self.os.head(&p).await {
                    Ok(_) => Ok(id.clone()),
                    Err(object_store::Error::NotFound { .. }) => Err(StoreError::ManifestMissing {
                        reference: reference.to_string(),
                        path: self.shown(&p),
                    }),
                    Err(e) => Err(self.be(&p, e)),
                }
            }
        }
    }

    /// Reads, authenticates and validates a checkpoint's manifest.
    pub async fn read_manifest(&self, key: &Key, reference: &CheckpointRef) -> Result<Manifest> {
        let id = self.resolve(reference).await?;
        self.read_manifest_id(key, &reference.workload, &id).await
    }

    /// The newest checkpoint of `workload` whose manifest is authentic and valid under `key`,
    /// with the newer ones that were skipped and why (wrong key, tampered, unsupported). Backend
    /// errors are returned, not skipped. Chunks are verified later, by [`Store::get_checkpoint`].
    pub async fn read_latest_valid(
        &self,
        key: &Key,
        workload: &WorkloadName,
    ) -> Result<(Manifest, Vec<(CheckpointId, StoreError)>)> {
        let mut skipped = Vec::new();
        let mut all = self.list(Some(workload)).await?;
        all.reverse();
        for s in all {
            match self.read_manifest_id(key, workload, &s.id).await {
                Ok(m) => return Ok((m, skipped)),
                Err(
                    e @ (StoreError::WrongKey { .. }
                    | StoreError::ManifestTampered { .. }
                    | StoreError::ManifestInvalid { .. }
                    | StoreError::ObjectTooLarge { .. }
                    | StoreError::ManifestMissing { .. }),
                ) => {
                    tracing::warn!(checkpoint = %s.reference(), error = %e, "skipping checkpoint");
                    skipped.push((s.id, e));
                }
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::NotFound {
            reference: format!(
                "{workload}/latest (no valid checkpoint under key {})",
                key.id()
            ),
        })
    }

    async fn read_manifest_id(
        &self,
        key: &Key,
        w: &WorkloadName,
        id: &CheckpointId,
    ) -> Result<Manifest> {
        let p = manifest_path(w, id);
        let bytes = self
            .get_bounded(&p, MAX_MANIFEST_OBJECT)
            .await?
            .ok_or_else(|| StoreError::ManifestMissing {
                reference: format!("{w}/{id}"),
                path: self.shown(&p),
            })?;
        envelope::open(key, &self.shown(&p), w, id, &bytes)
    }

    /// The object's full name, for messages.
    fn shown(&self, p: &ObjPath) -> String {
        format!("{}/{p}", self.url.trim_end_matches('/'))
    }

    /// Reads a whole object of at most `limit` bytes; `Ok(None)` when it does not exist. A
    /// larger object is refused from the size the backend announces (the GET's content length,
    /// a file's size) before its body is read, and the body is read as a stream that stops at
    /// the limit, so an object that is larger than announced costs no more memory either.
    async fn get_bounded(&self, p: &ObjPath, limit: u64) -> Result<Option<Bytes>> {
        let r = match self.os.get(p).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.be(p, e)),
        };
        let too_large = |size| StoreError::ObjectTooLarge {
            path: self.shown(p),
            size,
            limit,
        };
        if r.meta.size > limit {
            return Err(too_large(r.meta.size));
        }
        let mut out = bytes::BytesMut::with_capacity(r.meta.size as usize);
        let mut body = r.into_stream();
        while let Some(part) = body.next().await {
            let part = part.map_err(|e| self.be(p, e))?;
            let n = (out.len() + part.len()) as u64;
            if n > limit {
                return Err(too_large(n));
            }
            out.extend_from_slice(&part);
        }
        Ok(Some(out.freeze()))
    }

    /// Deletes a checkpoint's manifest (its chunks go at the next [`Store::gc`]). Returns the
    /// id deleted.
    pub async fn delete_checkpoint(&self, reference: &CheckpointRef) -> Result<CheckpointId> {
        let id = self.resolve(reference).await?;
        let p = manifest_path(&reference.workload, &id);
        self.os.delete(&p).await.map_err(|e| self.be(&p, e))?;
        Ok(id)
    }

    /// Create-if-absent. Backends without conditional puts (some S3-compatible servers) get a
    /// check-then-put, which is enough here: manifest ids are unique, and two GCs racing for the
    /// lock only repeat each other's work.
    async fn put_create(&self, p: &ObjPath, body: Bytes) -> object_store::Result<()> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .os
            .put_opts(p, PutPayload::from_bytes(body.clone()), opts)
            .await
        {
            Ok(_) => Ok(()),
            Err(object_store::Error::NotImplemented { .. }) => {
                match self.os.head(p).await {
                    Ok(_) => {
                        return Err(object_store::Error::AlreadyExists {
                            path: p.to_string(),
                            source: "object exists".into(),
                        })
                    }
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
                self.os
                    .put(p, PutPayload::from_bytes(body))
                    .await
                    .map(|_| ())
            }
            Err(e) => Err(e),
        }
    }

    // ---------------------------------------------------------------- leases

    async fn put_lease(&self, p: &ObjPath, doc: &LeaseDoc) -> Result<()> {
        self.os
            .put(p, PutPayload::from_bytes(doc.to_bytes()))
            .await
            .map(|_| ())
            .map_err(|e| self.be(p, e))
    }

    async fn drop_lease(&self, p: &ObjPath) {
        match self.os.delete(p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(lease = %p, error = %e, "could not remove lease; it expires on its own")
            }
        }
    }

    /// A lease or lock document; `None` when absent, oversized or unreadable (a dead writer's
    /// leftover, or not stasis's).
    async fn read_doc(&self, p: &ObjPath) -> Result<Option<LeaseDoc>> {
        match self.get_bounded(p, MAX_LEASE_OBJECT).await {
            Ok(b) => Ok(b.and_then(|b| serde_json::from_slice(&b).ok())),
            Err(e @ StoreError::ObjectTooLarge { .. }) => {
                tracing::warn!(error = %e, "ignoring an oversized lease");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Waits (bounded by `gc_wait`) while a live GC lock exists. Returns whether existing chunks
    /// may be relied on.
    async fn wait_for_gc(&self) -> Result<bool> {
        let deadline = Instant::now() + self.opts.gc_wait;
        let lock = ObjPath::from(GC_LOCK);
        loop {
            match self.read_doc(&lock).await? {
                Some(doc) if doc.live(now_ms()) => {
                    if Instant::now() >= deadline {
                        tracing::warn!(holder = %doc.holder, "garbage collection still running; uploading every chunk instead of relying on existing ones");
                        return Ok(false);
                    }
                    tracing::debug!(holder = %doc.holder, "waiting for garbage collection to finish");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => return Ok(true),
            }
        }
    }

    // ---------------------------------------------------------------- put

    /// Stores the checkpoint image in `image_dir` and publishes its manifest.
    ///
    /// `draft` carries everything but `files`, `stats` and `key_id`, which this fills in. Every
    /// regular file under `image_dir` is stored (recursively, by relative path, with its mode);
    /// empty directories are not recorded and anything other than regular files and directories
    /// (symlinks, devices) is refused. The manifest is written last, atomically; on error no
    /// manifest exists and the store's previous checkpoints are untouched.
    pub async fn put_checkpoint(
        &self,
        key: &Key,
        draft: Manifest,
        image_dir: &Path,
        progress: &dyn Progress,
    ) -> Result<Manifest> {
        self.put_checkpoint_until(key, draft, image_dir, progress, std::future::pending())
            .await
    }

    /// [`Store::put_checkpoint`], given up with [`StoreError::Cancelled`] (its lease removed, no
    /// manifest published) when `cancel` completes first.
    pub async fn put_checkpoint_until(
        &self,
        key: &Key,
        mut draft: Manifest,
        image_dir: &Path,
        progress: &dyn Progress,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<Manifest> {
        draft.key_id = key.id().to_owned();
        let dir = image_dir.to_owned();
        let files = blocking(move || scan_dir(&dir)).await??;
        let lease = lease_path(&draft.workload, &draft.id, "");
        let mut doc = LeaseDoc::new("put", self.opts.lease_ttl);
        self.put_lease(&lease, &doc).await?;
        let r = tokio::select! {
            r = self.put_leased(key, draft, files, progress, &lease, &mut doc) => r,
            () = cancel => Err(StoreError::Cancelled),
        };
        progress.finish();
        self.drop_lease(&lease).await;
        r
    }

    async fn put_leased(
        &self,
        key: &Key,
        mut m: Manifest,
        files: Vec<SourceFile>,
        progress: &dyn Progress,
        lease: &ObjPath,
        doc: &mut LeaseDoc,
    ) -> Result<Manifest> {
        let started = std::time::Instant::now();
        // Whether existing chunk objects may be relied on (no GC is sweeping). Each one is
        // still checked (it exists, with a size its chunk can have) before the manifest names
        // it: a writer to the bucket may have deleted or replaced it, and a checkpoint that
        // deduplicated against it would be unrestorable.
        let trust = self.wait_for_gc().await?;
        let claimed: Arc<Mutex<HashSet<[u8; 32]>>> = Arc::default();

        let total: u64 = files.iter().map(|f| f.size).sum();
        progress.start("upload", total);

        // Chunker threads: each takes the next 64 MiB segment of the files and cuts it.
        let mut units: Vec<(usize, u64, u64)> = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let mut start = 0;
            while start < f.size {
                let last = start + chunk::SEGMENT >= f.size;
                // the last segment reads to the end, whatever the file's size is by then
                units.push((
                    i,
                    start,
                    if last {
                        u64::MAX
                    } else {
                        start + chunk::SEGMENT
                    },
                ));
                start += chunk::SEGMENT;
            }
        }
        let units = Arc::new(units);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Piece>>(4);
        let next_unit = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let chunkers = self.opts.cpu_workers.clamp(1, 4).min(units.len().max(1));
        for t in 0..chunkers {
            let (tx, units, next_unit) = (tx.clone(), units.clone(), next_unit.clone());
            let paths: Vec<PathBuf> = files.iter().map(|f| f.abs.clone()).collect();
            std::thread::Builder::new()
                .name(format!("stasis-chunker-{t}"))
                .spawn(move || chunk_units(&units, &paths, &next_unit, &tx))
                .map_err(|e| StoreError::Internal(format!("cannot start chunker thread: {e}")))?;
        }
        drop(tx);

        let pieces =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
        let mut results = std::pin::pin!(pieces
            .map(|piece| {
                let key = key.clone();
                let claimed = claimed.clone();
                let cpu = self.cpu.clone();
                async move {
                    let Piece { unit, seq, buf } = piece?;
                    let len = buf.len() - HEADER_LEN;
                    let permit = cpu
                        .acquire_owned()
                        .await
                        .map_err(|e| StoreError::Internal(e.to_string()))?;
                    let hkey = key.clone();
                    let (id, first) = blocking(move || {
                        let _permit = permit;
                        let id = hkey.chunk_hash(&buf.data()[HEADER_LEN..]);
                        // Another piece of this put with the same content stores it.
                        let first = claimed
                            .lock()
                            .map(|mut c| c.insert(*id.as_bytes()))
                            .unwrap_or(true);
                        (id, first.then_some(buf))
                    })
                    .await?;
                    let id_hex = id.to_hex().to_string();
                    let mut written = None;
                    if let Some(buf) = first {
                        let rel = chunk_rel(key.id(), &id_hex);
                        if !(trust && self.chunk_present(&rel, len).await) {
                            written = Some(self.encode_and_store(&key, id, buf, rel).await?);
                        }
                    }
                    Ok::<_, StoreError>(PieceDone {
                        unit,
                        seq,
                        chunk: ChunkRef {
                            id: id_hex,
                            len: len as u32,
                        },
                        written,
                    })
                }
            })
            .buffered(self.opts.concurrency.max(1)));

        let mut done_chunks: Vec<(usize, u32, ChunkRef)> = Vec::new();
        let mut stats = StoreStats::default();
        let mut renewed = Instant::now();
        let renew_every = self.opts.lease_ttl / 3;
        while let Some(done) = results.next().await {
            let done = done?;
            let len = u64::from(done.chunk.len);
            stats.logical_bytes += len;
            stats.chunks += 1;
            if let Some(w) = done.written {
                stats.new_chunks += 1;
                stats.new_bytes += len;
                stats.written_bytes += w;
            }
            done_chunks.push((done.unit, done.seq, done.chunk));
            progress.advance(len);
            if renewed.elapsed() >= renew_every {
                doc.renewed_unix_ms = now_ms();
                self.put_lease(lease, doc).await?;
                renewed = Instant::now();
            }
        }

        done_chunks.sort_by_key(|(u, s, _)| (*u, *s));
        let mut chunks: Vec<Vec<ChunkRef>> = vec![Vec::new(); files.len()];
        for (u, _, c) in done_chunks {
            chunks[units[u].0].push(c);
        }
        m.files = files
            .into_iter()
            .zip(chunks)
            .map(|(f, chunks)| FileEntry {
                size: chunks.iter().map(|c| u64::from(c.len)).sum(),
                path: f.rel,
                mode: f.mode,
                chunks,
            })
            .collect();
        m.stats = stats;
        // The store's share of the time, and the total the caller started counting (its
        // `total_ms` so far) plus it: recorded in the manifest, so `inspect` shows them.
        m.timings.store_ms = started.elapsed().as_millis() as u64;
        m.timings.total_ms += m.timings.store_ms;
        m.validate().map_err(|source| StoreError::ManifestInvalid {
            path: format!("{}/{}", m.workload, m.id),
            source,
        })?;

        let body = envelope::seal(key, &m)?;
        let p = manifest_path(&m.workload, &m.id);
        self.put_create(&p, Bytes::from(body))
            .await
            .map_err(|e| self.be(&p, e))?;
        tracing::info!(
            checkpoint = %m.reference(),
            chunks = m.stats.chunks,
            new_chunks = m.stats.new_chunks,
            written_bytes = m.stats.written_bytes,
            "checkpoint published"
        );
        Ok(m)
    }

    /// Whether the chunk object `rel` exists with a size a chunk of `len` bytes can be stored
    /// as (a `HEAD`, or the file's metadata). Anything else (missing, another size, an error
    /// asking) means: store it again.
    async fn chunk_present(&self, rel: &str, len: usize) -> bool {
        let size = match &self.direct {
            Some(d) => {
                let p = d.path(rel);
                blocking(move || {
                    std::fs::metadata(p)
                        .ok()
                        .filter(|m| m.is_file())
                        .map(|m| m.len())
                })
                .await
                .ok()
                .flatten()
            }
            None => self.os.head(&ObjPath::from(rel)).await.ok().map(|m| m.size),
        };
        match size {
            Some(n) if chunk::plausible_object_len(len, n) => true,
            Some(n) => {
                tracing::warn!(object = %rel, size = n, chunk_len = len, "existing chunk object has a size its chunk cannot have; storing it again");
                false
            }
            None => false,
        }
    }

    /// Compresses, encrypts and writes one chunk; returns the bytes written.
    async fn encode_and_store(
        &self,
        key: &Key,
        id: blake3::Hash,
        buf: ChunkBuf,
        rel: String,
    ) -> Result<u64> {
        let permit = self
            .cpu
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| StoreError::Internal(e.to_string()))?;
        let (key, compress) = (key.clone(), self.opts.compress);
        let mut obj = blocking(move || {
            let _permit = permit;
            chunk::encode(&key, &id, buf, compress)
        })
        .await?;
        let p = ObjPath::from(rel.as_str());
        let n = obj.len() as u64;
        match &self.direct {
            Some(d) => {
                let d = d.clone();
                blocking(move || d.put(&rel, &mut obj))
                    .await?
                    .map_err(|e| self.be(&p, io_backend(e)))?;
            }
            None => {
                self.os
                    .put(&p, PutPayload::from(obj.into_bytes()))
                    .await
                    .map_err(|e| self.be(&p, e))?;
            }
        }
        Ok(n)
    }

    // ---------------------------------------------------------------- get

    /// Restores a checkpoint's files into `dest_dir` (created if missing) and returns its
    /// manifest. Every chunk is authenticated and checked against its id before it is written.
    ///
    /// Files are created with mode `0600`, pre-sized, filled with positioned writes, and given
    /// their recorded modes at the end. On error `dest_dir` may hold partial files: the caller
    /// owns `dest_dir` and removes it (restore into a fresh directory); nothing in it is valid
    /// unless this returns `Ok`.
    ///
    /// A reader lease protects the checkpoint's chunks from a concurrent [`Store::gc`].
    pub async fn get_checkpoint(
        &self,
        key: &Key,
        reference: &CheckpointRef,
        dest_dir: &Path,
        progress: &dyn Progress,
    ) -> Result<Manifest> {
        self.get_checkpoint_until(key, reference, dest_dir, progress, std::future::pending())
            .await
    }

    /// [`Store::get_checkpoint`], given up with [`StoreError::Cancelled`] (its lease removed)
    /// when `cancel` completes first.
    pub async fn get_checkpoint_until(
        &self,
        key: &Key,
        reference: &CheckpointRef,
        dest_dir: &Path,
        progress: &dyn Progress,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<Manifest> {
        let id = self.resolve(reference).await?;
        let lease = lease_path(
            &reference.workload,
            &id,
            &format!(".read-{:08x}", rand::random::<u32>()),
        );
        // A store this reader may not write (a read-only mount, read-only credentials) is
        // still read, without the lease: only a concurrent gc could then remove its chunks.
        let leased = match self
            .put_lease(&lease, &LeaseDoc::new("get", self.opts.lease_ttl))
            .await
        {
            Ok(()) => true,
            Err(e) if e.is_read_only() => {
                tracing::warn!(error = %e, "the store cannot be written here: reading without a read lease (a gc running elsewhere at the same time could remove this checkpoint's chunks)");
                false
            }
            Err(e) => return Err(e),
        };
        let r = tokio::select! {
            r = self.get_leased(
                key,
                &reference.workload,
                &id,
                dest_dir,
                progress,
                leased.then_some(&lease),
            ) => r,
            () = cancel => Err(StoreError::Cancelled),
        };
        progress.finish();
        if leased {
            self.drop_lease(&lease).await;
        }
        r
    }

    async fn get_leased(
        &self,
        key: &Key,
        w: &WorkloadName,
        id: &CheckpointId,
        dest_dir: &Path,
        progress: &dyn Progress,
        lease: Option<&ObjPath>,
    ) -> Result<Manifest> {
        let mut doc = LeaseDoc::new("get", self.opts.lease_ttl);
        let m = self.read_manifest_id(key, w, id).await?;
        let dest = dest_dir.to_owned();
        let layout: Vec<(String, u64)> = m.files.iter().map(|f| (f.path.clone(), f.size)).collect();
        let handles: Vec<Arc<std::fs::File>> =
            blocking(move || create_files(&dest, &layout)).await??;
        progress.start("download", m.logical_bytes());

        let mut work = Vec::with_capacity(m.chunk_count());
        for (fi, f) in m.files.iter().enumerate() {
            let mut off = 0u64;
            for c in &f.chunks {
                work.push((fi, off, c.clone()));
                off += u64::from(c.len);
            }
        }
        let files = &m.files;
        let dest_root = dest_dir.to_owned();
        {
            let fetches = futures::stream::iter(work)
                .map(|(fi, off, c): (usize, u64, ChunkRef)| {
                    let key = key.clone();
                    let handle = handles[fi].clone();
                    let cpu = self.cpu.clone();
                    let file_name = files[fi].path.clone();
                    let dest_path = dest_root.join(&files[fi].path);
                    async move {
                        let rel = chunk_rel(key.id(), &c.id);
                        let p = ObjPath::from(rel.as_str());
                        let shown = format!("{}/{p}", self.url.trim_end_matches('/'));
                        let missing = || StoreError::ChunkMissing {
                            chunk: c.id.clone(),
                            file: file_name.clone(),
                            path: shown.clone(),
                        };
                        // No object of this chunk is larger than its raw form (`c.len` is
                        // bounded by the manifest's validation).
                        let limit = chunk::max_object_len(c.len as usize);
                        let data = match &self.direct {
                            Some(d) => {
                                let d = d.clone();
                                match blocking(move || d.get(&rel, limit))
                                    .await?
                                    .map_err(|e| self.be(&p, io_backend(e)))?
                                {
                                    Fetched::Data(b) => b,
                                    Fetched::Missing => return Err(missing()),
                                    Fetched::TooLarge(size) => {
                                        return Err(StoreError::ObjectTooLarge {
                                            path: shown,
                                            size,
                                            limit,
                                        })
                                    }
                                }
                            }
                            None => match self.get_bounded(&p, limit).await? {
                                Some(b) => ChunkBuf::from_vec(Vec::from(b)),
                                None => return Err(missing()),
                            },
                        };
                        let permit = cpu
                            .acquire_owned()
                            .await
                            .map_err(|e| StoreError::Internal(e.to_string()))?;
                        let chunk_id = c.id.clone();
                        let len = c.len as usize;
                        blocking(move || {
                            let _permit = permit;
                            let mut data = data;
                            let plain = chunk::decode(&key, &chunk_id, len, data.data_mut())
                                .map_err(|reason| StoreError::ChunkCorrupt {
                                    chunk: chunk_id.clone(),
                                    file: file_name,
                                    path: shown,
                                    reason,
                                })?;
                            handle
                                .write_all_at(plain.as_slice(), off)
                                .map_err(|e| StoreError::io(dest_path, e))
                        })
                        .await??;
                        progress.advance(len as u64);
                        Ok::<_, StoreError>(())
                    }
                })
                .buffer_unordered(self.opts.concurrency.max(1));
            let mut fetches = std::pin::pin!(fetches);
            let mut renewed = Instant::now();
            while let Some(r) = fetches.next().await {
                r?;
                if let Some(lease) = lease.filter(|_| renewed.elapsed() >= self.opts.lease_ttl / 3)
                {
                    doc.renewed_unix_ms = now_ms();
                    self.put_lease(lease, &doc).await?;
                    renewed = Instant::now();
                }
            }
        }

        let dest = dest_dir.to_owned();
        let modes: Vec<(String, u32)> = m.files.iter().map(|f| (f.path.clone(), f.mode)).collect();
        blocking(move || -> Result<()> {
            drop(handles);
            for (rel, mode) in modes {
                let p = dest.join(rel);
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(|e| StoreError::io(&p, e))?;
            }
            Ok(())
        })
        .await??;
        Ok(m)
    }

    // ---------------------------------------------------------------- gc

    /// Retention and garbage collection: keeps the newest `keep_last` checkpoints of every
    /// workload, deletes the other manifests, then deletes chunks of this key that no kept
    /// manifest references and that are older than `grace`. See the crate docs for how this
    /// stays safe next to running writers.
    pub async fn gc(&self, key: &Key, keep_last: usize, grace: Duration) -> Result<GcReport> {
        let lock = ObjPath::from(GC_LOCK);
        let doc = LeaseDoc::new("gc", self.opts.gc_lock_ttl);
        let created = self.put_create(&lock, doc.to_bytes()).await;
        match created {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                if let Some(other) = self.read_doc(&lock).await? {
                    if other.live(now_ms()) {
                        return Err(StoreError::GcBusy {
                            path: format!("{}/{lock}", self.url.trim_end_matches('/')),
                            expires: rfc3339_ms(other.expires_ms()),
                            holder: other.holder,
                        });
                    }
                }
                tracing::warn!("replacing an expired garbage collection lock");
                self.put_lease(&lock, &doc).await?;
            }
            Err(e) => return Err(self.be(&lock, e)),
        }
        let r = self.gc_locked(key, keep_last, grace).await;
        self.drop_lease(&lock).await;
        r
    }

    async fn gc_locked(&self, key: &Key, keep_last: usize, grace: Duration) -> Result<GcReport> {
        let mut report = GcReport::default();
        let now = now_ms();

        // Leases: live ones block the sweep; expired ones (dead writers) are removed.
        let lease_prefix = ObjPath::from("leases");
        let leases: Vec<_> = self
            .os
            .list(Some(&lease_prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&lease_prefix, e))?;
        let mut live = Vec::new();
        for l in leases {
            match self.read_doc(&l.location).await? {
                Some(doc) if doc.live(now) => live.push(l.location.to_string()),
                _ => {
                    self.drop_lease(&l.location).await;
                    report.expired_leases_removed += 1;
                }
            }
        }

        // Retention.
        let mut by_workload: BTreeMap<WorkloadName, Vec<CheckpointSummary>> = BTreeMap::new();
        for s in self.list(None).await? {
            by_workload.entry(s.workload.clone()).or_default().push(s);
        }
        let mut kept = Vec::new();
        for (_, mut v) in by_workload {
            v.sort_by(|a, b| b.id.cmp(&a.id));
            for (i, s) in v.into_iter().enumerate() {
                if i < keep_last {
                    kept.push(s);
                } else {
                    let p = manifest_path(&s.workload, &s.id);
                    match self.os.delete(&p).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err(self.be(&p, e)),
                    }
                    report.manifests_deleted.push(s.reference().to_string());
                }
            }
        }
        report.manifests_kept = kept.len() as u64;

        if !live.is_empty() {
            report.sweep_skipped = Some(format!(
                "{} checkpoint operation(s) in progress ({}); chunks are swept by a later gc",
                live.len(),
                live.join(", ")
            ));
            return Ok(report);
        }

        // Mark.
        let mut referenced: HashSet<String> = HashSet::new();
        for s in &kept {
            let p = manifest_path(&s.workload, &s.id);
            let bytes = match self.get_bounded(&p, MAX_MANIFEST_OBJECT).await {
                Ok(Some(b)) => b,
                Ok(None) => continue,
                Err(e @ StoreError::ObjectTooLarge { .. }) => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be verified ({e}); not sweeping chunks",
                        s.reference()
                    ));
                    return Ok(report);
                }
                Err(e) => return Err(e),
            };
            match envelope::peek_key_id(&bytes) {
                Some(id) if id == key.id() => {}
                // Another key's checkpoint: its chunks live under another key id, untouched here.
                Some(_) => continue,
                // Not even an envelope (truncated, damaged): whose chunks it names is unknown,
                // and they may be this key's. Sweeping now could turn a repairable manifest
                // into a lost checkpoint.
                None => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be read (manifest {} is not a manifest envelope: truncated or damaged); not sweeping chunks until it is repaired or deleted",
                        s.reference(),
                        self.shown(&p)
                    ));
                    return Ok(report);
                }
            }
            match envelope::open(key, p.as_ref(), &s.workload, &s.id, &bytes) {
                Ok(m) => referenced.extend(m.chunk_ids().map(str::to_owned)),
                Err(e) => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be verified ({e}); not sweeping chunks",
                        s.reference()
                    ));
                    return Ok(report);
                }
            }
        }

        // Sweep.
        let prefix = ObjPath::from(format!("chunks/{}", key.id()));
        let metas: Vec<_> = self
            .os
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&prefix, e))?;
        let grace_ms = grace.as_millis() as i64;
        let now = now_ms() as i64;
        let mut doomed = Vec::new();
        for meta in metas {
            let Some(name) = meta.location.filename() else {
                continue;
            };
            if referenced.contains(name) {
                report.chunks_kept += 1;
            } else if now - meta.last_modified.timestamp_millis() < grace_ms {
                report.chunks_spared_young += 1;
            } else {
                report.bytes_deleted += meta.size;
                doomed.push(Ok(meta.location));
            }
        }
        let mut deleted = self.os.delete_stream(futures::stream::iter(doomed).boxed());
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) => report.chunks_deleted += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.be(&prefix, e)),
            }
        }
        if let Some(root) = &self.local_root {
            let dir = root.join("chunks").join(key.id());
            report.staging_files_removed = blocking(move || remove_staging(&dir, grace)).await?;
        }
        Ok(report)
    }
}

/// Removes `<name>#<digits>` staging files (left by writers killed mid-write) older than `grace`
/// from the fan-out directories under `dir`.
fn remove_staging(dir: &Path, grace: Duration) -> u64 {
    let mut n = 0;
    let Ok(fanout) = std::fs::read_dir(dir) else {
        return 0;
    };
    for sub in fanout.flatten() {
        let Ok(entries) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let staging = name
                .to_str()
                .and_then(|s| s.split_once('#'))
                .is_some_and(|(_, d)| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= grace);
            if staging && old && std::fs::remove_file(e.path()).is_ok() {
                n += 1;
            }
        }
    }
    n
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

/// Regular files under `root`, recursively, sorted by relative path.
fn scan_dir(root: &Path) -> Result<Vec<SourceFile>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir).map_err(|e| StoreError::io(&dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| StoreError::io(&dir, e))?;
            let abs = entry.path();
            let meta = std::fs::symlink_metadata(&abs).map_err(|e| StoreError::io(&abs, e))?;
            let ft = meta.file_type();
            if ft.is_dir() {
                stack.push(abs);
            } else if ft.is_file() {
                let rel = abs
                    .strip_prefix(root)
                    .ok()
                    .and_then(|r| r.to_str())
                    .ok_or_else(|| StoreError::Unsupported {
                        path: abs.clone(),
                        reason: "file name is not valid UTF-8".into(),
                    })?
                    .to_owned();
                out.push(SourceFile {
                    rel,
                    abs,
                    mode: meta.permissions().mode() & 0o7777,
                    size: meta.len(),
                });
            } else {
                return Err(StoreError::Unsupported {
                    path: abs,
                    reason: "only regular files and directories can be stored (symlink, device, socket or fifo found)".into(),
                });
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

/// Creates (truncating) and pre-sizes every file of a restore.
fn create_files(dest: &Path, layout: &[(String, u64)]) -> Result<Vec<Arc<std::fs::File>>> {
    std::fs::create_dir_all(dest).map_err(|e| StoreError::io(dest, e))?;
    layout
        .iter()
        .map(|(rel, size)| {
            let p = dest.join(rel);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&p)
                .map_err(|e| StoreError::io(&p, e))?;
            f.set_len(*size).map_err(|e| StoreError::io(&p, e))?;
            Ok(Arc::new(f))
        })
        .collect()
}

/// A chunker thread: takes segments (`(file index, start, end)`) in turn and sends their chunks.
fn chunk_units(
    units: &[(usize, u64, u64)],
    paths: &[PathBuf],
    next_unit: &std::sync::atomic::AtomicUsize,
    tx: &tokio::sync::mpsc::Sender<Result<Piece>>,
) {
    let mut chunker = Chunker::new();
    let mut open: Option<(usize, std::fs::File)> = None;
    loop {
        let u = next_unit.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some(&(fi, start, end)) = units.get(u) else {
            return;
        };
        if open.as_ref().map(|(i, _)| *i) != Some(fi) {
            match std::fs::File::open(&paths[fi]) {
                Ok(f) => open = Some((fi, f)),
                Err(e) => {
                    let _ = tx.blocking_send(Err(StoreError::io(&paths[fi], e)));
                    return;
                }
            }
        }
        let Some((_, file)) = open.as_ref() else {
            return;
        };
        let mut alive = true;
        let mut seq = 0u32;
        let reader = SegmentReader {
            file,
            pos: start,
            end,
        };
        let r = chunker.run(reader, |_, buf| {
            alive = tx.blocking_send(Ok(Piece { unit: u, seq, buf })).is_ok();
            seq += 1;
            alive
        });
        if let Err(e) = r {
            let _ = tx.blocking_send(Err(StoreError::io(&paths[fi], e)));
            return;
        }
        if !alive {
            return;
        }
    }
}
