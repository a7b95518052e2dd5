//! The agent's node side: the [`NodeHandler`] behind the socket (its checkpoints taken one at a
//! time per pod, [`crate::busy`]), and the [`Cluster`] seam through which it learns about pods
//! and reports to the API server (the Kubernetes implementation is `k8s::KubeCluster`;
//! [`Standalone`] needs no cluster).

use std::collections::BTreeMap;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime};

use stasis_core::deadline::{Final, Skipped};
use stasis_core::WorkloadName;
use stasis_node_api::{
    ColdStartCause, ContainerExitedRequest, FinalCheckpointRequest, PodRef, ReportEvent,
    ReportRequest, ResponseBody, RestorePlanRequest,
};
use tracing::{info, warn};

pub use crate::busy::{Busy, BusyGuard, FinalWait};
use crate::error::{AgentError, Result};
use crate::executor::{
    CheckpointJob, CheckpointOutcome, Executor, KeptLatest, NotInPlace, OutOfStep, PodLayout,
    PrepareJob, Target,
};
use crate::fence::{self, Stamp, Verdict};
use crate::reports::Delivery;
use crate::server::NodeHandler;
use crate::status::PodKey;

/// What the agent knows about a pod on its node.
#[derive(Debug, Clone)]
pub struct PodInfo {
    pub key: PodKey,
    pub spec_hash: Option<String>,
    pub declared: BTreeMap<String, String>,
    /// `metadata.deletionTimestamp` (the end of the grace period) when the pod is terminating.
    pub deletion_deadline: Option<SystemTime>,
    /// Whether the kubelet restarts its containers in place (`restartPolicy` not `Never`).
    pub restarts_in_place: bool,
    /// Whether a clean exit reads as the work being finished (`restartPolicy` `Never` or
    /// `OnFailure`, as a Job's pods have): after its final checkpoint such a pod's container
    /// ends with SIGKILL, so that its owner replaces it (and the replacement restores).
    pub clean_exit_finishes: bool,
    /// Whether a termination checkpoint is wanted (a policy selects the pod with
    /// `onTermination: true`); the reason when not.
    pub final_wanted: std::result::Result<(), FinalNotWanted>,
    /// Its containers by its spec (checkpointed and restored together; init containers skipped
    /// on a restore). Default: not known.
    pub layout: PodLayout,
    /// Whether a policy selecting it has `holdUntilEvicted`: the eviction responder's final
    /// checkpoint keeps it frozen until its stop.
    pub hold_until_evicted: bool,
    /// Its app containers' liveness probes (a hold ends before they would fail).
    pub liveness: Vec<stasis_core::policy::LivenessProbe>,
}

/// Why no termination checkpoint is wanted for a pod (the `skipped` answer's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FinalNotWanted {
    #[error("no CheckpointPolicy selects this pod")]
    NoPolicy,
    #[error("its CheckpointPolicy has onTermination: false")]
    OnTerminationOff,
}

