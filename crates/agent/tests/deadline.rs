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
//! And, against a real S3 server (s3s-fs) behind a slow link (`testkit::net::Throttle`, so that
//! an upload lasts seconds): a termination that meets a heartbeat uploading stops that upload
//! (nothing of it is published) and publishes its own checkpoint, instead of waiting for it;
//! and, for a pod whose checkpoints cannot finish in the time left, takes that heartbeat as the
//! final checkpoint, answering at once while its upload goes on.
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

use stasis_agent::error::{AgentError, Result};
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
    /// The termination records started (their reasons) and how they finished (the reference,
    /// or the error).
    records: Mutex<Vec<(String, Option<RecordEnd>)>>,
}

/// How a termination record finished: its checkpoint's reference, or the error.
type RecordEnd = std::result::Result<String, String>;

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
    fn checkpoint_started(&self, _: &PodInfo, _: &Stamp, r: &str, _: Duration) -> Option<String> {
        let mut records = self.records.lock().unwrap();
        records.push((r.to_owned(), None));
        Some((records.len() - 1).to_string())
    }
    fn checkpoint_finished(
        &self,
        rec: Option<&str>,
        _: &PodInfo,
        _: &Stamp,
        r: &Result<CheckpointOutcome>,
    ) {
        let i: usize = rec.expect("a record").parse().unwrap();
        self.records.lock().unwrap()[i].1 = Some(
            r.as_ref()
                .map(|o| o.reference.clone())
                .map_err(|e| e.to_string()),
        );
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
    let (lines, cluster, agent, key) = counter_pod(&mut w, &exec, uid, pod_name, 16);

    // A heartbeat, published: what the replacement restores when the final one is skipped.
    let job = heartbeat_of(cluster.stamp(&key).unwrap(), "d1", pod_name);
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

/// Bytes per second of the slow link to the S3 server: a 32 MiB counter's upload takes ≈ 4 s.
const SLOW_LINK: u64 = 8 * 1024 * 1024;

#[test]
fn a_termination_stops_a_heartbeat_upload_and_publishes_its_own_checkpoint() {
    let test = "a_termination_stops_a_heartbeat_upload_and_publishes_its_own_checkpoint";
    if !ready(test) {
        return;
    }
    let mut w = World::new("supersede");
    let s3 = w.path("s3");
    std::fs::create_dir_all(s3.join("ckpts")).unwrap();
    let Some(server) = stasis_testkit::s3::S3Server::start(test, &s3) else {
        return;
    };
    let link = stasis_testkit::net::Throttle::start(server.port, SLOW_LINK);
    eprintln!(
        "the S3 server is reached through a {} MiB/s link",
        SLOW_LINK >> 20
    );
    // The store reads its S3 settings from the environment, as stasisd does.
    for (k, v) in server.client_env() {
        std::env::set_var(k, v);
    }
    std::env::set_var("AWS_ENDPOINT_URL", link.endpoint());
    let rt = runtime();
    let store = rt
        .block_on(async { stasis_store::Store::open("s3://ckpts/supersede") })
        .unwrap();
    let exec = executor_on(&w, &rt, store, stasis_store::Key::random());
    let (uid, pod_name) = ("uid-supersede-1", "counter-s");
    let (_lines, cluster, agent, key) = counter_pod(&mut w, &exec, uid, pod_name, 32);
    let heartbeat = heartbeat_job(&agent, cluster.stamp(&key).unwrap(), "d1", uid, pod_name);

    // The first heartbeat runs to the end: the pod's measured cost, and what a cancelled upload
    // would otherwise leave the replacement.
    let (first, _) = heartbeat();
    let first = first.expect("the first heartbeat");
    eprintln!(
        "heartbeat {}: freeze {} ms, upload {} ms",
        first.reference, first.freeze_ms, first.upload_ms
    );
    assert!(
        first.upload_ms >= 2_000,
        "the slow link did not slow the upload ({} ms)",
        first.upload_ms
    );

    // The second is uploading when the stop comes, with 30 s left: its upload is stopped, and
    // the final checkpoint is taken at once and published.
    let second = std::thread::spawn(heartbeat.clone());
    wait_for("the second heartbeat's upload", 30, || {
        agent.busy.is_uploading(uid)
    });
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    let (answer, took) = final_checkpoint(&agent, 30_000, false);
    let (second, second_ended) = second.join().unwrap();
    eprintln!(
        "stop during the second heartbeat's upload: {answer:?} in {} ms; the heartbeat ended \
         {} ms after the stop: {second:?}",
        took.as_millis(),
        second_ended.duration_since(asked).as_millis()
    );
    let Err(AgentError::Superseded(why)) = &second else {
        panic!("the heartbeat uploading was not stopped: {second:?}");
    };
    assert!(why.contains("final checkpoint"), "{why}");
    // Stopped within moments, not after the rest of its ≈ 4 s upload.
    assert!(
        second_ended.duration_since(asked) < Duration::from_millis(first.upload_ms / 2),
        "the heartbeat ended {:?} after the stop",
        second_ended.duration_since(asked)
    );
    let ResponseBody::Done { checkpoint_ref, .. } = answer else {
        panic!("the final checkpoint was not taken: {answer:?}");
    };
    assert_ne!(checkpoint_ref, first.reference);
    assert_eq!(
        metric(
            &agent,
            "stasis_agent_checkpoints_total{result=\"superseded\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &agent,
            "stasis_agent_checkpoints_total{result=\"succeeded\"}"
        ),
        2.0
    );
    assert!(cluster.skipped.lock().unwrap().is_empty());

    // The store holds the first heartbeat and the final checkpoint, nothing of the stopped
    // one, and no lease left behind.
    let listed = rt.block_on(exec.store().list(None)).unwrap();
    let mut refs: Vec<String> = listed.iter().map(|c| c.reference().to_string()).collect();
    refs.sort();
    let mut want = vec![first.reference.clone(), checkpoint_ref.clone()];
    want.sort();
    assert_eq!(refs, want);
    // (s3s-fs keeps each object as a file under the bucket's directory.)
    assert!(!walk_files(&s3.join("ckpts/supersede/manifests")).is_empty());
    let leases = walk_files(&s3.join("ckpts/supersede/leases"));
    assert!(leases.is_empty(), "leases left: {leases:?}");

    // A pod whose checkpoints cost more than the time left (the stand-in: its recorded cost
    // set to 60 s a checkpoint): the stop that comes during a heartbeat's upload takes that
    // heartbeat as the final checkpoint. The answer (at the capture, as the wrapper asks) names
    // it at once, and its upload goes on to publish it.
    eprintln!("stand-in: the pod's recorded cost is set to 60 s a checkpoint");
    // (Another pod: this one's stop was answered above, and covers its containers.)
    let (uid, pod_name) = ("uid-supersede-2", "counter-s2");
    let b = pod_bundle(&w, "b2", &["STATE_MB=32", "INTERVAL_MS=50"], uid, pod_name);
    let lines = w.run_piped(&b, "d2");
    wait_counts(&lines, 5);
    let key = PodKey {
        uid: uid.into(),
        name: pod_name.into(),
        ..key
    };
    for _ in 0..COST_SAMPLES {
        exec.note_measured(
            uid,
            Measured {
                freeze_ms: 10_000,
                upload_ms: 50_000,
            },
        );
    }
    let heartbeat = heartbeat_job(&agent, cluster.stamp(&key).unwrap(), "d2", uid, pod_name);
    let third = std::thread::spawn(heartbeat);
    wait_for("the third heartbeat's upload", 30, || {
        agent.busy.is_uploading(uid)
    });
    let asked = Instant::now();
    let t = Instant::now();
    let answer = agent.final_checkpoint(&FinalCheckpointRequest {
        deadline_ms: 30_000,
        answer_when_captured: true,
        ..stop_request("d2")
    });
    let took = t.elapsed();
    let (third, third_ended) = third.join().unwrap();
    let third = third.expect("the heartbeat taken as the final checkpoint");
    eprintln!(
        "stop during the third heartbeat's upload, no new checkpoint fits: {answer:?} in {} ms; \
         the heartbeat published {} ms after the stop",
        took.as_millis(),
        third_ended.duration_since(asked).as_millis()
    );
    let ResponseBody::Captured { checkpoint_ref, .. } = answer else {
        panic!("the heartbeat uploading was not taken as the final checkpoint: {answer:?}");
    };
    assert_eq!(checkpoint_ref, third.reference);
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    // Recorded as the pod's termination checkpoint once the heartbeat published.
    let want = ("Termination".to_owned(), Some(Ok(third.reference.clone())));
    wait_for(
        "the termination record of the adopted heartbeat",
        10,
        || cluster.records.lock().unwrap().last() == Some(&want),
    );
    assert_eq!(
        metric(
            &agent,
            "stasis_agent_checkpoints_total{result=\"final_adopted\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &agent,
            "stasis_agent_checkpoints_total{result=\"superseded\"}"
        ),
        1.0
    );
    assert!(cluster.skipped.lock().unwrap().is_empty());

    // The counter ran on through all of it.
    let before = last_count(&lines).unwrap();
    wait_counts(&lines, before + 5);
}

/// Every file under `dir` (none when it does not exist).
fn walk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                todo.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// A heartbeat of container `id` as the agent runs one (`k8s::jobs`): the pod's guard held, its
/// upload stoppable; returns its outcome and when it ended.
fn heartbeat_job(
    agent: &Agent,
    stamp: stasis_agent::fence::Stamp,
    id: &str,
    uid: &'static str,
    pod_name: &str,
) -> impl Fn() -> (Result<CheckpointOutcome>, Instant) + Clone + Send + 'static {
    let (busy, exec) = (agent.busy.clone(), agent.exec.clone());
    let job = heartbeat_of(stamp, id, pod_name);
    move || {
        let _g = busy.try_take(uid).expect("the pod is free");
        let job = CheckpointJob {
            upload_stop: Some(busy.upload_stop(uid)),
            ahead_of_stop: false,
            ..job.clone()
        };
        let r = exec.checkpoint(&job, &|| Verdict::NoRecord);
        (r, Instant::now())
    }
}

