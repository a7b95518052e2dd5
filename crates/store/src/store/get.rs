//! Get: fetch, authenticate and write a checkpoint's files.

use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::ObjectStoreExt;
use stasis_core::{CheckpointId, CheckpointRef, ChunkRef, Manifest, WorkloadName};

use super::{blocking, chunk_rel, io_backend, now_ms, LeaseDoc, Store};
use crate::cache::Claim;
use crate::chunk::{self, ChunkBuf};
use crate::error::{Result, StoreError};
use crate::key::Key;
use crate::local::Fetched;
use crate::progress::Progress;

impl Store {
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
        let lease = self.read_lease(&reference.workload, &id, "get").await?;
        let r = tokio::select! {
            r = self.get_leased(
                key,
                &reference.workload,
                &id,
                dest_dir,
                progress,
                lease.as_ref(),
            ) => r,
            () = cancel => Err(StoreError::Cancelled),
        };
        progress.finish();
        if let Some(lease) = &lease {
            self.drop_lease(lease).await;
        }
        r
    }

    pub(super) async fn get_leased(
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
        {
            let fetches = futures::stream::iter(work)
                .map(|(fi, off, c): (usize, u64, ChunkRef)| {
                    let target = Target {
                        handle: handles[fi].clone(),
                        off,
                        file: files[fi].path.clone(),
                        dest: dest_dir.join(&files[fi].path),
                    };
                    async move {
                        self.restore_chunk(key, &c, target).await?;
                        progress.advance(u64::from(c.len));
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
}

/// Where one chunk of a restore goes.
struct Target {
    handle: Arc<std::fs::File>,
    off: u64,
    /// The file's path in the checkpoint, for messages.
    file: String,
    dest: PathBuf,
}

impl Store {
    /// Brings one chunk into its file.
    async fn restore_chunk(&self, key: &Key, c: &ChunkRef, t: Target) -> Result<()> {
        let Target {
            handle,
            off,
            file,
            dest,
        } = t;
        self.with_chunk(key, c, &file, move |plain| {
            handle
                .write_all_at(plain, off)
                .map_err(|e| StoreError::io(&dest, e))
        })
        .await
    }

    /// Hands the plaintext of one chunk of `file` (a path of the checkpoint, for messages) to
    /// `deliver`, on the blocking pool: from the node's cache when it holds an authentic copy,
    /// else from the store (cached on the way). Authenticated, decrypted, decompressed and
    /// checked against its id first; a chunk the store lacks is [`StoreError::ChunkMissing`],
    /// one that fails is [`StoreError::ChunkCorrupt`], both naming the chunk and the file.
    pub(super) async fn with_chunk<T, D>(
        &self,
        key: &Key,
        c: &ChunkRef,
        file: &str,
        deliver: D,
    ) -> Result<T>
    where
        T: Send + 'static,
        D: Fn(&[u8]) -> Result<T> + Clone + Send + 'static,
    {
        let limit = chunk::max_object_len(c.len as usize);
        // Held until the chunk is cached: a prefetch of it meanwhile waits instead of fetching.
        let mut _fetching = None;
        if let Some(cache) = self.cache() {
            if let Some(v) = self.cached_chunk(key, c, deliver.clone()).await? {
                return Ok(v);
            }
            match cache.claim(key.id(), &c.id) {
                Some(Claim::Wait(other)) => {
                    Claim::wait(other).await;
                    if let Some(v) = self.cached_chunk(key, c, deliver.clone()).await? {
                        return Ok(v);
                    }
                }
                Some(Claim::Fetch(mine)) => _fetching = Some(mine),
                None => {}
            }
        }
        let rel = chunk_rel(key.id(), &c.id);
        let obj =
            self.fetch_object(&rel, limit)
                .await?
                .ok_or_else(|| StoreError::ChunkMissing {
                    chunk: c.id.clone(),
                    file: file.to_owned(),
                    path: self.shown(&ObjPath::from(rel.as_str())),
                })?;
        self.decode_into(key, c, obj, true, deliver)
            .await?
            .map_err(|reason| StoreError::ChunkCorrupt {
                chunk: c.id.clone(),
                file: file.to_owned(),
                path: self.shown(&ObjPath::from(rel.as_str())),
                reason,
            })
    }

    /// The plaintext of a chunk from the node's cache handed to `deliver`, when the cache holds
    /// an authentic copy; one that fails authentication is removed.
    async fn cached_chunk<T, D>(&self, key: &Key, c: &ChunkRef, deliver: D) -> Result<Option<T>>
    where
        T: Send + 'static,
        D: FnOnce(&[u8]) -> Result<T> + Send + 'static,
    {
        let Some(cache) = self.cache() else {
            return Ok(None);
        };
        let limit = chunk::max_object_len(c.len as usize);
        let (cache, kid, id) = (cache.clone(), key.id().to_owned(), c.id.clone());
        let Some(obj) = blocking(move || cache.get(&kid, &id, limit)).await? else {
            return Ok(None);
        };
        match self.decode_into(key, c, obj, false, deliver).await? {
            Ok(v) => Ok(Some(v)),
            Err(reason) => {
                tracing::warn!(chunk = %c.id, %reason, "a cached chunk failed authentication; removed from the cache, fetching it from the store");
                if let Some(cache) = self.cache() {
                    cache.refuse(key.id(), &c.id);
                }
                Ok(None)
            }
        }
    }

    /// A chunk object of at most `limit` bytes, `None` when missing. The body lands in a
    /// recycled, aligned buffer (fresh memory costs more than the decryption here, and an
    /// aligned buffer can go to the cache with `O_DIRECT`).
    pub(super) async fn fetch_object(&self, rel: &str, limit: u64) -> Result<Option<ChunkBuf>> {
        let p = ObjPath::from(rel);
        let too_large = |size| StoreError::ObjectTooLarge {
            path: self.shown(&p),
            size,
            limit,
        };
        if let Some(d) = &self.direct {
            let (d, rel) = (d.clone(), rel.to_owned());
            return match blocking(move || d.get(&rel, limit))
                .await?
                .map_err(|e| self.be(&p, io_backend(e)))?
            {
                Fetched::Data(b) => Ok(Some(b)),
                Fetched::Missing => Ok(None),
                Fetched::TooLarge(size) => Err(too_large(size)),
            };
        }
        let r = match self.os.get(&p).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.be(&p, e)),
        };
        if r.meta.size > limit {
            return Err(too_large(r.meta.size));
        }
        let mut buf = ChunkBuf::with_room(r.meta.size as usize);
        let mut body = r.into_stream();
        while let Some(part) = body.next().await {
            let part = part.map_err(|e| self.be(&p, e))?;
            let n = (buf.len() + part.len()) as u64;
            if n > limit {
                return Err(too_large(n));
            }
            buf.extend(&part);
        }
        Ok(Some(buf))
    }

    /// Authenticates, decrypts and decompresses a chunk object and hands the plaintext to
    /// `deliver`; the inner `Err` is why the object is not the chunk. With `fill`, the object is
    /// also stored in the node's cache (and removed again if it turns out corrupt).
    async fn decode_into<T, D>(
        &self,
        key: &Key,
        c: &ChunkRef,
        mut obj: ChunkBuf,
        fill: bool,
        deliver: D,
    ) -> Result<std::result::Result<T, String>>
    where
        T: Send + 'static,
        D: FnOnce(&[u8]) -> Result<T> + Send + 'static,
    {
        let cache = self.cache().cloned().filter(|_| fill);
        let (key, id, len) = (key.clone(), c.id.clone(), c.len as usize);
        self.on_cpu(move || {
            if let Some(cache) = &cache {
                cache.insert(key.id(), &id, &mut obj);
            }
            match chunk::decode(&key, &id, len, obj.data_mut()) {
                Ok(plain) => deliver(plain.as_slice()).map(Ok),
                Err(reason) => {
                    if let Some(cache) = &cache {
                        cache.remove_chunk(key.id(), &id);
                    }
                    Ok(Err(reason))
                }
            }
        })
        .await?
    }
}

/// Creates (truncating) and pre-sizes every file of a restore.
pub(super) fn create_files(
    dest: &Path,
    layout: &[(String, u64)],
) -> Result<Vec<Arc<std::fs::File>>> {
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
            // The restore's room taken at once rather than as chunks arrive: chunks cached
            // meanwhile (by this restore or another) cannot take it, and a disk without it
            // fails here, before anything is fetched.
            allocate(&f, *size).map_err(|e| StoreError::io(&p, e))?;
            Ok(Arc::new(f))
        })
        .collect()
}

/// Sizes `f` to `len` bytes and gives it that much disk at once (`fallocate`); where the
/// filesystem cannot allocate ahead it stays sparse.
fn allocate(f: &std::fs::File, len: u64) -> std::io::Result<()> {
    f.set_len(len)?;
    let Ok(len) = i64::try_from(len) else {
        return Ok(());
    };
    if len == 0 {
        return Ok(());
    }
    match nix::fcntl::fallocate(
        std::os::fd::AsRawFd::as_raw_fd(f),
        nix::fcntl::FallocateFlags::empty(),
        0,
        len,
    ) {
        Ok(()) | Err(nix::errno::Errno::EOPNOTSUPP) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
