//! stasis as an eviction responder of the EvictionRequest API (`lifecycle.k8s.io/v1alpha1`,
//! alpha in Kubernetes 1.37; the rules: [`stasis_api::eviction`]).
//!
//! A requester's `EvictionRequest` becomes an `Eviction` whose `status.targetResponders` are the
//! pod's `spec.evictionResponders` (the webhook names stasis there, [`eviction::RESPONDER`]).
//! Responders watch `Eviction`s, not `EvictionRequest`s: this agent watches the ones labelled
//! with its responder name (the controller labels each `Eviction` with its responders' names)
//! and acts on those whose target pod is bound to its node. When stasis's turn comes (`Active`,
//! with the controller's `startTime`), it takes the pod's final checkpoint through the very path
//! a termination takes ([`NodeHandler::final_checkpoint`]: the policy's `onTermination`, the
//! lineage, the deadline decision, the `PodCheckpoint` record, one checkpoint per pod at a time),
//! reports `heartbeatTime` (and `expectedCompletionTime` from the pod's measured cost) while it
//! runs, and sets `completionTime` with a message naming the published checkpoint, or saying why
//! there is none: the eviction then goes on to the next responder (in the end the imperative
//! evictor) and is never held longer than the checkpoint.
//!
//! The checkpoint is recorded as the pod's termination capture, taken ahead of its stop: when the
//! eviction then stops the pod (a SIGTERM through the runtime), the wrapper's final checkpoint
//! request is answered with it at once if the pod was held frozen since (the policy's
//! `holdUntilEvicted`) or a new checkpoint does not fit the grace period by the pod's measured
//! cost; otherwise the stop takes a new one, and the replacement loses only that checkpoint's
//! freeze instead of everything the pod did through the upload and the eviction's own path
//! (`Executor::final_covering`, two minutes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::ResourceExt;
use stasis_api::eviction::{self, Eviction, ResponderStatus, Turn, RESPONDER};
use stasis_core::deadline::Final;
use stasis_node_api::{FinalCheckpointRequest, PodRef, ResponseBody};
use stasis_service::shutdown::Shutdown;
use tracing::{debug, info, warn};

use super::{KubeCluster, MANAGER};
use crate::node::Agent;
use crate::server::NodeHandler;

/// The final checkpoint's budget: the API gives an `Eviction` no deadline, so this bounds it (the
/// pod's grace period bounds it further once the pod is being deleted). Far below the API's
/// heartbeat deadline, though heartbeats would keep the eviction waiting anyway.
const CHECKPOINT_BUDGET: Duration = Duration::from_secs(10 * 60);
/// Heartbeats while the checkpoint runs: the least interval the API asks for.
const HEARTBEAT: Duration = Duration::from_secs(eviction::HEARTBEAT_MIN_INTERVAL_SECS);
/// How often the agent looks again whether the API server serves `Eviction`s (the gate is off
/// by default).
const SERVED_RECHECK: Duration = Duration::from_secs(60);
/// Evictions answered are remembered this long (a late watch event must not start another
/// checkpoint).
const REMEMBER: Duration = Duration::from_secs(3600);

/// Why a reconcile is retried.
#[derive(Debug, thiserror::Error)]
pub enum ResponderError {
    #[error("cannot report to the Eviction: {0}")]
    Kube(#[from] kube::Error),
}

struct Responder {
    cluster: Arc<KubeCluster>,
    agent: Arc<Agent>,
    /// The final report of each `Eviction` answered (by UID): sent again if sending it failed,
    /// never followed by another checkpoint.
    answered: Mutex<HashMap<String, (Instant, String)>>,
}

impl Responder {
    fn answer_of(&self, uid: &str) -> Option<String> {
        let mut m = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, (at, _)| at.elapsed() < REMEMBER);
        m.get(uid).map(|(_, msg)| msg.clone())
    }

    fn remember(&self, uid: &str, message: &str) {
        let mut m = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(uid.to_owned(), (Instant::now(), message.to_owned()));
    }
}

