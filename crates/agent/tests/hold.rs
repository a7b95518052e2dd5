//! A pod held frozen after the eviction responder's final checkpoint (a policy with
//! `holdUntilEvicted`), with real runc and CRIU: the checkpoint is published with the counter
//! still frozen, and it stays frozen (its count does not move) until its stop comes, which is
//! answered with that capture at once and finds it running again; a stop that does not come
//! within the hold's bound lets it run on, and when it comes it takes a new checkpoint (the pod
//! ran on after the capture taken ahead of it).
//!
//! Needs root, CRIU >= 4.2, runc and the counter image (`scripts/build-counter-image`); run
//! under `tini -s`. Without them the test prints why it did not run (and fails under `CI`).

mod common;

use std::time::{Duration, Instant};

use stasis_node_api::{CheckpointAnswer, Client, FinalCheckpointRequest};

use common::*;

fn final_request(id: &str, hold: bool) -> FinalCheckpointRequest {
    FinalCheckpointRequest {
        hold_until_stopped: hold,
        ..stop_request(id)
    }
}

fn status(w: &World, id: &str) -> String {
    w.runc().state(id).unwrap().status
}

#[test]
fn a_held_pod_stays_frozen_after_its_checkpoint_until_its_stop() {
    if !ready("a_held_pod_stays_frozen_after_its_checkpoint_until_its_stop") {
        return;
    }
    let mut w = World::new("hold");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let b = pod_bundle(
        &w,
        "b1",
        &["STATE_MB=16", "INTERVAL_MS=50"],
        "uid-hold",
        "counter-a",
    );
    let lines = w.run_piped(&b, "h1");
    wait_counts(&lines, 5);
    let server = AgentServer::start(&w, &exec);
    let client = Client::new(&server.sock);

    // The responder's final checkpoint: published, the pod still frozen.
    let answer = client.final_checkpoint(final_request("h1", true)).unwrap();
    let CheckpointAnswer::Done { checkpoint_ref, .. } = answer else {
        panic!("final checkpoint: {answer:?}");
    };
    assert_eq!(
        status(&w, "h1"),
        "paused",
        "not held after {checkpoint_ref}"
    );
    assert!(exec.is_held("uid-hold"));
    let frozen_at = last_count(&lines).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        last_count(&lines).unwrap(),
        frozen_at,
        "the held counter counted on"
    );

    // Its stop: the runtime's request is answered with that capture at once, and the pod
    // runs again so that the stop reaches it.
    let t = Instant::now();
    let answer = client.final_checkpoint(final_request("h1", false)).unwrap();
    let CheckpointAnswer::Done {
        checkpoint_ref: covering,
        ..
    } = answer
    else {
        panic!("the stop's final checkpoint: {answer:?}");
    };
    eprintln!(
        "held at count {frozen_at}; the stop answered in {} ms with {covering}",
        t.elapsed().as_millis()
    );
    assert_eq!(covering, checkpoint_ref);
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(status(&w, "h1"), "running");
    assert!(!exec.is_held("uid-hold"));
    wait_for("the counter counts again", 10, || {
        last_count(&lines).unwrap() > frozen_at
    });

    // A stop that does not come (another pod): it runs on after the bound.
    exec.set_hold_bound(Duration::from_secs(2));
    let b2 = pod_bundle(
        &w,
        "b2",
        &["STATE_MB=16", "INTERVAL_MS=50"],
        "uid-hold-2",
        "counter-b",
    );
    let lines = w.run_piped(&b2, "h2");
    wait_counts(&lines, 5);
    let answer = client.final_checkpoint(final_request("h2", true)).unwrap();
    let CheckpointAnswer::Done {
        checkpoint_ref: ahead,
        ..
    } = answer
    else {
        panic!("final checkpoint: {answer:?}");
    };
    assert_eq!(status(&w, "h2"), "paused");
    wait_for("the hold's bound", 10, || status(&w, "h2") == "running");
    assert!(!exec.is_held("uid-hold-2"));
    let resumed_at = last_count(&lines).unwrap();
    wait_for("the counter counts after the bound", 10, || {
        last_count(&lines).unwrap() > resumed_at
    });

    // Its stop, later: the pod ran on after the capture taken ahead of it, and a new checkpoint
    // (its measured cost: the one above) fits the stop's 30 s, so the stop takes one.
    let answer = client.final_checkpoint(final_request("h2", false)).unwrap();
    let CheckpointAnswer::Done {
        checkpoint_ref: at_stop,
        ..
    } = answer
    else {
        panic!("the stop's final checkpoint: {answer:?}");
    };
    eprintln!("ran on from the hold's bound at count {resumed_at}; the stop took {at_stop} in place of {ahead}");
    assert_ne!(
        at_stop, ahead,
        "the stop was answered with the capture taken ahead of it"
    );
    // ... which then covers the pod's other stops.
    let answer = client.final_checkpoint(final_request("h2", false)).unwrap();
    assert!(
        matches!(&answer, CheckpointAnswer::Done { checkpoint_ref, .. } if *checkpoint_ref == at_stop),
        "{answer:?}"
    );
    drop(server);
}