/// A heartbeat of container `id` of pod `pod_name` (namespace `default`).
fn heartbeat_of(stamp: stasis_agent::fence::Stamp, id: &str, pod_name: &str) -> CheckpointJob {
    CheckpointJob {
        target: Target::ContainerId(id.into()),
        namespace: "default".into(),
        pod_name: pod_name.into(),
        stamp,
        spec_hash: None,
        declared: BTreeMap::new(),
        reason: "Heartbeat".into(),
        leave_running: true,
        deadline: None,
        on_captured: None,
        expected: Vec::new(),
        hold: None,
        upload_stop: None,
        ahead_of_stop: false,
    }
}

/// A counter of `state_mb` MiB as container `d1` of pod `pod_name` (`uid`), counting; its
/// lines, the recording cluster, an agent over `exec` and the pod's key.
fn counter_pod(
    w: &mut World,
    exec: &Arc<stasis_agent::executor::Executor>,
    uid: &str,
    pod_name: &str,
    state_mb: u32,
) -> (stasis_testkit::Lines, Arc<Recording>, Agent, PodKey) {
    let state = format!("STATE_MB={state_mb}");
    let b = pod_bundle(w, "b1", &[&state, "INTERVAL_MS=50"], uid, pod_name);
    let lines = w.run_piped(&b, "d1");
    wait_counts(&lines, 5);
    let cluster = Arc::new(Recording::default());
    let agent = Agent {
        exec: exec.clone(),
        cluster: cluster.clone(),
        busy: Arc::new(Busy::default()),
    };
    let key = PodKey {
        namespace: "default".into(),
        name: pod_name.into(),
        uid: uid.into(),
    };
    (lines, cluster, agent, key)
}
