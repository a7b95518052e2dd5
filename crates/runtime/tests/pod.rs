//! A pod with two containers (an app container and a native sidecar) and an init container,
//! restored through `stasis-runc` with real runc and CRIU: both containers are captured at one
//! instant into one pod checkpoint (`containers/<name>/` each), the replacement pod's containers
//! each restore from their part of it, and the init container, which ran before the checkpoint,
//! exits 0 without running its command (the agent's skip note), in an image with no shell and no
//! `/bin/true` (the counter image holds one static binary).
//!
//! Needs root, CRIU >= 4.2, runc and the counter image; run under a reaping subreaper. Without
//! them the test prints SKIPPED (and fails when `CI` is set).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use stasis_core::manifest::pod_container_dir;
use stasis_engine::checkpoint::{checkpoint_pod, PodCheckpoint, PodMember};
use stasis_engine::image::ImageDir;
use stasis_node_api::planfile::{self, PlanFile, Skip};
use stasis_node_api::{Plan, ReportEvent, Request, RequestBody, PROTOCOL_VERSION};
use stasis_testkit::counter::last_count;
use stasis_testkit::net::loopback_up;
use stasis_testkit::World;

const CKPT: &str = "default/pod/a/1";

fn sandbox(uid: &str) -> serde_json::Value {
    serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": uid})
}

fn container(uid: &str, name: &str) -> serde_json::Value {
    serde_json::json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": format!("sb-{uid}"),
        "io.kubernetes.cri.sandbox-uid": uid,
        "io.kubernetes.cri.sandbox-namespace": "default",
        "io.kubernetes.cri.sandbox-name": "pod",
        "io.kubernetes.cri.container-name": name,
    })
}

/// A sandbox of pod `uid` created through the wrapper (passed through untouched), with
/// loopback up; its network namespace's path.
fn start_sandbox(w: &mut World, uid: &str, id: &str) -> PathBuf {
    let sb = w.cri_bundle(id, &["STATE_MB=1"], &sandbox(uid), None);
    let (st, _) = w.create(&sb, id);
    assert!(st.success(), "create {id}: {}", w.log());
    assert!(w.wrap(&["start", id]).status.success());
    let pid = w.pid(id);
    loopback_up(pid);
    PathBuf::from(format!("/proc/{pid}/ns/net"))
}

