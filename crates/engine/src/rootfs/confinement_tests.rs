//! A restore's rootfs changes are untrusted input: crafted archives never reach outside the
//! container's rootfs, and refused entries are named.
use super::tests::write;
use super::*;

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
