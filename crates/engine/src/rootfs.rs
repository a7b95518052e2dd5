//! The container's filesystem changes: captured while the container is frozen, put back into a
//! fresh bundle before restore (DESIGN §3).
//!
//! Two methods, chosen by what the rootfs is:
//!
//! - **overlayfs** (containerd's snapshotters, Kubernetes): the upper directory *is* the set of
//!   changes. It is archived whole, with whiteouts (character devices 0/0), opaque directories
//!   (`trusted.overlay.opaque`), modes, owners and xattrs. On restore, whiteouts delete, opaque
//!   directories are emptied, and everything else is extracted through the target's merged view.
//! - **plain directory** (a runc bundle made by hand): every entry whose ctime is at or after the
//!   container's creation (minus one second of slack) is archived, with the list of every path
//!   present at checkpoint time. On restore, paths of the fresh rootfs missing from that list are
//!   deleted and the archive is extracted over it. Copying the whole rootfs was the alternative;
//!   the changed-since-start set keeps the freeze window proportional to what the workload wrote.
//!
//! Archives are written and read by GNU tar (`--xattrs --numeric-owner`), which handles sparse
//! files, hard links and every xattr namespace; the `tar` crate only scans headers.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use stasis_core::manifest::{RootfsCapture, RootfsMethod};

use crate::error::EngineError;
use crate::image::ImageDir;
use crate::tools;

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
        let mount_point = left.split(' ').nth(4).map(unescape_mountinfo);
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
                upper: PathBuf::from(OsStr::from_bytes(&unescape_mountinfo(upper))),
            };
        }
    }
    RootfsKind::Plain
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// What the rootfs of the container whose init process is `pid` is.
///
/// Asked in the container's own mount namespace first (its `/`), which works wherever this
/// process runs: the node agent runs in a pod of its own and need not see the container's mounts
/// (no mount propagation). Then this process's view of the bundle's `rootfs` path.
pub fn detect(rootfs: &Path, pid: i32) -> RootfsKind {
    if pid > 0 {
        if let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) {
            if let kind @ RootfsKind::Overlay { .. } = detect_in(&info, Path::new("/")) {
                return kind;
            }
        }
    }
    let canon = rootfs
        .canonicalize()
        .unwrap_or_else(|_| rootfs.to_path_buf());
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    detect_in(&info, &canon)
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
    std::fs::create_dir_all(&dir).map_err(EngineError::io(&dir))?;
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
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(path).map_err(EngineError::io(path))?);
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
            let paths = image.rootfs_paths();
            let raw = std::fs::read(&paths).map_err(EngineError::io(&paths))?;
            let keep: HashSet<&[u8]> = raw.split(|b| *b == 0).filter(|s| !s.is_empty()).collect();
            delete_not_in(target, &keep)?;
            extract(&diff, target, &[])?;
        }
        RootfsMethod::OverlayUpper => {
            let (whiteouts, opaque) = scan_overlay_archive(&diff)?;
            for dir in &opaque {
                let d = target.join(dir);
                if let Ok(rd) = std::fs::read_dir(&d) {
                    for e in rd.flatten() {
                        remove_any(&e.path())?;
                    }
                }
            }
            for w in &whiteouts {
                remove_any(&target.join(w))?;
            }
            // Whiteouts stand for deletions: never extract them (an overlay's merged view, the
            // usual target, refuses `mknod c 0 0`). Exact names, one per line.
            let exclude = std::env::temp_dir().join(format!(
                "stasis-whiteouts-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos())
            ));
            let mut list = Vec::new();
            for w in &whiteouts {
                let b = w.as_os_str().as_bytes();
                if b.contains(&b'\n') {
                    return Err(EngineError::Rootfs(format!(
                        "{}: a deleted path with a newline in its name",
                        diff.display()
                    )));
                }
                list.extend_from_slice(b);
                list.push(b'\n');
            }
            std::fs::write(&exclude, &list).map_err(EngineError::io(&exclude))?;
            let exclude_arg = format!("--exclude-from={}", exclude.display());
            let r = extract(
                &diff,
                target,
                &[
                    "--xattrs-exclude=trusted.overlay.*",
                    "--no-wildcards",
                    "--anchored",
                    "--no-unquote",
                    &exclude_arg,
                ],
            );
            let _ = std::fs::remove_file(&exclude);
            r?;
        }
    }
    Ok(())
}

fn extract(diff: &Path, target: &Path, extra: &[&str]) -> Result<(), EngineError> {
    tools::run_capture(
        tar_cmd()
            .args(["--extract", "--preserve-permissions", "--same-owner"])
            .args(extra)
            .arg("--file")
            .arg(diff)
            .arg("-C")
            .arg(target),
        "extracting the rootfs changes",
    )
    .map(drop)
}

fn remove_any(p: &Path) -> Result<(), EngineError> {
    match std::fs::symlink_metadata(p) {
        Err(_) => Ok(()),
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(p).map_err(EngineError::io(p)),
        Ok(_) => std::fs::remove_file(p).map_err(EngineError::io(p)),
    }
}

/// Deletes every entry under `root` whose relative path is not in `keep` (deepest first).
fn delete_not_in(root: &Path, keep: &HashSet<&[u8]>) -> Result<(), EngineError> {
    let dev = std::fs::metadata(root)
        .map_err(EngineError::io(root))?
        .dev();
    let mut gone = Vec::new();
    walk(root, root, dev, &mut |rel, _| {
        if !keep.contains(rel.as_os_str().as_bytes()) {
            gone.push(rel.to_path_buf());
        }
    })?;
    for rel in gone {
        remove_any(&root.join(rel))?;
    }
    Ok(())
}

