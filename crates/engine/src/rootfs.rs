//! The container's filesystem changes: captured while the container is frozen, put back into a
//! fresh bundle before restore (DESIGN §3).
//!
//! Two methods, chosen by what the rootfs is:
//!
//! - **overlayfs** (containerd's snapshotters, Kubernetes): the upper directory *is* the set of
//!   changes. It is archived whole, with whiteouts (character devices 0/0), opaque directories
//!   (`trusted.overlay.opaque`), modes, owners and xattrs. On restore, whiteouts delete, opaque
//!   directories are emptied, and everything else is put into the target's merged view.
//! - **plain directory** (a runc bundle made by hand): every entry whose ctime is at or after the
//!   container's creation (minus one second of slack) is archived, with the list of every path
//!   present at checkpoint time. On restore, paths of the fresh rootfs missing from that list are
//!   deleted and the archive is extracted over it. Copying the whole rootfs was the alternative;
//!   the changed-since-start set keeps the freeze window proportional to what the workload wrote.
//!
//! Archives are written by GNU tar (`--xattrs --numeric-owner --sparse`), which reads the upper
//! directory or rootfs as it is. They are read back by `unpack` (through `tarball`), never by tar: the
//! target holds the image's symlinks, which mean the host's files when followed from the host,
//! so every restore step is confined to the target through descriptors.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use stasis_core::manifest::{RootfsCapture, RootfsMethod};

use crate::error::EngineError;
use crate::image::ImageDir;
use crate::tools;
use crate::unpack;

/// What a rootfs is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootfsKind {
    Overlay { upper: PathBuf },
    Plain,
}

/// Finds whether `rootfs` is an overlay mount point, and its upper directory, from
/// `/proc/self/mountinfo` text.
pub fn detect_in(mountinfo: &str, rootfs: &Path) -> RootfsKind {
    let want = rootfs.as_os_str().as_bytes();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = left.split(' ').nth(4).map(crate::mounts::unescape);
        if mount_point.as_deref() != Some(want) {
            continue;
        }
        let mut r = right.split(' ');
        if r.next() != Some("overlay") {
            return RootfsKind::Plain;
        }
        let opts = r.nth(1).unwrap_or("");
        if let Some(upper) = opts.split(',').find_map(|o| o.strip_prefix("upperdir=")) {
            return RootfsKind::Overlay {
                upper: PathBuf::from(OsStr::from_bytes(&crate::mounts::unescape(upper))),
            };
        }
    }
    RootfsKind::Plain
}

/// What the rootfs of the container whose init process is `pid` is.
///
/// Read from the mount namespace the runtime mounted the rootfs in, never from the
/// container's own: a container allowed to mount (CAP_SYS_ADMIN over its mount namespace)
/// could otherwise show an overlay whose `upperdir=` names any node directory, which the
/// capture would then archive. The container's init is a child of the runtime's shim (or the
/// reaper `runc run --detach` leaves it to), which the container cannot change, so its parent's
/// `/proc/<ppid>/mountinfo` holds `<bundle>/rootfs` as containerd mounted it. That works
/// wherever this process runs: the node agent has the node's pids (hostPID) but not its mounts,
/// and on the local test cluster each node's containerd has its own mount namespace, which the
/// host's pid 1 does not see. Without a container process (`pid` 0), this process's own view
/// of `rootfs`.
pub fn detect(rootfs: &Path, pid: i32) -> Result<RootfsKind, EngineError> {
    detect_with(
        rootfs,
        pid,
        &|p: &Path| std::fs::read_to_string(p),
        &|p: &Path| std::fs::read_link(p),
    )
}

type Read<'a> = &'a dyn Fn(&Path) -> std::io::Result<String>;
type Link<'a> = &'a dyn Fn(&Path) -> std::io::Result<PathBuf>;

