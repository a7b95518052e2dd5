//! Refusals and bounds that need no root and no real tools: processes that must not be
//! checkpointed, readers that create nothing, a silent S3 endpoint, the work directory's cleanup.
//! Each test names the bug of `cli-trial.md` it reproduces.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

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
