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

pub(super) fn write(p: &Path, s: &str) {
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