fn detect_with(
    rootfs: &Path,
    pid: i32,
    read: Read<'_>,
    link: Link<'_>,
) -> Result<RootfsKind, EngineError> {
    if pid <= 0 {
        let canon = rootfs
            .canonicalize()
            .unwrap_or_else(|_| rootfs.to_path_buf());
        let info = read(Path::new("/proc/self/mountinfo")).unwrap_or_default();
        return checked(detect_in(&info, &canon), rootfs);
    }
    let refuse = |reason: String| {
        EngineError::Rootfs(format!(
            "cannot tell how {} is mounted for container process {pid}: {reason}",
            rootfs.display()
        ))
    };
    let stat_path = PathBuf::from(format!("/proc/{pid}/stat"));
    let stat = read(&stat_path).map_err(|e| refuse(format!("{}: {e}", stat_path.display())))?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so from the last `)`.
    let ppid: i32 = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| refuse(format!("no parent pid in {}", stat_path.display())))?;
    if ppid <= 0 {
        return Err(refuse(
            "its parent is outside this pid namespace (the runtime's mount namespace is needed)"
                .into(),
        ));
    }
    let ns = |p: i32| {
        let l = PathBuf::from(format!("/proc/{p}/ns/mnt"));
        link(&l).map_err(|e| refuse(format!("{}: {e}", l.display())))
    };
    if ns(ppid)? == ns(pid)? {
        return Err(refuse(format!(
            "its parent {ppid} shares its mount namespace, so no view of the runtime's mounts is at hand"
        )));
    }
    let info_path = PathBuf::from(format!("/proc/{ppid}/mountinfo"));
    let info = read(&info_path).map_err(|e| refuse(format!("{}: {e}", info_path.display())))?;
    checked(detect_in(&info, rootfs), rootfs)
}

/// An upper directory is used only as an absolute, normal path that is a real directory (not
/// a symlink) where this process sees the node's files.
fn checked(kind: RootfsKind, rootfs: &Path) -> Result<RootfsKind, EngineError> {
    let RootfsKind::Overlay { upper } = &kind else {
        return Ok(kind);
    };
    let bad = |why: &str| {
        EngineError::Rootfs(format!(
            "the overlay at {} names the upper directory {}, which {why}; refusing to archive it",
            rootfs.display(),
            upper.display()
        ))
    };
    if !upper.is_absolute()
        || upper.components().any(|c| {
            !matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        })
    {
        return Err(bad("is not an absolute normal path"));
    }
    let seen = tools::host_path(upper);
    match std::fs::symlink_metadata(&seen) {
        Ok(md) if md.is_dir() => Ok(kind),
        Ok(_) => Err(bad("is not a directory")),
        Err(e) => Err(bad(&format!("cannot be read at {} ({e})", seen.display()))),
    }
}

fn tar_cmd() -> Command {
    let mut c = Command::new("tar");
    c.args(["--xattrs", "--xattrs-include=*", "--numeric-owner"]);
    c
}

/// File timestamps come from the kernel's coarse clock, which may lag the clock runc read the
/// creation time from by a tick or so: entries changed up to this long before creation count as
/// changed, so none written just after the start is missed.
const CTIME_SLACK_NANOS: i128 = 100_000_000;

/// Captures the filesystem changes of a frozen container into `image`.
/// `kind` is what [`detect`] found (before the freeze: it does not change while the container
/// runs, and reading mountinfo need not lengthen the freeze); `rootfs` is the bundle's rootfs (a
/// node path: [`tools::host_path`] maps it for in-process reads); `started_nanos` is the
/// container's creation time (Unix nanoseconds).
pub fn capture(
    kind: &RootfsKind,
    rootfs: &Path,
    started_nanos: i128,
    image: &ImageDir,
) -> Result<RootfsCapture, EngineError> {
    let dir = image.rootfs_dir();
    // Root's scratch: private, and every file in it made new (never through what was there).
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(EngineError::io(&dir))?;
    let diff = image.rootfs_diff();
    match kind {
        RootfsKind::Overlay { upper } => {
            let (entries, whiteouts) = count_overlay(&tools::host_path(upper))?;
            tools::run_capture(
                tar_cmd()
                    .arg("--create")
                    .arg("--sparse")
                    .arg("--file")
                    .arg(&diff)
                    .arg("-C")
                    .arg(upper)
                    .arg("."),
                "archiving the overlay upper directory",
            )?;
            Ok(RootfsCapture {
                method: RootfsMethod::OverlayUpper,
                entries,
                deleted: whiteouts,
                bytes: file_len(&diff),
            })
        }
        RootfsKind::Plain => {
            let seen = tools::host_path(rootfs);
            let root_dev = std::fs::metadata(&seen)
                .map_err(EngineError::io(&seen))?
                .dev();
            let mut all = Vec::new();
            let mut changed = Vec::new();
            walk(&seen, &seen, root_dev, &mut |rel, md| {
                all.push(rel.to_path_buf());
                let ctime = i128::from(md.ctime()) * 1_000_000_000 + i128::from(md.ctime_nsec());
                if ctime >= started_nanos - CTIME_SLACK_NANOS {
                    changed.push(rel.to_path_buf());
                }
            })?;
            write_nul_list(&image.rootfs_paths(), &all)?;
            let list = dir.join("changed");
            write_nul_list(&list, &changed)?;
            tools::run_capture(
                tar_cmd()
                    .args(["--create", "--sparse", "--file"])
                    .arg(&diff)
                    .arg("-C")
                    .arg(rootfs)
                    .args(["--no-recursion", "--null", "--files-from"])
                    .arg(&list),
                "archiving the rootfs changes",
            )?;
            let _ = std::fs::remove_file(&list);
            Ok(RootfsCapture {
                method: RootfsMethod::ChangedSinceStart,
                entries: changed.len() as u64,
                deleted: 0,
                bytes: file_len(&diff),
            })
        }
    }
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn write_nul_list(path: &Path, items: &[PathBuf]) -> Result<(), EngineError> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(EngineError::io(path))?;
    let mut f = std::io::BufWriter::new(f);
    for i in items {
        f.write_all(i.as_os_str().as_bytes())
            .and_then(|_| f.write_all(b"\0"))
            .map_err(EngineError::io(path))?;
    }
    f.flush().map_err(EngineError::io(path))
}