/// The cluster as the node side sees it.
pub trait Cluster: Send + Sync {
    /// The pod a container belongs to.
    fn pod(&self, pod: &PodRef) -> Option<PodInfo>;
    /// The lineage and generation the pod's checkpoints are written under, from the lineage
    /// record naming the pod as holder; `Err` says why there is none (the pod is then not
    /// checkpointed).
    fn stamp(&self, pod: &PodKey) -> std::result::Result<Stamp, String>;
    /// The fencing verdict for a stamp (reads the lineage record).
    fn fence(&self, stamp: &Stamp) -> Verdict;
    /// A checkpoint the agent started itself (termination): record it; returns its record's
    /// name.
    fn checkpoint_started(
        &self,
        pod: &PodInfo,
        stamp: &Stamp,
        reason: &str,
        timeout: Duration,
    ) -> Option<String>;
    fn checkpoint_finished(
        &self,
        record: Option<&str>,
        pod: &PodInfo,
        stamp: &Stamp,
        result: &Result<CheckpointOutcome>,
    );
    /// The wrapper's report of a restore or a cold start; one that may have been handled
    /// already ([`Delivery::MaybeAgain`]: taken from a file an agent may have handled before it
    /// died) is not applied again where its effect shows.
    fn report(&self, req: &ReportRequest, delivery: Delivery);
    /// A container of `pod` was OOM-killed, or lost its restore before it started (`cause`):
    /// `Ok(checkpoint)` when its restart restores that checkpoint in place (record it),
    /// `Err(why)` when it starts cold (say why; a lost restore's cold start is reported as a
    /// wrapper's, through [`Cluster::report`]).
    fn restart_in_place(
        &self,
        pod: &PodInfo,
        container: &str,
        cause: InPlace,
        decision: std::result::Result<&str, &NotInPlace>,
    );
    /// The pod's final checkpoint was skipped because it could not finish before its deadline
    /// (`message` says why and what the replacement restores): a Warning Event on the pod.
    fn final_skipped(&self, _pod: &PodInfo, _message: &str) {}
    /// The pod's final checkpoint is its heartbeat `reference`, captured as the stop came (or
    /// the newest state that could be published in time): an Event on the pod.
    fn final_adopted(&self, _pod: &PodInfo, _reference: &str) {}
    /// A member of the pod's restore started cold and its peers followed (what was stopped
    /// and withdrawn): a Warning Event on the pod.
    fn out_of_step(&self, _pod: &PodRef, _what: &OutOfStep) {}
}

/// [`Agent::relay_report`]: the cluster told, and when a container of a pod restore starts
/// cold, the rest of its pod follows it, so that no container runs from the checkpoint beside
/// one that starts over (`executor::members`).
fn relay(exec: &Executor, cluster: &dyn Cluster, req: &ReportRequest, delivery: Delivery) {
    cluster.report(req, delivery);
    if !matches!(req.event, ReportEvent::ColdStart { .. }) {
        return;
    }
    if let Some(out) = exec.member_cold(&req.pod.pod_uid, &req.pod.container_name) {
        warn!(pod_uid = %req.pod.pod_uid, cold = %out.cold, stopped = ?out.stopped, withdrawn = ?out.withdrawn, "a pod member starts cold: its whole pod does");
        cluster.out_of_step(&req.pod, &out);
    }
}

impl InPlace {
    /// What lost the restore, in the words of its Events (`None`: an OOM kill lost none).
    pub(crate) fn lost_words(self) -> Option<&'static str> {
        match self {
            InPlace::OomKilled => None,
            InPlace::RestoreLost => {
                Some("was deleted before it started (its create was given up), which lost its restore")
            }
            InPlace::MemoryLost => Some(
                "was ended while its memory was still arriving (the node's agent stopped during its lazy restore), which lost its restore",
            ),
        }
    }
}

/// A restart in place that will not happen: the container starts cold, said once for either
/// cause. A lost restore's cold start is reported as the wrapper reports one (its PodRestore
/// `ColdStart`, a Warning Event), its pod's other members following it: its next create,
/// finding no plan, would otherwise start cold without a word.
fn not_in_place(
    exec: &Executor,
    cluster: &dyn Cluster,
    pod: &PodInfo,
    container: &str,
    cause: InPlace,
    why: &NotInPlace,
) {
    let Some(lost) = cause.lost_words() else {
        return cluster.restart_in_place(pod, container, cause, Err(why));
    };
    exec.metrics.restore("cold_start");
    let req = ReportRequest {
        container_id: String::new(),
        pod: PodRef {
            pod_uid: pod.key.uid.clone(),
            pod_namespace: pod.key.namespace.clone(),
            pod_name: pod.key.name.clone(),
            container_name: container.to_owned(),
        },
        event: ReportEvent::ColdStart {
            cause: ColdStartCause::RestoreFailed,
            reason: format!(
                "container {container} {lost}, and it could not be prepared again: {why}"
            ),
            checkpoint_ref: None,
        },
    };
    relay(exec, cluster, &req, Delivery::First);
}

