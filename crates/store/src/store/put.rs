//! Put: chunk, hash, encode and upload an image directory, then publish its manifest.

use std::collections::HashSet;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};
use stasis_core::{ChunkRef, FileEntry, Manifest, StoreStats};

use super::{blocking, chunk_rel, io_backend, lease_path, manifest_path, now_ms, LeaseDoc, Store};
use crate::chunk::{self, ChunkBuf, Chunker, HEADER_LEN};
use crate::envelope;
use crate::error::{Result, StoreError};
use crate::key::Key;
use crate::progress::Progress;

/// A file of the image directory to upload.
#[derive(Debug, Clone)]
pub(super) struct SourceFile {
    rel: String,
    abs: PathBuf,
    mode: u32,
    size: u64,
}

/// Reads `[pos, end)` of a file with positioned reads (several threads share one file).
pub(super) struct SegmentReader<'a> {
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
pub(super) struct Piece {
    unit: usize,
    seq: u32,
    buf: ChunkBuf,
}

/// What became of one chunk of a put.
pub(super) struct PieceDone {
    unit: usize,
    seq: u32,
    chunk: ChunkRef,
    /// Stored bytes when this put wrote the chunk.
    written: Option<u64>,
}

impl Store {
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

    pub(super) async fn put_leased(
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
                async move {
                    let Piece { unit, seq, buf } = piece?;
                    let len = buf.len() - HEADER_LEN;
                    let hkey = key.clone();
                    let (id, first) = self
                        .on_cpu(move || {
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
    pub(super) async fn chunk_present(&self, rel: &str, len: usize) -> bool {
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
    pub(super) async fn encode_and_store(
        &self,
        key: &Key,
        id: blake3::Hash,
        buf: ChunkBuf,
        rel: String,
    ) -> Result<u64> {
        let (key, compress) = (key.clone(), self.opts.compress);
        // A restore on this node (a restart in place) then finds the chunk without the store.
        let cache = self.cache().cloned();
        let mut obj = self
            .on_cpu(move || {
                let mut obj = chunk::encode(&key, &id, buf, compress);
                if let Some(cache) = cache {
                    cache.insert(key.id(), id.to_hex().as_str(), &mut obj);
                }
                obj
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
}

/// Regular files under `root`, recursively, sorted by relative path.
pub(super) fn scan_dir(root: &Path) -> Result<Vec<SourceFile>> {
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

/// A chunker thread: takes segments (`(file index, start, end)`) in turn and sends their chunks.
pub(super) fn chunk_units(
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
