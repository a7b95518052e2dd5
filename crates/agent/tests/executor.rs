//! The agent's executor and node-api server with real runc and CRIU, against a counter
//! container whose bundle carries CRI annotations (as containerd writes them), with a `file://`
//! store:
//!
//! - `final_checkpoint` over the agent's socket (what `stasis-runc kill` sends) → the executor
//!   finds the container, checkpoints it and uploads it;
//! - the preparer fetches and verifies it for a replacement pod and writes the per-pod plan file;
//! - `stasis-runc create` + `start` (crates/runtime) restore it and the count continues; the
//!   wrapper's `restored` report reaches the agent, which forgets the images;
//! - the `stasisd` binary's RSS, idle and while it checkpoints a counter (`STASIS_AGENT_RSS_MB`,
//!   default 256; the design goal is measured with 2048).
//!
//! Needs root, CRIU >= 4.2, runc, the counter image (`scripts/build-counter-image`) and the
//! `stasis-runc` binary (built by `cargo build --workspace`, or `STASIS_RUNC_UNDER_TEST`); run
//! under a reaping subreaper (`make integration` uses `tini -s`). Without them each test prints
//! SKIPPED (and fails when `CI` is set).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stasis_agent::executor::PrepareJob;
use stasis_node_api::{CheckpointAnswer, Client, FinalCheckpointRequest, PodRef};
use stasis_store::Key;

use common::*;

