//! A restore destroys only what it made: it refuses a rootfs that is shared, read-only, in use or
//! another container's, never removes a container it did not create, and a refused or failed
//! restore leaves nothing behind and explains itself. Real runc and CRIU (root). Each test names
//! the bug of `cli-trial.md` it reproduces.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::safety::*;
use common::*;

/// B1, B6: a restore refuses a rootfs that is shared (outside the bundle), read-only or in use
/// by a running container, names why, and deletes nothing there; a refused restore leaves a
/// user's directories in the work directory alone.
#[test]
fn restore_refuses_a_shared_read_only_or_in_use_rootfs_and_deletes_nothing() {
    if !ready("restore_refuses_a_shared_read_only_or_in_use_rootfs_and_deletes_nothing") {
        return;
    }
    let mut w = World::new();
    // A user's directory in the work dir whose name looks like `<word>-<dead pid>-...` (B6).
    let photos = w.path("work/photos-2019-summer");
    std::fs::create_dir_all(&photos).unwrap();
    std::fs::write(photos.join("beach.jpg"), "pic").unwrap();

    let c = w.start("b1-a", &["STATE_MB=8"]);
    checkpoint(&w, "b1-a", &[]).expect_ok("checkpoint");

    // (a) root.path: a shared directory outside the bundle, holding files of its own.
    let shared = w.path("shared-root");
    let img = repo().join("target/images/counter/rootfs");
    assert!(Command::new("cp")
        .arg("-a")
        .arg(&img)
        .arg(&shared)
        .status()
        .unwrap()
        .success());
    std::fs::create_dir_all(shared.join("data")).unwrap();
    std::fs::write(shared.join("precious.txt"), "precious").unwrap();
    std::fs::write(shared.join("data/db.sqlite"), "db").unwrap();
    let b_shared = w.bundle("bundle-shared", &["STATE_MB=8"]);
    edit_config(
        &b_shared,
        |v| v["root"] = serde_json::json!({"path": shared.to_str().unwrap(), "readonly": false}),
    );
    let err =
        restore_into(&w, &b_shared, "b1-shared", &[]).expect_err("restore into a shared rootfs");
    assert!(err.contains("not inside the bundle"), "{err}");
    assert!(
        shared.join("precious.txt").exists(),
        "precious.txt was deleted"
    );
    assert!(
        shared.join("data/db.sqlite").exists(),
        "data/db.sqlite was deleted"
    );
    assert_eq!(w.status("b1-shared"), None);

    // (b) root.readonly.
    let b_ro = w.bundle("bundle-ro", &["STATE_MB=8"]);
    std::fs::write(b_ro.join("rootfs/precious.txt"), "precious").unwrap();
    edit_config(&b_ro, |v| v["root"]["readonly"] = true.into());
    let err = restore_into(&w, &b_ro, "b1-ro", &[]).expect_err("restore into a read-only rootfs");
    assert!(err.contains("readonly"), "{err}");
    assert!(b_ro.join("rootfs/precious.txt").exists());

    // (c) the rootfs of the running container: nothing under it is replaced.
    let marker = c.bundle.join("rootfs/precious.txt");
    std::fs::write(&marker, "precious").unwrap();
    let err =
        restore_into(&w, &c.bundle, "b1-inuse", &[]).expect_err("restore into a rootfs in use");
    assert!(err.contains("in use") && err.contains("process"), "{err}");
    assert!(
        marker.exists(),
        "a file under a running container was deleted"
    );
    assert_eq!(w.status("b1-a").as_deref(), Some("running"));
    c.wait_count(2);

    assert!(
        photos.join("beach.jpg").exists(),
        "a user's directory in the work dir was deleted"
    );
    assert!(scratch_left(&w).is_empty(), "{:?}", scratch_left(&w));
}

