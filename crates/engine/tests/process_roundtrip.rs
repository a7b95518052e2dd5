//! Integration test with real CRIU: checkpoint a process tree through CRIU's RPC, kill it,
//! restore it, and check that it continues. Needs root and CRIU >= 4.2 (scripts/setup); without
//! them the test says why and passes vacuously only outside CI (in CI it fails).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use stasis_engine::checkpoint::{checkpoint_process, ProcessCheckpoint};
use stasis_engine::image::ImageDir;
use stasis_engine::restore::restore_process;
use stasis_testkit::Requirements;

fn read_count(p: &Path) -> u64 {
    std::fs::read_to_string(p)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Reaps the tree's other processes (re-parented to us, the subreaper) so their pids are free.
fn reap_orphans() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < deadline {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(20)),
            Ok(_) => {}
            Err(_) => return, // ECHILD: nothing left
        }
    }
}

#[test]
fn process_tree_checkpoint_kill_restore_continues() {
    if !Requirements::new("process_tree_checkpoint_kill_restore_continues")
        .root()
        .criu()
        .met()
    {
        return;
    }
    // The restored tree becomes our child: reap it ourselves, and be a subreaper for its
    // children (PID 1 here does not reap).
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let t = tempfile::tempdir().unwrap();
    let counter = t.path().join("count");
    let script = format!(
        "i=0; while true; do i=$((i+1)); echo $i > {c}.tmp; mv {c}.tmp {c}; sleep 0.05; done",
        c = counter.display()
    );
    // setsid: a session of its own, so the tree is self-contained for CRIU.
    let mut child = Command::new("setsid")
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(700));

    let image = ImageDir::new(t.path().join("image"));
    let cap = checkpoint_process(&ProcessCheckpoint {
        pid,
        image: &image,
        leave_running: false,
        tcp_established: true,
    })
    .unwrap();
    let at_checkpoint = read_count(&counter);
    assert!(
        at_checkpoint > 3,
        "counter did not run before the checkpoint"
    );
    assert_eq!(cap.processes[0].pid, pid);
    // Stop mode: CRIU killed the tree after the dump.
    child.wait().unwrap();
    reap_orphans();

    let restored = restore_process(&image, None, None).unwrap();
    assert_eq!(
        restored, pid,
        "a process tree restores with its original pid"
    );
    std::thread::sleep(Duration::from_millis(700));
    let after = read_count(&counter);
    assert!(
        after > at_checkpoint,
        "restored counter did not continue: {after} <= {at_checkpoint}"
    );
    // It continued from the checkpoint, not from zero.
    assert!(after < at_checkpoint + 100);

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(restored),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(restored), None);
}

#[test]
fn checkpoint_of_a_missing_process_is_a_clear_error() {
    let t = tempfile::tempdir().unwrap();
    let image = ImageDir::new(t.path());
    let e = checkpoint_process(&ProcessCheckpoint {
        pid: i32::MAX - 1,
        image: &image,
        leave_running: true,
        tcp_established: true,
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("process {} does not exist", i32::MAX - 1)
    );
}
