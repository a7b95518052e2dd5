//! Layout of a checkpoint image directory, the unit the store uploads and downloads.
//!
//! ```text
//! <image>/criu/            CRIU images (runc's checkpoint output, or CRIU's RPC dump)
//! <image>/rootfs/diff.tar  the container's filesystem changes (see `rootfs`)
//! <image>/rootfs/paths     every path of the rootfs at checkpoint time, NUL-separated
//!                          (plain-directory rootfs only: deletions are replayed from it)
//! ```

use std::path::{Path, PathBuf};

/// Paths inside one image directory.
#[derive(Debug, Clone)]
pub struct ImageDir {
    pub root: PathBuf,
}

impl ImageDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
    pub fn criu(&self) -> PathBuf {
        self.root.join("criu")
    }
    pub fn rootfs_dir(&self) -> PathBuf {
        self.root.join("rootfs")
    }
    pub fn rootfs_diff(&self) -> PathBuf {
        self.root.join("rootfs/diff.tar")
    }
    pub fn rootfs_paths(&self) -> PathBuf {
        self.root.join("rootfs/paths")
    }
    /// CRIU's log of a dump or restore, for error messages.
    pub fn criu_log(&self, action: &str) -> PathBuf {
        self.criu().join(format!("{action}.log"))
    }
    pub fn path(&self) -> &Path {
        &self.root
    }
}