/// Why a container restarts in place from a checkpoint kept on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlace {
    /// The OOM killer ended it.
    OomKilled,
    /// Its create was given up after it had taken its restore (the kubelet or containerd died or
    /// timed out): the workload never ran from it, and the next create restores it again.
    RestoreLost,
    /// It ran from a lazy restore and was ended because its memory could not arrive (the agent
    /// serving it stopped): the next create restores it again.
    MemoryLost,
}

/// No cluster: pods are known from the container annotations alone, each writes its own
/// lineage, nothing fences, nothing is recorded.
pub struct Standalone;

impl Cluster for Standalone {
    fn pod(&self, pod: &PodRef) -> Option<PodInfo> {
        Some(PodInfo {
            key: PodKey {
                namespace: pod.pod_namespace.clone(),
                name: pod.pod_name.clone(),
                uid: pod.pod_uid.clone(),
            },
            spec_hash: None,
            declared: BTreeMap::new(),
            deletion_deadline: None,
            final_wanted: Ok(()),
            restarts_in_place: true,
            clean_exit_finishes: false,
            layout: PodLayout::default(),
            // (no policies: the request alone decides)
            hold_until_evicted: true,
            liveness: Vec::new(),
        })
    }
    fn stamp(&self, pod: &PodKey) -> std::result::Result<Stamp, String> {
        let key = WorkloadName::sanitize(&format!("{}_pod_{}", pod.namespace, pod.name));
        Ok(fence::standalone_stamp(&key, &pod.namespace, &pod.uid))
    }
    fn fence(&self, _stamp: &Stamp) -> Verdict {
        Verdict::NoRecord
    }
    fn checkpoint_started(&self, _: &PodInfo, _: &Stamp, _: &str, _: Duration) -> Option<String> {
        None
    }
    fn checkpoint_finished(
        &self,
        _: Option<&str>,
        _: &PodInfo,
        _: &Stamp,
        _: &Result<CheckpointOutcome>,
    ) {
    }
    fn report(&self, _: &ReportRequest, _: Delivery) {}
    fn restart_in_place(
        &self,
        _: &PodInfo,
        _: &str,
        _: InPlace,
        _: std::result::Result<&str, &NotInPlace>,
    ) {
    }
}

/// The deadline of a termination checkpoint: what the wrapper allows (less a margin to answer
/// in), bounded by the end of the pod's grace period (less a margin for the SIGTERM).
pub fn final_deadline(
    now: Instant,
    now_wall: SystemTime,
    requested_ms: u64,
    deletion_deadline: Option<SystemTime>,
) -> Option<Instant> {
    let asked = Duration::from_millis(requested_ms).checked_sub(Duration::from_millis(300))?;
    let grace = match deletion_deadline {
        None => asked,
        Some(d) => d
            .duration_since(now_wall)
            .ok()?
            .checked_sub(Duration::from_millis(500))?,
    };
    let left = asked.min(grace);
    (!left.is_zero()).then(|| now + left)
}

pub struct Agent {
    pub exec: Arc<Executor>,
    pub cluster: Arc<dyn Cluster>,
    pub busy: Arc<Busy>,
}

impl Agent {
    /// A failed restore whose lazy restore failed first (a damaged chunk found before the
    /// container ran): the report, which only knows that `runc restore` failed, with the cause.
    fn with_lazy_cause(&self, req: &ReportRequest) -> Option<ReportRequest> {
        let ReportEvent::ColdStart {
            cause: ColdStartCause::RestoreFailed,
            reason,
            checkpoint_ref,
        } = &req.event
        else {
            return None;
        };
        let why = self.exec.lazy_failure_before_run(
            &req.pod.pod_uid,
            &req.pod.container_name,
            Duration::from_secs(2),
        )?;
        Some(ReportRequest {
            event: ReportEvent::ColdStart {
                cause: ColdStartCause::RestoreFailed,
                reason: format!("{reason}; its memory could not be served: {why}"),
                checkpoint_ref: checkpoint_ref.clone(),
            },
            ..req.clone()
        })
    }

