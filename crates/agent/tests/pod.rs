//! The agent with a pod of two containers, real runc and CRIU, a `file://` store:
//!
//! - `final_checkpoint` for one container (what `stasis-runc kill` sends) checkpoints the whole
//!   pod at one instant into one checkpoint; the same request for the other container, as its
//!   stop follows, is answered with that checkpoint, without another;
//! - a replacement whose spec lacks a container is refused before anything is fetched;
//! - the replacement pod's preparation writes a plan for each container and a skip note for
//!   its init container; `stasis-runc create` + `start` restore both, and both counts continue;
//! - a second replacement whose sidecar cannot be restored (its images damaged after the
//!   preparation) starts cold as a whole: the counter, restored first, is stopped, and the
//!   sidecar starts over;
//! - a third replacement with lazy restores on: each container is staged and served by its own
//!   page server, both run before their memory has arrived, both counts continue, and both
//!   come to full residency with their state intact.
//!
//! Needs root, CRIU >= 4.2, runc, the counter image and `stasis-runc`; run under a reaping
//! subreaper. Without them the test prints SKIPPED (and fails when `CI` is set).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use stasis_agent::error::AgentError;
use stasis_agent::executor::{PodLayout, PrepareJob};
use stasis_node_api::{CheckpointAnswer, Client};
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
        .final_checkpoint(stop_request(id))
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

    let job_for = |uid: &str, members: &[&str]| PrepareJob {
        reference: reference.parse().unwrap(),
        namespace: "default".into(),
        pod_uid: uid.into(),
        container_name: None,
        layout: Some(layout(members)),
        spec_hash: None,
        image_digest: None,
        declared: BTreeMap::new(),
        manifest_digest: None,
    };
    let job = |members: &[&str]| job_for("uid-dst", members);
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

    // A replacement whose sidecar cannot be restored: its images lose a file after the
    // preparation. The counter is restored first (as the kubelet creates one container after
    // another); the sidecar's restore fails, so it starts cold, and the counter must not run on
    // from the checkpoint beside it: it is stopped (the kubelet would start it again, cold).
    exec.prepare(&job_for("uid-out", &["side", "counter"]))
        .expect("prepare the second replacement");
    let b = member(&w, "uid-out", "counter", &envs[0]);
    let rx_counter = wrapper_create_start(&mut w, &b, "out-counter");
    let restored_at = first_count(&rx_counter);
    assert!(restored_at > before[0], "restored: {restored_at}");
    std::fs::remove_file(w.path("images/uid-out/side/criu/inventory.img")).unwrap();
    let b = member(&w, "uid-out", "side", &envs[1]);
    let rx_side = wrapper_create_start(&mut w, &b, "out-side");
    let cold_at = first_count(&rx_side);
    assert!(cold_at < before[1], "the sidecar starts over: {cold_at}");
    wait_for("the restored counter to be stopped", 30, || {
        let out = w.runc_output(&["state", "out-counter"]);
        !String::from_utf8_lossy(&out.stdout).contains("\"running\"")
    });
    let metrics = exec.metrics.render();
    assert!(
        metrics.contains("stasis_agent_restores_total{result=\"out_of_step\"} 1"),
        "{metrics}"
    );
    eprintln!(
        "the sidecar started cold at {cold_at}; the counter restored at {restored_at} was stopped"
    );

    // The same pod restored lazily: each container has its own page server, and both run
    // before their memory has arrived.
    exec.set_lazy_restore(stasis_agent::executor::LazyRestore::Auto);
    exec.prepare(&job_for("uid-lazy", &["side", "counter"]))
        .expect("prepare the lazy replacement");
    for name in NAMES {
        let plan =
            stasis_node_api::planfile::read(&plans.join(format!("pod_uid-lazy_{name}.json")))
                .unwrap()
                .expect("a plan")
                .plan;
        assert!(plan.lazy, "{name}: {plan:?}");
    }
    let mut lazy_ids = Vec::new();
    for (i, (name, env)) in NAMES.iter().zip(&envs).enumerate() {
        let b = member(&w, "uid-lazy", name, env);
        let id = format!("lazy-{name}");
        let rx = wrapper_create_start(&mut w, &b, &id);
        let first = first_count(&rx);
        eprintln!("{name}: restored lazily at {first}");
        assert!(
            first > before[i] && first <= after[i] + 1,
            "{name}: first={first}, before={}, after={}",
            before[i],
            after[i]
        );
        lazy_ids.push(id);
    }
    wait_for("both lazily restored containers resident", 120, || {
        exec.metrics
            .render()
            .contains("stasis_agent_restores_total{result=\"lazy_resident\"} 2")
    });
    // Every page of both, checked by the counters themselves (SIGUSR1: a full check).
    for id in &lazy_ids {
        assert_full_check(&w, id);
    }
}
