//! A checkpoint that cannot be taken or stored leaves the workload running and nothing behind:
//! signals mid-checkpoint, a read-only store, a stdout that is a host file, a dead pipe, a
//! damaged manifest. Real runc and CRIU (root). Each test names the bug of `cli-trial.md` it
//! reproduces.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::safety::*;
use common::*;

/// B11: SIGTERM while the container is frozen, SIGINT while the checkpoint is being stored:
/// stasis exits 128+signal, the workload runs, nothing is published, no plaintext images stay.
#[test]
fn a_signal_mid_checkpoint_leaves_the_workload_running_and_no_images() {
    if !ready("a_signal_mid_checkpoint_leaves_the_workload_running_and_no_images") {
        return;
    }
    let mut w = World::new();
    let c = w.start("b11-a", &["STATE_MB=256"]);
    for (sig, when_paused) in [
        (nix::sys::signal::SIGTERM, true),
        (nix::sys::signal::SIGINT, false),
    ] {
        let mut child = w
            .command(&["checkpoint", "container", "b11-a", "--workload", "counter"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.status("b11-a").as_deref() != Some("paused") {
            assert!(Instant::now() < deadline, "container never paused");
            std::thread::sleep(Duration::from_millis(5));
        }
        if !when_paused {
            // After the dump: the images are being stored.
            while w.status("b11-a").as_deref() == Some("paused") {
                assert!(Instant::now() < deadline, "container stayed paused");
                std::thread::sleep(Duration::from_millis(5));
            }
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig).unwrap();
        let status = child.wait().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let published = w.stasis(&["list", "-o", "json"]).json();
        if status.success() {
            // The signal came as the checkpoint finished: it is complete, and that is fine.
            eprintln!("{sig}: the checkpoint finished first");
        } else {
            assert_eq!(status.code(), Some(128 + sig as i32), "{sig}: {err}");
            assert!(err.contains("interrupted"), "{err}");
            assert_eq!(published.as_array().unwrap().len(), 0, "{published}");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while w.status("b11-a").as_deref() != Some("running") {
            assert!(Instant::now() < deadline, "left {:?}", w.status("b11-a"));
            std::thread::sleep(Duration::from_millis(50));
        }
        c.wait_count(2);
        assert!(
            scratch_left(&w).is_empty(),
            "{sig}: images left: {:?}",
            scratch_left(&w)
        );
        let leases = w.path("store/leases");
        let left: Vec<_> = files_under(&leases);
        assert!(left.is_empty(), "{sig}: leases left: {left:?}");
        w.stasis(&["gc", "--keep-last", "0", "--grace-secs", "0"])
            .expect_ok("gc");
    }
}

/// B17, B14: a store that cannot be written is found before the container is frozen; a
/// read-only store can still be restored from.
#[test]
fn a_read_only_store_fails_a_checkpoint_before_the_freeze_and_still_restores() {
    if !ready("a_read_only_store_fails_a_checkpoint_before_the_freeze_and_still_restores") {
        return;
    }
    let mut w = World::new();
    w.start("b17-a", &["STATE_MB=8"]);
    checkpoint(&w, "b17-a", &[]).expect_ok("checkpoint");
    let ro = w.path("ro-store");
    std::fs::create_dir_all(&ro).unwrap();
    let mount = |args: &[&str]| Command::new("mount").args(args).status().unwrap().success();
    assert!(mount(&[
        "--bind",
        w.path("store").to_str().unwrap(),
        ro.to_str().unwrap()
    ]));
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(ro.clone());
    assert!(mount(&["-o", "remount,ro,bind", ro.to_str().unwrap()]));
    let mut r = World::new();
    r.store = format!("file://{}", ro.display());
    r.key = w.key.clone();
    r.runc_root = w.runc_root.clone();

    let doctor = r.stasis(&["doctor", "-o", "json"]).json();
    let store_check = doctor["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "store")
        .cloned()
        .unwrap();
    assert!(
        store_check["detail"]
            .as_str()
            .unwrap()
            .contains("READ-ONLY"),
        "{store_check}"
    );
    let err = checkpoint(&r, "b17-a", &[]).expect_err("checkpoint into a read-only store");
    assert!(
        err.contains("nothing was frozen") && err.contains("Read-only"),
        "{err}"
    );
    assert_eq!(w.status("b17-a").as_deref(), Some("running"));

    let b = r.bundle("bundle-b17", &["STATE_MB=8"]);
    let log = r.path("b17-b.log");
    let run = restore_into(&r, &b, "b17-b", &["--log", log.to_str().unwrap()]);
    let _b = Own(&w, "b17-b");
    run.expect_ok("restore from a read-only store");
    let restored = Container {
        id: "b17-b".into(),
        log,
        bundle: b,
    };
    restored.wait_count(2);
    assert!(!restored.corrupt());
}

/// Item 4 (trial case 1b): a container whose stdout is a host file is refused before it is
/// frozen, naming the fd, the file and the fix; it keeps running and nothing is stored.
#[test]
fn a_container_whose_stdout_is_a_host_file_is_refused_up_front() {
    if !ready("a_container_whose_stdout_is_a_host_file_is_refused_up_front") {
        return;
    }
    let w = World::new();
    let b = w.bundle("bundle-1b", &["STATE_MB=8"]);
    let out = w.path("run.log");
    run_detached(
        &w,
        "c1b",
        &b,
        Stdio::from(std::fs::File::create(&out).unwrap()),
    );
    let _c = Own(&w, "c1b");
    wait_running(&w, "c1b");
    let err =
        checkpoint(&w, "c1b", &[]).expect_err("checkpoint of a container writing to a host file");
    assert!(
        err.contains("fd 1") && err.contains(out.to_str().unwrap()) && err.contains("pipe"),
        "{err}"
    );
    assert!(!err.contains("Can't lookup mount"), "{err}");
    assert_eq!(w.status("c1b").as_deref(), Some("running"));
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list.as_array().unwrap().len(), 0);
    assert!(scratch_left(&w).is_empty());
}

/// B10: a process whose stdout was a pipe (its reader gone) is not restored onto that pipe
/// without --log (it would die at its first write): refused, naming --log; with --log it runs.
#[test]
fn process_restore_onto_a_dead_pipe_is_refused_and_works_with_log() {
    if !ready("process_restore_onto_a_dead_pipe_is_refused_and_works_with_log") {
        return;
    }
    let w = World::new();
    let counter = repo().join("target/images/counter/rootfs/stasis-counter");
    let mut child = Command::new("setsid")
        .arg(&counter)
        .env("STATE_MB", "8")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let mut pipe = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    std::io::Read::read_exact(&mut pipe, &mut first).unwrap();
    w.stasis(&[
        "checkpoint",
        "process",
        &pid.to_string(),
        "--workload",
        "b10",
        "--stop",
    ])
    .expect_ok("checkpoint --stop");
    drop(pipe);
    let _ = child.wait();

    let run = w.stasis(&["restore", "b10/latest", "--process"]);
    let err = run.expect_err("restore onto a dead pipe");
    assert!(err.contains("pipe") && err.contains("--log"), "{err}");
    assert!(!Path::new(&format!("/proc/{pid}")).exists() || !is_live(pid));

    let log = w.path("b10.log");
    let run = w.stasis(&[
        "restore",
        "b10/latest",
        "--process",
        "--log",
        log.to_str().unwrap(),
    ]);
    run.expect_ok("restore with --log");
    let c = Container {
        id: "b10".into(),
        log,
        bundle: w.path("."),
    };
    c.wait_count(2);
    assert!(is_live(pid));
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
}

/// B3: a truncated manifest (half of the file) is marked by `list` with the reason, and `gc`
/// sweeps none of its chunks, saying which manifest blocked the sweep; repaired, it restores.
#[test]
fn a_damaged_manifest_is_listed_as_unreadable_and_blocks_the_gc_sweep() {
    if !ready("a_damaged_manifest_is_listed_as_unreadable_and_blocks_the_gc_sweep") {
        return;
    }
    let mut w = World::new();
    w.start("b3-a", &["STATE_MB=16"]);
    let reference = checkpoint(&w, "b3-a", &[]).expect_ok("checkpoint");
    let id = reference.split('/').nth(1).unwrap().to_owned();
    let manifest = w.path(&format!("store/manifests/counter/{id}.json"));
    let whole = std::fs::read(&manifest).unwrap();
    std::fs::write(&manifest, &whole[..whole.len() / 2]).unwrap();
    let chunks = files_under(&w.path("store/chunks")).len();
    assert!(chunks > 0);

    let list = w.stasis(&["list"]).expect_ok("list");
    assert!(
        list.contains("UNREADABLE") && list.contains(&format!("warning: {reference}")),
        "{list}"
    );
    let report = w
        .stasis(&["gc", "--keep-last", "1", "--grace-secs", "0", "-o", "json"])
        .json();
    assert_eq!(report["chunks_deleted"], 0, "{report}");
    assert!(
        report["sweep_skipped"]
            .as_str()
            .is_some_and(|s| s.contains(&reference)),
        "{report}"
    );
    assert_eq!(
        files_under(&w.path("store/chunks")).len(),
        chunks,
        "chunks were swept"
    );

    std::fs::write(&manifest, &whole).unwrap();
    w.kill("b3-a");
    let (run, r) = w.restore("counter/latest", "b3-b", &["STATE_MB=16"], &[]);
    run.expect_ok("restore of the repaired checkpoint");
    r.wait_count(2);
    assert!(!r.corrupt());
}
