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

    /// A fake `/proc`: container 42 (in mount namespace A, whose own view shows an overlay
    /// at `/` with `upperdir=/etc`), its parent 7 (the shim, namespace B, where the bundle's
    /// rootfs is an overlay over a snapshot).
    fn fake_proc(parent_ns: &'static str) -> impl Fn(&Path) -> std::io::Result<String> {
        move |p: &Path| {
            let text = match p.to_str().unwrap() {
                "/proc/42/stat" => "42 (sh) x) S 7 42 42 0 -1".to_owned(),
                "/proc/42/mountinfo" => {
                    "1 0 0:9 / / rw - overlay overlay rw,lowerdir=/l,upperdir=/etc,workdir=/w\n"
                        .to_owned()
                }
                "/proc/7/mountinfo" => format!(
                    "1 0 8:1 / / rw - ext4 /dev/vda rw\n\
                     99 1 0:50 / /run/c/rootfs rw - overlay overlay rw,lowerdir=/l,upperdir={},workdir=/w\n",
                    std::env::temp_dir().display()
                ),
                "/proc/7/ns/mnt" => parent_ns.to_owned(),
                "/proc/42/ns/mnt" => "mnt:[A]".to_owned(),
                other => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        other.to_owned(),
                    ))
                }
            };
            Ok(text)
        }
    }

    #[test]
    fn the_upper_dir_comes_from_the_runtime_side_never_from_the_container() {
        let read = fake_proc("mnt:[B]");
        let link = |p: &Path| read(p).map(PathBuf::from);
        let kind = detect_with(Path::new("/run/c/rootfs"), 42, &read, &link).unwrap();
        assert_eq!(
            kind,
            RootfsKind::Overlay {
                upper: std::env::temp_dir()
            }
        );
        // A parent in the container's own mount namespace is no runtime view: refused.
        let read = fake_proc("mnt:[A]");
        let link = |p: &Path| read(p).map(PathBuf::from);
        let err = detect_with(Path::new("/run/c/rootfs"), 42, &read, &link)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shares its mount namespace"), "{err}");
    }

    #[test]
    fn an_upper_dir_that_is_a_symlink_or_relative_is_refused() {
        let t = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", t.path().join("up")).unwrap();
        for upper in [
            t.path().join("up"),
            PathBuf::from("rel/up"),
            PathBuf::from("/a/../etc"),
        ] {
            let err = checked(RootfsKind::Overlay { upper }, Path::new("/r"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("refusing to archive it"), "{err}");
        }
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
            &detect(&rootfs, 0).unwrap(),
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
        let cap = capture(&detect(&rootfs, 0).unwrap(), &rootfs, i128::MAX / 2, &image).unwrap();
        assert_eq!(cap.entries, 0);
        let fresh = t.path().join("fresh");
        write(&fresh.join("old"), "x");
        apply(&image, cap.method, &fresh).unwrap();
        assert!(fresh.join("old").exists());
    }

    // --- Restores are confined to the target (the new container's rootfs) ---

    /// Builds `rootfs/diff.tar` from raw headers: names are written as given (absolute, `..`),
    /// as a crafted archive would have them; owners are this process's, so no root is needed.
    struct Crafted {
        b: tar::Builder<std::fs::File>,
        uid: u64,
        gid: u64,
    }

    impl Crafted {
        fn new(image: &ImageDir) -> Self {
            std::fs::create_dir_all(image.rootfs_dir()).unwrap();
            let md = std::fs::metadata(image.rootfs_dir()).unwrap();
            Self {
                b: tar::Builder::new(std::fs::File::create(image.rootfs_diff()).unwrap()),
                uid: u64::from(md.uid()),
                gid: u64::from(md.gid()),
            }
        }

        fn pax(&mut self, kv: &[(&str, &[u8])]) {
            let mut data = Vec::new();
            for (k, v) in kv {
                let body = 1 + k.len() + 1 + v.len() + 1;
                let mut len = body + 1;
                while len.to_string().len() + body != len {
                    len += 1;
                }
                data.extend_from_slice(format!("{len} {k}=").as_bytes());
                data.extend_from_slice(v);
                data.push(b'\n');
            }
            self.raw(
                tar::EntryType::XHeader,
                b"PaxHeaders/x",
                None,
                &data,
                (0, 0),
            );
        }

        fn raw(
            &mut self,
            ty: tar::EntryType,
            name: &[u8],
            link: Option<&[u8]>,
            data: &[u8],
            dev: (u32, u32),
        ) {
            let mut h = tar::Header::new_ustar();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            if let Some(l) = link {
                h.as_old_mut().linkname[..l.len()].copy_from_slice(l);
            }
            h.set_entry_type(ty);
            h.set_mode(if ty == tar::EntryType::Directory {
                0o755
            } else {
                0o644
            });
            h.set_uid(self.uid);
            h.set_gid(self.gid);
            h.set_mtime(1_700_000_000);
            h.set_size(data.len() as u64);
            h.set_device_major(dev.0).unwrap();
            h.set_device_minor(dev.1).unwrap();
            h.set_cksum();
            self.b.append(&h, data).unwrap();
        }

        fn dir(&mut self, name: &str) {
            self.raw(
                tar::EntryType::Directory,
                name.as_bytes(),
                None,
                b"",
                (0, 0),
            );
        }
        fn opaque_dir(&mut self, name: &str) {
            self.pax(&[("SCHILY.xattr.trusted.overlay.opaque", b"y")]);
            self.dir(name);
        }
        fn file(&mut self, name: &str, data: &str) {
            self.raw(
                tar::EntryType::Regular,
                name.as_bytes(),
                None,
                data.as_bytes(),
                (0, 0),
            );
        }
        fn whiteout(&mut self, name: &str) {
            self.raw(tar::EntryType::Char, name.as_bytes(), None, b"", (0, 0));
        }
        fn done(mut self) {
            self.b.finish().unwrap();
        }
    }

    /// A temp dir with `outside/` (a host directory with a canary), `fresh/` (the new rootfs)
    /// and an image dir.
    fn confinement_world() -> (tempfile::TempDir, PathBuf, PathBuf, ImageDir) {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        write(&outside.join("canary/keep"), "host");
        let fresh = t.path().join("fresh");
        std::fs::create_dir_all(&fresh).unwrap();
        let image = ImageDir::new(t.path().join("image"));
        (t, outside, fresh, image)
    }

    fn assert_outside_intact(outside: &Path) {
        assert_eq!(
            std::fs::read_to_string(outside.join("canary/keep"))
                .ok()
                .as_deref(),
            Some("host"),
            "the restore changed a host directory outside the rootfs"
        );
        let names: Vec<_> = std::fs::read_dir(outside)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("canary")],
            "new host files"
        );
    }

    #[test]
    fn opaque_dir_over_an_image_symlink_to_the_host_stays_inside() {
        let (_t, outside, fresh, image) = confinement_world();
        std::fs::create_dir_all(fresh.join("var")).unwrap();
        std::os::unix::fs::symlink(&outside, fresh.join("var/run")).unwrap();
        let mut a = Crafted::new(&image);
        a.dir("./");
        a.dir("./var/");
        a.opaque_dir("./var/run/");
        a.file("./var/run/app.pid", "1");
        a.done();
        apply(&image, RootfsMethod::OverlayUpper, &fresh).unwrap();
        assert_outside_intact(&outside);
        // The image's symlink was replaced by the (opaque) directory of the archive.
        let md = std::fs::symlink_metadata(fresh.join("var/run")).unwrap();
        assert!(md.is_dir(), "var/run is not a directory: {md:?}");
        assert_eq!(std::fs::read_dir(fresh.join("var/run")).unwrap().count(), 1);
        assert_eq!(
            std::fs::read_to_string(fresh.join("var/run/app.pid")).unwrap(),
            "1"
        );
    }

    #[test]
    fn whiteouts_and_opaque_dirs_named_outside_the_archive_are_refused() {
        for name in ["/abs", "../x", "a/../../x", "./a/../../../x"] {
            let (t, outside, fresh, image) = confinement_world();
            write(&fresh.join("a/keep"), "image");
            // What each name would reach from the target: absolute names the host's
            // `outside`, `..` names the temp dir's `outside`.
            let abs = format!("{}/canary", outside.display());
            let name_bytes = if name == "/abs" {
                abs
            } else {
                name.replace('x', "outside/canary")
            };
            for opaque in [false, true] {
                let mut a = Crafted::new(&image);
                a.dir("./");
                if opaque {
                    a.opaque_dir(&name_bytes);
                } else {
                    a.whiteout(&name_bytes);
                }
                a.done();
                let err = apply(&image, RootfsMethod::OverlayUpper, &fresh)
                    .expect_err(&format!("{name_bytes} was accepted"))
                    .to_string();
                assert!(err.contains(&name_bytes), "{err}");
                assert!(err.contains("refused before anything was changed"), "{err}");
                assert_outside_intact(&outside);
                assert!(fresh.join("a/keep").exists());
            }
            drop(t);
        }
    }

    #[test]
    fn members_under_an_image_symlink_to_the_host_never_reach_it() {
        for link in ["ABS", "../../../outside"] {
            let (_t, outside, fresh, image) = confinement_world();
            std::fs::create_dir_all(fresh.join("var")).unwrap();
            let text = if link == "ABS" {
                outside.clone()
            } else {
                PathBuf::from(link)
            };
            std::os::unix::fs::symlink(&text, fresh.join("var/run")).unwrap();
            // No `./var/run/` entry: GNU tar would write through the symlink.
            let mut a = Crafted::new(&image);
            a.file("./var/run/evil", "evil");
            a.whiteout("./var/run/canary");
            a.done();
            let r = apply(&image, RootfsMethod::OverlayUpper, &fresh);
            assert_outside_intact(&outside);
            if let Err(e) = r {
                assert!(e.to_string().contains("./var/run/evil"), "{e}");
            }
        }
    }

    #[test]
    fn members_under_an_image_symlink_inside_the_rootfs_follow_it_there() {
        let (_t, outside, fresh, image) = confinement_world();
        std::fs::create_dir_all(fresh.join("usr/lib")).unwrap();
        std::fs::create_dir_all(fresh.join("run")).unwrap();
        std::os::unix::fs::symlink("usr/lib", fresh.join("lib")).unwrap();
        std::fs::create_dir_all(fresh.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", fresh.join("var/run")).unwrap();
        let mut a = Crafted::new(&image);
        a.file("./lib/foo", "in usr/lib");
        a.file("./var/run/pid", "in /run of the rootfs");
        a.done();
        apply(&image, RootfsMethod::OverlayUpper, &fresh).unwrap();
        assert_outside_intact(&outside);
        assert_eq!(
            std::fs::read_to_string(fresh.join("usr/lib/foo")).unwrap(),
            "in usr/lib"
        );
        assert_eq!(
            std::fs::read_to_string(fresh.join("run/pid")).unwrap(),
            "in /run of the rootfs"
        );
        assert!(std::fs::symlink_metadata(fresh.join("var/run"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn device_nodes_are_refused_naming_the_entry() {
        for (ty, dev, name) in [
            (tar::EntryType::Char, (1, 3), "./dev-null"),
            (tar::EntryType::Block, (8, 0), "./disk"),
        ] {
            let (_t, _outside, fresh, image) = confinement_world();
            let mut a = Crafted::new(&image);
            a.file("./before", "x");
            a.raw(ty, name.as_bytes(), None, b"", dev);
            a.done();
            let err = apply(&image, RootfsMethod::OverlayUpper, &fresh)
                .unwrap_err()
                .to_string();
            assert!(err.contains(name) && err.contains("device node"), "{err}");
            assert!(!fresh.join("before").exists(), "changed before refusing");
        }
        // Not even a 0/0 character device in a plain rootfs: there it is no whiteout. Refused
        // before the plain method's deletions run (the empty path list would delete `image`).
        let (_t, _outside, fresh, image) = confinement_world();
        write(&fresh.join("image"), "from the image");
        let mut a = Crafted::new(&image);
        a.whiteout("./w");
        a.done();
        std::fs::write(image.rootfs_paths(), b"").unwrap();
        let err = apply(&image, RootfsMethod::ChangedSinceStart, &fresh)
            .unwrap_err()
            .to_string();
        assert!(err.contains("./w") && err.contains("device node"), "{err}");
        assert!(fresh.join("image").exists(), "deleted before refusing");
    }

    #[test]
    fn hard_links_out_of_the_tree_are_refused_or_stay_inside() {
        use std::os::unix::fs::MetadataExt;
        for target in ["../outside/canary/keep", "/etc/passwd", "a/../../x"] {
            let (_t, outside, fresh, image) = confinement_world();
            let mut a = Crafted::new(&image);
            a.raw(
                tar::EntryType::Link,
                b"./l",
                Some(target.as_bytes()),
                b"",
                (0, 0),
            );
            a.done();
            let err = apply(&image, RootfsMethod::OverlayUpper, &fresh)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("./l") && err.contains("leave the rootfs"),
                "{err}"
            );
            assert_outside_intact(&outside);
        }
        // Through an image symlink to the host: resolved inside the rootfs, where it is absent.
        let (_t, outside, fresh, image) = confinement_world();
        std::os::unix::fs::symlink(&outside, fresh.join("w")).unwrap();
        let mut a = Crafted::new(&image);
        a.raw(
            tar::EntryType::Link,
            b"./l",
            Some(b"w/canary/keep"),
            b"",
            (0, 0),
        );
        a.done();
        assert!(apply(&image, RootfsMethod::OverlayUpper, &fresh).is_err());
        assert_eq!(
            std::fs::metadata(outside.join("canary/keep"))
                .unwrap()
                .nlink(),
            1
        );
        assert!(std::fs::symlink_metadata(fresh.join("l")).is_err());
    }

    #[test]
    fn files_replace_image_symlinks_instead_of_writing_through_them() {
        let (_t, outside, fresh, image) = confinement_world();
        std::os::unix::fs::symlink(outside.join("canary/keep"), fresh.join("f")).unwrap();
        std::os::unix::fs::symlink(outside.join("canary"), fresh.join("d")).unwrap();
        let mut a = Crafted::new(&image);
        a.file("./f", "container");
        a.dir("./d/");
        a.file("./d/keep", "container");
        a.done();
        apply(&image, RootfsMethod::OverlayUpper, &fresh).unwrap();
        assert_outside_intact(&outside);
        assert_eq!(
            std::fs::read_to_string(fresh.join("f")).unwrap(),
            "container"
        );
        assert_eq!(
            std::fs::read_to_string(fresh.join("d/keep")).unwrap(),
            "container"
        );
    }

    #[test]
    fn plain_rootfs_deletions_never_follow_image_symlinks() {
        let (_t, outside, fresh, image) = confinement_world();
        std::fs::create_dir_all(fresh.join("var")).unwrap();
        std::os::unix::fs::symlink(&outside, fresh.join("var/run")).unwrap();
        let mut a = Crafted::new(&image);
        a.file("./new", "x");
        a.done();
        // At checkpoint time var/run (the symlink) existed; nothing under it is listed.
        std::fs::write(image.rootfs_paths(), b"var\0var/run\0new\0").unwrap();
        apply(&image, RootfsMethod::ChangedSinceStart, &fresh).unwrap();
        assert_outside_intact(&outside);
        assert!(std::fs::symlink_metadata(fresh.join("var/run"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn only_user_and_capability_xattrs_are_restored() {
        let (_t, _outside, fresh, image) = confinement_world();
        let mut a = Crafted::new(&image);
        a.pax(&[
            ("SCHILY.xattr.user.kept", b"1"),
            ("SCHILY.xattr.trusted.evil", b"1"),
            (
                "SCHILY.xattr.security.selinux",
                b"system_u:object_r:etc_t:s0",
            ),
            ("SCHILY.xattr.trusted.overlay.redirect", b"/etc"),
        ]);
        a.file("./x", "data");
        a.done();
        apply(&image, RootfsMethod::OverlayUpper, &fresh).unwrap();
        let x = fresh.join("x");
        let names = Command::new("python3")
            .args([
                "-c",
                "import os,sys; print(' '.join(sorted(os.listxattr(sys.argv[1]))))",
            ])
            .arg(&x)
            .output()
            .unwrap();
        assert!(names.status.success(), "{names:?}");
        let names = String::from_utf8_lossy(&names.stdout);
        assert!(names.contains("user.kept"), "{names}");
        for dropped in ["trusted.evil", "trusted.overlay.redirect"] {
            assert!(!names.contains(dropped), "{dropped} restored: {names}");
        }
        // SELinux labels may exist by policy on some hosts, never the archive's.
        assert!(!names.contains("security.selinux") || !Path::new("/sys/fs/selinux").exists());
    }

    #[test]
    fn gnu_tar_captures_round_trip_sparse_files_hard_links_modes_and_times() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        write(&upper.join("d/small"), "small");
        // Sparse: 8 MiB with 4 KiB of data in the middle.
        let sparse = upper.join("d/sparse");
        let f = std::fs::File::create(&sparse).unwrap();
        f.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 4096], 4 << 20).unwrap();
        drop(f);
        std::fs::hard_link(upper.join("d/small"), upper.join("d/hard")).unwrap();
        std::fs::set_permissions(
            upper.join("d/small"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc/nowhere", upper.join("d/link")).unwrap();
        let st = Command::new("mkfifo")
            .arg(upper.join("d/fifo"))
            .status()
            .unwrap();
        assert!(st.success());
        let long = "n".repeat(200);
        write(&upper.join(format!("d/{long}/{long}")), "long");
        let setx = Command::new("python3")
            .args([
                "-c",
                "import os,sys; os.setxattr(sys.argv[1], 'user.k', b'v')",
            ])
            .arg(upper.join("d/small"))
            .status()
            .unwrap();
        assert!(setx.success());
        // Binary values with newlines, as an overlay's origin handle or a capability mask may
        // hold, on the archive's root (where CI met one) and a file; one holding text shaped
        // like a PAX record (a parser splitting at newlines would read a `size` from it).
        let setx = Command::new("python3")
            .args([
                "-c",
                "import os,sys; os.setxattr(sys.argv[1], 'trusted.stasis-test', b'\\x00\\n\\xfb\\n'); \
                 os.setxattr(sys.argv[2], 'user.bin', b'a\\n21 size=99999999\\n=\\x00z')",
            ])
            .arg(&upper)
            .arg(upper.join("d/small"))
            .status()
            .unwrap();
        assert!(setx.success());
        let touch = Command::new("touch")
            .args(["-h", "-d", "2001-02-03 04:05:06.123456789"])
            .arg(upper.join("d/small"))
            .arg(upper.join("d/link"))
            .arg(upper.join("d"))
            .status()
            .unwrap();
        assert!(touch.success());
        let image = ImageDir::new(t.path().join("image"));
        let cap = capture(
            &RootfsKind::Overlay {
                upper: upper.clone(),
            },
            &upper,
            0,
            &image,
        )
        .unwrap();
        let fresh = t.path().join("fresh");
        write(
            &fresh.join("d/small"),
            "image version, longer than the new one",
        );
        apply(&image, cap.method, &fresh).unwrap();
        let d = fresh.join("d");
        assert_eq!(std::fs::read_to_string(d.join("small")).unwrap(), "small");
        let small = std::fs::metadata(d.join("small")).unwrap();
        assert_eq!(small.mode() & 0o7777, 0o4755, "setuid mode");
        assert_eq!(small.nlink(), 2, "hard link");
        assert_eq!(
            small.ino(),
            std::fs::metadata(d.join("hard")).unwrap().ino()
        );
        assert_eq!(
            (small.mtime(), small.mtime_nsec()),
            (981_173_106, 123_456_789)
        );
        let dir = std::fs::metadata(&d).unwrap();
        assert_eq!((dir.mtime(), dir.mtime_nsec()), (981_173_106, 123_456_789));
        let link = std::fs::symlink_metadata(d.join("link")).unwrap();
        assert_eq!(link.mtime(), 981_173_106);
        assert_eq!(
            std::fs::read_link(d.join("link")).unwrap(),
            PathBuf::from("/etc/nowhere")
        );
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(d.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        let sp = std::fs::read(d.join("sparse")).unwrap();
        assert_eq!(sp.len(), 8 << 20);
        assert!(sp[4 << 20..(4 << 20) + 4096].iter().all(|b| *b == 7));
        assert_eq!(sp.iter().filter(|b| **b != 0).count(), 4096);
        let blocks = std::fs::metadata(d.join("sparse")).unwrap().blocks();
        assert!(blocks * 512 < 1 << 20, "not sparse: {blocks} blocks");
        assert_eq!(
            std::fs::read_to_string(d.join(format!("{long}/{long}"))).unwrap(),
            "long"
        );
        assert_eq!(xattr_of(&d.join("small"), "user.k").as_deref(), Some("v"));
        let bin = Command::new("python3")
            .args([
                "-c",
                "import os,sys; print(os.getxattr(sys.argv[1], 'user.bin').hex())",
            ])
            .arg(d.join("small"))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&bin.stdout).trim(),
            "610a32312073697a653d39393939393939390a3d007a"
        );
    }

    fn xattr_of(p: &Path, name: &str) -> Option<String> {
        let out = Command::new("python3")
            .args([
                "-c",
                "import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())",
            ])
            .arg(p)
            .arg(name)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}
