//! Room on the node's disk for a restore's files, made before anything is staged.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use stasis_core::Manifest;
use tracing::info;

use super::Executor;
use crate::error::{AgentError, Result};

/// Kept free beyond a restore's own files: the plan, the markers and the logs written beside
/// them, and CRIU's work files.
const MARGIN_BYTES: u64 = 16 << 20;

impl Executor {
    /// Makes sure the filesystem of the images directory has room for every file of
    /// `manifest` (a lazy restore stages few of them at first, but its page images fill up as
    /// the memory arrives, so it needs the same). When it has not, the node's chunk cache, if
    /// it shares that filesystem, gives back the difference, oldest chunks first: the cache is
    /// the agent's own use of the disk, and a restore is worth more than cached chunks of
    /// checkpoints no one is restoring. What is still missing then fails the restore before
    /// anything is staged, with the sizes, instead of a `No space left on device` halfway
    /// through a lazy restore (the soak's cold start on a full disk while the cache held room).
    pub(super) fn make_room(&self, manifest: &Manifest) -> Result<()> {
        let dir = &self.cfg.images_dir;
        let needed = manifest.files.iter().map(|f| f.size).sum::<u64>() + MARGIN_BYTES;
        // (a filesystem that cannot say: the restore tries, and a write that fails says why)
        let Some(available) = filesystem_space(dir).map(|s| s.available) else {
            return Ok(());
        };
        if available >= needed {
            return Ok(());
        }
        let freed = match self.store.cache() {
            Some(cache) if same_filesystem(cache.dir(), dir) => {
                cache.yield_space(needed - available)
            }
            _ => 0,
        };
        let available = filesystem_space(dir).map_or(available + freed, |s| s.available);
        if freed > 0 {
            info!(needed, freed, available, dir = %dir.display(), "the chunk cache gave disk space back for a restore");
        }
        if available >= needed {
            return Ok(());
        }
        Err(AgentError::NoRoom {
            dir: dir.clone(),
            needed,
            available,
            freed,
        })
    }
}

/// The size of a filesystem and what an unprivileged writer may still use of it.
pub(crate) struct FilesystemSpace {
    pub(crate) total: u64,
    pub(crate) available: u64,
}

/// The space of the filesystem that holds `dir` (or its nearest existing parent).
pub(crate) fn filesystem_space(dir: &Path) -> Option<FilesystemSpace> {
    let existing = dir.ancestors().find(|p| p.exists())?;
    let st = nix::sys::statvfs::statvfs(existing).ok()?;
    let block = st.fragment_size() as u64;
    Some(FilesystemSpace {
        total: st.blocks() as u64 * block,
        available: st.blocks_available() as u64 * block,
    })
}

fn same_filesystem(a: &Path, b: &Path) -> bool {
    let dev = |p: &Path| {
        p.ancestors()
            .find_map(|q| std::fs::metadata(q).ok())
            .map(|m| m.dev())
    };
    matches!((dev(a), dev(b)), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_shares_its_filesystem_with_itself_and_not_with_proc() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(same_filesystem(
            tmp.path(),
            &tmp.path().join("not/yet/made")
        ));
        assert!(!same_filesystem(tmp.path(), Path::new("/proc/self")));
        let space = filesystem_space(&tmp.path().join("not/yet")).expect("the space of a tmpdir");
        assert!(space.total >= space.available && space.available > 0);
    }
}
