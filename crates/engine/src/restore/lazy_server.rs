//! The page side of a lazy restore, shared by `stasis restore --lazy` and the node agent (which
//! serves a plan's pages while `stasis-runc create` restores the container): the staging of the
//! small files and the eager pages, `criu lazy-pages` with this page server, the background
//! fetch of every other chunk, and the end of the container whose memory cannot arrive.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::warn;

use super::files::Files;
use super::pagemap::PageMap;
use super::procs::{record_helpers, start_daemon, KillTarget, Killer, Watchdog};
use super::{no_userfaultfd, refused, xfer, ChunkSource, LazyOptions, LazyReport};
use crate::error::EngineError;

/// A lazy restore's image dir staged and its pages served: `criu lazy-pages` listens on
/// `lazy-pages.socket` in the restore's work dir, this page server answers it, and the
/// background fetch fills the page images.
pub struct LazyServer {
    started: Instant,
    staged_bytes: u64,
    files: Arc<Files>,
    daemon: Child,
    server: std::thread::JoinHandle<Result<u64, String>>,
    background: std::thread::JoinHandle<u64>,
    watchdog: Watchdog,
    log: PathBuf,
}

/// Stops a [`LazyServer`] whose container will not be restored (its pod went away, its create
/// started cold), from another thread than the one waiting for residency.
#[derive(Clone)]
pub struct LazyCancel {
    files: Arc<Files>,
    daemon: i32,
}

impl LazyCancel {
    /// Ends the transfer with `why`; [`LazyServer::wait_resident`] then returns it. A container
    /// already restored from the files is killed (it could not get its memory).
    pub fn cancel(&self, why: &str) {
        self.files.fail(why.to_owned());
        // Unreaped until the server is done (`wait_resident`): the pid is still the daemon's.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.daemon),
            nix::sys::signal::SIGKILL,
        );
    }
}

/// Stages the checkpoint `source` describes into `root` (an empty directory the caller owns and
/// removes afterwards: every file but the page images whole, the page images as sparse files
/// holding only their eager pages), starts `criu lazy-pages` on `root/criu` with this process's
/// page server, and starts the background fetch of the other chunks. Returns once a
/// `runc restore --lazy-pages --image-path root/criu --work-path <work>` can run.
///
/// `work` (an existing directory the caller owns) takes what is written after the staging: the
/// daemon's socket and log, and the restore's own log and its announcement
/// ([`super::announce`]). The node agent puts it on its run directory, not beside the images:
/// a disk that fills after the staging must not fail a restore whose files are all in place.
pub fn serve_lazy(
    root: &Path,
    work: &Path,
    source: Arc<dyn ChunkSource>,
    opts: LazyOptions,
    target: KillTarget,
) -> Result<LazyServer, EngineError> {
    let started = Instant::now();
    if let Some(why) = no_userfaultfd() {
        return Err(refused(&format!("{why}: restore it in full")));
    }
    let files = Arc::new(Files::create(root, source)?);
    let page_size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |p| p as u64);
    let (maps, lazy_files) = read_pagemaps(&files, page_size)?;

    // Staging: every chunk but those of lazily served page images, and of those the chunks
    // that hold eager pages.
    let mut eager = Vec::new();
    for (fi, f) in files.files.iter().enumerate() {
        match lazy_files.get(&fi) {
            None => eager.extend((0..f.chunk_lens.len()).map(|ci| (fi, ci))),
            Some(ranges) => {
                let mut cs: Vec<usize> = ranges
                    .iter()
                    .flat_map(|(o, l)| files.chunks_of(fi, *o, *l))
                    .collect();
                cs.dedup();
                eager.extend(cs.into_iter().map(|ci| (fi, ci)));
            }
        }
    }
    files.fetch_all(eager, opts.parallel);
    if let Some(e) = files.failed() {
        return Err(EngineError::Image {
            dir: root.into(),
            reason: format!("fetching its files failed: {e}"),
        });
    }
    let staged_bytes = files.fetched.load(Ordering::Relaxed);
    for (f, h) in files.files.iter().zip(&files.handles) {
        let _ = h.set_permissions(std::fs::Permissions::from_mode(f.mode & 0o7777));
    }

    let (ours, theirs) = UnixStream::pair().map_err(EngineError::io(root))?;
    // A 4 MiB answer (the daemon's background requests) in one write rather than in many
    // wakeups of both sides; the kernel caps it at net.core.wmem_max.
    let _ = nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::SndBuf, &(8 << 20));
    let log = work.join("lazy-pages.log");
    let daemon = start_daemon(&root.join("criu"), work, &log, theirs)?;
    let watchdog = Watchdog::start(&target, &ours, daemon.id() as i32)?;
    if let KillTarget::Announced { dir } = &target {
        let pids = [Some(daemon.id() as i32), watchdog.pid()];
        record_helpers(dir, &pids.into_iter().flatten().collect::<Vec<_>>())
            .map_err(EngineError::io(dir))?;
    }
    let server = {
        let (files, maps) = (files.clone(), maps);
        let killer = Killer {
            target,
            daemon: daemon.id() as i32,
        };
        std::thread::spawn(move || serve(ours, &files, &maps, page_size, &killer))
    };
    let background = {
        let files = files.clone();
        let work: Vec<(usize, usize)> = lazy_files
            .keys()
            .flat_map(|&fi| (0..files.files[fi].chunk_lens.len()).map(move |ci| (fi, ci)))
            .collect();
        std::thread::spawn(move || {
            files.fetch_all(work, opts.parallel);
            started.elapsed().as_millis() as u64
        })
    };
    Ok(LazyServer {
        started,
        staged_bytes,
        files,
        daemon,
        server,
        background,
        watchdog,
        log,
    })
}

