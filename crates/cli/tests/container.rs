//! The CLI contract against real runc containers of the counter image (issue 2, "Must show"),
//! and the bad-input and fault cases, each its own test.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn checkpoint_sigkill_restore_continues_with_state_and_port() {
    if !ready("checkpoint_sigkill_restore_continues_with_state_and_port") {
        return;
    }
    let mut w = World::new();
    let port = free_port();
    let env = ["STATE_MB=64".to_owned(), format!("LISTEN_PORT={port}")];
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let c = w.start("ctr-a", &env);
    c.wait_count(5);

    let before = c.last_count();
    let reference = checkpoint(&w, "ctr-a", &[]).expect_ok("checkpoint");
    assert!(reference.starts_with("counter/"), "printed {reference:?}");
    // Leave-running: the workload went on, and is not left paused.
    assert_eq!(w.status("ctr-a").as_deref(), Some("running"));
    c.wait_count(3);
    w.kill("ctr-a");

    let (run, r) = w.restore("counter/latest", "ctr-b", &env, &[]);
    run.expect_ok("restore");
    r.wait_count(5);
    let counts = r.counts();
    assert!(
        counts[0] >= before,
        "restored count {} < count at checkpoint {before}",
        counts[0]
    );
    assert!(
        counts[0] <= c.last_count() + 1,
        "restored count {} is past the kill",
        counts[0]
    );
    assert!(
        counts.windows(2).all(|p| p[1] == p[0] + 1),
        "counts do not continue: {counts:?}"
    );
    assert!(!r.corrupt(), "restored state is corrupt: {:?}", r.lines());
    let answer = ask_line(port).expect("restored container does not answer on its port");
    assert!(
        answer.starts_with("count=") && answer.ends_with("state=ok"),
        "{answer}"
    );

    // Full state check on demand (SIGUSR1), then list and inspect.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(w.pid("ctr-b")),
        nix::sys::signal::SIGUSR1,
    )
    .unwrap();
    r.wait_count(3);
    assert!(!r.corrupt());
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list.as_array().unwrap().len(), 1);
    let m = w.stasis(&["inspect", &reference, "-o", "json"]).json();
    assert_eq!(m["processes"][0]["command"], "stasis-counter");
    assert!(m["requirements"]["image_digest"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
}

#[test]
fn filesystem_changes_are_restored() {
    if !ready("filesystem_changes_are_restored") {
        return;
    }
    let mut w = World::new();
    let c = w.start("fs-a", &["STATE_MB=8"]);
    let rootfs = c.bundle.join("rootfs");
    std::fs::create_dir_all(rootfs.join("data")).unwrap();
    std::fs::write(rootfs.join("data/new.txt"), "written by the workload").unwrap();
    std::fs::remove_file(rootfs.join("etc/passwd")).unwrap();
    checkpoint(&w, "fs-a", &["--stop"]).expect_ok("checkpoint --stop");
    w.kill("fs-a");

    let (run, r) = w.restore("counter/latest", "fs-b", &["STATE_MB=8"], &[]);
    run.expect_ok("restore");
    r.wait_count(2);
    let fresh = r.bundle.join("rootfs");
    assert_eq!(
        std::fs::read_to_string(fresh.join("data/new.txt")).unwrap(),
        "written by the workload"
    );
    assert!(
        !fresh.join("etc/passwd").exists(),
        "a deleted file came back"
    );
    assert!(fresh.join("stasis-counter").exists());
}

#[test]
fn checkpoint_of_a_missing_container_is_a_clear_error() {
    if !ready("checkpoint_of_a_missing_container_is_a_clear_error") {
        return;
    }
    let w = World::new();
    let err = checkpoint(&w, "no-such-container", &[]).expect_err("checkpoint");
    assert!(
        err.contains("container \"no-such-container\" does not exist"),
        "{err}"
    );
}

#[test]
fn wrong_key_is_refused_and_leaves_no_container() {
    if !ready("wrong_key_is_refused_and_leaves_no_container") {
        return;
    }
    let mut w = World::new();
    w.start("key-a", &["STATE_MB=8"]);
    checkpoint(&w, "key-a", &[]).expect_ok("checkpoint");
    let other = w.path("other-key");
    w.stasis(&["key", "generate", other.to_str().unwrap()])
        .expect_ok("key generate");
    let (run, _) = w.restore(
        "counter/latest",
        "key-b",
        &["STATE_MB=8"],
        &["--key", other.to_str().unwrap()],
    );
    let err = run.expect_err("restore with the wrong key");
    assert!(err.contains("key"), "{err}");
    assert_eq!(
        w.status("key-b"),
        None,
        "a refused restore left a container"
    );
}

#[test]
fn corrupt_or_missing_chunk_is_named_and_leaves_no_container() {
    if !ready("corrupt_or_missing_chunk_is_named_and_leaves_no_container") {
        return;
    }
    let mut w = World::new();
    w.start("chunk-a", &["STATE_MB=16"]);
    checkpoint(&w, "chunk-a", &[]).expect_ok("checkpoint");
    let chunks: Vec<_> = files_under(&w.path("store/chunks"));
    assert!(chunks.len() > 2);
    // Corrupt the largest chunk (a memory page chunk), then remove another.
    let mut by_size = chunks.clone();
    by_size.sort_by_key(|p| std::fs::metadata(p).unwrap().len());
    let victim = by_size.last().unwrap();
    let mut bytes = std::fs::read(victim).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(victim, bytes).unwrap();
    let name = victim.file_name().unwrap().to_str().unwrap().to_owned();

    let (run, _) = w.restore("counter/latest", "chunk-b", &["STATE_MB=16"], &[]);
    let err = run.expect_err("restore from a corrupt chunk");
    assert!(
        err.contains(&name[..16]),
        "error does not name chunk {name}: {err}"
    );
    assert_eq!(
        w.status("chunk-b"),
        None,
        "a refused restore left a container"
    );

    std::fs::remove_file(victim).unwrap();
    let (run, _) = w.restore("counter/latest", "chunk-c", &["STATE_MB=16"], &[]);
    let err = run.expect_err("restore with a missing chunk");
    assert!(
        err.contains(&name[..16]),
        "error does not name chunk {name}: {err}"
    );
    assert_eq!(w.status("chunk-c"), None);
}

#[test]
fn incompatible_declared_version_is_refused_naming_the_field() {
    if !ready("incompatible_declared_version_is_refused_naming_the_field") {
        return;
    }
    let mut w = World::new();
    w.start("ver-a", &["STATE_MB=8"]);
    checkpoint(&w, "ver-a", &["--declare", "engine=v1"]).expect_ok("checkpoint");
    let (run, _) = w.restore(
        "counter/latest",
        "ver-b",
        &["STATE_MB=8"],
        &["--declare", "engine=v2"],
    );
    let err = run.expect_err("restore with another engine version");
    assert!(
        err.contains("declared.engine") && err.contains("v1") && err.contains("v2"),
        "{err}"
    );
    assert_eq!(w.status("ver-b"), None);
}

#[test]
fn two_checkpoints_at_once_are_both_valid_or_one_is_refused() {
    if !ready("two_checkpoints_at_once_are_both_valid_or_one_is_refused") {
        return;
    }
    let mut w = World::new();
    w.start("two-a", &["STATE_MB=128"]);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| checkpoint(&w, "two-a", &[]));
        let b = s.spawn(|| checkpoint(&w, "two-a", &[]));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        a.ok() || b.ok(),
        "both failed: {} / {}",
        a.stderr(),
        b.stderr()
    );
    for r in [&a, &b] {
        if !r.ok() {
            assert!(
                r.stderr().contains("in progress"),
                "unexpected failure: {}",
                r.stderr()
            );
        }
    }
    assert_eq!(w.status("two-a").as_deref(), Some("running"), "left frozen");
    let list = w.stasis(&["list", "-o", "json"]).json();
    let n = list.as_array().unwrap().len();
    assert_eq!(n, usize::from(a.ok()) + usize::from(b.ok()));
    // Every listed checkpoint is complete: it restores.
    w.kill("two-a");
    let (run, r) = w.restore("counter/latest", "two-b", &["STATE_MB=128"], &[]);
    run.expect_ok("restore");
    r.wait_count(2);
    assert!(!r.corrupt());
}

