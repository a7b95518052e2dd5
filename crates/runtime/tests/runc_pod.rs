//! `stasis-runc` restoring a container shaped the way containerd shapes a pod's, with real runc
//! and CRIU: an overlay rootfs, CRI annotations, a network namespace joined from the sandbox,
//! and a plan the agent wrote for the pod and container name (the container id is known only
//! at create).
//!
//! Needs root, CRIU >= 4.2, runc and the counter image; run under a reaping subreaper. Without
//! them the test prints SKIPPED (and fails when `CI` is set).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use stasis_engine::checkpoint::{checkpoint_container, ContainerCheckpoint};
use stasis_engine::image::ImageDir;
use stasis_node_api::planfile::{self, PlanFile};
use stasis_node_api::{Plan, ReportEvent, Request, RequestBody, RootfsMethod, PROTOCOL_VERSION};
use stasis_testkit::counter::last_count;
use stasis_testkit::net::{ask_line_in, loopback_up};
use stasis_testkit::World;

#[test]
fn pod_shaped_restore_overlay_rootfs_joined_netns_per_pod_plan() {
    if !ready("pod_shaped_restore_overlay_rootfs_joined_netns_per_pod_plan") {
        return;
    }
    let mut w = World::new("pod");
    const PORT: u16 = 18080;
    let env = ["STATE_MB=16", "INTERVAL_MS=100", "LISTEN_PORT=18080"];
    let sandbox = |uid: &str| serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": uid});
    let app = |uid: &str| {
        serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-id": format!("sb-{uid}"),
            "io.kubernetes.cri.sandbox-uid": uid,
            "io.kubernetes.cri.sandbox-namespace": "default",
            "io.kubernetes.cri.sandbox-name": format!("counter-{uid}"),
            "io.kubernetes.cri.container-name": "app",
        })
    };

    // Pod A: a sandbox holding the network namespace, and the app container joining it.
    let sb1 = w.cri_bundle("sb1", &["STATE_MB=1"], &sandbox("uid-a"), None);
    w.run_piped(&sb1, "sb1");
    let sb1_pid = w.pid("sb1");
    loopback_up(sb1_pid);
    let netns1 = PathBuf::from(format!("/proc/{sb1_pid}/ns/net"));
    let b1 = w.cri_bundle("b1", &env, &app("uid-a"), Some(&netns1));
    let c1_lines = w.run_piped(&b1, "c1");
    wait_lines(&c1_lines, 8);
    assert!(ask_line_in(sb1_pid, PORT).is_some_and(|l| l.starts_with("count=")));
    std::fs::write(b1.join("rootfs/data.txt"), "pod A wrote this").unwrap();
    std::fs::remove_file(b1.join("rootfs/etc/group")).ok();

    let img = ImageDir::new(w.path("img"));
    let cap = checkpoint_container(&ContainerCheckpoint {
        runc: &w.runc(),
        id: "c1",
        image: &img,
        leave_running: false,
        tcp_established: true,
    })
    .expect("checkpoint c1");
    assert_eq!(
        cap.rootfs.as_ref().map(|r| r.method),
        Some(RootfsMethod::OverlayUpper)
    );
    std::thread::sleep(Duration::from_millis(100));
    let last = last_count(&c1_lines).unwrap();
    w.runc().delete_force("c1").unwrap();

    // The replacement pod B (another uid, another sandbox); the agent's plan names its pod and
    // container, since containerd picks the container id only at create.
    planfile::write_verified_stamp(&img.root, "default/counter/a/1").unwrap();
    let plans = w.run_dir().join("plans");
    planfile::write(
        &planfile::path_for_pod(&plans, "uid-b", "app").unwrap(),
        &PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("uid-b".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: img.root.clone(),
                rootfs_method: Some(RootfsMethod::OverlayUpper),
                checkpoint_ref: "default/counter/a/1".into(),
                tcp_established: true,
                lazy: false,
                work_dir: None,
            },
            expires_at_unix_ms: None,
        },
    )
    .unwrap();
    let srv = agent(&w.run_dir().join("agent.sock"));
    let sb2 = w.cri_bundle("sb2", &["STATE_MB=1"], &sandbox("uid-b"), None);
    // The sandbox's create goes through the wrapper too, untouched.
    let (st, _sb_out) = w.create(&sb2, "sb2");
    assert!(st.success());
    assert!(w.wrap(&["start", "sb2"]).status.success());
    let sb2_pid = w.pid("sb2");
    loopback_up(sb2_pid);
    let netns2 = PathBuf::from(format!("/proc/{sb2_pid}/ns/net"));
    let b2 = w.cri_bundle("b2", &env, &app("uid-b"), Some(&netns2));
    let (st, rx) = w.create(&b2, "c2");
    assert!(st.success(), "create: {st}; log: {}", w.log());
    assert!(w.wrap(&["start", "c2"]).status.success());
    let (first, line) = next_count(&rx);
    eprintln!("pod A checkpointed at count={last}; pod B's container: {line}");
    assert!(
        first > last && first <= last + 3,
        "{line} after count={last}; log: {}",
        w.log()
    );
    assert!(line.contains("state=ok"));
    let answer = ask_line_in(sb2_pid, PORT).unwrap_or_default();
    assert!(
        answer.starts_with("count=") && answer.contains("state=ok"),
        "{answer:?}"
    );
    assert_eq!(
        std::fs::read_to_string(b2.join("rootfs/data.txt")).unwrap(),
        "pod A wrote this"
    );
    assert!(
        !b2.join("rootfs/etc/group").exists(),
        "a deletion replays as a whiteout"
    );
    assert!(
        b2.join("lower/etc/group").exists(),
        "the image layer is untouched"
    );
    assert!(!plans.join("pod_uid-b_app.json").exists());
    let restored = |r: &[Request]| {
        r.iter().any(|q| matches!(&q.body, RequestBody::Report(rep)
            if rep.container_id == "c2" && rep.pod.pod_uid == "uid-b" && rep.pod.container_name == "app"
            && matches!(rep.event, ReportEvent::Restored { .. })))
    };
    let r = srv.wait_until(Duration::from_secs(5), restored);
    assert!(restored(&r), "{r:?}");
    assert!(
        !r.iter()
            .any(|q| matches!(&q.body, RequestBody::Report(rep) if rep.container_id == "sb2")),
        "sandboxes are not reported"
    );
}
