//! The restart in place after an OOM kill, with real runc and CRIU, the agent's node-api server
//! (standalone cluster), a `file://` store and the node's chunk cache:
//!
//! - a checkpoint of a counter pod's container keeps no memory image on the node: only the
//!   reference `.stasis-latest.json` (its chunks went into the encrypted chunk cache as they
//!   uploaded), and the scratch directory is gone;
//! - `container_exited {oom_killed, wait_for_plan}` (what `stasis-runc delete` sends) is answered
//!   at once with `preparing`; the restarted container's `stasis-runc create` waits for the plan
//!   (the pending note `delete` writes from that answer), restores from the cache, and the count
//!   continues from the checkpoint; the restore directory is removed after the restore;
//! - a second OOM kill before the next checkpoint gets `no_plan` (no restore loop);
//! - a restore lost before its container started (the create that took the plan was given up,
//!   as when the kubelet dies during it, and the container deleted without a start): the
//!   wrapper's `delete` tells the agent, which prepares the same checkpoint again, and the next
//!   create restores it instead of starting cold. A container that did start is not taken for
//!   one.
//!
//! Needs what `executor.rs` needs (root, CRIU, runc, the counter image, `stasis-runc`); prints
//! SKIPPED without them (fails when `CI` is set). The store here is `file://`: the cache and its
//! fallback to the bucket are the store's code, tested against the real S3 server in
//! `crates/store/tests`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stasis_agent::executor::PrepareJob;
use stasis_node_api::planfile::{self, Pending};
use stasis_node_api::{
    CheckpointAnswer, Client, ContainerExitedRequest, ExitAnswer, FinalCheckpointRequest, PodRef,
    PROTOCOL_VERSION,
};
use stasis_store::ChunkCache;

use common::*;

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(files_under(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

fn images(files: &[PathBuf]) -> Vec<&PathBuf> {
    files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "img" || e == "tar"))
        .collect()
}

