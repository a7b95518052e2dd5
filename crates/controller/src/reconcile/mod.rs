//! The reconcilers (leader only): pods (heartbeats, holders, decisions made at admission),
//! `PodCheckpoint`s (publishing with fencing, retention, stuck checkpoints, final checkpoints),
//! `PodRestore`s (the restore-loop guard), `CheckpointPolicy` status, and a sweep over the
//! lineage records (docs/design.md §13).

mod apply;
mod checkpoint;
mod decision_report;
mod heartbeat;
mod pod;
mod policy;
mod restore;
mod retention;
mod sweep;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use stasis_api::condition::{self, reason, set_condition};
use stasis_api::names;
use stasis_api::{
    pod as podfacts, CheckpointPhase, CheckpointPolicy, CheckpointPolicyStatus, CheckpointReason,
    PodCheckpoint, PodCheckpointSpec, PodCheckpointStatus, PodRestore, PodRestoreSpec,
    PodRestoreStatus, RestoreFailure, RestorePhase,
};
use stasis_core::lineage::{retention, Lineage, LineageCheckpoint};
use stasis_core::policy::parse_duration;
use stasis_core::reference::{CheckpointId, CheckpointRef};
use stasis_service::shutdown::Shutdown;

use crate::cache::{Checkpoints, RecordCache, RecordIndex};
use crate::holder::holder_state;
use crate::metrics::Metrics;
use crate::record::{refresh, Holder, Record, Records};
use crate::schedule::{
    eligible, heartbeat_name, jitter_ms, next_heartbeat, policy_for, protected_since,
    CheckpointView, HeartbeatInputs, Next,
};
use crate::{k8s_time, now_ms, time_ms, Error, Result};

pub use checkpoint::reconcile_checkpoint;
pub use pod::reconcile_pod;
pub use policy::reconcile_policy;
pub use restore::{failure_signature, reconcile_restore};
pub use sweep::sweep;
#[allow(unused_imports)]
use {
    apply::*, checkpoint::*, decision_report::*, heartbeat::*, pod::*, policy::*, restore::*,
    retention::*, sweep::*,
};

/// Field manager of the controller's writes.
pub const MANAGER: &str = "stasis-controller";

/// Settings of the reconcilers.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub runtime_class: String,
    /// A pending/running checkpoint without progress for this long is marked failed.
    pub in_flight_timeout: Duration,
    /// A claim whose pod never appeared is released after this long.
    pub phantom_after: Duration,
    /// How long after a pod's creation the commit of its claim waits for a source's in-flight
    /// final checkpoint (`--final-wait-seconds`, as at admission).
    pub final_wait: Duration,
    /// How often the lineage records are swept.
    pub sweep_every: Duration,
    /// An orphaned lineage without checkpoints whose pod is gone is deleted this long after it
    /// was orphaned.
    pub collect_records_after: Duration,
    /// At most this many lineage records per workload namespace.
    pub max_records_per_namespace: usize,
}

/// Shared state of the reconcilers.
pub struct Context {
    pub client: Client,
    pub records: Records,
    pub recorder: Recorder,
    pub metrics: Metrics,
    pub cfg: ControllerConfig,
    pub policies: Store<CheckpointPolicy>,
    /// Shared with the webhook (every replica keeps it), looked up by pod and by lineage.
    pub checkpoints: Checkpoints,
    pub restores: Store<PodRestore>,
    pub record_maps: Store<ConfigMap>,
    /// The same records parsed, by holder UID and claim token (fed by the same watch).
    pub record_index: RecordIndex,
    pub pods: Store<Pod>,
    /// Pod UID → when its last heartbeat was skipped (freeze budget).
    pub skips: Mutex<HashMap<String, u64>>,
    /// Interruptions seen and the nodes' pools, for `interval: auto` (in memory).
    pub evictions: Mutex<stasis_core::interval::EvictionLog>,
    /// The store, for deleting manifests by retention (`None`: CRs only).
    pub store: Option<stasis_store::Store>,
    /// The process's cache of owners' metadata, asked before the API server when a pod's
    /// workload is verified (`None`: read from the API server).
    pub owners: Option<crate::owners::OwnerCache>,
}

