//! Puts a captured filesystem archive into a fresh rootfs without ever leaving it.
//!
//! The target is the new container's rootfs, seen from the host's mount namespace (the merged
//! overlay containerd mounted, or a plain directory). Its symlinks belong to the image and point
//! wherever the image says, including absolute paths that mean the *host's* files here. So no
//! path is ever resolved from the host's `/`: the target is opened once, every parent directory
//! is resolved from that descriptor with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)` (symlinks resolve as they would inside the container, `..` stops at the
//! rootfs, no mount is crossed), and every change is an `*at` call on that parent with a single
//! name that is never followed: files are created `O_EXCL|O_NOFOLLOW`, whatever stood at a name
//! (a symlink included) is removed through descriptors before something else is put there,
//! symlink text is only ever written as data.
//!
//! The archive is checked whole before anything is touched ([`check`]): absolute names, `..`,
//! device nodes (other than overlay whiteouts), hard links leaving the tree and unsupported
//! entry types are refused, naming the entry. Extended attributes are restored only in the
//! namespaces a container may set itself (`user.*`, `security.capability`); the overlay opaque
//! marker is interpreted, never set.

use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::EngineError;

mod at;
mod member;

use at::*;
pub(crate) use at::{empty_dir, list_dir, remove_at};
pub(crate) use member::check;
use member::*;

/// How the archive was captured, which decides what whiteouts and opaque markers mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// An overlay upper directory: character devices 0/0 are deletions, directories marked
    /// `trusted.overlay.opaque=y` hide what the image had in them.
    OverlayUpper,
    /// Entries of a plain directory: no whiteouts, no opaque directories.
    Plain,
}

/// An archive that passed [`check`].
#[derive(Debug)]
pub(crate) struct Checked {
    archive: PathBuf,
    flavor: Flavor,
}

