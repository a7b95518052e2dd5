//! A restore touches nothing outside the new container's rootfs, with real runc, CRIU and
//! overlayfs: an image symlink that points at a host directory, replaced by a directory inside
//! the container, must not make the restore (which runs on the host) delete that host
//! directory's files.

mod common;

use std::path::Path;

use common::*;

/// The image of `bundle` gets `/w` (mode 0777) and the absolute symlink `/w/x -> host_dir`,
/// then an overlay rootfs over it.
fn image_with_symlink_to(bundle: &Path, host_dir: &Path) -> Overlay {
    use std::os::unix::fs::PermissionsExt;
    let w = bundle.join("rootfs/w");
    std::fs::create_dir(&w).unwrap();
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::symlink(host_dir, w.join("x")).unwrap();
    image_overlay(bundle)
}

#[test]
fn restoring_a_replaced_image_symlink_leaves_the_host_directory_alone() {
    if !ready("restoring_a_replaced_image_symlink_leaves_the_host_directory_alone") {
        return;
    }
    let mut w = World::new();
    let canary = w.path("host-canary");
    std::fs::create_dir(&canary).unwrap();
    std::fs::write(canary.join("keep"), "host file").unwrap();

    let bundle = w.bundle("bundle-esc-a", &["STATE_MB=8"]);
    let ov_a = image_with_symlink_to(&bundle, &canary);
    let c = w.start_bundle("esc-a", &bundle);
    // What the workload does, `rm /w/x; mkdir /w/x; touch /w/x/a`, done in its own view of
    // its root: overlayfs records /w/x as an opaque directory in the upper directory.
    let inside = std::path::PathBuf::from(format!("/proc/{}/root/w/x", w.pid("esc-a")));
    std::fs::remove_file(&inside).unwrap();
    std::fs::create_dir(&inside).unwrap();
    std::fs::write(inside.join("a"), "").unwrap();
    assert!(
        canary.join("keep").exists(),
        "the test itself touched the host dir"
    );
    c.wait_count(2);

    w.stasis(&["checkpoint", "container", "esc-a", "--workload", "esc"])
        .expect_ok("checkpoint of the container");
    w.kill("esc-a");
    let m = w.stasis(&["inspect", "esc/latest", "-o", "json"]).json();
    assert_eq!(m["rootfs"]["method"], "overlay_upper", "{}", m["rootfs"]);
    drop(ov_a);

    // Restore into a fresh overlay bundle of the same image (whose /w/x is the symlink again).
    let bundle_b = w.bundle("bundle-esc-b", &["STATE_MB=8"]);
    let ov_b = image_with_symlink_to(&bundle_b, &canary);
    let log = w.path("esc-b.log");
    let run = w.stasis(&[
        "restore",
        "esc/latest",
        "--bundle",
        bundle_b.to_str().unwrap(),
        "--container-id",
        "esc-b",
        "--log",
        log.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(canary.join("keep")).ok().as_deref(),
        Some("host file"),
        "the restore deleted a host file through the image's symlink (restore: {})",
        run.stderr()
    );
    run.expect_ok("restore into a fresh overlay bundle");
    let r = Container {
        id: "esc-b".into(),
        log,
        bundle: bundle_b.clone(),
    };
    r.wait_count(2);
    assert!(!r.corrupt(), "state=CORRUPT after the restore");
    let x = format!("/proc/{}/root/w/x", w.pid("esc-b"));
    let md = std::fs::symlink_metadata(&x).unwrap();
    assert!(md.is_dir(), "/w/x is not the workload's directory: {md:?}");
    assert!(
        Path::new(&x).join("a").exists(),
        "/w/x/a is missing in the restored container"
    );
    let names: Vec<_> = std::fs::read_dir(&canary)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("keep")],
        "the host dir changed"
    );
    w.kill("esc-b");
    drop(ov_b);
}
