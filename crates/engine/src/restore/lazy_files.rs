//! The image's files of a lazy restore as they fill, chunk by chunk: each chunk fetched once
//! (by the background or by a page request, whichever comes first; the other waits), written
//! into its sparse file only after the source authenticated it.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::{ChunkSource, SourceFile};
use crate::error::EngineError;

pub(super) const MISSING: u8 = 0;
pub(super) const IN_FLIGHT: u8 = 1;
pub(super) const DONE: u8 = 2;

pub(super) struct State {
    pub(super) chunks: Vec<Vec<u8>>,
    pub(super) failed: Option<String>,
    /// The workload is dead (after a failure), or the transfer ended.
    pub(super) settled: bool,
}

/// The image's files as they fill, chunk by chunk.
pub(super) struct Files {
    pub(super) source: Arc<dyn ChunkSource>,
    pub(super) files: Vec<SourceFile>,
    pub(super) starts: Vec<Vec<u64>>,
    pub(super) handles: Vec<std::fs::File>,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) fetched: AtomicU64,
    pub(super) demand: AtomicU64,
}

impl Files {
    pub(super) fn create(dir: &Path, source: Arc<dyn ChunkSource>) -> Result<Self, EngineError> {
        let files = source.files();
        let mut handles = Vec::with_capacity(files.len());
        for f in &files {
            let p = dir.join(&f.path);
            if f.path.starts_with('/') || f.path.split('/').any(|c| c == ".." || c.is_empty()) {
                return Err(EngineError::Image {
                    dir: dir.into(),
                    reason: format!("file {:?} is not a plain relative path", f.path),
                });
            }
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).map_err(EngineError::io(parent))?;
            }
            let h = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&p)
                .map_err(EngineError::io(&p))?;
            // Only what is fetched is written, but every page arrives in the end: the room is
            // taken at once (chunks cached meanwhile cannot take it, and a disk without it
            // fails the staging before the container runs, not the transfer after).
            allocate(&h, f.size).map_err(EngineError::io(&p))?;
            handles.push(h);
        }
        let starts = files
            .iter()
            .map(|f| {
                let mut off = 0u64;
                f.chunk_lens
                    .iter()
                    .map(|l| {
                        let s = off;
                        off += u64::from(*l);
                        s
                    })
                    .collect()
            })
            .collect();
        let chunks = files
            .iter()
            .map(|f| vec![MISSING; f.chunk_lens.len()])
            .collect();
        Ok(Files {
            source,
            files,
            starts,
            handles,
            state: Mutex::new(State {
                chunks,
                failed: None,
                settled: false,
            }),
            cv: Condvar::new(),
            fetched: AtomicU64::new(0),
            demand: AtomicU64::new(0),
        })
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn fail(&self, why: String) {
        let mut st = self.lock();
        st.failed.get_or_insert(why);
        self.cv.notify_all();
    }

    pub(super) fn failed(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Brings chunk `ci` of file `fi` into its file (or waits for the fetch in flight).
    /// Returns whether this call fetched it.
    pub(super) fn ensure(&self, fi: usize, ci: usize) -> Result<bool, String> {
        let mut st = self.lock();
        loop {
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            match st.chunks[fi][ci] {
                DONE => return Ok(false),
                IN_FLIGHT => st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                _ => break,
            }
        }
        st.chunks[fi][ci] = IN_FLIGHT;
        drop(st);
        let f = &self.files[fi];
        let want = f.chunk_lens[ci] as usize;
        let r = self.source.chunk(fi, ci).and_then(|plain| {
            if plain.len() != want {
                return Err(format!(
                    "chunk {ci} of {} has {} bytes, the manifest says {want}",
                    f.path,
                    plain.len()
                ));
            }
            self.handles[fi]
                .write_all_at(&plain, self.starts[fi][ci])
                .map_err(|e| format!("cannot write {}: {e}", f.path))
        });
        let mut st = self.lock();
        match &r {
            Ok(()) => {
                st.chunks[fi][ci] = DONE;
                self.fetched.fetch_add(want as u64, Ordering::Relaxed);
            }
            Err(e) => {
                st.chunks[fi][ci] = MISSING;
                st.failed.get_or_insert(e.clone());
            }
        }
        self.cv.notify_all();
        drop(st);
        r.map(|()| true)
    }

    /// The chunks of file `fi` that hold bytes `[off, off + len)`.
    pub(super) fn chunks_of(&self, fi: usize, off: u64, len: u64) -> std::ops::Range<usize> {
        let s = &self.starts[fi];
        let first = s.partition_point(|&c| c <= off).saturating_sub(1);
        let end = s.partition_point(|&c| c < off + len);
        first..end.max(first)
    }

    /// Fetches `work` with `threads` threads; stops at the first failure.
    pub(super) fn fetch_all(self: &Arc<Self>, work: Vec<(usize, usize)>, threads: usize) {
        let work = Arc::new(work);
        let next = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                let (me, work, next) = (self.clone(), work.clone(), next.clone());
                std::thread::spawn(move || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(fi, ci)) = work.get(i) else { return };
                    if me.ensure(fi, ci).is_err() {
                        return;
                    }
                })
            })
            .collect();
        for h in hs {
            let _ = h.join();
        }
    }
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