    /// Passes a restore's outcome (the wrapper's report, or a lazy restore whose memory could
    /// not arrive) to the cluster, and keeps the rest of its pod in step with it.
    pub fn relay_report(&self, req: &ReportRequest) {
        relay(&self.exec, &*self.cluster, req, Delivery::First);
    }

    /// Runs one checkpoint of a pod (the caller holds the pod's [`BusyGuard`]).
    pub fn checkpoint(&self, job: &CheckpointJob) -> Result<CheckpointOutcome> {
        let cluster = self.cluster.clone();
        let stamp = job.stamp.clone();
        self.exec.checkpoint(job, &move || cluster.fence(&stamp))
    }

    /// Starts preparing a restart in place from `kept` (marked as taken first: no restore
    /// loop) on a thread of its own, so that the runtime's `delete` gets its answer at once;
    /// returns how long the restarted container's `create` may wait for the plan. The thread
    /// records the PodRestore once the checkpoint is fetched, then writes the plan; on failure
    /// the pod gets a Warning `ColdStart` Event naming why, and the waiting `create` a note.
    fn start_in_place(
        &self,
        pod: &PodInfo,
        name: &str,
        cause: InPlace,
        kept: &KeptLatest,
    ) -> std::result::Result<u64, NotInPlace> {
        let refused = |why: String| NotInPlace::Fetch {
            checkpoint_ref: kept.checkpoint_ref.clone(),
            why,
        };
        let reference: stasis_core::CheckpointRef = kept
            .checkpoint_ref
            .parse()
            .map_err(|e| refused(format!("not a checkpoint reference: {e}")))?;
        // The data key is the pod's namespace's: a record naming another is not followed.
        if !kept.namespace.is_empty() && kept.namespace != pod.key.namespace {
            return Err(refused(format!(
                "it was kept for namespace {}, the pod is in {}",
                kept.namespace, pod.key.namespace
            )));
        }
        self.exec.mark_restored_in_place(&pod.key.uid, name)?;
        let wait_ms = kept.prepare_wait_ms();
        let until = crate::executor::now_ms() + wait_ms;
        let job = PrepareJob {
            reference,
            namespace: pod.key.namespace.clone(),
            pod_uid: pod.key.uid.clone(),
            container_name: Some(name.to_owned()),
            layout: None,
            spec_hash: pod.spec_hash.clone(),
            image_digest: kept.image_digest.clone(),
            declared: pod.declared.clone(),
            manifest_digest: kept.manifest_digest.clone(),
        };
        let (exec, cluster, pod, name) = (
            self.exec.clone(),
            self.cluster.clone(),
            pod.clone(),
            name.to_owned(),
        );
        std::thread::Builder::new()
            .name("restart-in-place".into())
            .spawn(move || {
                let r = exec.prepare_in_place(&job, until, |checkpoint| {
                    cluster.restart_in_place(&pod, &name, cause, Ok(checkpoint))
                });
                if let Err(why) = r {
                    not_in_place(&exec, &*cluster, &pod, &name, cause, &why);
                }
            })
            .map_err(|e| refused(format!("cannot start its thread: {e}")))?;
        Ok(wait_ms)
    }