impl LazyServer {
    /// Bytes fetched before the restore could start.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    /// Milliseconds since [`serve_lazy`] started.
    pub fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A handle that stops this transfer from another thread.
    pub fn canceller(&self) -> LazyCancel {
        LazyCancel {
            files: self.files.clone(),
            daemon: self.daemon.id() as i32,
        }
    }

    /// The first failure so far (a chunk that could not be had), if any.
    pub fn failed(&self) -> Option<String> {
        self.files.failed()
    }

    /// Waits until every page is in place (the lazy-pages daemon is done). A chunk that could
    /// not be had has ended the workload by then: the error names it. `running_ms` of the
    /// report is 0: when the container ran is its restorer's to say.
    pub fn wait_resident(mut self) -> Result<LazyReport, EngineError> {
        // A daemon that dies before the last page (a crash) has closed its userfaultfds, and the
        // processes would fault in zero-filled pages: the page server's read then ends and it
        // kills the container and signals the daemon (`fail_and_kill`). So the daemon's end is
        // waited for without reaping it (WNOWAIT), and reaped only once the server is done:
        // its pid cannot be reused by another process while the server may still signal it.
        let pid = nix::unistd::Pid::from_raw(self.daemon.id() as i32);
        let _ = nix::sys::wait::waitid(
            nix::sys::wait::Id::Pid(pid),
            nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT,
        );
        let served = self.server.join();
        let status = self.daemon.wait();
        let fetched_ms = self.background.join().unwrap_or(0);
        self.watchdog.done();
        let failed = self.files.failed();
        let detail = match (&status, &served, failed) {
            (_, _, Some(e)) => Some(format!(
                "{e}; the restored container was killed rather than run with missing memory"
            )),
            (Ok(s), _, None) if !s.success() => Some(format!(
                "criu lazy-pages ended with {s} before every page was in place"
            )),
            (Err(e), _, None) => Some(format!("cannot wait for criu lazy-pages: {e}")),
            (_, Ok(Err(e)), None) => Some(e.clone()),
            _ => None,
        };
        if let Some(detail) = detail {
            return Err(EngineError::ToolFailed {
                what: "lazy restore".into(),
                detail,
                log: Some(self.log.clone()),
            });
        }
        let requests = served.ok().and_then(Result::ok).unwrap_or(0);
        Ok(LazyReport {
            staged_bytes: self.staged_bytes,
            running_ms: 0,
            resident_ms: self.started.elapsed().as_millis() as u64,
            requests,
            demand_fetches: self.files.demand.load(Ordering::Relaxed),
            fetched_ms,
        })
    }

    /// After a failed `runc restore`: stops the daemon, the server and the fetches.
    pub fn abandon(mut self, why: &str) {
        self.files.fail(why.to_owned());
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        self.watchdog.done();
        let _ = self.server.join();
        let _ = self.background.join();
    }
}

/// The tasks' pagemaps by task id, and for each page image served lazily the byte ranges the
/// restore reads itself.
type Pagemaps = (
    BTreeMap<u64, (usize, PageMap)>,
    BTreeMap<usize, Vec<(u64, u64)>>,
);