impl Context {
    /// The pod's workload, its owners verified as at admission (the owners' cache first).
    pub(crate) async fn verified_identity(
        &self,
        ns: &str,
        pod: &Pod,
    ) -> Result<std::result::Result<stasis_core::workload::WorkloadIdentity, (&'static str, String)>>
    {
        crate::webhook::verified_identity(&self.client, self.owners.as_ref(), ns, pod).await
    }

    /// Every readable lineage record (a damaged one is skipped, never silently: it is counted
    /// and logged when it arrives, and its pods look unregistered until someone repairs or
    /// deletes it).
    pub(crate) fn all_records(&self) -> Vec<Record> {
        self.record_index.records()
    }

    /// The record of `namespace` whose registered holder is the pod `uid` (the held one first,
    /// then the newest generation: a stopping pod still owns its orphaned lineage until a
    /// replacement claims it).
    pub(crate) fn record_of_holder(&self, namespace: &str, uid: &str) -> Option<Record> {
        self.record_index
            .by_holder(namespace, uid)
            .into_iter()
            .filter(|r| r.held_by(namespace, uid))
            .max_by_key(|r| (!r.lineage.orphaned, r.lineage.generation))
    }

    /// The record of `namespace` whose holder token is `token` (held or orphaned): a token is
    /// only ever looked up in the pod's own namespace.
    pub(crate) fn record_with_token(&self, namespace: &str, token: &str) -> Option<Record> {
        self.record_index
            .by_token(namespace, token)
            .into_iter()
            .filter(|r| r.namespace == namespace && r.lineage.holder.as_deref() == Some(token))
            .max_by_key(|r| (!r.lineage.orphaned, r.lineage.generation))
    }

    /// The checkpoints of a record's registered holder pod: all that [`holder_state`] reads
    /// (its final checkpoint in flight), found by the cache's index.
    pub(crate) fn holder_checkpoints(&self, r: &Record) -> Vec<PodCheckpoint> {
        r.holder_uid()
            .map(|uid| self.checkpoints.of_pod(&r.namespace, uid))
            .unwrap_or_default()
            .iter()
            .map(|c| (**c).clone())
            .collect()
    }

    pub(crate) async fn event(
        &self,
        pod_ref: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: reason.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, pod_ref).await {
            tracing::warn!(error = %e, reason, "event not published");
        }
    }
}

pub(super) fn drain<T, E: std::fmt::Display>(
    controller: &'static str,
) -> impl FnMut(std::result::Result<T, E>) -> futures::future::Ready<()> {
    move |r| {
        if let Err(e) = r {
            tracing::debug!(controller, error = %e, "controller stream");
        }
        futures::future::ready(())
    }
}

pub(super) fn error_policy<K>(
    controller: &'static str,
) -> impl Fn(Arc<K>, &Error, Arc<Context>) -> Action {
    move |_obj, err, ctx| {
        ctx.metrics.failed(controller, err);
        match err {
            Error::Conflict(_) => Action::requeue(Duration::from_millis(200)),
            _ => {
                tracing::warn!(controller, error = %err, "reconcile failed");
                Action::requeue(Duration::from_secs(5))
            }
        }
    }
}

/// The pod a `PodCheckpoint` change reconciles. Not the pod of a heartbeat still in flight:
/// the reconcile that created it requeued itself, and its creation or `Running` changes no
/// outcome of the pod's reconcile (a heartbeat in flight is one from its creation, whatever
/// its phase; a holder's final checkpoint is never a heartbeat). Its end (`Succeeded`,
/// `Failed`) and every change of any other checkpoint still reconcile the pod. Each heartbeat
/// reconciled its pod three times before, one per change; now once.
pub(crate) fn pod_to_reconcile(c: PodCheckpoint) -> Option<ObjectRef<Pod>> {
    let in_flight_heartbeat =
        c.spec.reason == CheckpointReason::Heartbeat && CheckpointView::of(&c).in_flight();
    if in_flight_heartbeat {
        return None;
    }
    Some(ObjectRef::new(&c.spec.source_pod_name).within(&c.namespace()?))
}