/// B2: a restore whose id is taken between its check and `runc restore` (here a user's `runc
/// run` of that id, injected by a runc wrapper) fails with "in use" and leaves the user's
/// container running; two restores into one new id at once: one wins, the other is refused.
#[test]
fn a_failed_restore_never_removes_a_container_it_did_not_create() {
    if !ready("a_failed_restore_never_removes_a_container_it_did_not_create") {
        return;
    }
    let mut w = World::new();
    w.start("b2-a", &["STATE_MB=8"]);
    checkpoint(&w, "b2-a", &[]).expect_ok("checkpoint");

    let users = w.bundle("bundle-users", &["STATE_MB=8"]);
    let wrapper = w.path("runc-race.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do if [ \"$a\" = restore ]; then runc --root {} run -d --bundle {} b2-user </dev/null >/dev/null 2>&1; fi; done\nexec runc \"$@\"\n",
            w.runc_root.display(),
            users.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _user = Own(&w, "b2-user");
    let mine = w.bundle("bundle-b2", &["STATE_MB=8"]);
    let mut wr = World::new();
    wr.store = w.store.clone();
    wr.key = w.key.clone();
    wr.runc_root = w.runc_root.clone();
    wr.env
        .push(("STASIS_RUNC".into(), wrapper.display().to_string()));
    let err = restore_into(&wr, &mine, "b2-user", &[]).expect_err("restore into a taken id");
    assert!(err.contains("already in use"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        w.status("b2-user").as_deref(),
        Some("running"),
        "the user's container was removed by a failed restore"
    );

    // Two restores into one new id at once.
    let (b1, b2) = (
        w.bundle("bundle-c1", &["STATE_MB=8"]),
        w.bundle("bundle-c2", &["STATE_MB=8"]),
    );
    let _both = Own(&w, "b2-new");
    let (r1, r2) = std::thread::scope(|s| {
        let a = s.spawn(|| restore_into(&w, &b1, "b2-new", &[]));
        let b = s.spawn(|| restore_into(&w, &b2, "b2-new", &[]));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        r1.ok() != r2.ok(),
        "expected exactly one restore to win: {} / {}",
        r1.stderr(),
        r2.stderr()
    );
    let loser = if r1.ok() { &r2 } else { &r1 };
    assert!(
        loser.stderr().contains("in progress") || loser.stderr().contains("already in use"),
        "{}",
        loser.stderr()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        w.status("b2-new").as_deref(),
        Some("running"),
        "the winner was removed"
    );
}

/// B7, B12: a restore into a memory limit smaller than the checkpoint is refused up front,
/// naming the memory; a restore that fails inside CRIU (the rootfs lacks the binary) cites a
/// CRIU log that still exists; neither leaves a container, a mount or plaintext images.
#[test]
fn a_refused_or_failed_restore_leaves_nothing_and_cites_a_log_that_exists() {
    if !ready("a_refused_or_failed_restore_leaves_nothing_and_cites_a_log_that_exists") {
        return;
    }
    let mut w = World::new();
    // The image's files are older than the container by more than the capture's ctime slack,
    // so the checkpoint does not carry the binary (the last case removes it from the target
    // and expects CRIU to miss it).
    let bundle = w.bundle("bundle-b7-a", &["STATE_MB=32"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    w.start_bundle("b7-a", &bundle);
    checkpoint(&w, "b7-a", &[]).expect_ok("checkpoint");

    let small = bundle::make_bundle_with(
        &["--memory", "8"],
        &w.path("bundle-small"),
        &["STATE_MB=32"],
    );
    let err = restore_into(&w, &small, "b7-small", &[]).expect_err("restore into 8 MiB");
    assert!(
        err.contains("memory limit") && err.contains("8.0 MiB"),
        "{err}"
    );
    assert_eq!(w.status("b7-small"), None);

    // A limit the checkpoint's pages just fit in: CRIU (or the restored process) is killed for
    // memory half-way, leaving its cgroup yard mounted under the work dir if nothing unmounts it.
    let pages = {
        let m = w
            .stasis(&["inspect", "counter/latest", "-o", "json"])
            .json();
        m["files"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["path"].as_str().unwrap().starts_with("criu/pages-"))
            .map(|f| f["size"].as_u64().unwrap())
            .sum::<u64>()
    };
    let tight = w.bundle("bundle-tight", &["STATE_MB=32"]);
    edit_config(&tight, |v| {
        v["linux"]["resources"]["memory"] = serde_json::json!({ "limit": pages })
    });
    let err = restore_into(&w, &tight, "b7-tight", &[]).expect_err("restore into a tight limit");
    assert!(
        err.contains("memory limit") && err.contains("SIGKILL"),
        "{err}"
    );
    assert!(
        !err.contains("log file: ") && !err.contains("/work/restore-"),
        "the error names a path in the removed scratch dir: {err}"
    );
    assert_eq!(w.status("b7-tight"), None);
    assert!(
        mounts_under(&w.path("work")).is_empty(),
        "{:?}",
        mounts_under(&w.path("work"))
    );
    assert!(scratch_left(&w).is_empty(), "{:?}", scratch_left(&w));

    // CRIU fails: the binary is not in the target rootfs.
    let broken = w.bundle("bundle-broken", &["STATE_MB=32"]);
    std::fs::remove_file(broken.join("rootfs/stasis-counter")).unwrap();
    let err = restore_into(&w, &broken, "b7-broken", &[]).expect_err("restore without the binary");
    assert!(
        err.contains("missing from the bundle's rootfs") && err.contains("stasis-counter"),
        "{err}"
    );
    let log = err
        .split("(CRIU log: ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no CRIU log cited: {err}"));
    assert!(
        Path::new(log).exists(),
        "the cited log {log} does not exist: {err}"
    );
    assert!(
        log.contains("/work/failed/"),
        "the cited log is not a kept copy: {log}"
    );
    assert_eq!(w.status("b7-broken"), None);

    assert!(
        mounts_under(&w.path("work")).is_empty(),
        "{:?}",
        mounts_under(&w.path("work"))
    );
    assert!(scratch_left(&w).is_empty(), "{:?}", scratch_left(&w));
}

/// B12: when runc fails before CRIU runs, its own message is in the error.
#[test]
fn runc_s_own_message_is_quoted() {
    if !ready("runc_s_own_message_is_quoted") {
        return;
    }
    let mut w = World::new();
    w.start("b12-a", &["STATE_MB=8"]);
    checkpoint(&w, "b12-a", &[]).expect_ok("checkpoint");
    let b = w.bundle("bundle-b12", &["STATE_MB=8"]);
    edit_config(&b, |v| {
        v["linux"]["namespaces"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"type": "network", "path": "/proc/999999999/ns/net"}));
    });
    let err = restore_into(&w, &b, "b12-b", &[]).expect_err("restore with a bad netns path");
    assert!(err.contains("runc"), "{err}");
    assert!(
        err.contains("999999999"),
        "runc's message is missing: {err}"
    );
    assert_eq!(w.status("b12-b"), None);
}

/// B1 ("not fresh"): a bundle stasis already restored into holds that container's files; a
/// restore of another container's checkpoint into it is refused and deletes nothing there, while
/// a checkpoint of the container restored there goes back into it (migration in place).
#[test]
fn a_bundle_already_restored_into_takes_only_its_own_container_back() {
    if !ready("a_bundle_already_restored_into_takes_only_its_own_container_back") {
        return;
    }
    let mut w = World::new();
    w.start("nf-a", &["STATE_MB=8"]);
    let from_a = checkpoint(&w, "nf-a", &[]).expect_ok("checkpoint of nf-a");
    let b = w.bundle("bundle-nf", &["STATE_MB=8"]);
    let _x = Own(&w, "nf-x");
    restore_into(&w, &b, "nf-x", &[]).expect_ok("restore into a fresh bundle");
    // The restored container writes a file of its own.
    let own = b.join("rootfs/tmp/written-by-nf-x");
    std::fs::write(&own, "mine").unwrap();
    let from_x = checkpoint(&w, "nf-x", &["--stop"]).expect_ok("checkpoint --stop of nf-x");
    w.runc_output(&["delete", "--force", "nf-x"]);

    let mut args = vec!["restore", from_a.as_str(), "--bundle", b.to_str().unwrap()];
    args.extend(["--container-id", "nf-y"]);
    let err = w
        .stasis(&args)
        .expect_err("restore of another container's checkpoint");
    assert!(
        err.contains("already restored into") && err.contains("nf-x"),
        "{err}"
    );
    assert!(
        own.exists(),
        "a file of the container restored there was deleted"
    );
    assert_eq!(w.status("nf-y"), None);

    let mut args = vec!["restore", from_x.as_str(), "--bundle", b.to_str().unwrap()];
    args.extend(["--container-id", "nf-x"]);
    w.stasis(&args)
        .expect_ok("restore of nf-x back into its bundle");
    assert!(own.exists());
    wait_running(&w, "nf-x");
}

/// Item 4, for stasis's own restores: a restored container's stdout and stderr are a pipe to a
/// forwarder that appends to its log, not the log file itself, so it can be checkpointed and
/// restored again (before, its fd 1 was a host file: `Can't lookup mount`).
#[test]
fn a_restored_container_checkpoints_again_and_its_log_still_fills() {
    if !ready("a_restored_container_checkpoints_again_and_its_log_still_fills") {
        return;
    }
    let mut w = World::new();
    w.start("ch-a", &["STATE_MB=8"]);
    checkpoint(&w, "ch-a", &[]).expect_ok("first checkpoint");
    w.kill("ch-a");
    let (run, b) = w.restore("counter/latest", "ch-b", &["STATE_MB=8"], &[]);
    run.expect_ok("first restore");
    b.wait_count(3);
    let at = b.last_count();
    checkpoint(&w, "ch-b", &[]).expect_ok("checkpoint of a restored container");
    w.kill("ch-b");
    let (run, c) = w.restore("counter/latest", "ch-c", &["STATE_MB=8"], &[]);
    run.expect_ok("second restore");
    c.wait_count(3);
    assert!(c.counts()[0] >= at, "{:?} (was {at})", c.counts());
    assert!(!c.corrupt());
}