#[test]
fn final_checkpoint_then_prepared_restore_through_the_wrapper() {
    if !ready("final_checkpoint_then_prepared_restore_through_the_wrapper") {
        return;
    }
    let mut w = World::new("exec");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let env = ["STATE_MB=16", "INTERVAL_MS=100"];

    // The source pod's app container.
    let b1 = pod_bundle(&w, "b1", &env, "uid-source-1", "counter-a");
    let lines = w.run_piped(&b1, "c1");
    wait_counts(&lines, 5);
    std::fs::write(b1.join("rootfs/note.txt"), "written before the checkpoint").unwrap();

    // The agent's socket, as stasis-runc's `kill` reaches it.
    let server = AgentServer::start(&w, &exec);
    let sock = server.sock.clone();

    let before = last_count(&lines).unwrap();
    let t = Instant::now();
    let answer = Client::new(&sock)
        .final_checkpoint(stop_request("c1"))
        .expect("final_checkpoint");
    let took = t.elapsed();
    let CheckpointAnswer::Done { checkpoint_ref, .. } = answer else {
        panic!("final checkpoint: {answer:?}");
    };
    let after = last_count(&lines).unwrap();
    eprintln!(
        "final checkpoint {checkpoint_ref} in {} ms (count {before}..{after})",
        took.as_millis()
    );
    assert!(
        checkpoint_ref.starts_with("default_pod_counter-a."),
        "{checkpoint_ref}"
    );
    // The source is stopped now (SIGKILL, as after a grace period).
    w.runc().delete_force("c1").unwrap();

    // The replacement pod: the agent prepares the restore (fetch, verify, plan file). Its
    // bundle carries the image digest the checkpoint recorded (make-bundle's annotation).
    let b2 = pod_bundle(&w, "b2", &env, "uid-replacement-2", "counter-b");
    let digest = stasis_engine::restore::bundle_image_digest(&b2).unwrap();
    assert!(digest.is_some());
    let prepared = exec
        .prepare(&PrepareJob {
            reference: checkpoint_ref.parse().unwrap(),
            namespace: "default".into(),
            pod_uid: "uid-replacement-2".into(),
            container_name: None,
            layout: None,
            spec_hash: None,
            image_digest: digest,
            declared: BTreeMap::new(),
            manifest_digest: None,
        })
        .expect("prepare");
    assert_eq!(prepared.container_name, "counter");
    assert_eq!(
        prepared.plan_path,
        w.run_dir().join("plans/pod_uid-replacement-2_counter.json")
    );
    assert!(prepared.image_dir.join("criu/inventory.img").exists());
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&w.path("images")), 0o700);
    assert_eq!(mode(&w.path("images/uid-replacement-2")), 0o700);
    let stamp = stasis_node_api::planfile::read_verified_stamp(&prepared.image_dir)
        .unwrap()
        .unwrap();
    assert_eq!(stamp.checkpoint_ref, checkpoint_ref);
    // The same answer over the socket.
    let plan = Client::new(&sock)
        .restore_plan(stasis_node_api::RestorePlanRequest {
            container_id: "c2".into(),
            pod: PodRef {
                pod_uid: "uid-replacement-2".into(),
                container_name: "counter".into(),
                ..Default::default()
            },
        })
        .unwrap();
    assert!(
        matches!(&plan, stasis_node_api::PlanAnswer::Plan(p) if p.checkpoint_ref == checkpoint_ref),
        "{plan:?}"
    );

    // The shim's calls through the wrapper: create (restores), start (no-op).
    let rx = wrapper_create_start(&mut w, &b2, "c2");
    let first = first_count(&rx);
    eprintln!("restored container's first count: {first} (source counted {before}..{after} around the checkpoint)");
    assert!(
        first > before && first <= after + 1,
        "first={first}, before={before}, after={after}"
    );
    assert_eq!(
        std::fs::read_to_string(b2.join("rootfs/note.txt")).unwrap(),
        "written before the checkpoint"
    );

    // The wrapper's report reached the agent: counted, and the images are gone.
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let m = exec.metrics.render();
        if m.contains("stasis_agent_restores_total{result=\"restored\"} 1") {
            assert!(m.contains("stasis_agent_checkpoints_total{result=\"succeeded\"} 1"));
            break;
        }
        assert!(Instant::now() < until, "no restored report: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let until = Instant::now() + Duration::from_secs(2);
    while prepared.image_dir.exists() {
        assert!(
            Instant::now() < until,
            "images not removed after the restore"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // An incompatible target (a declared engine version the checkpoint lacks) is refused
    // before anything is fetched: no images, no plan.
    let e = exec
        .prepare(&PrepareJob {
            reference: checkpoint_ref.parse().unwrap(),
            namespace: "default".into(),
            pod_uid: "uid-other-3".into(),
            container_name: None,
            layout: None,
            spec_hash: None,
            image_digest: stasis_engine::restore::bundle_image_digest(&b2).unwrap(),
            declared: BTreeMap::from([("engine".to_owned(), "v2".to_owned())]),
            manifest_digest: None,
        })
        .unwrap_err();
    assert!(e.to_string().contains("declared.engine"), "{e}");
    assert!(!w.path("images/uid-other-3").exists());
    assert!(!w
        .run_dir()
        .join("plans/pod_uid-other-3_counter.json")
        .exists());

    drop(server);
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn stasisd_rss_idle_and_while_checkpointing() {
    if !ready("stasisd_rss_idle_and_while_checkpointing") {
        return;
    }
    let mb: u64 = std::env::var("STASIS_AGENT_RSS_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let mut w = World::new("rss");
    Key::generate(&w.path("key")).unwrap();
    let sock = w.run_dir().join("agent.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut agent = Command::new(env!("CARGO_BIN_EXE_stasisd"))
        .args(["--standalone", "--store"])
        .arg(format!("file://{}", w.path("store").display()))
        .arg("--key-file")
        .arg(w.path("key"))
        .arg("--runc-root")
        .arg(&w.runc_root)
        .arg("--socket")
        .arg(&sock)
        .arg("--plans-dir")
        .arg(w.run_dir().join("plans"))
        .arg("--images-dir")
        .arg(w.path("images"))
        .arg("--work-dir")
        .arg(w.path("work"))
        .arg("--metrics-addr")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(w.path("stasisd.log")).unwrap())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let pid = agent.id();
    let until = Instant::now() + Duration::from_secs(10);
    while Client::new(&sock).ping().is_err() {
        assert!(
            Instant::now() < until && agent.try_wait().unwrap().is_none(),
            "stasisd did not come up: {}",
            std::fs::read_to_string(w.path("stasisd.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let agent = Kill(agent);
    std::thread::sleep(Duration::from_millis(500));
    let idle = rss_kib(pid, "VmRSS:");

    let b = pod_bundle(
        &w,
        "big",
        &[&format!("STATE_MB={mb}"), "INTERVAL_MS=200"],
        "uid-rss",
        "big",
    );
    let lines = w.run_piped(&b, "big");
    // The counter fills its state before it counts.
    let until = Instant::now() + Duration::from_secs(120);
    while last_count(&lines).is_none() {
        assert!(Instant::now() < until, "the counter never counted");
        std::thread::sleep(Duration::from_millis(100));
    }
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::SeqCst) {
                peak.fetch_max(rss_kib(pid, "VmRSS:"), std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let t = Instant::now();
    let answer = Client::new(&sock)
        .final_checkpoint(FinalCheckpointRequest {
            deadline_ms: 300_000,
            ..stop_request("big")
        })
        .expect("final_checkpoint");
    let took = t.elapsed();
    sampling.store(false, std::sync::atomic::Ordering::SeqCst);
    sampler.join().unwrap();
    let hwm = rss_kib(pid, "VmHWM:");
    let busy = peak.load(std::sync::atomic::Ordering::SeqCst).max(hwm);
    let after = rss_kib(pid, "VmRSS:");
    eprintln!(
        "stasisd RSS: idle {} MiB, peak while checkpointing {mb} MiB {} MiB (VmHWM {} MiB), after {} MiB; checkpoint took {} ms: {answer:?}",
        idle / 1024,
        busy / 1024,
        hwm / 1024,
        after / 1024,
        took.as_millis()
    );
    assert!(
        matches!(answer, CheckpointAnswer::Done { .. }),
        "{answer:?}: {}",
        std::fs::read_to_string(w.path("stasisd.log")).unwrap_or_default()
    );
    // /metrics answers and counts the checkpoint.
    let body = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        // HTTP/1.1 keeps a connection open unless asked: read to its end.
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut b = String::new();
        s.read_to_string(&mut b).unwrap();
        b
    };
    assert!(
        body.contains("stasis_agent_checkpoints_total{result=\"succeeded\"} 1"),
        "{body}"
    );
    assert!(idle <= 64 * 1024, "idle RSS {idle} KiB > 64 MiB");
    assert!(busy <= 256 * 1024, "busy RSS {busy} KiB > 256 MiB");
    drop(agent);
}
