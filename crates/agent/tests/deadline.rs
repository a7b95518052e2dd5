//! Final checkpoints with a deadline, with real runc and CRIU and a `file://` store: a counter
//! pod's heartbeat is taken and published; then
//!
//! - a final checkpoint with 6 s left, for a pod whose checkpoints cost ≈ 11 s (the 2 GiB pod of
//!   docs/benchmarks.md: freeze 4.2 s + upload 7 s), is skipped at once, before any freeze: the
//!   answer is `skipped` naming the estimate, the time left and the heartbeat the replacement
//!   restores; the pod gets a Warning Event with that text; `stasis_agent_checkpoints_total
//!   {result="final_skipped"}` counts it; the freeze histogram is unchanged and the counter
//!   keeps counting;
//! - the same request while a heartbeat is in progress waits for it, lets it publish, and is
//!   then skipped, naming it;
//! - the same request with 30 s left is taken and published.
//!
//! The one stand-in: the pod's recorded cost is the 2 GiB pod's (noted with
//! `Executor::note_measured`, as the agent notes each checkpoint it takes); this counter's own
//! checkpoints cost a fraction of a second, and a 2 GiB pod does not fit this test's machine.
//!
//! Needs root, CRIU >= 4.2, runc and the counter image; run under a reaping subreaper
//! (`tini -s`). Without them the test prints SKIPPED (and fails when `CI` is set).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stasis_agent::error::Result;
use stasis_agent::executor::{CheckpointJob, CheckpointOutcome, NotInPlace, Target};
use stasis_agent::fence::{Stamp, Verdict};
use stasis_agent::node::{Agent, Busy, Cluster, InPlace, PodInfo, Standalone};
use stasis_agent::reports::Delivery;
use stasis_agent::server::NodeHandler;
use stasis_agent::status::PodKey;
use stasis_core::interval::{Measured, COST_SAMPLES};
use stasis_node_api::{FinalCheckpointRequest, PodRef, ReportRequest, ResponseBody};

use common::*;

/// [`Standalone`], keeping the Warning Events of skipped final checkpoints.
#[derive(Default)]
struct Recording {
    skipped: Mutex<Vec<String>>,
}

impl Cluster for Recording {
    fn pod(&self, pod: &PodRef) -> Option<PodInfo> {
        Standalone.pod(pod)
    }
    fn stamp(&self, pod: &PodKey) -> std::result::Result<Stamp, String> {
        Standalone.stamp(pod)
    }
    fn fence(&self, stamp: &Stamp) -> Verdict {
        Standalone.fence(stamp)
    }
    fn checkpoint_started(&self, p: &PodInfo, s: &Stamp, r: &str, t: Duration) -> Option<String> {
        Standalone.checkpoint_started(p, s, r, t)
    }
    fn checkpoint_finished(
        &self,
        rec: Option<&str>,
        p: &PodInfo,
        s: &Stamp,
        r: &Result<CheckpointOutcome>,
    ) {
        Standalone.checkpoint_finished(rec, p, s, r)
    }
    fn report(&self, req: &ReportRequest, delivery: Delivery) {
        Standalone.report(req, delivery)
    }
    fn restart_in_place(
        &self,
        p: &PodInfo,
        c: &str,
        cause: InPlace,
        d: std::result::Result<&str, &NotInPlace>,
    ) {
        Standalone.restart_in_place(p, c, cause, d)
    }
    fn final_skipped(&self, _: &PodInfo, message: &str) {
        self.skipped.lock().unwrap().push(message.to_owned());
    }
}

