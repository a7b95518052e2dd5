//! The same CLI contract against a real S3-compatible server (s3s-fs, built by
//! `scripts/build-platform`), through the store's `s3://` backend: the code path the cluster uses.

mod common;

use common::*;
use stasis_testkit::s3::S3Server;

#[test]
fn checkpoint_to_s3_and_restore_from_it() {
    if !ready("checkpoint_to_s3_and_restore_from_it") {
        return;
    }
    let mut w = World::new();
    let root = w.path("s3");
    std::fs::create_dir_all(root.join("ckpts")).unwrap(); // the bucket
    let Some(server) = S3Server::start("checkpoint_to_s3_and_restore_from_it", &root) else {
        return;
    };
    w.store = "s3://ckpts/node-a".into();
    w.env = server.client_env();

    // Slow ticks: each tick rewrites one block somewhere in the state, which dirties one ~1 MiB
    // chunk; few ticks between the two checkpoints keep most chunks unchanged.
    let c = w.start("s3-a", &["STATE_MB=32", "INTERVAL_MS=500"]);
    let first = checkpoint_as(&w, "s3", "s3-a", &["-o", "json"]);
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
    let second = checkpoint_as(&w, "s3", "s3-a", &["-o", "json"]).json();
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