#[test]
fn oom_restart_in_place_through_the_chunk_cache_keeps_no_image_on_the_node() {
    if !ready("oom_restart_in_place_through_the_chunk_cache_keeps_no_image_on_the_node") {
        return;
    }
    let mut w = World::new("inplace");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let cache = Arc::new(ChunkCache::open(&w.path("chunk-cache"), 256 << 20).unwrap());
    assert!(exec.store().set_cache(cache.clone()));
    let env = ["STATE_MB=16", "INTERVAL_MS=100"];
    let pod = PodRef {
        pod_uid: "uid-oom-1".into(),
        pod_namespace: "default".into(),
        pod_name: "counter-o".into(),
        container_name: "counter".into(),
    };
    let b1 = pod_bundle(&w, "b1", &env, &pod.pod_uid, &pod.pod_name);
    let lines = w.run_piped(&b1, "c1");
    wait_counts(&lines, 5);

    let server = AgentServer::start(&w, &exec);
    let sock = server.sock.clone();

    // A checkpoint (leave-running), as every heartbeat takes one.
    let before = last_count(&lines).unwrap();
    let answer = Client::new(&sock)
        .final_checkpoint(FinalCheckpointRequest {
            pod: pod.clone(),
            ..stop_request("c1")
        })
        .expect("checkpoint");
    let CheckpointAnswer::Done { checkpoint_ref, .. } = answer else {
        panic!("checkpoint: {answer:?}");
    };
    // What the node keeps: the reference, no image; the chunks are in the cache.
    let kept = w.path("images/uid-oom-1/.latest-counter");
    let kept_files = files_under(&w.path("images"));
    assert_eq!(kept_files, vec![kept.join(".stasis-latest.json")]);
    assert!(images(&files_under(&w.path("work"))).is_empty());
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&kept_files[0]).unwrap()).unwrap();
    assert_eq!(record["checkpoint_ref"], checkpoint_ref.as_str());
    assert_eq!(record["namespace"], "default");
    let cached = cache.stats();
    assert!(cached.inserted > 0, "{cached:?}");

    // The OOM killer ends the container; the runtime deletes it and tells the agent.
    let after = last_count(&lines).unwrap();
    w.runc().delete_force("c1").unwrap();
    let t = Instant::now();
    let exited = |wait_for_plan| {
        Client::new(&sock)
            .with_io_timeout(Duration::from_millis(500))
            .container_exited(ContainerExitedRequest {
                container_id: "c1".into(),
                pod: pod.clone(),
                oom_killed: true,
                wait_for_plan,
                restore_lost: None,
                memory_lost: false,
            })
            .expect("container_exited")
    };
    let ExitAnswer::Preparing {
        checkpoint_ref: preparing,
        wait_ms,
    } = exited(true)
    else {
        panic!("no preparing answer");
    };
    let answered = t.elapsed();
    assert_eq!(preparing, checkpoint_ref);
    assert!(answered < Duration::from_millis(500), "{answered:?}");
    assert!((5_000..=stasis_node_api::MAX_PREPARE_WAIT_MS).contains(&wait_ms));
    // What `stasis-runc delete` writes from the answer.
    planfile::write_pending(
        &planfile::path_for_pending(&w.run_dir().join("plans"), &pod.pod_uid, "counter").unwrap(),
        &Pending {
            v: PROTOCOL_VERSION,
            checkpoint_ref: checkpoint_ref.clone(),
            until_unix_ms: stasis_core::time::now_ms() + wait_ms,
        },
    )
    .unwrap();

    // The kubelet's restart: the same pod's container, created through the wrapper, which
    // waits for the plan and restores.
    let b2 = pod_bundle(&w, "b2", &env, &pod.pod_uid, &pod.pod_name);
    let rx = wrapper_create_start(&mut w, &b2, "c2");
    let first = first_count(&rx);
    assert!(
        !w.run_dir()
            .join("plans/pod_uid-oom-1_counter.pending")
            .exists(),
        "the wait is over: a later create must not wait again"
    );
    eprintln!(
        "restart in place: answered in {} ms, counting again {} ms after the exit; first count {first} (counted {before}..{after} around the checkpoint); cache {:?}",
        answered.as_millis(),
        t.elapsed().as_millis(),
        cache.stats()
    );
    let log = std::fs::read_to_string(w.path("log.json")).unwrap_or_default();
    assert!(
        first > before && first <= after + 1,
        "first={first}, before={before}, after={after}; runc log: {log}"
    );
    assert!(cache.stats().hits > cached.hits, "{:?}", cache.stats());
    assert!(
        log.contains(&format!("from checkpoint {checkpoint_ref}")),
        "{log}"
    );

    // The wrapper's report removed the restore directory: again only the reference (and the
    // mark that it was restored in place).
    let until = Instant::now() + Duration::from_secs(5);
    let left = [
        kept.join(".stasis-latest.json"),
        kept.join(".stasis-restored-in-place"),
    ];
    while files_under(&w.path("images")) != left {
        assert!(
            Instant::now() < until,
            "restore directory left: {:?}",
            files_under(&w.path("images"))
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // A second OOM kill before the next checkpoint: a cold start, not a restore loop.
    match exited(true) {
        ExitAnswer::NoPlan { reason } => {
            assert!(reason.contains("restored in place already"), "{reason}")
        }
        other => panic!("{other:?}"),
    }

    drop(server);
}

#[test]
fn a_restore_lost_before_its_container_started_restores_again_on_the_next_create() {
    if !ready("a_restore_lost_before_its_container_started_restores_again_on_the_next_create") {
        return;
    }
    let mut w = World::new("lost");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let env = ["STATE_MB=16", "INTERVAL_MS=100"];
    let source = PodRef {
        pod_uid: "uid-lost-src".into(),
        pod_namespace: "default".into(),
        pod_name: "counter-s".into(),
        container_name: "counter".into(),
    };
    let b1 = pod_bundle(&w, "b1", &env, &source.pod_uid, &source.pod_name);
    let lines = w.run_piped(&b1, "c1");
    wait_counts(&lines, 5);
    let server = AgentServer::start(&w, &exec);
    let before = last_count(&lines).unwrap();
    let answer = Client::new(&server.sock)
        .final_checkpoint(FinalCheckpointRequest {
            pod: source.clone(),
            ..stop_request("c1")
        })
        .expect("checkpoint");
    let CheckpointAnswer::Done { checkpoint_ref, .. } = answer else {
        panic!("checkpoint: {answer:?}");
    };
    let after = last_count(&lines).unwrap();
    w.runc().delete_force("c1").unwrap();

    // The replacement pod's restore, prepared as for its PodRestore.
    let uid = "uid-lost-new";
    let b2 = pod_bundle(&w, "b2", &env, uid, "counter-n");
    exec.prepare(&PrepareJob {
        reference: checkpoint_ref.parse().unwrap(),
        namespace: "default".into(),
        pod_uid: uid.into(),
        container_name: None,
        layout: None,
        spec_hash: None,
        image_digest: stasis_engine::restore::bundle_image_digest(&b2).unwrap(),
        declared: BTreeMap::new(),
        manifest_digest: None,
    })
    .expect("prepare");
    let plans = w.run_dir().join("plans");
    let pending = planfile::path_for_pending(&plans, uid, "counter").unwrap();

    // The create restores and takes the plan; the kubelet dies before `start`, and containerd
    // deletes the container it gave up on.
    let _lost = wrapper_create(&mut w, &b2, "c2");
    assert!(
        !plans.join(format!("pod_{uid}_counter.json")).exists(),
        "the create took the plan"
    );
    assert!(wrapper(&w, &["delete", "--force", "c2"]).success());
    let log_file = w.path("log.json");
    let log = || std::fs::read_to_string(&log_file).unwrap_or_default();
    assert!(
        pending.exists(),
        "the delete of a container that never started waits for its restore again; log: {}",
        log()
    );
    assert!(
        log().contains(&format!(
            "c2 was deleted before it started, losing its restore from {checkpoint_ref}: the agent is preparing"
        )),
        "{}",
        log()
    );

    // The kubelet's next create of the container restores the same checkpoint.
    let rx = wrapper_create_start(&mut w, &b2, "c3");
    let first = first_count(&rx);
    eprintln!(
        "lost restore: the next create restored {checkpoint_ref}: first count {first} (counted {before}..{after} around the checkpoint)"
    );
    assert!(
        first > before && first <= after + 1,
        "first={first}, before={before}, after={after}; log: {}",
        log()
    );

    // A container that started is not taken for a lost restore when it is deleted.
    wait_for("the restart-in-place's pending note to go", 5, || {
        !pending.exists()
    });
    assert!(wrapper(&w, &["delete", "--force", "c3"]).success());
    assert!(!pending.exists(), "log: {}", log());
    assert_eq!(
        log().matches("deleted before it started").count(),
        1,
        "{}",
        log()
    );
    drop(server);
}