/// The container's state once it is `stopped`, or what it is after 10 s.
fn wait_stopped(w: &World, id: &str) -> String {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = w.state(id);
        if s == "stopped" || Instant::now() > until {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn args_of(bundle: &Path) -> serde_json::Value {
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    c["process"]["args"].clone()
}

#[test]
fn a_pod_restores_every_container_from_one_checkpoint_and_skips_its_init_container() {
    if !ready("a_pod_restores_every_container_from_one_checkpoint_and_skips_its_init_container") {
        return;
    }
    let mut w = World::new("pod2");
    // Pod A: the app and its sidecar in the sandbox's network namespace, counting at different
    // paces from different states.
    let netns_a = start_sandbox(&mut w, "uid-a", "sb-a");
    let members = [
        ("app", ["STATE_MB=16", "INTERVAL_MS=50"]),
        ("side", ["STATE_MB=8", "INTERVAL_MS=80"]),
    ];
    let mut lines = Vec::new();
    for (name, env) in &members {
        let b = w.cri_bundle(
            &format!("a-{name}"),
            env,
            &container("uid-a", name),
            Some(&netns_a),
        );
        let l = w.run_piped(&b, &format!("a-{name}"));
        wait_lines(&l, 8);
        lines.push(l);
    }
    std::fs::write(w.path("a-side/rootfs/side.txt"), "the sidecar wrote this").unwrap();

    // The pod checkpoint, as the agent takes a final one: stop mode, one directory per
    // container.
    let img = ImageDir::new(w.path("img"));
    let dirs: Vec<ImageDir> = members
        .iter()
        .map(|(n, _)| ImageDir::new(img.root.join(pod_container_dir(n))))
        .collect();
    let caps = checkpoint_pod(&PodCheckpoint {
        runc: &w.runc(),
        members: &[
            PodMember {
                id: "a-app",
                image: &dirs[0],
            },
            PodMember {
                id: "a-side",
                image: &dirs[1],
            },
        ],
        leave_running: false,
        tcp_established: true,
    })
    .expect("pod checkpoint");
    std::thread::sleep(Duration::from_millis(150));
    let last: Vec<u64> = lines.iter().map(|l| last_count(l).unwrap()).collect();
    for (n, _) in &members {
        w.runc().delete_force(&format!("a-{n}")).unwrap();
    }

    // The agent's part for pod B: each container's directory verified, a plan per container,
    // a skip note for the init container.
    let plans = w.run_dir().join("plans");
    for ((name, _), (dir, cap)) in members.iter().zip(dirs.iter().zip(&caps)) {
        planfile::write_verified_stamp(&dir.root, CKPT).unwrap();
        planfile::write(
            &planfile::path_for_pod(&plans, "uid-b", name).unwrap(),
            &PlanFile {
                v: PROTOCOL_VERSION,
                container_id: None,
                pod_uid: Some("uid-b".into()),
                container_name: Some((*name).into()),
                plan: Plan {
                    image_dir: dir.root.clone(),
                    rootfs_method: cap.rootfs.as_ref().map(|r| r.method),
                    checkpoint_ref: CKPT.into(),
                    tcp_established: true,
                    lazy: false,
                    work_dir: None,
                },
                expires_at_unix_ms: None,
            },
        )
        .unwrap();
    }
    let skip = planfile::path_for_skip(&plans, "uid-b", "init").unwrap();
    planfile::write_skip(
        &skip,
        &Skip {
            v: PROTOCOL_VERSION,
            checkpoint_ref: CKPT.into(),
            expires_at_unix_ms: u64::MAX,
        },
    )
    .unwrap();
    let srv = agent(&w.run_dir().join("agent.sock"));
    let netns_b = start_sandbox(&mut w, "uid-b", "sb-b");

    // The init container first, as the kubelet runs it: its command (the counter, which would
    // count forever) does not run; it exits at once, and the note is used up.
    let bi = w.cri_bundle(
        "b-init",
        &["STATE_MB=1"],
        &container("uid-b", "init"),
        Some(&netns_b),
    );
    assert!(
        !bi.join("rootfs/bin/true").exists() && !bi.join("rootfs/bin/sh").exists(),
        "the image must have neither /bin/true nor a shell"
    );
    let (st, init_out) = w.create(&bi, "b-init");
    assert!(st.success(), "create b-init: {}", w.log());
    assert_eq!(args_of(&bi), serde_json::json!(["/.stasis-exit0"]));
    assert!(w.wrap(&["start", "b-init"]).status.success());
    assert_eq!(wait_stopped(&w, "b-init"), "stopped", "{}", w.log());
    assert!(
        init_out.recv_timeout(Duration::from_millis(300)).is_err(),
        "the init container's command ran"
    );
    assert!(!skip.exists(), "the skip note is used once");
    assert!(w
        .log()
        .contains("init container init (b-init) ran before checkpoint"));

    // The control: the same init container without a note runs its command.
    let bc = w.cri_bundle(
        "b-init2",
        &["STATE_MB=1"],
        &container("uid-b", "init"),
        Some(&netns_b),
    );
    let (st, ctl_out) = w.create(&bc, "b-init2");
    assert!(st.success());
    assert!(w.wrap(&["start", "b-init2"]).status.success());
    let (n, _) = next_count(&ctl_out);
    assert!(n >= 1);
    w.runc().delete_force("b-init2").unwrap();

    // Both containers of pod B restore from their part of the one checkpoint.
    for (i, (name, env)) in members.iter().enumerate() {
        let id = format!("b-{name}");
        let b = w.cri_bundle(&id, env, &container("uid-b", name), Some(&netns_b));
        let (st, rx) = w.create(&b, &id);
        assert!(st.success(), "create {id}: {}", w.log());
        assert!(w.wrap(&["start", &id]).status.success());
        let (first, line) = next_count(&rx);
        eprintln!(
            "{name}: checkpointed at count={}, restored: {line}",
            last[i]
        );
        assert!(
            first > last[i] && first <= last[i] + 3,
            "{name}: {line} after count={}; log: {}",
            last[i],
            w.log()
        );
        assert!(line.contains("state=ok"), "{line}");
    }
    assert_eq!(
        std::fs::read_to_string(w.path("b-side/rootfs/side.txt")).unwrap(),
        "the sidecar wrote this"
    );
    let restored = |r: &[Request], name: &str| {
        r.iter().any(|q| matches!(&q.body, RequestBody::Report(rep)
            if rep.pod.container_name == name
            && matches!(&rep.event, ReportEvent::Restored { checkpoint_ref, .. } if checkpoint_ref == CKPT)))
    };
    let r = srv.wait_until(Duration::from_secs(5), |r| {
        restored(r, "app") && restored(r, "side")
    });
    for name in ["app", "side"] {
        assert!(restored(&r, name), "{name}: {r:?}");
    }
    // No report for the skipped init container: it is neither restored nor a cold start.
    assert!(!r
        .iter()
        .any(|q| matches!(&q.body, RequestBody::Report(rep) if rep.pod.container_name == "init")));
}