/// Answers the `Eviction`s of the pods of this node until `shutdown`; waits first for the pods
/// of the node to be known and for the API server to serve `Eviction`s.
pub async fn run(cluster: Arc<KubeCluster>, agent: Arc<Agent>, shutdown: Shutdown) {
    tokio::select! {
        _ = stasis_api::cache::wait_ready(&cluster.pods) => {}
        _ = shutdown.wait() => return,
    }
    let group_version = format!("{}/{}", eviction::GROUP, eviction::VERSION);
    let mut said = false;
    loop {
        match cluster
            .client
            .list_api_group_resources(&group_version)
            .await
        {
            Ok(list) if list.resources.iter().any(|r| r.name == eviction::PLURAL) => break,
            Ok(_) | Err(_) if !said => {
                info!(
                    api = %group_version,
                    "the API server does not serve Evictions (feature gate EvictionRequestAPI off): \
                     not answering as an eviction responder; looking again every minute"
                );
                said = true;
            }
            _ => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(SERVED_RECHECK) => {}
            _ = shutdown.wait() => return,
        }
    }
    info!(
        responder = RESPONDER,
        "answering Evictions of this node's pods"
    );
    let ctx = Arc::new(Responder {
        cluster: cluster.clone(),
        agent,
        answered: Mutex::default(),
    });
    Controller::new(
        Api::<Eviction>::all(cluster.client.clone()),
        watcher::Config::default().labels(RESPONDER),
    )
    .graceful_shutdown_on(shutdown.stopped())
    .run(reconcile, error_policy, ctx)
    .for_each(|r| async move {
        if let Err(e) = r {
            debug!(error = %e, "Eviction controller");
        }
    })
    .await;
}

fn error_policy(ev: Arc<Eviction>, e: &ResponderError, _: Arc<Responder>) -> Action {
    warn!(eviction = %ev.name_any(), namespace = ?ev.namespace(), error = %e, "eviction responder; retrying");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(ev: Arc<Eviction>, ctx: Arc<Responder>) -> Result<Action, ResponderError> {
    if ev.turn(RESPONDER) != Turn::Active {
        return Ok(Action::await_change());
    }
    let (Some(ns), Some(target)) = (ev.namespace(), ev.target_pod()) else {
        return Ok(Action::await_change());
    };
    // Only the agent of the pod's node answers.
    let Some(pod) = ctx
        .cluster
        .pod_by_uid(&target.uid)
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
    else {
        return Ok(Action::await_change());
    };
    let api: Api<Eviction> = Api::namespaced(ctx.cluster.client.clone(), &ns);
    let name = ev.name_any();
    let uid = ev.uid().unwrap_or_default();
    let message = match ctx.answer_of(&uid) {
        Some(m) => m,
        None => {
            let m = take_final_checkpoint(&ctx, &api, &name, &pod).await;
            ctx.remember(&uid, &m);
            m
        }
    };
    let now = crate::status::now();
    let done = ResponderStatus {
        name: RESPONDER.into(),
        heartbeat_time: Some(now.clone()),
        completion_time: Some(now),
        message: Some(message),
        ..Default::default()
    };
    match report(&api, &name, &eviction::responder_patch(&done)).await {
        Ok(()) => {
            info!(namespace = %ns, eviction = %name, pod = %pod.name_any(), "eviction responder done");
            Ok(Action::await_change())
        }
        // Refused: no longer stasis's turn (the eviction was canceled, or the controller moved
        // on): nothing to report any more.
        Err(kube::Error::Api(s)) if s.code == 422 => {
            warn!(namespace = %ns, eviction = %name, reason = %s.message, "the Eviction no longer takes stasis's report");
            Ok(Action::await_change())
        }
        Err(e) => Err(e.into()),
    }
}

/// Patches stasis's own `status.responders[]` entry ([`eviction::responder_patch`]).
async fn report(api: &Api<Eviction>, name: &str, patch: &serde_json::Value) -> kube::Result<()> {
    let pp = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    };
    api.patch_status(name, &pp, &Patch::Strategic(patch))
        .await
        .map(drop)
}