/// A value of the agent's metrics exposition (0 when absent).
fn metric(agent: &Agent, series: &str) -> f64 {
    agent
        .exec
        .metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

const FREEZES: &str = "stasis_agent_phase_seconds_count{phase=\"freeze\"}";
const SKIPPED: &str = "stasis_agent_checkpoints_total{result=\"final_skipped\"}";

/// `answer_when_captured`: as the wrapper asks (the answer comes at the capture, or at the
/// skip when there is none).
fn final_checkpoint(
    agent: &Agent,
    deadline_ms: u64,
    answer_when_captured: bool,
) -> (ResponseBody, Duration) {
    let t = Instant::now();
    let answer = agent.final_checkpoint(&FinalCheckpointRequest {
        deadline_ms,
        answer_when_captured,
        ..stop_request("d1")
    });
    (answer, t.elapsed())
}

#[test]
fn a_final_checkpoint_that_cannot_finish_in_time_is_skipped_before_the_freeze() {
    if !ready("a_final_checkpoint_that_cannot_finish_in_time_is_skipped_before_the_freeze") {
        return;
    }
    let mut w = World::new("deadline");
    let rt = runtime();
    let exec = executor(&w, &rt);
    let (uid, pod_name) = ("uid-deadline-1", "counter-d");
    let b = pod_bundle(&w, "b1", &["STATE_MB=16", "INTERVAL_MS=50"], uid, pod_name);
    let lines = w.run_piped(&b, "d1");
    wait_counts(&lines, 5);
    let cluster = Arc::new(Recording::default());
    let agent = Agent {
        exec: exec.clone(),
        cluster: cluster.clone(),
        busy: Arc::new(Busy::default()),
    };

    // A heartbeat, published: what the replacement restores when the final one is skipped.
    let key = PodKey {
        namespace: "default".into(),
        name: pod_name.into(),
        uid: uid.into(),
    };
    let job = CheckpointJob {
        target: Target::ContainerId("d1".into()),
        namespace: "default".into(),
        pod_name: pod_name.into(),
        stamp: cluster.stamp(&key).unwrap(),
        spec_hash: None,
        declared: BTreeMap::new(),
        reason: "Heartbeat".into(),
        leave_running: true,
        deadline: None,
        on_captured: None,
        expected: Vec::new(),
        hold: None,
    };
    let heartbeat = agent.checkpoint(&job).expect("heartbeat");
    eprintln!(
        "heartbeat {}: freeze {} ms, upload {} ms",
        heartbeat.reference, heartbeat.freeze_ms, heartbeat.upload_ms
    );
    assert_eq!(metric(&agent, FREEZES), 1.0);

    // The pod's recorded cost: the 2 GiB pod's (see the module comment).
    eprintln!("stand-in: the pod's recorded cost is set to the 2 GiB pod's, 4.2 s + 7 s");
    for _ in 0..COST_SAMPLES {
        exec.note_measured(
            uid,
            Measured {
                freeze_ms: 4_200,
                upload_ms: 7_000,
            },
        );
    }

    // 6 s left (the wrapper's 6.3 s less the agent's 300 ms margin): skipped at once.
    let before = last_count(&lines).unwrap();
    let (answer, took) = final_checkpoint(&agent, 6_300, true);
    eprintln!("6 s left: {answer:?} in {} ms", took.as_millis());
    let ResponseBody::Skipped { reason } = answer else {
        panic!("a final checkpoint of ≈ 11 s with 6 s left was not skipped: {answer:?}");
    };
    assert!(
        reason
            .starts_with("final checkpoint skipped: it would take about 11 s and 6.0 s were left"),
        "{reason}"
    );
    assert!(reason.contains(&heartbeat.reference), "{reason}");
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    assert_eq!(*cluster.skipped.lock().unwrap(), vec![reason.clone()]);
    assert_eq!(metric(&agent, SKIPPED), 1.0);
    // Never frozen: no capture ran, and the counter goes on.
    assert_eq!(metric(&agent, FREEZES), 1.0, "the pod was frozen");
    wait_counts(&lines, before + 5);
    let state = w.runc_output(&["state", "d1"]);
    let state = String::from_utf8_lossy(&state.stdout);
    assert!(state.contains("\"status\": \"running\""), "{state}");

    // A heartbeat in progress when the stop comes: waited for (never cancelled), published,
    // and then the final checkpoint is skipped, naming that heartbeat.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let in_progress = {
        let (exec, busy, job) = (exec.clone(), agent.busy.clone(), job.clone());
        std::thread::spawn(move || {
            let _g = busy.try_take(uid).expect("the pod is free");
            started_tx.send(()).unwrap();
            exec.checkpoint(&job, &|| Verdict::NoRecord)
        })
    };
    started_rx.recv().unwrap();
    let (answer, took) = final_checkpoint(&agent, 6_300, true);
    let second = in_progress
        .join()
        .unwrap()
        .expect("the heartbeat in progress");
    eprintln!(
        "6 s left, heartbeat in progress: {answer:?} in {} ms",
        took.as_millis()
    );
    let ResponseBody::Skipped { reason } = answer else {
        panic!("with a heartbeat in progress and 6 s left: {answer:?}");
    };
    assert!(reason.contains(&second.reference), "{reason}");
    assert_eq!(metric(&agent, SKIPPED), 2.0);
    assert_eq!(
        metric(&agent, FREEZES),
        2.0,
        "only the heartbeats froze the pod"
    );

    // 30 s left: the ≈ 11 s checkpoint fits; taken and published.
    let (answer, took) = final_checkpoint(&agent, 30_000, false);
    eprintln!("30 s left: {answer:?} in {} ms", took.as_millis());
    let ResponseBody::Done { checkpoint_ref, .. } = answer else {
        panic!("a final checkpoint of ≈ 11 s with 30 s left was not taken: {answer:?}");
    };
    assert_ne!(checkpoint_ref, heartbeat.reference);
    assert_eq!(metric(&agent, FREEZES), 3.0);
    assert_eq!(metric(&agent, SKIPPED), 2.0);
    assert_eq!(cluster.skipped.lock().unwrap().len(), 2);
}
