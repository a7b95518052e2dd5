//! Lazy restore (DESIGN §6.2a): the container runs before its memory has arrived.
//!
//! Only the small files are fetched before `runc restore`: every file but CRIU's page images,
//! and of those only the pages CRIU maps itself (the eager ones: stacks, file-backed private
//! pages, shared memory). The page images are sparse files of their full size; their chunks
//! arrive in the background, in order and in parallel, while `criu lazy-pages` (started before
//! the restore, `runc restore --lazy-pages` hands it the processes' userfaultfds) asks this
//! page server for the pages the processes touch and, after the restore, for all the others.
//! A page is answered from the chunks that cover it, fetched at once when the background has
//! not brought them yet; a chunk is written into the page image only after its source
//! authenticated it, so no page reaches the process unauthenticated.
//!
//! A chunk that cannot be had (missing, corrupt) ends the workload: the request that needs it
//! is never answered (its thread stays blocked in the fault), the container is killed, and only
//! then is the connection closed, so the daemon never gives up while a process could still run
//! on (zero-filled) memory. A watchdog process holds the page server's socket too and kills
//! the container if this process dies before the transfer ends.
//!
//! Threads only, no async: this code forks runc and CRIU. The [`ChunkSource`] may bridge to an
//! async store from the fetching threads; none of them forks.

#[path = "lazy_files.rs"]
mod files;
#[path = "lazy_pagemap.rs"]
mod pagemap;
#[path = "lazy_procs.rs"]
mod procs;
#[path = "lazy_server.rs"]
mod server;
#[path = "lazy_xfer.rs"]
mod xfer;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stasis_core::manifest::{ChunkRef, FileEntry};
use tracing::info;

use super::{ContainerRestore, Restored};
use crate::error::EngineError;

pub use pagemap::PageMap;
pub use procs::{
    adopt_helpers, announce, announce_outcome, announced, helpers_alive, take_killed, Announcement,
    KillTarget,
};
pub use server::{serve_lazy, LazyCancel, LazyServer};

/// Where a lazy restore's files come from: the checkpoint's files as lists of chunks, each
/// fetched and authenticated on request. Called from several threads at once.
pub trait ChunkSource: Send + Sync {
    /// The checkpoint's files, each with its chunks' lengths in order.
    fn files(&self) -> Vec<SourceFile>;
    /// The plaintext of chunk `index` of file `file` (an index into [`ChunkSource::files`]),
    /// authenticated; the error names the chunk and why it cannot be had.
    fn chunk(&self, file: usize, index: usize) -> Result<Vec<u8>, String>;
}

/// One file of a checkpoint.
#[derive(Debug, Clone)]
pub struct SourceFile {
    /// Relative to the image directory (`criu/pages-1.img`).
    pub path: String,
    pub mode: u32,
    pub size: u64,
    pub chunk_lens: Vec<u32>,
}

/// How a lazy restore went, once every page is in place.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LazyReport {
    /// Bytes fetched before `runc restore` (the small files and the eager pages' chunks).
    pub staged_bytes: u64,
    /// From the start to `runc restore` returning (the workload runs from then on).
    pub running_ms: u64,
    /// From the start to the last page in place (the lazy-pages daemon done).
    pub resident_ms: u64,
    /// Page requests answered, and how many of them waited for a chunk fetched on demand.
    pub requests: u64,
    pub demand_fetches: u64,
    /// From the start to the background fetch's end (every chunk in the page images): against
    /// `resident_ms`, whether the store or the page transfer into the processes is the limit.
    pub fetched_ms: u64,
}

/// Tuning of a lazy restore.
#[derive(Debug, Clone, Copy)]
pub struct LazyOptions {
    /// Chunks fetched at once (staging and background).
    pub parallel: usize,
}

impl Default for LazyOptions {
    fn default() -> Self {
        LazyOptions { parallel: 12 }
    }
}

/// A container restored lazily and running; its pages are still arriving.
pub struct LazyRunning {
    pub restored: Restored,
    running_ms: u64,
    server: LazyServer,
}

