//! Scratch directories in the work directory: where CRIU images live, in plaintext, between the
//! workload and the store.
//!
//! Only stasis's own directories are ever removed. Each is named
//! `<checkpoint|restore>-<pid>-<8 hex>` and holds a marker file, [`MARKER`], which its run keeps
//! locked (`flock`) while it lives. A directory counts as a leftover of a run that died only
//! when its name has that form, it is a real directory (not a symlink), and its marker exists
//! and can be locked; anything else in the work directory (a user's files, another stasis's live
//! scratch, in another pid namespace) is left alone. Before a scratch directory is removed,
//! whatever is mounted under it (CRIU's cgroup yard, left by a CRIU killed for memory) is
//! unmounted, so that nothing stays mounted and the plaintext images can go.
//!
//! A failed run keeps its CRIU and runc logs (not the images) under `<work dir>/failed/`, so the
//! log an error message cites still exists; the newest [`KEEP_FAILED`] are kept.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};

/// The marker file inside every scratch directory.
pub const MARKER: &str = ".stasis-scratch";
/// Failed runs whose logs are kept.
pub const KEEP_FAILED: usize = 20;
/// At most this much of each log is kept (its end).
const LOG_CAP: u64 = 4 << 20;

/// Scratch directories of this process, for the signal handler's last-resort cleanup.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A scratch directory for one checkpoint or restore, removed (after unmounting what is under
/// it) when dropped.
pub struct ScratchDir {
    pub path: PathBuf,
    work_dir: PathBuf,
    _marker: Flock<File>,
}

impl ScratchDir {
    pub fn new(work_dir: &Path, what: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(work_dir)
            .with_context(|| format!("cannot create the work directory {}", work_dir.display()))?;
        remove_stale(work_dir);
        let path = work_dir.join(format!(
            "{what}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&path)
                .with_context(|| format!("cannot create {}", path.display()))?;
        }
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.clone());
        let marker = path.join(MARKER);
        let f =
            File::create(&marker).with_context(|| format!("cannot create {}", marker.display()));
        let lock = f.and_then(|f| {
            Flock::lock(f, FlockArg::LockExclusiveNonblock)
                .map_err(|(_, e)| anyhow::anyhow!("cannot lock {}: {e}", marker.display()))
        });
        match lock {
            Ok(l) => Ok(Self {
                path,
                work_dir: work_dir.to_owned(),
                _marker: l,
            }),
            Err(e) => {
                remove(&path);
                Err(e)
            }
        }
    }

    /// Keeps the logs (`*.log`, not the images) of a failed run under `<work dir>/failed/<name>/`
    /// and returns where, for error messages.
    pub fn keep_logs(&self) -> Option<PathBuf> {
        let name = self.path.file_name()?;
        let failed = self.work_dir.join("failed");
        let dest = failed.join(name);
        let mut kept = false;
        for dir in [self.path.clone(), self.path.join("criu")] {
            let Ok(rd) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "log")
                    && e.file_type().is_ok_and(|t| t.is_file())
                {
                    if !kept {
                        use std::os::unix::fs::DirBuilderExt;
                        if std::fs::DirBuilder::new()
                            .recursive(true)
                            .mode(0o700)
                            .create(&dest)
                            .is_err()
                        {
                            return None;
                        }
                        kept = true;
                    }
                    copy_tail(&p, &dest.join(e.file_name()));
                }
            }
        }
        if kept {
            prune_failed(&failed);
        }
        kept.then_some(dest)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        remove(&self.path);
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| p != &self.path);
    }
}

/// Removes every scratch directory of this process (the signal handler's last resort).
pub fn remove_all_live() {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for p in live {
        remove(&p);
    }
}

/// Unmounts everything mounted under `dir`, deepest first, then removes it.
fn remove(dir: &Path) {
    unmount_under(dir);
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove a scratch directory");
        }
    }
}

fn unmount_under(dir: &Path) {
    let done = stasis_engine::mounts::unmount_under(dir);
    for m in done.unmounted {
        tracing::info!(mount = %m.display(), "unmounted a leftover mount in a scratch directory");
    }
    for (m, e) in done.failed {
        tracing::warn!(mount = %m.display(), error = %e, "could not unmount under a scratch directory");
    }
}

