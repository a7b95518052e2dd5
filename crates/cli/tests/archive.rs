//! Kubernetes checkpoint archives (KEP-2008) against real runc, CRIU and checkpointctl: a
//! checkpoint of an overlay container exported with `stasis export` is read by `checkpointctl
//! show` and `inspect`, imported back with `stasis import`, and restored by `stasis restore`
//! into a new container that counts on with its filesystem changes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// checkpointctl as `scripts/build-platform checkpointctl` builds it (`make integration` does);
/// `None`, after saying why, when it is not there (a failure in CI).
fn checkpointctl(test: &str) -> Option<PathBuf> {
    let out = Command::new(repo().join("scripts/build-platform"))
        .args(["--print-dir", "checkpointctl"])
        .output()
        .ok()?;
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("bin/checkpointctl");
    if bin.exists() {
        return Some(bin);
    }
    let why = format!(
        "SKIPPED {test}: {} is missing (scripts/build-platform checkpointctl builds it)",
        bin.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("{why}");
    None
}

fn run(cmd: &Path, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{text}",
        cmd.display()
    );
    text
}

#[test]
fn an_exported_checkpoint_is_read_by_checkpointctl_and_imports_and_restores() {
    let test = "an_exported_checkpoint_is_read_by_checkpointctl_and_imports_and_restores";
    if !ready(test) {
        return;
    }
    let Some(ctl) = checkpointctl(test) else {
        return;
    };
    let mut w = World::new();
    let bundle = w.bundle("bundle-ex-a", &["STATE_MB=8"]);
    let ov_a = image_overlay(&bundle);
    let c = w.start_bundle("ex-a", &bundle);
    c.wait_count(2);
    change_rootfs(&ov_a.merged);
    w.stasis(&[
        "checkpoint",
        "container",
        "ex-a",
        "--workload",
        "counter",
        "--stop",
    ])
    .expect_ok("checkpoint --stop");
    let stopped_at = c.last_count();
    w.kill("ex-a");
    drop(ov_a);

    // Export: the kubelet's layout, which checkpointctl reads.
    let archive = w.path("checkpoint-counter.tar");
    let report = w
        .stasis(&[
            "export",
            "counter/latest",
            "--file",
            archive.to_str().unwrap(),
            "-o",
            "json",
        ])
        .json();
    assert!(report["images"].as_u64().unwrap() > 5, "{report}");
    assert_eq!(report["rootfs_whiteouts"], 1, "{report}");
    assert_eq!(report["rootfs_opaque_dirs"], 1, "{report}");
    let again = w.stasis(&[
        "export",
        "counter/latest",
        "--file",
        archive.to_str().unwrap(),
    ]);
    assert!(
        again
            .expect_err("a second export to the same file")
            .contains("exists"),
        "an existing archive was replaced"
    );
    let show = run(&ctl, &["show", archive.to_str().unwrap()]);
    println!("checkpointctl show:\n{show}");
    assert!(show.contains("ex-a"), "container id not shown:\n{show}");
    assert!(show.contains("containerd"), "engine not shown:\n{show}");
    let inspect = run(&ctl, &["inspect", archive.to_str().unwrap(), "--ps-tree"]);
    println!("checkpointctl inspect --ps-tree:\n{inspect}");
    assert!(
        inspect.contains("stasis-counter"),
        "CRIU's process tree not read:\n{inspect}"
    );

    // Import under another name, and restore that into a fresh overlay bundle.
    let imported = w
        .stasis(&[
            "import",
            archive.to_str().unwrap(),
            "--workload",
            "imported",
            "-o",
            "json",
        ])
        .json();
    let reference = imported["reference"].as_str().unwrap().to_owned();
    assert!(reference.starts_with("imported/"), "{imported}");
    assert_eq!(imported["rootfs_deletions"], 1, "{imported}");
    let m = w.stasis(&["inspect", &reference, "-o", "json"]).json();
    assert_eq!(m["labels"]["stasis.dev/reason"], "Imported", "{m}");
    assert!(
        m["requirements"]["image_digest"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:")),
        "the image digest did not travel: {}",
        m["requirements"]
    );

    let bundle_b = w.bundle("bundle-ex-b", &["STATE_MB=8"]);
    let ov_b = image_overlay(&bundle_b);
    let (run_b, r) = w.restore_into(&reference, "ex-b", bundle_b.clone(), &[]);
    run_b.expect_ok("restore of the imported checkpoint");
    r.wait_count(3);
    let counts = r.counts();
    assert!(
        counts[0] > stopped_at.saturating_sub(1) && counts[0] <= stopped_at + 1,
        "restored count {} does not follow the stopped count {stopped_at}",
        counts[0]
    );
    assert!(!r.corrupt(), "restored state is corrupt: {:?}", r.lines());
    assert_rootfs_changes(&ov_b.merged);
    w.kill("ex-b");
    drop(ov_b);
}

#[test]
fn an_archive_that_is_not_a_checkpoint_is_refused_and_stores_nothing() {
    let test = "an_archive_that_is_not_a_checkpoint_is_refused_and_stores_nothing";
    if !ready(test) {
        return;
    }
    let w = World::new();
    let bad = w.path("not-a-checkpoint.tar");
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&bad)
        .arg("-C")
        .arg(repo())
        .arg("README.md")
        .status()
        .unwrap();
    assert!(st.success());
    let err = w
        .stasis(&["import", bad.to_str().unwrap(), "--workload", "x"])
        .expect_err("import of a tar that is no checkpoint");
    assert!(
        err.contains("config.dump") && err.contains("missing"),
        "the error does not say what is missing: {err}"
    );
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list.as_array().map(Vec::len), Some(0), "{list}");
}