/// Whiteouts and opaque directories in an archive of an overlay upper directory.
fn scan_overlay_archive(diff: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), EngineError> {
    let f = std::fs::File::open(diff).map_err(EngineError::io(diff))?;
    let mut ar = tar::Archive::new(std::io::BufReader::new(f));
    let (mut whiteouts, mut opaque) = (Vec::new(), Vec::new());
    let bad = |e: std::io::Error| EngineError::Rootfs(format!("{}: {e}", diff.display()));
    for entry in ar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let path = entry.path().map_err(bad)?.into_owned();
        let h = entry.header();
        if h.entry_type() == tar::EntryType::Char
            && h.device_major().ok().flatten() == Some(0)
            && h.device_minor().ok().flatten() == Some(0)
        {
            whiteouts.push(path);
            continue;
        }
        if h.entry_type() == tar::EntryType::Directory {
            if let Some(exts) = entry.pax_extensions().map_err(bad)? {
                for ext in exts.flatten() {
                    if ext.key_bytes() == b"SCHILY.xattr.trusted.overlay.opaque"
                        && ext.value_bytes() == b"y"
                    {
                        opaque.push(path.clone());
                    }
                }
            }
        }
    }
    Ok((whiteouts, opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_is_detected_from_mountinfo() {
        let info = "1 0 8:1 / / rw - ext4 /dev/vda rw\n\
            99 1 0:50 / /run/c/rootfs rw,relatime - overlay overlay rw,lowerdir=/l1:/l2,upperdir=/var/lib/up\\040dir,workdir=/w\n";
        assert_eq!(
            detect_in(info, Path::new("/run/c/rootfs")),
            RootfsKind::Overlay {
                upper: PathBuf::from("/var/lib/up dir")
            }
        );
        assert_eq!(detect_in(info, Path::new("/other")), RootfsKind::Plain);
    }

    fn write(p: &Path, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    }

    #[test]
    fn plain_rootfs_changes_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let rootfs = t.path().join("rootfs");
        write(&rootfs.join("etc/keep"), "image");
        write(&rootfs.join("etc/gone"), "image");
        write(&rootfs.join("data/changed"), "new contents");
        std::fs::remove_file(rootfs.join("etc/gone")).unwrap();
        let image = ImageDir::new(t.path().join("image"));
        // Everything counts as changed: the "container" started an hour ago.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let cap = capture(
            &detect(&rootfs, 0),
            &rootfs,
            i128::from(now - 3600) * 1_000_000_000,
            &image,
        )
        .unwrap();
        assert_eq!(cap.method, RootfsMethod::ChangedSinceStart);
        assert!(cap.entries >= 4);

        // A fresh rootfs from the "image": has etc/gone, lacks data/changed.
        let fresh = t.path().join("fresh");
        write(&fresh.join("etc/keep"), "image");
        write(&fresh.join("etc/gone"), "image");
        apply(&image, cap.method, &fresh).unwrap();
        assert!(!fresh.join("etc/gone").exists());
        assert_eq!(
            std::fs::read_to_string(fresh.join("data/changed")).unwrap(),
            "new contents"
        );
        assert_eq!(
            std::fs::read_to_string(fresh.join("etc/keep")).unwrap(),
            "image"
        );
    }

    #[test]
    fn overlay_whiteouts_delete_and_are_not_extracted() {
        use std::os::unix::fs::FileTypeExt;
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        write(&upper.join("data/new"), "new");
        // A whiteout is a 0/0 character device: only root can make one.
        let st = Command::new("mknod")
            .arg(upper.join("data/gone"))
            .args(["c", "0", "0"])
            .status();
        if !st.is_ok_and(|s| s.success()) {
            eprintln!("SKIPPED overlay_whiteouts_delete_and_are_not_extracted: mknod needs root");
            return;
        }
        let image = ImageDir::new(t.path().join("image"));
        std::fs::create_dir_all(image.rootfs_dir()).unwrap();
        tools::run_capture(
            tar_cmd()
                .args(["--create", "--file"])
                .arg(image.rootfs_diff())
                .arg("-C")
                .arg(&upper)
                .arg("."),
            "archive",
        )
        .unwrap();
        let fresh = t.path().join("fresh");
        write(&fresh.join("data/gone"), "image");
        write(&fresh.join("data/kept"), "image");
        apply(&image, RootfsMethod::OverlayUpper, &fresh).unwrap();
        assert!(std::fs::symlink_metadata(fresh.join("data/gone")).is_err());
        assert_eq!(
            std::fs::read_to_string(fresh.join("data/new")).unwrap(),
            "new"
        );
        assert!(!std::fs::symlink_metadata(fresh.join("data/kept"))
            .unwrap()
            .file_type()
            .is_char_device());
    }

    #[test]
    fn unchanged_files_are_not_archived() {
        let t = tempfile::tempdir().unwrap();
        let rootfs = t.path().join("rootfs");
        write(&rootfs.join("old"), "x");
        let image = ImageDir::new(t.path().join("image"));
        let cap = capture(&detect(&rootfs, 0), &rootfs, i128::MAX / 2, &image).unwrap();
        assert_eq!(cap.entries, 0);
        let fresh = t.path().join("fresh");
        write(&fresh.join("old"), "x");
        apply(&image, cap.method, &fresh).unwrap();
        assert!(fresh.join("old").exists());
    }
}
