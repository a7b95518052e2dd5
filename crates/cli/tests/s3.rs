//! The same CLI contract against a real S3-compatible server (s3s-fs, built by
//! `scripts/build-platform`), through the store's `s3://` backend: the code path the cluster uses.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The s3s-fs binary: `$STASIS_S3S_FS`, else the platform cache.
fn s3s_fs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("STASIS_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let cache = PathBuf::from(std::env::var_os("HOME")?).join(".cache/stasis/platform");
    std::fs::read_dir(cache)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("s3s-fs-"))
        .map(|e| e.path().join("bin/s3s-fs"))
        .find(|p| p.exists())
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn checkpoint_to_s3_and_restore_from_it() {
    if !ready("checkpoint_to_s3_and_restore_from_it") {
        return;
    }
    let Some(bin) = s3s_fs() else {
        let why = "the s3s-fs server is not built (scripts/build-platform s3s-fs)";
        assert!(
            std::env::var_os("CI").is_none(),
            "checkpoint_to_s3_and_restore_from_it cannot run in CI: {why}"
        );
        eprintln!("SKIPPED checkpoint_to_s3_and_restore_from_it: {why}");
        return;
    };
    let mut w = World::new();
    let root = w.path("s3");
    std::fs::create_dir_all(root.join("ckpts")).unwrap(); // the bucket
    let port = free_port();
    let server = Server(
        Command::new(bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                "stasis",
                "--secret-key",
                "stasis-secret",
            ])
            .arg(&root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "s3s-fs did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    w.store = "s3://ckpts/node-a".into();
    w.env = vec![
        (
            "AWS_ENDPOINT_URL".into(),
            format!("http://127.0.0.1:{port}"),
        ),
        ("AWS_ACCESS_KEY_ID".into(), "stasis".into()),
        ("AWS_SECRET_ACCESS_KEY".into(), "stasis-secret".into()),
        ("AWS_REGION".into(), "us-east-1".into()),
    ];

    // Slow ticks: each tick rewrites one block somewhere in the state, which dirties one ~1 MiB
    // chunk; few ticks between the two checkpoints keep most chunks unchanged.
    let c = w.start("s3-a", &["STATE_MB=32", "INTERVAL_MS=500"]);
    let first = w.stasis(&[
        "checkpoint",
        "container",
        "s3-a",
        "--workload",
        "s3",
        "-o",
        "json",
    ]);
    let first = first.json();
    assert!(
        first["reference"].as_str().unwrap().starts_with("s3/"),
        "{first}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(w.pid("s3-a")),
        nix::sys::signal::SIGUSR2,
    )
    .unwrap();
    c.wait_count(3);
    let second = w
        .stasis(&[
            "checkpoint",
            "container",
            "s3-a",
            "--workload",
            "s3",
            "-o",
            "json",
        ])
        .json();
    // Unchanged chunks are not uploaded again, through S3 too.
    let (new, total) = (
        second["stats"]["new_bytes"].as_u64().unwrap(),
        second["stats"]["logical_bytes"].as_u64().unwrap(),
    );
    assert!(
        new * 2 < total,
        "second checkpoint re-uploaded {new} of {total} bytes"
    );
    let before = c.last_count();
    w.kill("s3-a");

    let (run, r) = w.restore("s3/latest", "s3-b", &["STATE_MB=32"], &[]);
    run.expect_ok("restore from S3");
    r.wait_count(3);
    assert!(
        r.counts()[0] <= before + 1 && !r.corrupt(),
        "{:?}",
        r.lines()
    );
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let gc = w
        .stasis(&["gc", "--keep-last", "1", "--grace-secs", "0", "-o", "json"])
        .json();
    assert_eq!(gc["manifests_kept"], 1, "{gc}");
    drop(server);
}
