//! Issue 10, items 1, 3 and 4: stasis destroys only what it made, and a failure leaves nothing
//! behind and explains itself. Real runc and CRIU (root); the tests that need neither say so.
//! Each test names the bug of `cli-trial.md` it reproduces.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn checkpoint(w: &World, id: &str, extra: &[&str]) -> Run {
    let mut args = vec!["checkpoint", "container", id, "--workload", "counter"];
    args.extend_from_slice(extra);
    w.stasis(&args)
}

fn restore_into(w: &World, bundle: &Path, id: &str, extra: &[&str]) -> Run {
    let mut args = vec![
        "restore",
        "counter/latest",
        "--bundle",
        bundle.to_str().unwrap(),
        "--container-id",
        id,
    ];
    args.extend_from_slice(extra);
    w.stasis(&args)
}

/// Edits a bundle's config.json.
fn edit_config(bundle: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = bundle.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Mount points at or under `dir` (host mount namespace).
fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
        .filter(|m| Path::new(m).starts_with(dir))
        .collect()
}

/// Entries of the work directory that are stasis scratch directories (`checkpoint-*`,
/// `restore-*`): left behind, they hold plaintext images.
fn scratch_left(w: &World) -> Vec<String> {
    std::fs::read_dir(w.path("work"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("checkpoint-") || n.starts_with("restore-"))
                .collect()
        })
        .unwrap_or_default()
}

/// A container started by the test itself (not through `World`), deleted at the end.
struct Own<'a>(&'a World, &'a str);
impl Drop for Own<'_> {
    fn drop(&mut self) {
        self.0.runc_output(&["delete", "--force", self.1]);
    }
}

fn run_detached(w: &World, id: &str, bundle: &Path, stdout: Stdio) {
    let st = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["run", "--detach", "--bundle"])
        .arg(bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "runc run {id} failed");
}

fn wait_running(w: &World, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.status(id).as_deref() != Some("running") {
        assert!(Instant::now() < deadline, "{id} is {:?}", w.status(id));
        std::thread::sleep(Duration::from_millis(20));
    }
}

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
        let left: Vec<_> = walk(&leases);
        assert!(left.is_empty(), "{sig}: leases left: {left:?}");
        w.stasis(&["gc", "--keep-last", "0", "--grace-secs", "0"])
            .expect_ok("gc");
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            } else {
                out.push(e.path());
            }
        }
    }
    out
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

fn is_live(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let st = s.rsplit(')').next().unwrap_or("").trim_start();
            !st.starts_with('Z') && !st.starts_with('X')
        })
        .unwrap_or(false)
}

/// B16: pid 1 and the caller's own ancestors are refused before CRIU is called (a stub CRIU
/// records any call). No root or real tools needed.
#[test]
fn checkpoint_process_refuses_pid_1_and_its_own_ancestors() {
    let w = World::new();
    let called = w.path("criu-called");
    let stub = w.path("criu-stub");
    std::fs::write(
        &stub,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho 'Version: 4.2'\n",
            called.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    // This test process is the parent of the stasis it runs: an ancestor.
    let me = std::process::id().to_string();
    for (pid, expect) in [("1", "pid 1"), (me.as_str(), "ancestor")] {
        let out = Command::new(STASIS)
            .args(["checkpoint", "process", pid, "--workload", "x"])
            .env("STASIS_STORE", &w.store)
            .env("STASIS_KEY_FILE", &w.key)
            .env("STASIS_WORK_DIR", w.path("work"))
            .env("STASIS_CRIU", &stub)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "checkpoint process {pid} was accepted"
        );
        assert!(
            err.contains("cannot be checkpointed") && err.contains(expect),
            "{err}"
        );
        assert!(!called.exists(), "CRIU was called for pid {pid}");
    }
}