/// Depth-first walk of `dir` (not crossing onto other filesystems), calling `f` with each
/// entry's path relative to `root`.
fn walk(
    root: &Path,
    dir: &Path,
    dev: u64,
    f: &mut dyn FnMut(&Path, &std::fs::Metadata),
) -> Result<(), EngineError> {
    let rd = std::fs::read_dir(dir).map_err(EngineError::io(dir))?;
    for e in rd {
        let e = e.map_err(EngineError::io(dir))?;
        let p = e.path();
        let md = std::fs::symlink_metadata(&p).map_err(EngineError::io(&p))?;
        let rel = p.strip_prefix(root).unwrap_or(&p);
        f(rel, &md);
        if md.is_dir() && md.dev() == dev {
            walk(root, &p, dev, f)?;
        }
    }
    Ok(())
}

fn count_overlay(upper: &Path) -> Result<(u64, u64), EngineError> {
    use std::os::unix::fs::FileTypeExt;
    let dev = std::fs::metadata(upper)
        .map_err(EngineError::io(upper))?
        .dev();
    let (mut entries, mut whiteouts) = (0, 0);
    walk(upper, upper, dev, &mut |_, md| {
        entries += 1;
        if md.file_type().is_char_device() && md.rdev() == 0 {
            whiteouts += 1;
        }
    })?;
    Ok((entries, whiteouts))
}

/// Puts the captured changes into a fresh rootfs (a plain directory, or an overlay's merged view).
///
/// Confined to `target` by construction (the `unpack` module): the archive is checked whole first
/// (a refused entry is named and nothing is changed), then every deletion and every new entry is
/// made through descriptors resolved inside `target`, so neither the archive nor the image's own
/// symlinks can reach the host's files.
pub fn apply(image: &ImageDir, method: RootfsMethod, target: &Path) -> Result<(), EngineError> {
    let diff = image.rootfs_diff();
    if !diff.exists() {
        return Err(EngineError::Image {
            dir: image.root.clone(),
            reason: "rootfs/diff.tar is missing".into(),
        });
    }
    match method {
        RootfsMethod::ChangedSinceStart => {
            let checked = unpack::check(&diff, unpack::Flavor::Plain)?;
            let paths = image.rootfs_paths();
            let raw = std::fs::read(&paths).map_err(EngineError::io(&paths))?;
            let keep: HashSet<&[u8]> = raw.split(|b| *b == 0).filter(|s| !s.is_empty()).collect();
            unpack::delete_not_in(target, &keep)?;
            checked.apply(target)?;
        }
        RootfsMethod::OverlayUpper => {
            // Whiteouts delete and opaque directories are emptied as the archive is read; the
            // upper directory lists a directory before what is in it.
            unpack::check(&diff, unpack::Flavor::OverlayUpper)?.apply(target)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod confinement_tests;
#[cfg(test)]
mod tests;