impl Checked {
    /// Puts the archive into `target` (see the module's description).
    pub(crate) fn apply(&self, target: &Path) -> Result<(), EngineError> {
        let root = rustix::fs::open(target, dir_flags(), Mode::empty())
            .map_err(|e| EngineError::io(target)(e.into()))?;
        let mut ar = open_archive(&self.archive, 1 << 20)?;
        let unreadable =
            |e: std::io::Error| refuse(&self.archive, "(archive)", format!("unreadable: {e}"));
        // Directories get their owner, mode and times once everything in them is there.
        let mut dirs = Vec::new();
        while let Some(h) = ar.next().map_err(unreadable)? {
            let m = member(&h, self.flavor).map_err(|why| {
                refuse(
                    &self.archive,
                    String::from_utf8_lossy(&h.path).into_owned(),
                    why,
                )
            })?;
            self.put(&root, &mut ar.data(), &m)
                .map_err(|why| refuse(&self.archive, display(&m.path), why))?;
            if matches!(m.kind, Kind::Dir) {
                dirs.push(m);
            }
        }
        for m in dirs.iter().rev() {
            let r = match m.path.split_last() {
                None => set_meta(&root, m),
                Some((name, parent)) => match open_dir(&root, parent, false).and_then(|p| {
                    rustix::fs::openat2(
                        &p,
                        name,
                        dir_flags(),
                        Mode::empty(),
                        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                    )
                }) {
                    // Replaced or deleted by a later entry: nothing to set.
                    Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => Ok(()),
                    r => r.and_then(|fd| set_meta(&fd, m)),
                },
            };
            r.map_err(|e| {
                refuse(
                    &self.archive,
                    display(&m.path),
                    format!("setting owner, mode and times: {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// Applies one member.
    fn put(&self, root: &OwnedFd, entry: &mut impl Read, m: &Member) -> Result<(), String> {
        let Some((name, parent_path)) = m.path.split_last() else {
            // The archive's root: the target itself.
            if m.opaque {
                empty_dir(root).map_err(|e| format!("emptying the opaque root: {e}"))?;
            }
            return Ok(());
        };
        let name = name.as_os_str();
        if matches!(m.kind, Kind::Whiteout) {
            // Nothing to delete where the parent is missing.
            return match open_dir(root, parent_path, false) {
                Err(Errno::NOENT | Errno::NOTDIR) => Ok(()),
                Err(e) => Err(format!("opening its directory: {e}")),
                Ok(dir) => remove_at(&dir, name).map_err(|e| format!("deleting it: {e}")),
            };
        }
        let dir = open_dir(root, parent_path, true).map_err(|e| match e {
            Errno::EXIST | Errno::NOTDIR => format!(
                "its directory {} is not a directory inside the rootfs (a symlink out of it, or a file)",
                display(parent_path)
            ),
            e => format!("opening its directory: {e}"),
        })?;
        let existing = match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Some(rustix::fs::FileType::from_raw_mode(st.st_mode)),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(format!("looking at what is there: {e}")),
        };
        let replace = |dir: &OwnedFd| {
            if existing.is_some() {
                remove_at(dir, name).map_err(|e| format!("removing what was there: {e}"))
            } else {
                Ok(())
            }
        };
        match &m.kind {
            Kind::Whiteout => unreachable!("handled above"),
            Kind::Dir => {
                if existing != Some(rustix::fs::FileType::Directory) {
                    // A symlink (or anything else) where the archive has a directory is
                    // replaced, never followed.
                    replace(&dir)?;
                    rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700))
                        .map_err(|e| format!("making the directory: {e}"))?;
                } else if m.opaque {
                    let sub = rustix::fs::openat2(
                        &dir,
                        name,
                        dir_flags(),
                        Mode::empty(),
                        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                    )
                    .map_err(|e| format!("opening the opaque directory: {e}"))?;
                    empty_dir(&sub).map_err(|e| format!("emptying the opaque directory: {e}"))?;
                }
                Ok(())
            }
            Kind::File => {
                replace(&dir)?;
                let fd = rustix::fs::openat(
                    &dir,
                    name,
                    OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::WRONLY
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| format!("creating the file: {e}"))?;
                let mut f = std::fs::File::from(fd);
                write_file(&mut f, entry, m).map_err(|e| format!("writing the file: {e}"))?;
                set_meta(&f, m).map_err(|e| format!("setting owner, mode, xattrs and times: {e}"))
            }
            Kind::Symlink(text) => {
                replace(&dir)?;
                rustix::fs::symlinkat(OsStr::from_bytes(text), &dir, name)
                    .map_err(|e| format!("making the symlink: {e}"))?;
                self.link_meta(&dir, name, m)
            }
            Kind::HardLink(target) => {
                let (tname, tparent) = target.split_last().expect("checked: not the root");
                if tparent == parent_path && tname == name {
                    return Ok(());
                }
                let tdir = open_dir(root, tparent, false).map_err(|e| {
                    format!(
                        "opening the link target's directory {}: {e}",
                        display(tparent)
                    )
                })?;
                replace(&dir)?;
                rustix::fs::linkat(&tdir, tname, &dir, name, AtFlags::empty())
                    .map_err(|e| format!("linking to {}: {e}", display(target)))
            }
            Kind::Fifo => {
                replace(&dir)?;
                rustix::fs::mknodat(
                    &dir,
                    name,
                    rustix::fs::FileType::Fifo,
                    Mode::from_raw_mode(0o600),
                    0,
                )
                .map_err(|e| format!("making the FIFO: {e}"))?;
                // Opened without blocking for a writer, only to set its metadata.
                let fd = rustix::fs::openat(
                    &dir,
                    name,
                    OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| format!("opening the FIFO: {e}"))?;
                set_meta(&fd, m).map_err(|e| format!("setting owner, mode and times: {e}"))
            }
        }
    }

    /// Owner and times of a symlink (never followed; symlinks have no mode, and no xattrs a
    /// container may set).
    fn link_meta(&self, dir: &OwnedFd, name: &OsStr, m: &Member) -> Result<(), String> {
        rustix::fs::chownat(
            dir,
            name,
            Some(rustix::fs::Uid::from_raw(m.uid)),
            Some(rustix::fs::Gid::from_raw(m.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| format!("setting the symlink's owner: {e}"))?;
        rustix::fs::utimensat(dir, name, &times(m), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| format!("setting the symlink's times: {e}"))
    }
}

/// Deletes every entry of `target` whose path relative to it is not in `keep` (a plain
/// rootfs's paths at checkpoint time), through descriptors, not crossing onto other
/// filesystems.
pub(crate) fn delete_not_in(
    target: &Path,
    keep: &std::collections::HashSet<&[u8]>,
) -> Result<(), EngineError> {
    fn prune(
        dir: &OwnedFd,
        prefix: &[u8],
        dev: u64,
        keep: &std::collections::HashSet<&[u8]>,
    ) -> Result<(), (Vec<u8>, Errno)> {
        for name in list_dir(dir).map_err(|e| (prefix.to_vec(), e))? {
            let mut rel = prefix.to_vec();
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(name.as_bytes());
            if !keep.contains(rel.as_slice()) {
                remove_at(dir, &name).map_err(|e| (rel, e))?;
                continue;
            }
            let st = rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| (rel.clone(), e))?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
                && st.st_dev == dev
            {
                let sub = rustix::fs::openat2(
                    dir,
                    &name,
                    dir_flags(),
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                )
                .map_err(|e| (rel.clone(), e))?;
                prune(&sub, &rel, dev, keep)?;
            }
        }
        Ok(())
    }
    let root = rustix::fs::open(target, dir_flags(), Mode::empty())
        .map_err(|e| EngineError::io(target)(e.into()))?;
    let dev = rustix::fs::fstat(&root)
        .map_err(|e| EngineError::io(target)(e.into()))?
        .st_dev;
    prune(&root, b"", dev, keep).map_err(|(rel, e)| {
        EngineError::io(target.join(OsStr::from_bytes(&rel)))(std::io::Error::from(e))
    })
}