/// A heartbeat's patch: the present time, and the expected completion while it lies ahead; once
/// passed it is removed (`null`), since a stale estimate misleads and the API refuses one set in
/// the past.
fn heartbeat_patch(expected: Option<&Time>, now: Time) -> serde_json::Value {
    let ahead = expected.filter(|e| e.0 > now.0).cloned();
    let stale = expected.is_some() && ahead.is_none();
    let mut p = eviction::responder_patch(&ResponderStatus {
        name: RESPONDER.into(),
        heartbeat_time: Some(now),
        expected_completion_time: ahead,
        message: Some(
            "stasis is taking the pod's final checkpoint; the pod is evicted once it is published"
                .into(),
        ),
        ..Default::default()
    });
    if stale {
        p["status"]["responders"][0]["expectedCompletionTime"] = serde_json::Value::Null;
    }
    p
}

/// Takes the pod's final checkpoint, reporting heartbeats meanwhile; returns the completion
/// message (what was published, or why nothing was).
async fn take_final_checkpoint(
    ctx: &Responder,
    api: &Api<Eviction>,
    name: &str,
    pod: &Pod,
) -> String {
    let req = match final_request(pod) {
        Ok(r) => r,
        Err(why) => return format!("stasis took no final checkpoint: {why}; the eviction goes on"),
    };
    let expected = estimate(ctx, &req.pod.pod_uid).map(|d| {
        let t = k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_millis(d.as_millis() as i64);
        Time(t)
    });
    let beat = || heartbeat_patch(expected.as_ref(), crate::status::now());
    if let Err(e) = report(api, name, &beat()).await {
        warn!(eviction = %name, error = %e, "cannot report the start of the final checkpoint");
    }
    info!(eviction = %name, namespace = %req.pod.pod_namespace, pod = %req.pod.pod_name, "eviction: taking the final checkpoint");
    let agent = ctx.agent.clone();
    let mut job = tokio::task::spawn_blocking(move || agent.final_checkpoint(&req));
    let answer = loop {
        tokio::select! {
            r = &mut job => break r,
            _ = tokio::time::sleep(HEARTBEAT) => {
                if let Err(e) = report(api, name, &beat()).await {
                    warn!(eviction = %name, error = %e, "cannot report a heartbeat");
                }
            }
        }
    };
    match answer {
        Ok(a) => completion_message(&a),
        Err(e) => {
            format!("stasis's final checkpoint failed: its task ended ({e}); the eviction goes on")
        }
    }
}

/// The expected cost of the pod's final checkpoint: the deadline decision's estimate (the mean
/// freeze + upload of its recent checkpoints), which it states when nothing is left to spend.
/// `None` when the pod has no measured checkpoint or nothing published yet.
fn estimate(ctx: &Responder, pod_uid: &str) -> Option<Duration> {
    match ctx
        .agent
        .exec
        .final_decision(pod_uid, Duration::ZERO, false)
    {
        Final::Skip(s) => Some(s.estimate),
        Final::Take | Final::Wait => None,
    }
}

/// The request a stopping container's runtime would send, for the pod's first running app
/// container (the checkpoint holds every container of the pod).
fn final_request(pod: &Pod) -> Result<FinalCheckpointRequest, String> {
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()) && c.container_id.is_some())
        .ok_or("the pod has no running container")?;
    let id = running.container_id.as_deref().unwrap_or_default();
    let id = id.split_once("://").map_or(id, |(_, id)| id);
    Ok(FinalCheckpointRequest {
        container_id: id.to_owned(),
        pod: PodRef {
            pod_uid: pod.uid().unwrap_or_default(),
            pod_namespace: pod.namespace().unwrap_or_default(),
            pod_name: pod.name_any(),
            container_name: running.name.clone(),
        },
        deadline_ms: CHECKPOINT_BUDGET.as_millis() as u64,
        answer_when_captured: false,
        // (ahead of the stop; the agent holds the pod only when its policy asks for it:
        // `holdUntilEvicted`)
        hold_until_stopped: true,
    })
}