#[test]
fn sigkill_of_the_cli_mid_checkpoint_publishes_nothing_and_thaws_the_workload() {
    if !ready("sigkill_of_the_cli_mid_checkpoint_publishes_nothing_and_thaws_the_workload") {
        return;
    }
    let mut w = World::new();
    let c = w.start("kill-a", &["STATE_MB=768"]);
    let child = std::process::Command::new(STASIS)
        .args(["checkpoint", "container", "kill-a", "--workload", "counter"])
        .env("STASIS_STORE", &w.store)
        .env("STASIS_KEY_FILE", &w.key)
        .env("STASIS_RUNC_ROOT", &w.runc_root)
        .env("STASIS_WORK_DIR", w.path("work"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it while the container is frozen (the dump of 768 MiB takes seconds).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while w.status("kill-a").as_deref() != Some("paused") {
        assert!(
            std::time::Instant::now() < deadline,
            "container never paused"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    let mut child = child;
    child.wait().unwrap();

    // The watchdog lets the in-flight dump end, then resumes the container.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while w.status("kill-a").as_deref() != Some("running") {
        assert!(
            std::time::Instant::now() < deadline,
            "container left {:?}",
            w.status("kill-a")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    c.wait_count(3);
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(
        list.as_array().unwrap().len(),
        0,
        "a partial checkpoint became visible: {list}"
    );
}

#[test]
fn full_disk_keeps_the_previous_checkpoint_and_the_workload_running() {
    if !ready("full_disk_keeps_the_previous_checkpoint_and_the_workload_running") {
        return;
    }
    let mut w = World::new();
    let store_dir = w.path("small-store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=40m", "tmpfs"])
        .arg(&store_dir)
        .status()
        .unwrap();
    assert!(mounted.success(), "cannot mount a small tmpfs");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(store_dir.clone());
    w.store = format!("file://{}", store_dir.display());

    let c = w.start("full-a", &["STATE_MB=24", "DIRTY_PCT=100"]);
    let first = checkpoint(&w, "full-a", &[]).expect_ok("first checkpoint");
    // Rewrite all state: the second checkpoint needs another 24 MiB, which does not fit.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(w.pid("full-a")),
        nix::sys::signal::SIGUSR2,
    )
    .unwrap();
    c.wait_count(3);
    let err = checkpoint(&w, "full-a", &[]).expect_err("checkpoint to a full disk");
    assert!(
        err.to_lowercase().contains("space"),
        "error does not say the disk is full: {err}"
    );
    assert_eq!(
        w.status("full-a").as_deref(),
        Some("running"),
        "workload not running after the failure"
    );
    c.wait_count(3);
    let m = w
        .stasis(&["inspect", "counter/latest", "-o", "json"])
        .json();
    assert_eq!(
        format!("counter/{}", m["id"].as_str().unwrap()),
        first,
        "latest is not the previous checkpoint"
    );
    // And it still restores.
    w.kill("full-a");
    let (run, r) = w.restore("counter/latest", "full-b", &["STATE_MB=24"], &[]);
    run.expect_ok("restore of the previous checkpoint");
    r.wait_count(2);
    assert!(!r.corrupt());
}

#[test]
fn established_tcp_connection_survives_a_stop_mode_checkpoint() {
    if !ready("established_tcp_connection_survives_a_stop_mode_checkpoint") {
        return;
    }
    use std::io::BufRead;
    let mut w = World::new();
    let port = free_port();
    let env = ["STATE_MB=8".to_owned(), format!("STREAM_PORT={port}")];
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    w.start("tcp-a", &env);
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut reader = std::io::BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let before = count_of(&line).unwrap();

    checkpoint(&w, "tcp-a", &["--stop"]).expect_ok("checkpoint --stop");
    w.runc_output(&["delete", "--force", "tcp-a"]);
    let (run, _r) = w.restore("counter/latest", "tcp-b", &env, &[]);
    run.expect_ok("restore");
    // The same connection carries lines from the restored process.
    let mut last = before;
    for _ in 0..5 {
        line.clear();
        reader
            .read_line(&mut line)
            .expect("connection broke across the restore");
        last = count_of(&line).unwrap_or(last);
    }
    assert!(last > before, "no new counts on the old connection");
}

#[test]
fn overlay_rootfs_changes_are_restored_with_whiteouts_modes_owners_and_xattrs() {
    if !ready("overlay_rootfs_changes_are_restored_with_whiteouts_modes_owners_and_xattrs") {
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut w = World::new();
    // The container runs on an overlay rootfs.
    let bundle = w.bundle("bundle-ov-a", &["STATE_MB=8"]);
    let ov_a = image_overlay(&bundle);
    let c = w.start_bundle("ov-a", &bundle);
    c.wait_count(2);
    let root = &ov_a.merged;
    // Changes, made through the merged view (what the container would see):
    change_rootfs(root);
    let new = root.join("data/new.txt");
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(&new, Some(1234), Some(2345)).unwrap();
    let st = std::process::Command::new("python3")
        .args([
            "-c",
            "import os,sys; os.setxattr(sys.argv[1], 'user.stasis', b'kept')",
        ])
        .arg(&new)
        .status()
        .unwrap();
    assert!(st.success(), "setxattr failed");

    checkpoint(&w, "ov-a", &["--stop"]).expect_ok("checkpoint --stop of an overlay container");
    w.kill("ov-a");
    let m = w
        .stasis(&["inspect", "counter/latest", "-o", "json"])
        .json();
    assert_eq!(m["rootfs"]["method"], "overlay_upper", "{}", m["rootfs"]);
    assert!(
        m["rootfs"]["deleted"].as_u64().unwrap() >= 1,
        "no whiteout captured: {}",
        m["rootfs"]
    );
    drop(ov_a);

    // Restore into a fresh overlay bundle made from the same image.
    let bundle_b = w.bundle("bundle-ov-b", &["STATE_MB=8"]);
    let ov_b = image_overlay(&bundle_b);
    let log = w.path("ov-b.log");
    let run = w.stasis(&[
        "restore",
        "counter/latest",
        "--bundle",
        bundle_b.to_str().unwrap(),
        "--container-id",
        "ov-b",
        "--log",
        log.to_str().unwrap(),
    ]);
    run.expect_ok("restore into an overlay bundle");
    let r = Container {
        id: "ov-b".into(),
        log,
        bundle: bundle_b.clone(),
    };
    r.wait_count(2);
    assert!(!r.corrupt());
    let root = &ov_b.merged;
    assert_rootfs_changes(root);
    let new = root.join("data/new.txt");
    let md = std::fs::metadata(&new).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o640, "mode not kept");
    assert_eq!((md.uid(), md.gid()), (1234, 2345), "owner not kept");
    assert_eq!(
        xattr(&new, "user.stasis").as_deref(),
        Some("kept"),
        "xattr not kept"
    );
    w.kill("ov-b");
    drop(ov_b);
}