/// B8, B13, B15: `file://` with an empty path is refused; read-only commands create no store
/// directory and no key; `-o json` gives JSON for argument errors. No root needed.
#[test]
fn readers_create_nothing_and_json_mode_covers_argument_errors() {
    let w = World::new();
    let home = w.path("home");
    let run = |args: &[&str]| {
        let out = Command::new(STASIS)
            .args(args)
            .env_remove("STASIS_KEY_FILE")
            .env_remove("STASIS_STORE")
            .env_remove("STASIS_OUTPUT")
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join("config"))
            .output()
            .unwrap();
        Run(out)
    };
    let err = run(&["list", "--store", "file://"]).expect_err("list --store file://");
    assert!(err.contains("needs a path"), "{err}");

    let missing = w.path("typo/store");
    let url = format!("file://{}", missing.display());
    for args in [
        vec!["list", "--store", &url],
        vec!["inspect", "a/latest", "--store", &url],
        vec!["gc", "--keep-last", "1", "--store", &url],
    ] {
        let err = run(&args).expect_err(&args.join(" "));
        assert!(err.contains("no store at"), "{err}");
        assert!(!missing.exists(), "{} created the store", args[0]);
    }
    let store = w.path("store");
    let s = format!("file://{}", store.display());
    for args in [
        vec!["inspect", "a/latest", "--store", &s],
        vec!["gc", "--keep-last", "1", "--store", &s],
        vec!["restore", "a/latest", "--process", "--store", &s],
    ] {
        let err = run(&args).expect_err(&args.join(" "));
        assert!(err.contains("no key"), "{err}");
        assert!(
            !home.exists(),
            "{} created a key under {}",
            args[0],
            home.display()
        );
    }
    let err = run(&[
        "list",
        "--store",
        &s,
        "--key",
        w.path("nokey").to_str().unwrap(),
    ])
    .expect_err("list with a missing --key");
    assert!(err.contains("does not exist"), "{err}");

    for args in [
        vec!["-o", "json", "gc", "--store", &s, "--keep-last", "-1"],
        vec!["gc", "--store", &s, "-o", "json"],
        vec![
            "-o",
            "json",
            "checkpoint",
            "process",
            "1",
            "--store",
            &s,
            "--declare",
            "noequals",
        ],
        vec![
            "-o", "json", "restore", "a/latest", "--store", &s, "--bundle", "",
        ],
    ] {
        let r = run(&args);
        assert_eq!(r.0.status.code(), Some(2), "{}", args.join(" "));
        let v = r.json();
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let out = Command::new(STASIS)
        .args(["gc", "--store", &s])
        .env("STASIS_OUTPUT", "json")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("keep-last"), "{v}");
}

/// B9: an S3 endpoint that accepts connections and never answers fails within the configured
/// time (`--store-timeout`), and missing credentials are named. No root needed.
#[test]
fn a_silent_s3_endpoint_fails_in_bounded_time_and_missing_credentials_are_named() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let endpoint = format!("http://127.0.0.1:{port}");
    let w = World::new();
    let s3 = |creds: bool, args: &[&str]| {
        let mut c = Command::new(STASIS);
        c.args(args)
            .args(["--store", "s3://bucket/prefix", "--store-timeout", "2"])
            .env("STASIS_KEY_FILE", &w.key)
            .env("AWS_ENDPOINT_URL", &endpoint)
            .env("AWS_REGION", "us-east-1")
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env_remove("AWS_PROFILE");
        if creds {
            c.env("AWS_ACCESS_KEY_ID", "x")
                .env("AWS_SECRET_ACCESS_KEY", "y");
        }
        let t = Instant::now();
        let out = c.output().unwrap();
        (Run(out), t.elapsed())
    };
    for args in [&["list"][..], &["doctor"][..]] {
        let (r, took) = s3(true, args);
        assert!(!r.ok() || args[0] == "doctor" && r.0.status.code() == Some(2));
        assert!(took < Duration::from_secs(20), "{args:?} took {took:?}");
        let text = format!("{}{}", r.stderr(), r.stdout());
        assert!(
            text.contains("timed out") || text.contains("timeout"),
            "{text}"
        );
    }
    let (r, took) = s3(false, &["list"]);
    let err = r.expect_err("list without credentials");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(err.contains("no AWS credentials"), "{err}");
}

/// B6: the stale-scratch cleanup that every checkpoint and restore runs removes only a dead
/// run's marked scratch directory: a user's directory named `<word>-<dead pid>-…` and an
/// unmarked look-alike stay. No root or real tools needed (the checkpoint fails later).
#[test]
fn the_work_dir_cleanup_touches_only_stasis_s_own_directories() {
    let w = World::new();
    let work = w.path("work");
    let photos = work.join("photos-2019-summer");
    let backup = work.join("backup-999997-old");
    let lookalike = work.join("restore-999996-0a1b2c3d");
    let dead = work.join("checkpoint-999998-deadbeef");
    for d in [&photos, &backup, &lookalike, &dead.join("criu")] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(photos.join("beach.jpg"), "pic").unwrap();
    std::fs::write(backup.join("db.sqlite"), "db").unwrap();
    std::fs::write(dead.join(".stasis-scratch"), "").unwrap();
    std::fs::write(dead.join("criu/pages-1.img"), "plaintext").unwrap();
    let run = w.stasis(&["checkpoint", "container", "no-such-container"]);
    run.expect_err("checkpoint of a missing container");
    assert!(
        photos.join("beach.jpg").exists(),
        "photos-2019-summer was deleted"
    );
    assert!(
        backup.join("db.sqlite").exists(),
        "backup-999997-old was deleted"
    );
    assert!(lookalike.exists(), "an unmarked directory was deleted");
    assert!(!dead.exists(), "a dead run's scratch directory was kept");
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
    let chunks = walk(&w.path("store/chunks")).len();
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
        walk(&w.path("store/chunks")).len(),
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