    fn final_checkpoint_inner(&self, req: &FinalCheckpointRequest) -> ResponseBody {
        let skipped = |r: &str| ResponseBody::Skipped { reason: r.into() };
        let c = self.exec.resolve(&req.container_id);
        let pod = match &c {
            Ok(c) => c.pod().unwrap_or_else(|| req.pod.clone()),
            Err(_) => req.pod.clone(),
        };
        // The stop of a pod held frozen since its checkpoint: it runs again first, so that the
        // stop reaches it whatever is answered (a paused container cannot take its SIGTERM).
        let was_held = !req.hold_until_stopped
            && !pod.pod_uid.is_empty()
            && self.exec.release_hold(&pod.pod_uid, "its stop came");
        if req.deadline_ms == 0 {
            return skipped("no time given");
        }
        let c = match c {
            Ok(c) => c,
            Err(e) => return skipped(&e.to_string()),
        };
        if pod.pod_uid.is_empty() {
            return skipped("not a pod's container (no CRI annotations)");
        }
        let Some(info) = self.cluster.pod(&pod) else {
            return skipped("the agent does not know this pod");
        };
        if let Err(why) = &info.final_wanted {
            return skipped(&why.to_string());
        }
        // A pod the controller has not registered yet (its first second or so) holds no
        // lineage: its stop goes on without a final checkpoint.
        let stamp = match self.cluster.stamp(&info.key) {
            Ok(s) => s,
            Err(why) => return skipped(&why),
        };
        let Some(deadline) = final_deadline(
            Instant::now(),
            SystemTime::now(),
            req.deadline_ms,
            info.deletion_deadline,
        ) else {
            return skipped("no time left in the grace period");
        };
        let end_with_kill = info.clean_exit_finishes;
        let left = deadline.saturating_duration_since(Instant::now());
        // The pod's termination checkpoint of a moment ago holds this container too (the kubelet
        // stops a pod's containers one by one; the first stop checkpoints them all). One taken
        // ahead of the stop (the eviction responder's) is the pod's state at its capture: unless
        // the pod was held frozen since, it has run on through the upload and the eviction's
        // path, and a new checkpoint that fits the time left loses only its own freeze.
        let mut replacing = None;
        if let Some(cover) = self.exec.final_covering(&pod.pod_uid, &c.id) {
            let checkpoint_ref = cover.reference;
            if !cover.ahead_of_stop
                || req.hold_until_stopped
                || was_held
                || !self.exec.new_checkpoint_fits(&pod.pod_uid, left)
            {
                info!(container = %req.container_id, %checkpoint_ref, "held by the pod's final checkpoint");
                return ResponseBody::Done {
                    checkpoint_ref,
                    end_with_kill,
                };
            }
            info!(container = %req.container_id, ahead = %checkpoint_ref, left_ms = left.as_millis() as u64,
                "the pod ran on after its checkpoint taken ahead of the stop; a new one fits the time left");
            replacing = Some(checkpoint_ref);
        }
        // Said early, before anything is frozen: a final checkpoint that cannot finish in time
        // would freeze the pod and publish nothing. A checkpoint in progress is waited for
        // (below) and the decision made again when it ends.
        if let Final::Skip(s) =
            self.exec
                .final_decision(&pod.pod_uid, left, self.busy.is_busy(&pod.pod_uid))
        {
            return final_skipped(&self.exec, self.cluster.as_ref(), &info, &s);
        }
        let (captured_tx, captured_rx) = mpsc::channel();
        let job = CheckpointJob {
            target: Target::ContainerId(c.id.clone()),
            namespace: info.key.namespace.clone(),
            pod_name: info.key.name.clone(),
            stamp: stamp.clone(),
            spec_hash: info.spec_hash.clone(),
            declared: info.declared.clone(),
            reason: "Termination".into(),
            leave_running: true,
            deadline: Some(deadline),
            on_captured: req.answer_when_captured.then_some(captured_tx),
            expected: info.layout.members.clone(),
            hold: (req.hold_until_stopped && info.hold_until_evicted)
                .then(|| stasis_core::policy::hold_limit(self.exec.hold_bound(), &info.liveness)),
            upload_stop: None,
            ahead_of_stop: req.hold_until_stopped,
        };
        let (tx, rx) = mpsc::channel();
        let asked = Instant::now();
        let (exec, cluster, busy) = (self.exec.clone(), self.cluster.clone(), self.busy.clone());
        let uid = pod.pod_uid.clone();
        let container_id = c.id.clone();
        // The request's span, into the thread that outlives the answer (the upload).
        let span = tracing::info_span!("final_checkpoint", namespace = %info.key.namespace, pod = %info.key.name);
        let spawned = std::thread::Builder::new()
            .name("final-checkpoint".into())
            .spawn(move || {
                let _span = span.entered();
                // A heartbeat in progress: its capture is waited for (a freeze is not cut
                // short). Then, when the stop came during that capture, the capture is this
                // pod's state at the stop: it is the final checkpoint, and the stop goes on
                // while it uploads. Otherwise its upload is stopped when a new checkpoint is
                // estimated to fit in the time left, and else it is the final checkpoint too
                // (the newest state that can be published in time). The controller keeps the
                // replacement waiting for it either way (busy.rs, docs/design.md §12.3).
                let fits = |left| exec.new_checkpoint_fits(&uid, left);
                let adopt_since = job.on_captured.is_some().then_some(asked);
                let _g = match busy.take_for_final(&uid, deadline, adopt_since, fits) {
                    FinalWait::Taken(g) => g,
                    FinalWait::Adopted(reference, ends) => {
                        if let Some(captured) = &job.on_captured {
                            let _ = captured.send(reference.clone());
                        }
                        // The first of the pod's stops to adopt it: counted, said, and recorded
                        // as the pod's termination checkpoint once the heartbeat ends, so that
                        // the controller and users see the final checkpoint as for any stop.
                        if let Some(ends) = ends {
                            exec.metrics.checkpoint("final_adopted");
                            cluster.final_adopted(&info, &reference);
                            let left = deadline.saturating_duration_since(Instant::now());
                            let record =
                                cluster.checkpoint_started(&info, &stamp, "Termination", left);
                            let r = ends.recv().unwrap_or_else(|_| {
                                Err("the heartbeat ended without a word".into())
                            });
                            let r = r.map_err(|why| {
                                AgentError::Invalid(format!(
                                    "the heartbeat {reference} taken as the final checkpoint failed: {why}"
                                ))
                            });
                            cluster.checkpoint_finished(record.as_deref(), &info, &stamp, &r);
                        }
                        let _ = tx.send(Ok(FinalEnd::Published(reference, 0)));
                        return;
                    }
                    FinalWait::TimedOut => {
                        let _ = tx.send(Err(AgentError::Deadline(
                            "a checkpoint of this pod was still in progress at the deadline".into(),
                        )));
                        return;
                    }
                };
                // The checkpoint waited for may have been this pod's final one, taken for another
                // of its containers stopping at the same time: it holds this one too (not the
                // capture ahead of the stop this one replaces).
                if let Some(cover) = exec.final_covering(&uid, &container_id) {
                    if replacing.as_ref() != Some(&cover.reference) {
                        let _ = tx.send(Ok(FinalEnd::Published(cover.reference, 0)));
                        return;
                    }
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if let Final::Skip(s) = exec.final_decision(&uid, left, false) {
                    let _ = tx.send(Ok(FinalEnd::Skipped(final_skipped(
                        &exec,
                        cluster.as_ref(),
                        &info,
                        &s,
                    ))));
                    return;
                }
                let record = cluster.checkpoint_started(&info, &stamp, "Termination", left);
                let a = Agent {
                    exec,
                    cluster: cluster.clone(),
                    busy: busy.clone(),
                };
                let r = a.checkpoint(&job);
                cluster.checkpoint_finished(record.as_deref(), &info, &stamp, &r);
                let _ = tx.send(r.map(|o| FinalEnd::Published(o.reference, o.total_ms)));
            });
        if spawned.is_err() {
            return ResponseBody::Failed {
                reason: "cannot start the checkpoint thread".into(),
            };
        }
        let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_millis(200);
        if req.answer_when_captured {
            // Captured: the stop goes on while the upload finishes in the thread (which records
            // the outcome on the PodCheckpoint). Disconnected: it ended before the capture.
            match captured_rx.recv_timeout(wait) {
                Ok(checkpoint_ref) => {
                    info!(container = %req.container_id, %checkpoint_ref, "final checkpoint captured; uploading");
                    return ResponseBody::Captured {
                        checkpoint_ref,
                        end_with_kill,
                    };
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return ResponseBody::Failed {
                        reason: "the final checkpoint was not captured before its deadline".into(),
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
        }
        match rx.recv_timeout(wait) {
            Ok(Ok(FinalEnd::Skipped(answer))) => answer,
            Ok(Ok(FinalEnd::Published(reference, total_ms))) => {
                info!(container = %req.container_id, %reference, total_ms, "final checkpoint done");
                ResponseBody::Done {
                    checkpoint_ref: reference,
                    end_with_kill,
                }
            }
            Ok(Err(e)) => {
                warn!(container = %req.container_id, error = %e, "final checkpoint failed");
                ResponseBody::Failed {
                    reason: e.to_string(),
                }
            }
            Err(_) => ResponseBody::Failed {
                reason: "the final checkpoint did not finish before its deadline".into(),
            },
        }
    }
}

/// How a final checkpoint's thread ended (its errors aside).
enum FinalEnd {
    /// Published: its reference and how long it took.
    Published(String, u64),
    /// Skipped before the freeze: the answer to give.
    Skipped(ResponseBody),
}

/// A final checkpoint skipped because it cannot finish in time: counted
/// (`stasis_agent_checkpoints_total{result="final_skipped"}`), a Warning Event on the pod, and
/// the `skipped` answer (the wrapper passes the stop on at once).
fn final_skipped(
    exec: &Executor,
    cluster: &dyn Cluster,
    pod: &PodInfo,
    s: &Skipped,
) -> ResponseBody {
    let reason = s.to_string();
    warn!(namespace = %pod.key.namespace, pod = %pod.key.name, estimate_ms = s.estimate.as_millis() as u64, left_ms = s.left.as_millis() as u64, fallback = %s.fallback, "final checkpoint skipped: it cannot finish before its deadline");
    exec.metrics.checkpoint("final_skipped");
    cluster.final_skipped(pod, &reason);
    ResponseBody::Skipped { reason }
}

impl NodeHandler for Agent {
    fn restore_plan(&self, req: &RestorePlanRequest) -> ResponseBody {
        match self
            .exec
            .plan_for(&req.container_id, &req.pod.pod_uid, &req.pod.container_name)
        {
            Some(p) => ResponseBody::Plan(p),
            None => ResponseBody::NoPlan {
                reason: "no restore prepared on this node for this container".into(),
            },
        }
    }

    fn final_checkpoint(&self, req: &FinalCheckpointRequest) -> ResponseBody {
        self.final_checkpoint_inner(req)
    }

    fn container_exited(&self, req: &ContainerExitedRequest) -> ResponseBody {
        // A lost restore first: the container never ran, whatever its memory cgroup says.
        let cause = match (&req.restore_lost, req.oom_killed) {
            (Some(_), _) if req.memory_lost => InPlace::MemoryLost,
            (Some(_), _) => InPlace::RestoreLost,
            (None, true) => InPlace::OomKilled,
            (None, false) => {
                return ResponseBody::NoPlan {
                    reason: "not killed by the OOM killer".into(),
                }
            }
        };
        let Some(pod) = self.cluster.pod(&req.pod) else {
            return ResponseBody::NoPlan {
                reason: "its pod is not known on this node".into(),
            };
        };
        let name = req.pod.container_name.as_str();
        if cause != InPlace::OomKilled {
            // (before runc deletes the container, whose process a lazy restore still serves)
            self.exec.restore_lost(&pod.key.uid, name);
        }
        let decision = if pod.deletion_deadline.is_some() {
            Err(NotInPlace::PodDeleting)
        } else if !pod.restarts_in_place && cause == InPlace::OomKilled {
            // (a create given up is tried again whatever the restart policy: the container
            // never ran)
            Err(NotInPlace::RestartPolicyNever)
        } else {
            self.exec
                .kept_for_restart(&pod.key.uid, name)
                .and_then(|kept| match req.wait_for_plan {
                    true => Ok(kept),
                    false => Err(NotInPlace::RuntimeCannotWait),
                })
                .and_then(|kept| {
                    self.start_in_place(&pod, name, cause, &kept)
                        .map(|w| (kept, w))
                })
        };
        match cause {
            InPlace::OomKilled => {
                info!(container = %req.container_id, pod = %pod.key.name, ?decision, "container OOM-killed")
            }
            InPlace::RestoreLost => warn!(
                container = %req.container_id, pod = %pod.key.name,
                lost = req.restore_lost.as_deref().unwrap_or_default(), ?decision,
                "a restored container was deleted before it started: its restore was lost"
            ),
            InPlace::MemoryLost => warn!(
                container = %req.container_id, pod = %pod.key.name,
                lost = req.restore_lost.as_deref().unwrap_or_default(), ?decision,
                "a container restored lazily was ended as its memory could not arrive: its restore was lost"
            ),
        }
        match decision {
            Ok((kept, wait_ms)) => ResponseBody::Preparing {
                checkpoint_ref: kept.checkpoint_ref,
                wait_ms,
            },
            Err(why) => {
                not_in_place(&self.exec, &*self.cluster, &pod, name, cause, &why);
                ResponseBody::NoPlan {
                    reason: why.to_string(),
                }
            }
        }
    }

    fn report(&self, req: &ReportRequest) {
        self.report_from_socket(req);
    }
}

impl Agent {
    /// Handles a runtime's report (the caller has claimed its file, if any: `reports`). A
    /// second delivery of the same report ([`Delivery::MaybeAgain`]) is harmless: the
    /// cluster does not apply again what its PodRestore shows; the container's plan files and
    /// images are removed again (already gone, unless a restart in place was prepared for it
    /// since: that restart then starts cold); a cold start's pod members follow it again (the
    /// members this agent knows, none after a restart). Its metrics count it again.
    pub(crate) fn handle_report(&self, req: &ReportRequest, delivery: Delivery) {
        let amended = self.with_lazy_cause(req);
        let req = amended.as_ref().unwrap_or(req);
        match &req.event {
            ReportEvent::Restored {
                checkpoint_ref,
                restore_ms,
            } => {
                info!(container = %req.container_id, %checkpoint_ref, restore_ms, "restored");
                self.exec.member_restored(
                    &req.pod.pod_uid,
                    &req.pod.container_name,
                    &req.container_id,
                );
                self.exec.metrics.restore("restored");
                self.exec.metrics.phase_ms("restore", *restore_ms);
            }
            ReportEvent::ColdStart { cause, reason, .. } => {
                info!(container = %req.container_id, ?cause, %reason, "cold start");
                self.exec.metrics.restore("cold_start");
            }
        }
        if !req.pod.pod_uid.is_empty() && !req.pod.container_name.is_empty() {
            self.exec.forget(&req.pod.pod_uid, &req.pod.container_name);
        }
        relay(&self.exec, &*self.cluster, req, delivery);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_deadline_is_bounded_by_the_grace_period() {
        let now = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // Only the wrapper's budget.
        assert_eq!(
            final_deadline(now, wall, 20_000, None),
            Some(now + Duration::from_millis(19_700))
        );
        // The grace period ends sooner.
        assert_eq!(
            final_deadline(now, wall, 20_000, Some(wall + Duration::from_secs(5))),
            Some(now + Duration::from_millis(4_500))
        );
        // Nothing left.
        assert_eq!(final_deadline(now, wall, 200, None), None);
        assert_eq!(
            final_deadline(now, wall, 20_000, Some(wall - Duration::from_secs(1))),
            None
        );
        assert_eq!(
            final_deadline(now, wall, 20_000, Some(wall + Duration::from_millis(400))),
            None
        );
    }
}
