//! The agent with a pod of two containers, real runc and CRIU, a `file://` store:
//!
//! - `final_checkpoint` for one container (what `stasis-runc kill` sends) checkpoints the whole
//!   pod at one instant into one checkpoint; the same request for the other container, as its
//!   stop follows, is answered with that checkpoint, without another;
//! - a replacement whose spec lacks a container is refused before anything is fetched;
//! - the replacement pod's preparation writes a plan for each container and a skip note for
//!   its init container; `stasis-runc create` + `start` restore both, and both counts continue.
//!
//! Needs root, CRIU >= 4.2, runc, the counter image and `stasis-runc`; run under a reaping
//! subreaper. Without them the test prints SKIPPED (and fails when `CI` is set).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use stasis_agent::error::AgentError;
use stasis_agent::executor::{PodLayout, PrepareJob};
use stasis_node_api::{CheckpointAnswer, Client, FinalCheckpointRequest, PodRef};
use stasis_testkit::bundle;

use common::*;

const NAMES: [&str; 2] = ["counter", "side"];

/// A bundle of container `name` of pod `uid` (CRI annotations as containerd writes them).
fn member(w: &World, uid: &str, name: &str, env: &[&str]) -> PathBuf {
    let b = pod_bundle(w, &format!("{uid}-{name}"), env, uid, "pod");
    bundle::annotate(
        &b,
        &serde_json::json!({"io.kubernetes.cri.container-name": name}),
    );
    b
}

fn final_checkpoint(sock: &std::path::Path, id: &str) -> String {
    let answer = Client::new(sock)
        .final_checkpoint(FinalCheckpointRequest {
            container_id: id.into(),
            pod: PodRef::default(),
            deadline_ms: 30_000,
            answer_when_captured: false,
        })
        .expect("final_checkpoint");
    match answer {
        CheckpointAnswer::Done { checkpoint_ref, .. } => checkpoint_ref,
        other => panic!("final checkpoint of {id}: {other:?}"),
    }
}

fn layout(members: &[&str]) -> PodLayout {
    PodLayout {
        members: members.iter().map(|s| s.to_string()).collect(),
        run_once: vec!["setup".into()],
    }
}

#[test]
fn a_pod_is_checkpointed_and_prepared_as_a_whole() {
    if !ready("a_pod_is_checkpointed_and_prepared_as_a_whole") {
        return;
    }
    let mut w = World::new("agent-pod");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let envs = [
        ["STATE_MB=16", "INTERVAL_MS=100"],
        ["STATE_MB=8", "INTERVAL_MS=70"],
    ];
    let mut lines = Vec::new();
    for (name, env) in NAMES.iter().zip(&envs) {
        let b = member(&w, "uid-src", name, env);
        let l = w.run_piped(&b, &format!("src-{name}"));
        wait_counts(&l, 5);
        lines.push(l);
    }
    let server = AgentServer::start(&w, &exec);

    let before: Vec<u64> = lines.iter().map(|l| last_count(l).unwrap()).collect();
    let t = Instant::now();
    let reference = final_checkpoint(&server.sock, "src-counter");
    // Leave-running: the counters go on; the capture lies between these counts.
    let after: Vec<u64> = lines.iter().map(|l| last_count(l).unwrap()).collect();
    eprintln!(
        "pod checkpoint {reference} in {} ms",
        t.elapsed().as_millis()
    );
    let t = Instant::now();
    assert_eq!(
        final_checkpoint(&server.sock, "src-side"),
        reference,
        "the sidecar's stop is covered by the pod's final checkpoint"
    );
    assert!(t.elapsed().as_millis() < 1000, "no second checkpoint");
    for name in NAMES {
        w.runc().delete_force(&format!("src-{name}")).unwrap();
    }

    let job = |members: &[&str]| PrepareJob {
        reference: reference.parse().unwrap(),
        namespace: "default".into(),
        pod_uid: "uid-dst".into(),
        container_name: None,
        layout: Some(layout(members)),
        spec_hash: None,
        image_digest: None,
        declared: BTreeMap::new(),
        manifest_digest: None,
    };
    // A replacement that lost its sidecar: refused, nothing fetched, nothing planned.
    let e = exec.prepare(&job(&["counter"])).unwrap_err();
    assert!(matches!(e, AgentError::ContainersDiffer(_)), "{e}");
    eprintln!("refused: {e}");
    let plans = w.run_dir().join("plans");
    assert!(!plans.join("pod_uid-dst_counter.json").exists());

    let prepared = exec.prepare(&job(&["side", "counter"])).expect("prepare");
    assert_eq!(prepared.checkpoint_ref, reference);
    for name in NAMES {
        assert!(
            plans.join(format!("pod_uid-dst_{name}.json")).exists(),
            "{name}"
        );
        assert!(w
            .path(&format!("images/uid-dst/{name}/criu/inventory.img"))
            .exists());
    }
    assert!(plans.join("pod_uid-dst_setup.skip").exists());

    for (i, (name, env)) in NAMES.iter().zip(&envs).enumerate() {
        let b = member(&w, "uid-dst", name, env);
        let rx = wrapper_create_start(&mut w, &b, &format!("dst-{name}"));
        let first = first_count(&rx);
        eprintln!(
            "{name}: counted {}..{} around the checkpoint, restored at {first}",
            before[i], after[i]
        );
        assert!(
            first > before[i] && first <= after[i] + 1,
            "{name}: first={first}, before={}, after={}",
            before[i],
            after[i]
        );
    }
}