/// Whether `name` is one of stasis's scratch directory names: `<checkpoint|restore>-<pid>-<8 hex>`.
pub fn is_scratch_name(name: &str) -> bool {
    let Some((kind, rest)) = name.split_once('-') else {
        return false;
    };
    let Some((pid, hex)) = rest.split_once('-') else {
        return false;
    };
    matches!(kind, "checkpoint" | "restore")
        && !pid.is_empty()
        && pid.len() <= 10
        && pid.bytes().all(|b| b.is_ascii_digit())
        && hex.len() == 8
        && hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Removes scratch directories left by stasis runs that died (see the module docs).
fn remove_stale(work_dir: &Path) {
    let Ok(rd) = std::fs::read_dir(work_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if !name.to_str().is_some_and(is_scratch_name) {
            continue;
        }
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = e.path();
        let Ok(marker) = File::open(dir.join(MARKER)) else {
            continue;
        };
        // Locked: a live run (of this pid namespace or another). Free: its run died.
        if let Ok(lock) = Flock::lock(marker, FlockArg::LockExclusiveNonblock) {
            tracing::info!(dir = %dir.display(), "removing the scratch directory of a stasis run that died");
            remove(&dir);
            drop(lock);
        }
    }
}

/// Copies the last [`LOG_CAP`] bytes of a log, mode 0600.
fn copy_tail(from: &Path, to: &Path) {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut src) = File::open(from) else {
        return;
    };
    let len = src.metadata().map(|m| m.len()).unwrap_or(0);
    if len > LOG_CAP && src.seek(SeekFrom::Start(len - LOG_CAP)).is_err() {
        return;
    }
    if let Ok(mut dst) = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(to)
    {
        let _ = std::io::copy(&mut src, &mut dst);
    }
}

/// Keeps the newest [`KEEP_FAILED`] failed runs' logs (only directories named as scratch ones).
fn prune_failed(failed: &Path) {
    let Ok(rd) = std::fs::read_dir(failed) else {
        return;
    };
    let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = rd
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_scratch_name))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dirs.sort();
    let excess = dirs.len().saturating_sub(KEEP_FAILED);
    for (_, d) in dirs.into_iter().take(excess) {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stasis_names_are_scratch_names() {
        assert!(is_scratch_name("checkpoint-4242-0a1b2c3d"));
        assert!(is_scratch_name("restore-1-ffffffff"));
        for n in [
            "photos-2019-summer",
            "checkpoint-4242-0a1b2c3",
            "checkpoint-4242-0A1B2C3D",
            "restore--0a1b2c3d",
            "restore-12x-0a1b2c3d",
            "backup-4242-0a1b2c3d",
            "checkpoint-4242-0a1b2c3d-x",
            "failed",
        ] {
            assert!(!is_scratch_name(n), "{n}");
        }
    }

    #[test]
    fn stale_cleanup_leaves_what_is_not_a_marked_dead_scratch_dir() {
        let t = tempfile::tempdir().unwrap();
        let w = t.path();
        // A user's directory whose name looks like `<word>-<dead pid>-...`.
        std::fs::create_dir_all(w.join("photos-2019-summer")).unwrap();
        std::fs::write(w.join("photos-2019-summer/beach.jpg"), "pic").unwrap();
        // A scratch-like name without the marker (not made by this stasis).
        std::fs::create_dir_all(w.join("restore-999999-0a1b2c3d")).unwrap();
        // A live scratch dir of another run (its marker locked).
        let live = ScratchDir::new(w, "checkpoint").unwrap();
        // A dead run's scratch dir: marked, unlocked.
        let dead = w.join("checkpoint-999998-deadbeef");
        std::fs::create_dir_all(dead.join("criu")).unwrap();
        std::fs::write(dead.join(MARKER), "").unwrap();
        std::fs::write(dead.join("criu/pages-1.img"), "secret").unwrap();

        let next = ScratchDir::new(w, "restore").unwrap();
        assert!(w.join("photos-2019-summer/beach.jpg").exists());
        assert!(w.join("restore-999999-0a1b2c3d").exists());
        assert!(live.path.exists(), "a live run's scratch dir was removed");
        assert!(!dead.exists(), "a dead run's scratch dir was kept");
        let (a, b) = (live.path.clone(), next.path.clone());
        drop(live);
        drop(next);
        assert!(!a.exists() && !b.exists());
    }
}