/// Everything the reconcilers need from outside.
pub struct Setup {
    pub client: Client,
    pub namespace: String,
    pub identity: String,
    pub metrics: Metrics,
    pub cfg: ControllerConfig,
    pub store: Option<stasis_store::Store>,
    /// The `PodCheckpoint` cache the process keeps for the webhook ([`Checkpoints::watch`]).
    pub checkpoints: Checkpoints,
    /// The owners' metadata cache the process keeps for the webhook.
    pub owners: Option<crate::owners::OwnerCache>,
    /// The lineage records' cache the process keeps for the webhook ([`RecordCache::watch`]).
    pub records: RecordCache,
    /// The process's stop (its signal handler is the binary's): the reconcilers finish what
    /// they are doing and return.
    pub shutdown: Shutdown,
}

/// Runs the reconcilers and the sweep until `setup.shutdown`.
pub async fn run(setup: Setup) -> Result<()> {
    let client = setup.client.clone();
    let wc = watcher::Config::default;
    let pod_ctrl = Controller::new(Api::<Pod>::all(client.clone()), wc()).watches(
        Api::<PodCheckpoint>::all(client.clone()),
        wc(),
        pod_to_reconcile,
    );
    let ck_ctrl = Controller::new(Api::<PodCheckpoint>::all(client.clone()), wc());
    let pr_ctrl = Controller::new(Api::<PodRestore>::all(client.clone()), wc());
    let pol_ctrl = Controller::new(Api::<CheckpointPolicy>::all(client.clone()), wc());
    let ctx = Arc::new(Context {
        client: client.clone(),
        records: Records::new(client.clone(), &setup.namespace)
            .with_cap(setup.cfg.max_records_per_namespace),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: Some(setup.identity.clone()),
            },
        ),
        metrics: setup.metrics.clone(),
        cfg: setup.cfg.clone(),
        policies: pol_ctrl.store(),
        checkpoints: setup.checkpoints.clone(),
        restores: pr_ctrl.store(),
        record_maps: setup.records.maps.clone(),
        record_index: setup.records.index.clone(),
        pods: pod_ctrl.store(),
        skips: Mutex::new(HashMap::new()),
        evictions: Mutex::new(stasis_core::interval::EvictionLog::new(
            stasis_core::time::now_ms(),
        )),
        store: setup.store,
        owners: setup.owners,
    });
    let cks = ck_ctrl
        .graceful_shutdown_on(setup.shutdown.stopped())
        .run(
            reconcile_checkpoint,
            error_policy("checkpoints"),
            ctx.clone(),
        )
        .for_each(drain("checkpoints"));
    let prs = pr_ctrl
        .graceful_shutdown_on(setup.shutdown.stopped())
        .run(reconcile_restore, error_policy("restores"), ctx.clone())
        .for_each(drain("restores"));
    let pols = pol_ctrl
        .graceful_shutdown_on(setup.shutdown.stopped())
        .run(reconcile_policy, error_policy("policies"), ctx.clone())
        .for_each(drain("policies"));
    // Heartbeats wait until the checkpoints, policies and records are known: an empty cache
    // would schedule checkpoints that already exist.
    let pods = {
        let (ctx, shutdown) = (ctx.clone(), setup.shutdown.clone());
        async move {
            let caches = async {
                ctx.checkpoints.wait_ready().await;
                stasis_api::cache::wait_ready(&ctx.policies).await;
                stasis_api::cache::wait_ready(&ctx.record_maps).await;
            };
            tokio::select! {
                _ = caches => {}
                _ = shutdown.wait() => return,
            }
            tracing::info!("caches ready: reconciling pods");
            pod_ctrl
                .graceful_shutdown_on(shutdown.stopped())
                .run(reconcile_pod, error_policy("pods"), ctx.clone())
                .for_each(drain("pods"))
                .await
        }
    };
    let sweeper = {
        let ctx = ctx.clone();
        async move {
            stasis_api::cache::wait_ready(&ctx.record_maps).await;
            stasis_api::cache::wait_ready(&ctx.pods).await;
            loop {
                tokio::time::sleep(ctx.cfg.sweep_every).await;
                if let Err(e) = sweep(&ctx).await {
                    ctx.metrics.failed("sweep", &e);
                    tracing::warn!(error = %e, "sweep");
                }
            }
        }
    };
    tokio::select! {
        _ = async { tokio::join!(cks, prs, pols, pods) } => {}
        _ = sweeper => {}
    }
    Ok(())
}