/// What stasis says when it is done: the checkpoint the replacement restores, or why there is
/// none.
fn completion_message(a: &ResponseBody) -> String {
    match a {
        ResponseBody::Done { checkpoint_ref, .. } => format!(
            "stasis published the pod's final checkpoint {checkpoint_ref}: the pod may be \
             evicted, its replacement restores it"
        ),
        ResponseBody::Captured { checkpoint_ref, .. } => format!(
            "stasis captured the pod's final checkpoint {checkpoint_ref} (still uploading): the \
             pod may be evicted"
        ),
        ResponseBody::Skipped { reason } => {
            format!("stasis took no final checkpoint: {reason}; the eviction goes on")
        }
        ResponseBody::Failed { reason } | ResponseBody::Error { reason } => format!(
            "stasis's final checkpoint failed: {reason}; the eviction goes on, and the \
             replacement restores the pod's latest published checkpoint, if it has one"
        ),
        other => {
            format!("stasis's final checkpoint gave no answer ({other:?}); the eviction goes on")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(statuses: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "app", "image": "i"}]},
            "status": {"containerStatuses": statuses}
        }))
        .unwrap()
    }

    #[test]
    fn the_request_names_a_running_container_of_the_pod() {
        let p = pod(json!([
            {"name": "gone", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
             "state": {"terminated": {"exitCode": 0}}, "containerID": "containerd://old"},
            {"name": "app", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
             "state": {"running": {}}, "containerID": "containerd://abc123"}
        ]));
        let r = final_request(&p).unwrap();
        assert_eq!(r.container_id, "abc123");
        assert_eq!(
            (
                r.pod.pod_uid.as_str(),
                r.pod.pod_namespace.as_str(),
                r.pod.pod_name.as_str()
            ),
            ("u1", "ns", "p")
        );
        assert_eq!(r.pod.container_name, "app");
        assert_eq!(r.deadline_ms, CHECKPOINT_BUDGET.as_millis() as u64);
        assert!(!r.answer_when_captured, "the eviction waits for the upload");
        let none = final_request(&pod(json!([]))).unwrap_err();
        assert!(none.contains("no running container"), "{none}");
    }

    #[test]
    fn a_heartbeat_keeps_the_expected_completion_only_while_it_lies_ahead() {
        let t = |s: &str| Time(s.parse().unwrap());
        let now = t("2026-12-02T05:35:42Z");
        let entry = |p: serde_json::Value| p["status"]["responders"][0].clone();
        let ahead = entry(heartbeat_patch(
            Some(&t("2026-12-02T05:36:00Z")),
            now.clone(),
        ));
        assert_eq!(ahead["heartbeatTime"], "2026-12-02T05:35:42Z");
        assert_eq!(ahead["expectedCompletionTime"], "2026-12-02T05:36:00Z");
        let passed = entry(heartbeat_patch(
            Some(&t("2026-12-02T05:35:33Z")),
            now.clone(),
        ));
        assert_eq!(
            passed.get("expectedCompletionTime"),
            Some(&serde_json::Value::Null),
            "removed once passed: {passed}"
        );
        let none = entry(heartbeat_patch(None, now));
        assert!(none.get("expectedCompletionTime").is_none(), "{none}");
        assert!(none.get("completionTime").is_none(), "{none}");
    }

    #[test]
    fn the_completion_names_the_checkpoint_or_the_reason() {
        let done = completion_message(&ResponseBody::Done {
            checkpoint_ref: "ns_deployment_web/ck-1".into(),
            end_with_kill: false,
        });
        assert!(done.contains("ns_deployment_web/ck-1"), "{done}");
        let failed = completion_message(&ResponseBody::Failed {
            reason: "the store refused the upload".into(),
        });
        assert!(
            failed.contains("failed: the store refused the upload"),
            "{failed}"
        );
        assert!(failed.contains("the eviction goes on"), "{failed}");
        let skipped = completion_message(&ResponseBody::Skipped {
            reason: "no CheckpointPolicy selects this pod".into(),
        });
        assert!(skipped.contains("no CheckpointPolicy"), "{skipped}");
    }
}