fn read_pagemaps(files: &Files, page_size: u64) -> Result<Pagemaps, EngineError> {
    let index: BTreeMap<&str, usize> = files
        .files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.as_str(), i))
        .collect();
    let (mut maps, mut lazy) = (BTreeMap::new(), BTreeMap::new());
    for (fi, f) in files.files.iter().enumerate() {
        let Some(id) = f
            .path
            .strip_prefix("criu/pagemap-")
            .and_then(|r| r.strip_suffix(".img"))
            .and_then(|r| r.parse::<u64>().ok())
        else {
            continue;
        };
        // Pagemaps are small: fetched here, before everything else.
        let all: Vec<_> = (0..f.chunk_lens.len()).map(|ci| (fi, ci)).collect();
        for (fi, ci) in all {
            files.ensure(fi, ci).map_err(|e| EngineError::Image {
                dir: PathBuf::from(&f.path),
                reason: e,
            })?;
        }
        let mut raw = vec![0u8; f.size as usize];
        files.handles[fi]
            .read_exact_at(&mut raw, 0)
            .map_err(EngineError::io(&f.path))?;
        let bad = |reason: String| EngineError::Image {
            dir: PathBuf::from(&f.path),
            reason,
        };
        let pm = PageMap::parse(&raw, page_size).map_err(bad)?;
        let pages = format!("criu/pages-{}.img", pm.pages_id);
        let &pi = index
            .get(pages.as_str())
            .ok_or_else(|| bad(format!("its pages image {pages} is not in the checkpoint")))?;
        if files.files[pi].size < pm.pages_bytes(page_size) {
            return Err(bad(format!("{pages} is smaller than the pagemap says")));
        }
        lazy.insert(pi, pm.eager_ranges(page_size, false));
        maps.insert(id, (pi, pm));
    }
    Ok((maps, lazy))
}

/// The page server: answers the daemon's requests in order until it closes the session.
/// Returns the number of page requests answered.
fn serve(
    mut sock: UnixStream,
    files: &Files,
    maps: &BTreeMap<u64, (usize, PageMap)>,
    page_size: u64,
    killer: &Killer,
) -> Result<u64, String> {
    let mut served = 0u64;
    let mut buf = Vec::new();
    let r = loop {
        let mut head = [0u8; xfer::IOV_LEN];
        if let Err(e) = sock.read_exact(&mut head) {
            // The daemon went away without closing the session: it failed (its log says why).
            break Err(format!("the lazy-pages daemon left the page server: {e}"));
        }
        match xfer::Request::from(xfer::Iov::decode(&head)) {
            xfer::Request::Get {
                pid,
                vaddr,
                nr_pages,
            } => {
                let located = maps.get(&pid).and_then(|(fi, pm)| {
                    pm.locate(vaddr, nr_pages, page_size).map(|(o, n)| (*fi, o, n))
                });
                let Some((fi, off, n)) = located else {
                    break Err(format!(
                        "the lazy-pages daemon asked for pages at {vaddr:#x} of task {pid}, which the checkpoint does not hold"
                    ));
                };
                let len = n * page_size;
                let mut fetched = false;
                for ci in files.chunks_of(fi, off, len) {
                    match files.ensure(fi, ci) {
                        Ok(f) => fetched |= f,
                        Err(e) => return Err(fail_and_kill(files, killer, e)),
                    }
                }
                if fetched {
                    files.demand.fetch_add(1, Ordering::Relaxed);
                }
                buf.resize(len as usize, 0);
                if let Err(e) = files.handles[fi].read_exact_at(&mut buf, off) {
                    break Err(format!("cannot read {}: {e}", files.files[fi].path));
                }
                let head = xfer::Iov::pages(pid, vaddr, n).encode();
                if let Err(e) = sock.write_all(&head).and_then(|()| sock.write_all(&buf)) {
                    break Err(format!("the lazy-pages daemon left the page server: {e}"));
                }
                served += 1;
            }
            xfer::Request::Close => {
                let _ = sock.write_all(&0i32.to_ne_bytes());
                break Ok(served);
            }
            xfer::Request::Other(cmd) => {
                break Err(format!(
                    "the lazy-pages daemon sent page server command {cmd:#x}, which a lazy restore does not use"
                ))
            }
        }
    };
    if let Err(e) = &r {
        // A daemon that gave up may leave processes on pages it never filled.
        return Err(fail_and_kill(files, killer, e.clone()));
    }
    r
}

/// Records the failure, kills the container while the faulting request is still unanswered,
/// and returns the failure.
fn fail_and_kill(files: &Files, killer: &Killer, e: String) -> String {
    files.fail(e.clone());
    warn!(container = %killer.id(), error = %e, "lazy restore failed: killing the container");
    killer.kill();
    let mut st = files.lock();
    st.settled = true;
    files.cv.notify_all();
    e
}
