//! `stasis checkpoint process` / `stasis restore --process` with the counter as a plain process
//! tree (CRIU's RPC), and the CLI's answers when CRIU is missing or too old.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

#[test]
fn process_checkpoint_kill_restore_continues() {
    if !ready("process_checkpoint_kill_restore_continues") {
        return;
    }
    let w = World::new();
    let port = free_port();
    let counter = repo().join("target/images/counter/rootfs/stasis-counter");
    // setsid: the counter leads its own session, so the dumped tree is self-contained. Its
    // stdout is a pipe read here (the reader is not part of the tree).
    let mut child = Command::new("setsid")
        .arg(&counter)
        .env("STATE_MB", "32")
        .env("LISTEN_PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = child.stdout.take().unwrap();
    let log = w.path("before.log");
    let logf = log.clone();
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            let _ = std::fs::write(&logf, &all);
        }
    });
    let before = Container {
        id: "proc".into(),
        log: log.clone(),
        bundle: w.path("."),
    };
    before.wait_count(5);

    let at = before.last_count();
    let reference = w
        .stasis(&[
            "checkpoint",
            "process",
            &pid.to_string(),
            "--workload",
            "proc",
        ])
        .expect_ok("checkpoint process");
    assert!(reference.starts_with("proc/"));
    before.wait_count(2); // leave-running: it went on
    child.kill().unwrap();
    child.wait().unwrap();

    let after_log = w.path("after.log");
    let run = w.stasis(&[
        "restore",
        "proc/latest",
        "--process",
        "--log",
        after_log.to_str().unwrap(),
        "-o",
        "json",
    ]);
    let report = run.json();
    assert!(run.ok(), "restore failed: {}", run.stderr());
    assert_eq!(
        report["pid"].as_u64(),
        Some(u64::from(pid)),
        "restored with another pid"
    );
    let after = Container {
        id: "proc".into(),
        log: after_log,
        bundle: w.path("."),
    };
    after.wait_count(3);
    let counts = after.counts();
    assert!(
        counts[0] >= at && counts[0] <= before.last_count() + 1,
        "restored at {} (checkpoint ≈{at})",
        counts[0]
    );
    assert!(!after.corrupt());
    let answer = ask_line(port).expect("restored process does not answer on its port");
    assert!(answer.ends_with("state=ok"), "{answer}");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    );
}

fn with_fake_criu(w: &World, version: Option<&str>) -> Command {
    let mut c = Command::new(STASIS);
    c.env("STASIS_STORE", &w.store)
        .env("STASIS_KEY_FILE", &w.key)
        .env("STASIS_WORK_DIR", w.path("work"));
    match version {
        None => {
            c.env("STASIS_CRIU", w.path("no-such-criu"));
        }
        Some(v) => {
            let fake = w.path("old-criu");
            std::fs::write(&fake, format!("#!/bin/sh\necho 'Version: {v}'\n")).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
            c.env("STASIS_CRIU", fake);
        }
    }
    c
}

#[test]
fn missing_or_old_criu_is_named_with_the_fix() {
    // No privileges or real tools needed: the fake CRIU is a script.
    let w = World::new();
    // A process of its own (this test process is the CLI's parent, which it refuses to dump).
    let mut target = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = target.id().to_string();
    for (version, expect) in [(None, "not found"), (Some("4.1.1"), "4.1.1 is too old")] {
        let out = with_fake_criu(&w, version)
            .args(["checkpoint", "process", &pid, "--workload", "x"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains(expect) && err.contains("scripts/setup"),
            "{err}"
        );

        let out = with_fake_criu(&w, version)
            .args(["doctor", "-o", "json"])
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "doctor must fail when CRIU is unusable"
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["ready"], false);
        let criu = report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "criu")
            .unwrap();
        assert_eq!(criu["ok"], false);
        assert!(criu["fix"].as_str().unwrap().contains("scripts/setup"));
    }
    let _ = target.kill();
    let _ = target.wait();
}

#[test]
fn doctor_reports_this_machine() {
    let w = World::new();
    let out = w.stasis(&["doctor", "-o", "json"]);
    let report = out.json();
    let checks = report["checks"].as_array().unwrap();
    let gpu = checks.iter().find(|c| c["name"] == "gpu").unwrap();
    assert!(
        gpu["detail"].as_str().unwrap().contains("no NVIDIA driver"),
        "{gpu}"
    );
    assert!(report["fingerprint"]["kernel"].as_str().is_some());
    if ready("doctor_reports_this_machine") {
        assert_eq!(
            report["ready"], true,
            "doctor says not ready on a set-up machine: {report}"
        );
        // As root with userfaultfd and the cgroup hierarchies mounted (this machine, CI).
        let lazy = checks.iter().find(|c| c["name"] == "lazy restore").unwrap();
        assert_eq!(lazy["ok"], true, "{lazy}");
    }
}

#[test]
fn gc_keeps_the_newest_and_they_still_restore() {
    if !ready("gc_keeps_the_newest_and_they_still_restore") {
        return;
    }
    let mut w = World::new();
    let c = w.start("gc-a", &["STATE_MB=8", "DIRTY_PCT=50"]);
    let mut refs = Vec::new();
    for _ in 0..3 {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(w.pid("gc-a")),
            nix::sys::signal::SIGUSR2,
        )
        .unwrap();
        c.wait_count(2);
        refs.push(
            w.stasis(&["checkpoint", "container", "gc-a", "--workload", "gc"])
                .expect_ok("checkpoint"),
        );
    }
    let report = w
        .stasis(&["gc", "--keep-last", "1", "--grace-secs", "0", "-o", "json"])
        .json();
    assert_eq!(report["manifests_kept"], 1, "{report}");
    assert_eq!(report["manifests_deleted"].as_array().unwrap().len(), 2);
    assert!(
        report["chunks_deleted"].as_u64().unwrap() > 0,
        "nothing swept: {report}"
    );
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list[0]["reference"].as_str().unwrap(), refs[2]);
    w.kill("gc-a");
    let (run, r) = w.restore("gc/latest", "gc-b", &["STATE_MB=8"], &[]);
    run.expect_ok("restore after gc");
    r.wait_count(2);
    assert!(!r.corrupt());
    std::thread::sleep(Duration::from_millis(10));
}