/// Restores a container checkpoint lazily into `req.image.root` (an empty directory that the
/// caller owns and removes afterwards), with the files from `source`. Returns once the
/// container runs; [`LazyRunning::wait_resident`] returns once every page is in place.
pub fn restore_container_lazy(
    req: &ContainerRestore<'_>,
    source: Arc<dyn ChunkSource>,
    opts: LazyOptions,
) -> Result<LazyRunning, EngineError> {
    if req.gpu.is_some_and(|g| g.processes > 0) {
        return Err(refused("the checkpoint has CUDA processes, whose device memory is restored before they run: restore it without --lazy"));
    }
    let restore_finished = Arc::new(AtomicBool::new(false));
    let server = serve_lazy(
        &req.image.root,
        &req.image.criu(),
        source,
        opts,
        KillTarget::Container {
            runc: req.runc.clone(),
            id: req.new_id.to_owned(),
            restore_finished: restore_finished.clone(),
        },
    )?;
    let restored = super::restore_container_reporting(&ContainerRestore {
        lazy_pages: true,
        ..req.clone()
    });
    restore_finished.store(true, Ordering::SeqCst);
    let running_ms = server.elapsed_ms();
    match restored {
        Ok(r) => {
            info!(
                container = req.new_id,
                pid = r.pid,
                "container restored lazily, its pages arriving"
            );
            Ok(LazyRunning {
                restored: r,
                running_ms,
                server,
            })
        }
        Err(e) => {
            let chunk = server.failed();
            server.abandon(&format!("runc restore failed: {e}"));
            // A page the restore itself needed could not be had: that is the cause.
            match chunk {
                Some(why) => Err(EngineError::ToolFailed {
                    what: "lazy restore".into(),
                    detail: format!(
                        "{why}; the restore was stopped before the container ran ({e})"
                    ),
                    log: None,
                }),
                None => Err(e),
            }
        }
    }
}

impl LazyRunning {
    /// Milliseconds from the start to the container running.
    pub fn running_ms(&self) -> u64 {
        self.running_ms
    }

    /// Waits until every page is in place (the lazy-pages daemon is done). A chunk that could
    /// not be had has ended the workload by then: the error names it.
    pub fn wait_resident(self) -> Result<LazyReport, EngineError> {
        let running_ms = self.running_ms;
        self.server
            .wait_resident()
            .map(|r| LazyReport { running_ms, ..r })
    }
}

/// A [`ChunkSource`] over a manifest's files: `read` brings one chunk (authenticated) from
/// wherever the caller's store keeps it. The CLI and the node agent read through it.
pub struct ManifestSource<F> {
    files: Vec<FileEntry>,
    read: F,
}

impl<F> ManifestSource<F>
where
    F: Fn(&FileEntry, &ChunkRef) -> Result<Vec<u8>, String> + Send + Sync,
{
    pub fn new(files: Vec<FileEntry>, read: F) -> Self {
        ManifestSource { files, read }
    }
}

impl<F> ChunkSource for ManifestSource<F>
where
    F: Fn(&FileEntry, &ChunkRef) -> Result<Vec<u8>, String> + Send + Sync,
{
    fn files(&self) -> Vec<SourceFile> {
        self.files
            .iter()
            .map(|f| SourceFile {
                path: f.path.clone(),
                mode: f.mode,
                size: f.size,
                chunk_lens: f.chunks.iter().map(|c| c.len).collect(),
            })
            .collect()
    }

    fn chunk(&self, file: usize, index: usize) -> Result<Vec<u8>, String> {
        let f = &self.files[file];
        (self.read)(f, &f.chunks[index])
    }
}

/// Whether this node can restore lazily: userfaultfd offered to this process and CRIU's
/// non-cooperative userfaultfd (`criu check --feature uffd-noncoop`). `Err`: why not, for the
/// caller that then restores in full. Runs `criu`: callers check once per node.
pub fn node_supports_lazy() -> Result<(), String> {
    if let Some(why) = no_userfaultfd() {
        return Err(why.into());
    }
    let (criu, _) = crate::tools::criu_checked().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(&criu)
        .args(["check", "--feature", "uffd-noncoop"])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", criu.display()))?;
    if out.status.success() {
        return Ok(());
    }
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let said = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message");
    Err(format!(
        "criu check --feature uffd-noncoop failed ({}): {said}",
        out.status
    ))
}

fn refused(reason: &str) -> EngineError {
    EngineError::ToolFailed {
        what: "lazy restore".into(),
        detail: reason.into(),
        log: None,
    }
}

/// Why this process can have no userfaultfd, if it can have none: no `/dev/userfaultfd`, and
/// the syscall refused to it (`vm.unprivileged_userfaultfd` off for a non-root process).
pub fn no_userfaultfd() -> Option<&'static str> {
    (!Path::new("/dev/userfaultfd").exists() && !uffd_sysctl_allows()).then_some(
        "this kernel offers no userfaultfd to this process (no /dev/userfaultfd, vm.unprivileged_userfaultfd off)",
    )
}

fn uffd_sysctl_allows() -> bool {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").is_ok_and(|s| s.trim() == "1")
        || nix::unistd::geteuid().is_root()
}
