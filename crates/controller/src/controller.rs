//! The reconcilers (leader only): pods (heartbeats, holders, decisions made at admission),
//! `PodCheckpoint`s (publishing with fencing, retention, stuck checkpoints, final checkpoints),
//! `PodRestore`s (the restore-loop guard), `CheckpointPolicy` status, and a sweep over the
//! lineage records (docs/design.md §13).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
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

use crate::metrics::Metrics;
use crate::record::{refresh, Holder, Record, Records};
use crate::schedule::{
    eligible, heartbeat_name, jitter_ms, next_heartbeat, policy_for, protected_since,
    CheckpointView, HeartbeatInputs, Next,
};
use crate::webhook::{checkpoint_pod_uid, holder_state};
use crate::{k8s_time, now_ms, time_ms, Error, Result};

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
    pub checkpoints: Store<PodCheckpoint>,
    pub restores: Store<PodRestore>,
    pub record_maps: Store<ConfigMap>,
    pub pods: Store<Pod>,
    /// Pod UID → when its last heartbeat was skipped (freeze budget).
    pub skips: Mutex<HashMap<String, u64>>,
    /// The store, for deleting manifests by retention (`None`: CRs only).
    pub store: Option<stasis_store::Store>,
}

impl Context {
    fn all_records(&self) -> Vec<Record> {
        self.record_maps
            .state()
            .iter()
            .filter_map(|cm| Record::from_config_map(cm).ok())
            .collect()
    }

    /// The record of `namespace` whose registered holder is the pod `uid` (the held one first,
    /// then the newest generation: a stopping pod still owns its orphaned lineage until a
    /// replacement claims it).
    fn record_of_holder(&self, namespace: &str, uid: &str) -> Option<Record> {
        self.all_records()
            .into_iter()
            .filter(|r| r.held_by(namespace, uid))
            .max_by_key(|r| (!r.lineage.orphaned, r.lineage.generation))
    }

    /// The record of `namespace` whose holder token is `token` (held or orphaned): a token is
    /// only ever looked up in the pod's own namespace.
    fn record_with_token(&self, namespace: &str, token: &str) -> Option<Record> {
        self.all_records()
            .into_iter()
            .filter(|r| r.namespace == namespace && r.lineage.holder.as_deref() == Some(token))
            .max_by_key(|r| (!r.lineage.orphaned, r.lineage.generation))
    }

    async fn event(
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

fn pod_uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// Pods: a stasis pod gets its holder registered, its admission decision materialised, its
/// lineage orphaned when it stops, and its heartbeat checkpoints.
pub async fn reconcile_pod(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action> {
    let class = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    if class != Some(ctx.cfg.runtime_class.as_str()) {
        return Ok(Action::await_change());
    }
    ctx.metrics.reconciled("pods");
    let ns = pod.namespace().unwrap_or_default();
    let uid = pod_uid(&pod);
    let token = pod.labels().get(names::CLAIM_TOKEN).cloned();
    let policy = policy_for(
        ctx.policies.state().iter().map(|p| p.as_ref()),
        &ns,
        pod.labels(),
    )
    .cloned();

    if uid.is_empty() {
        return Ok(Action::await_change());
    }

    // The pod's lineage record: the one of its namespace that names its UID as holder, else the
    // one its claim token holds, which it then registers as the first pod seen with the token.
    let mut record = ctx.record_of_holder(&ns, &uid);
    if let (None, Some(t)) = (&record, token.as_deref()) {
        let mut found = ctx.record_with_token(&ns, t);
        if found.is_none() {
            // The record cache may lag behind the webhook's write (two watch streams): ask the
            // API server for the record the pod's lineage annotation names (only stasis sets
            // it: the webhook strips it from what users send, the admission policy refuses it)
            // before concluding the pod holds nothing. The token must still match below.
            if let Some(lineage) = pod.annotations().get(names::LINEAGE) {
                found = ctx
                    .records
                    .get(lineage)
                    .await?
                    .filter(|r| r.namespace == ns && r.lineage.holder.as_deref() == Some(t));
            }
        }
        match found {
            Some(r) if r.held_by(&ns, &uid) => record = Some(r),
            Some(mut r) if r.registrable_by(&ns, t) => {
                // Registration is a write at the version read: of two pods carrying the token,
                // only the first one seen becomes the holder (the other meets a conflict, then
                // a registered holder that is not itself).
                let h = r.holder.get_or_insert_with(|| Holder {
                    token: t.to_owned(),
                    claimed_unix_ms: now_ms(),
                    ..Default::default()
                });
                h.uid = Some(uid.clone());
                h.pod = Some(pod.name_any());
                record = Some(ctx.records.save(&r).await?);
            }
            Some(r) if r.holder_uid().is_some() => return impostor(&pod, &r, &ctx).await,
            // A released claim (its pod appeared too late): the pod holds nothing; below it
            // starts its own lineage like a pod the webhook never saw.
            _ => {}
        }
    }

    // A decision made at admission becomes a PodRestore (restore) or an Event (cold start),
    // only for the registered holder and only from what its record says.
    let annotations = pod.annotations();
    let restore_decided = record
        .as_ref()
        .and_then(|r| r.holder.as_ref())
        .is_some_and(|h| h.restore.is_some());
    if (annotations.contains_key(names::DECISION) || restore_decided)
        && !annotations.contains_key(names::DECISION_REPORTED)
    {
        report_decision(&pod, record.as_ref(), &ctx).await?;
    }

    // A stopping or ended pod orphans its lineage (and its final checkpoint is waited for).
    if let Some(r) = record.as_mut() {
        let on_termination = policy.as_ref().is_none_or(|p| p.spec.on_termination);
        let checkpoints: Vec<PodCheckpoint> = ctx
            .checkpoints
            .state()
            .iter()
            .map(|c| (**c).clone())
            .collect();
        let (state, _) = holder_state(r, std::slice::from_ref(&*pod), &checkpoints, on_termination);
        if refresh(
            r,
            &state,
            now_ms(),
            ctx.cfg.phantom_after.as_millis() as u64,
        ) {
            *r = ctx.records.save(r).await?;
        }
    }

    let Some(policy) = policy else {
        return Ok(Action::await_change());
    };
    if eligible(&pod, &ctx.cfg.runtime_class).is_err() {
        return Ok(Action::await_change());
    }
    // A running pod the webhook never saw (installed later, or the webhook was down): its own
    // new lineage, held by its UID.
    let record = match record {
        Some(r) if r.lineage.orphaned => return Ok(Action::await_change()),
        Some(r) => r,
        None => match start_lineage(&pod, &ctx).await {
            Ok(r) => r,
            Err(Error::RecordCap { namespace, cap }) => {
                tracing::warn!(pod = %pod.name_any(), %namespace, cap, "no new lineage: the namespace has the most lineage records allowed");
                ctx.event(
                    &pod.object_ref(&()),
                    EventType::Warning,
                    "CheckpointSkipped",
                    format!("no checkpoints for this pod: namespace {namespace} already has {cap} lineage records, the most stasis keeps per namespace"),
                )
                .await;
                return Ok(Action::requeue(Duration::from_secs(600)));
            }
            Err(Error::UnverifiedIdentity(reason)) => {
                tracing::warn!(pod = %pod.name_any(), namespace = %ns, %reason, "no new lineage: the pod's owners could not be verified");
                ctx.event(
                    &pod.object_ref(&()),
                    EventType::Warning,
                    "CheckpointSkipped",
                    format!("no checkpoints for this pod: {reason}"),
                )
                .await;
                return Ok(Action::requeue(Duration::from_secs(600)));
            }
            Err(e) => return Err(e),
        },
    };
    heartbeat(&pod, &policy, &record, &ctx).await
}

/// A pod that carries the claim token of a lineage whose registered holder is another pod (a
/// copied label): it holds nothing. It gets a Warning Event once (then the decision is marked
/// reported, so its wait container, if any, stops waiting), never a `PodRestore`, and the
/// real holder's lineage is left alone.
async fn impostor(pod: &Pod, r: &Record, ctx: &Context) -> Result<Action> {
    if pod.annotations().contains_key(names::DECISION_REPORTED) {
        return Ok(Action::await_change());
    }
    let ns = pod.namespace().unwrap_or_default();
    let holder = r
        .holder
        .as_ref()
        .and_then(|h| h.pod.clone())
        .unwrap_or_default();
    ctx.metrics.refused("ClaimTokenCopied");
    tracing::warn!(pod = %pod.name_any(), namespace = %ns, holder = %holder, lineage = %r.lineage.id, "a pod carries another pod's claim token: ignored");
    ctx.event(
        &pod.object_ref(&()),
        EventType::Warning,
        "ClaimRefused",
        format!(
            "label {} of this pod is the claim of pod {holder}: this pod holds no lineage, is not restored and gets no checkpoints",
            names::CLAIM_TOKEN
        ),
    )
    .await;
    let patch = json!({"metadata": {"annotations": {names::DECISION_REPORTED: "true"}}});
    Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(Action::await_change())
}

/// A new lineage for a running pod without one; the pod is labelled and annotated with it.
async fn start_lineage(pod: &Pod, ctx: &Context) -> Result<Record> {
    let ns = pod.namespace().unwrap_or_default();
    let uid = pod_uid(pod);
    // Owners verified by UID, as at admission: a guess from names would let a user's
    // ReplicaSet `web-zz9` start a lineage of Deployment `web`, which web's replacements could
    // then claim (docs/design.md §10.2).
    let workload = match crate::webhook::verified_identity(&ctx.client, &ns, pod).await? {
        Ok(identity) => identity.key(),
        Err((_, reason)) => return Err(Error::UnverifiedIdentity(reason)),
    };
    let existing: Vec<Lineage> = ctx
        .all_records()
        .into_iter()
        .filter(|r| r.lineage.workload == workload)
        .map(|r| r.lineage)
        .collect();
    let lineage = Lineage::start(&workload, &uid, &existing);
    let record = Record::new(
        &ns,
        lineage,
        Some(Holder {
            token: uid.clone(),
            claimed_unix_ms: now_ms(),
            pod: Some(pod.name_any()),
            uid: Some(uid.clone()),
            ..Default::default()
        }),
    );
    let record = ctx.records.save(&record).await?;
    let patch = json!({"metadata": {
        "labels": {names::CLAIM_TOKEN: uid},
        "annotations": {
            names::CLAIM_TOKEN: uid,
            names::LINEAGE: record.lineage.id.as_str(),
            names::GENERATION: record.lineage.generation.to_string(),
        }
    }});
    Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    tracing::info!(pod = %pod.name_any(), namespace = %ns, lineage = %record.lineage.id, "new lineage for a pod admitted without the webhook");
    Ok(record)
}

/// Turns the webhook's decision into a `PodRestore` or a `ColdStart` Event, once.
async fn report_decision(pod: &Pod, record: Option<&Record>, ctx: &Context) -> Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let oref = pod.object_ref(&());
    let annotations = pod.annotations();
    // Only what the record says counts: annotations can be copied, the record cannot. The
    // caller passes only a record this pod is the registered holder of.
    let restore = record
        .and_then(|r| r.holder.as_ref())
        .is_some_and(|h| h.restore.is_some());
    let decision = if restore {
        "Restore"
    } else {
        annotations
            .get(names::DECISION)
            .map_or("ColdStart", String::as_str)
    };
    match decision {
        "Restore" => {
            let holder = record.and_then(|r| r.holder.as_ref().map(|h| (r, h)));
            match holder.and_then(|(r, h)| h.restore.clone().map(|c| (r, h, c))) {
                Some((r, h, checkpoint_ref)) => {
                    let restore = PodRestore {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            namespace: Some(ns.clone()),
                            labels: Some(BTreeMap::from([
                                (names::POD_UID.to_owned(), pod_uid(pod)),
                                (
                                    names::MANAGED_BY.0.to_owned(),
                                    names::MANAGED_BY.1.to_owned(),
                                ),
                            ])),
                            ..Default::default()
                        },
                        spec: PodRestoreSpec {
                            checkpoint_ref: checkpoint_ref.clone(),
                            target_pod_name: name.clone(),
                            target_pod_uid: pod.metadata.uid.clone(),
                            source_pod_name: h.source_pod.clone(),
                            lineage: Some(r.lineage.id.as_str().to_owned()),
                            generation: Some(r.lineage.generation as i64),
                        },
                        status: None,
                    };
                    let api = Api::<PodRestore>::namespaced(ctx.client.clone(), &ns);
                    match api.create(&PostParams::default(), &restore).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 409 => {}
                        Err(e) => return Err(e.into()),
                    }
                    let mut status = PodRestoreStatus {
                        phase: Some(RestorePhase::Pending),
                        ..Default::default()
                    };
                    set_condition(
                        &mut status.conditions,
                        condition::READY,
                        false,
                        "Pending",
                        format!("restore of {checkpoint_ref} decided at admission"),
                        None,
                        k8s_time(now_ms()),
                    );
                    // Only when the agent has not written a status yet.
                    let current = api.get_status(&name).await?;
                    if current.status.as_ref().and_then(|s| s.phase).is_none() {
                        api.patch_status(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"status": status})),
                        )
                        .await?;
                    }
                    ctx.event(
                        &oref,
                        EventType::Normal,
                        "RestoreDecided",
                        format!("restoring checkpoint {checkpoint_ref} (PodRestore {name})"),
                    )
                    .await;
                }
                None => {
                    ctx.event(
                        &oref,
                        EventType::Warning,
                        "ColdStart",
                        "restore annotation without a matching lineage record: not restoring"
                            .into(),
                    )
                    .await;
                }
            }
        }
        _ => {
            let why = annotations
                .get(names::DECISION_REASON)
                .cloned()
                .unwrap_or_else(|| "no restore".into());
            ctx.event(&oref, EventType::Normal, "ColdStart", why).await;
        }
    }
    let patch = json!({"metadata": {"annotations": {names::DECISION_REPORTED: "true"}}});
    Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// The heartbeat of one running pod under its policy.
async fn heartbeat(
    pod: &Pod,
    policy: &CheckpointPolicy,
    record: &Record,
    ctx: &Context,
) -> Result<Action> {
    let Ok(interval) = policy.spec.heartbeat() else {
        // The policy's status says why; look again when it changes.
        return Ok(Action::requeue(Duration::from_secs(60)));
    };
    let ns = pod.namespace().unwrap_or_default();
    let uid = pod_uid(pod);
    let mine: Vec<CheckpointView> = ctx
        .checkpoints
        .state()
        .iter()
        .filter(|c| {
            c.namespace().as_deref() == Some(&ns) && checkpoint_pod_uid(c).as_deref() == Some(&uid)
        })
        .map(|c| CheckpointView::of(c))
        .collect();
    let now = now_ms();
    let started = pod
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(pod.metadata.creation_timestamp.as_ref())
        .map_or(now, time_ms);
    ctx.metrics.checkpoint_freshness(
        &ns,
        &pod.name_any(),
        protected_since(&mine, started),
        interval,
    );
    let probes = podfacts::liveness_probes(pod);
    let last_skip = ctx.skips.lock().ok().and_then(|s| s.get(&uid).copied());
    let inputs = HeartbeatInputs {
        interval,
        pod_started_unix_ms: started,
        checkpoints: &mine,
        last_skip_unix_ms: last_skip,
        jitter_ms: jitter_ms(&uid, interval),
        probes: &probes,
        max_freeze_fraction: policy.spec.freeze_fraction(),
        in_flight_timeout: ctx.cfg.in_flight_timeout,
        now_unix_ms: now,
    };
    match next_heartbeat(&inputs) {
        Next::InFlight => Ok(Action::requeue(interval.min(Duration::from_secs(60)))),
        Next::NotDue { at_unix_ms } => Ok(Action::requeue(Duration::from_millis(at_unix_ms - now))),
        Next::Skip { reason } => {
            if let Ok(mut s) = ctx.skips.lock() {
                s.insert(uid, now);
            }
            ctx.metrics
                .checkpoints_skipped
                .get_or_create(&crate::metrics::ReasonLabel {
                    reason: reason::FREEZE_BUDGET_EXCEEDED.to_owned(),
                })
                .inc();
            ctx.event(
                &pod.object_ref(&()),
                EventType::Warning,
                "CheckpointSkipped",
                reason,
            )
            .await;
            Ok(Action::requeue(interval))
        }
        Next::Create { due_unix_ms } => {
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let name = heartbeat_name(&pod.name_any(), due_unix_ms);
            let mut labels = BTreeMap::from([
                (names::POD_UID.to_owned(), uid.clone()),
                (names::POLICY.to_owned(), policy.name_any()),
                (
                    names::MANAGED_BY.0.to_owned(),
                    names::MANAGED_BY.1.to_owned(),
                ),
            ]);
            if node.len() <= 63 {
                labels.insert(names::NODE.to_owned(), node.clone());
            }
            let ck = PodCheckpoint {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    labels: Some(labels),
                    annotations: Some(BTreeMap::from([
                        (
                            names::LINEAGE.to_owned(),
                            record.lineage.id.as_str().to_owned(),
                        ),
                        (
                            names::GENERATION.to_owned(),
                            record.lineage.generation.to_string(),
                        ),
                    ])),
                    ..Default::default()
                },
                spec: PodCheckpointSpec {
                    source_pod_name: pod.name_any(),
                    source_pod_uid: Some(uid),
                    reason: CheckpointReason::Heartbeat,
                    timeout_seconds: None,
                },
                status: None,
            };
            let api = Api::<PodCheckpoint>::namespaced(ctx.client.clone(), &ns);
            match api.create(&PostParams::default(), &ck).await {
                Ok(_) => {
                    ctx.metrics.checkpoints_scheduled.inc();
                    tracing::info!(pod = %pod.name_any(), namespace = %ns, checkpoint = %name, node = %node, "heartbeat checkpoint requested");
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            Ok(Action::requeue(interval.min(Duration::from_secs(60))))
        }
    }
}

/// The lineage and generation of a checkpoint, as the agent that took it wrote them into its
/// status (the status subresource; the agent takes them from the lineage record that names the
/// source pod as holder). Annotations and labels of a `PodCheckpoint` are never read: anyone
/// who may create one may set them.
fn checkpoint_lineage(c: &PodCheckpoint) -> Option<(String, u64)> {
    let s = c.status.as_ref()?;
    let lineage = s.lineage.clone()?;
    let generation = s.generation.and_then(|g| u64::try_from(g).ok())?;
    Some((lineage, generation))
}

/// The source pod's UID as the agent found it (status), else as the spec pins it.
fn checkpoint_source_uid(c: &PodCheckpoint) -> Option<String> {
    c.status
        .as_ref()
        .and_then(|s| s.source_pod_uid.clone())
        .or_else(|| c.spec.source_pod_uid.clone())
}

/// Why an object in `namespace` naming a checkpoint of its source pod `source_uid` must not
/// touch the lineage record `r` (`None`: it may). The label is the metric's reason.
fn foreign(
    r: &Record,
    namespace: &str,
    source_uid: Option<&str>,
) -> Option<(&'static str, String)> {
    if r.namespace != namespace {
        return Some((
            "OtherNamespace",
            format!(
                "lineage {} belongs to another namespace than {namespace}",
                r.lineage.id
            ),
        ));
    }
    if let Some(uid) = source_uid {
        if !r.held_by(namespace, uid) {
            return Some((
                "NotHolder",
                format!(
                    "source pod (UID {uid}) is not the holder of lineage {}",
                    r.lineage.id
                ),
            ));
        }
    }
    None
}

/// Why a checkpoint was not written by the agent of its source pod's node (`None`: it was, or
/// the pod is gone from the cache and only the API server's policy vouches for the writer). The
/// API server holds each agent to its own node's `status.node` (the chart's agent policy); this
/// ties that node to the pod.
fn wrong_node(
    ck: &PodCheckpoint,
    source_uid: Option<&str>,
    pods: &Store<Pod>,
) -> Option<(&'static str, String)> {
    let written_by = ck.status.as_ref().and_then(|s| s.node.as_deref());
    let pod = pods.find(|p| source_uid.is_some() && p.metadata.uid.as_deref() == source_uid)?;
    let on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    (on != written_by).then(|| {
        (
            "OtherNode",
            format!(
                "written by the agent of node {}, but the source pod is on node {}",
                written_by.unwrap_or("(none)"),
                on.unwrap_or("(none)")
            ),
        )
    })
}

/// Why a `PodRestore`'s status was not written by the agent of its target pod's node (`None`:
/// it was, or the pod is not in the cache).
fn restore_from_other_node(pr: &PodRestore, pods: &Store<Pod>) -> Option<String> {
    let ns = pr.namespace()?;
    let pod = pods.find(|p| {
        p.metadata.namespace.as_deref() == Some(ns.as_str())
            && p.metadata.name.as_deref() == Some(pr.spec.target_pod_name.as_str())
            && pr
                .spec
                .target_pod_uid
                .as_deref()
                .is_none_or(|u| p.metadata.uid.as_deref() == Some(u))
    })?;
    let on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())?;
    let written_by = pr.status.as_ref().and_then(|s| s.node.as_deref());
    (written_by != Some(on)).then(|| {
        format!(
            "its status was written by the agent of node {}, but pod {} is on node {on}",
            written_by.unwrap_or("(none)"),
            pr.spec.target_pod_name
        )
    })
}

/// `sha256:` and 64 lowercase hex digits: the form of `PodCheckpoint.status.manifestDigest`.
fn is_manifest_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Marks a checkpoint `Failed` with `Ready=False/<reason>` and the message.
async fn fail_checkpoint(
    ck: &PodCheckpoint,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<()> {
    let ns = ck.namespace().unwrap_or_default();
    let mut status: PodCheckpointStatus = ck.status.clone().unwrap_or_default();
    status.phase = Some(CheckpointPhase::Failed);
    set_condition(
        &mut status.conditions,
        condition::READY,
        false,
        reason,
        message,
        None,
        k8s_time(now_ms()),
    );
    Api::<PodCheckpoint>::namespaced(ctx.client.clone(), &ns)
        .patch_status(
            &ck.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await?;
    Ok(())
}

/// `PodCheckpoint`s: a succeeded one is published into its lineage (or fenced), then retention
/// runs on the lineage; a failed final checkpoint ends the wait for it; a stuck one fails.
pub async fn reconcile_checkpoint(ck: Arc<PodCheckpoint>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled("checkpoints");
    let ns = ck.namespace().unwrap_or_default();
    let name = ck.name_any();
    let view = CheckpointView::of(&ck);
    let now = now_ms();
    if view.in_flight() {
        let age = now.saturating_sub(view.created_unix_ms);
        let timeout = ctx.cfg.in_flight_timeout.as_millis() as u64;
        if ck.spec.reason == CheckpointReason::Termination && age < timeout {
            // The agent's final checkpoint (also for stops without a deletion timestamp, such as
            // a graceful node shutdown): a replacement's claim waits for it (DESIGN §3).
            note_final_in_flight(&ck, view.created_unix_ms, &ctx).await?;
        }
        if age < timeout {
            return Ok(Action::requeue(Duration::from_millis(
                timeout - age + 1_000,
            )));
        }
        fail_checkpoint(
            &ck,
            reason::CHECKPOINT_FAILED,
            format!(
                "no progress in {}s (is the node's agent running?)",
                timeout / 1000
            ),
            &ctx,
        )
        .await?;
        return Ok(Action::await_change());
    }
    let Some((lineage_id, generation)) = checkpoint_lineage(&ck) else {
        return Ok(Action::await_change());
    };
    let phase = view.phase;
    let source_uid = checkpoint_source_uid(&ck);
    if phase == Some(CheckpointPhase::Failed) && ck.spec.reason == CheckpointReason::Termination {
        if let Some(mut r) = ctx.records.get(&lineage_id).await? {
            if foreign(&r, &ns, source_uid.as_deref()).is_none()
                && r.lineage.final_deadline_unix_ms.is_some()
            {
                r.lineage.end_final();
                ctx.records.save(&r).await?;
            }
        }
        return Ok(Action::await_change());
    }
    if phase != Some(CheckpointPhase::Succeeded) {
        return Ok(Action::await_change());
    }
    let Some(reference) = ck.status.as_ref().and_then(|s| s.checkpoint_ref.clone()) else {
        return Ok(Action::await_change());
    };
    let Some(id) = reference
        .rsplit_once('/')
        .and_then(|(_, id)| CheckpointId::parse(id).ok())
    else {
        return Ok(Action::await_change());
    };
    let Some(mut r) = ctx.records.get(&lineage_id).await? else {
        return Ok(Action::await_change());
    };
    // Only the holder's own checkpoints, in its own namespace, enter a lineage: anything else
    // changes nothing and deletes nothing.
    let reference_lineage = reference.rsplit_once('/').map(|(l, _)| l);
    let why = foreign(&r, &ns, source_uid.as_deref()).or_else(|| {
        if source_uid.is_none() {
            Some((
                "NotHolder",
                "checkpoint without a source pod UID".to_owned(),
            ))
        } else if reference_lineage != Some(lineage_id.as_str()) {
            Some((
                "LineageMismatch",
                format!("checkpointRef {reference} is not of lineage {lineage_id}"),
            ))
        } else {
            wrong_node(&ck, source_uid.as_deref(), &ctx.pods)
        }
    });
    if let Some((label, message)) = why {
        ctx.metrics.refused(label);
        tracing::warn!(checkpoint = %name, namespace = %ns, %message, "checkpoint refused");
        fail_checkpoint(&ck, reason::FENCED, message, &ctx).await?;
        return Ok(Action::await_change());
    }
    if r.lineage.checkpoints.iter().any(|c| c.id == id) {
        return Ok(Action::await_change());
    }
    // The digest the restoring agent will hold the manifest to: a checkpoint without one is
    // never published (a node holding the data key could otherwise swap its manifest later).
    let Some(digest) = ck
        .status
        .as_ref()
        .and_then(|s| s.manifest_digest.clone())
        .filter(|d| is_manifest_digest(d))
    else {
        ctx.metrics.refused("NoManifestDigest");
        let message =
            "checkpoint without a valid manifestDigest (sha256:<64 hex>): not published".to_owned();
        tracing::warn!(checkpoint = %name, namespace = %ns, %message, "checkpoint refused");
        fail_checkpoint(&ck, reason::CHECKPOINT_FAILED, message, &ctx).await?;
        return Ok(Action::await_change());
    };
    let created = ck
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .map_or(view.created_unix_ms, time_ms);
    match r.lineage.publish(LineageCheckpoint {
        id,
        generation,
        created_unix_ms: created,
        manifest_digest: Some(digest),
    }) {
        Ok(()) => {
            let r = ctx.records.save(&r).await?;
            apply_retention(r, &ctx).await?;
        }
        Err(fenced) => {
            ctx.metrics.checkpoints_fenced.inc();
            fail_checkpoint(&ck, reason::FENCED, fenced.to_string(), &ctx).await?;
            tracing::warn!(checkpoint = %name, namespace = %ns, error = %fenced, "fenced");
        }
    }
    Ok(Action::await_change())
}

/// Records an in-flight termination checkpoint in its lineage (`begin_final`), until its
/// `timeoutSeconds` (default 30) plus 5 s after its creation, unless one is recorded already.
async fn note_final_in_flight(
    ck: &PodCheckpoint,
    created_unix_ms: u64,
    ctx: &Context,
) -> Result<()> {
    let Some((lineage_id, generation)) = checkpoint_lineage(ck) else {
        return Ok(());
    };
    let Some(mut r) = ctx.records.get(&lineage_id).await? else {
        return Ok(());
    };
    let ns = ck.namespace().unwrap_or_default();
    let source_uid = checkpoint_source_uid(ck);
    if source_uid.is_none() || foreign(&r, &ns, source_uid.as_deref()).is_some() {
        return Ok(());
    }
    let secs = u64::try_from(
        ck.spec
            .timeout_seconds
            .unwrap_or(30)
            .clamp(1, stasis_api::checkpoint::MAX_TIMEOUT_SECONDS),
    )
    .unwrap_or(30);
    let deadline = created_unix_ms + secs * 1000 + 5_000;
    if r.lineage.final_deadline_unix_ms.is_some()
        || generation != r.lineage.generation
        || deadline <= now_ms()
    {
        return Ok(());
    }
    r.lineage.begin_final(deadline, created_unix_ms);
    ctx.records.save(&r).await?;
    Ok(())
}

/// Retention of one lineage under the checkpoint's policy: drops the ids from the record first
/// (so no restore picks them), then deletes their `PodCheckpoint`s and, with a store, their
/// manifests (chunks go with the store's garbage collection).
async fn apply_retention(mut r: Record, ctx: &Context) -> Result<()> {
    let ns = r.namespace.clone();
    let policies = ctx.policies.state();
    // The policy that selects the lineage's holder pod (by the record's namespace and the
    // policies' selectors), else the namespace's only policy, else the defaults.
    let holder = r
        .holder_uid()
        .and_then(|uid| ctx.pods.find(|p| p.metadata.uid.as_deref() == Some(uid)))
        .filter(|p| p.namespace().as_deref() == Some(&ns));
    let policy = holder
        .and_then(|p| policy_for(policies.iter().map(|x| x.as_ref()), &ns, p.labels()).cloned())
        .or_else(|| {
            let in_ns: Vec<_> = policies
                .iter()
                .filter(|x| x.namespace().as_deref() == Some(&ns))
                .collect();
            (in_ns.len() == 1).then(|| (**in_ns[0]).clone())
        });
    let retention_spec = policy.map(|p| p.spec.retention.clone()).unwrap_or_default();
    let max_age = retention_spec
        .max_age
        .as_deref()
        .and_then(|a| parse_duration(a).ok())
        .map(|d| d.as_millis() as u64);
    let prefix = format!("{}/", r.lineage.id);
    let pinned: Vec<CheckpointId> = ctx
        .restores
        .state()
        .iter()
        .filter(|x| {
            matches!(
                x.status.as_ref().and_then(|s| s.phase),
                None | Some(RestorePhase::Pending)
                    | Some(RestorePhase::Fetching)
                    | Some(RestorePhase::Ready)
            )
        })
        .filter_map(|x| {
            x.spec
                .checkpoint_ref
                .strip_prefix(&prefix)
                .and_then(|id| CheckpointId::parse(id).ok())
        })
        .collect();
    let drop = retention(
        &r.lineage,
        retention_spec.keep_last.max(1) as usize,
        max_age,
        now_ms(),
        &pinned,
    );
    if drop.is_empty() {
        return Ok(());
    }
    r.lineage.checkpoints.retain(|c| !drop.contains(&c.id));
    let r = ctx.records.save(&r).await?;
    let api = Api::<PodCheckpoint>::namespaced(ctx.client.clone(), &ns);
    for id in &drop {
        let reference = format!("{}{}", prefix, id);
        for c in ctx.checkpoints.state().iter().filter(|c| {
            c.namespace().as_deref() == Some(&ns)
                && c.status.as_ref().and_then(|s| s.checkpoint_ref.as_deref()) == Some(&reference)
        }) {
            match api.delete(&c.name_any(), &DeleteParams::default()).await {
                Ok(_) | Err(kube::Error::Api(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if let Some(store) = &ctx.store {
            let cref = CheckpointRef::exact(r.lineage.id.clone(), id.clone());
            if let Err(e) = store.delete_checkpoint(&cref).await {
                tracing::warn!(error = %e, checkpoint = %reference, "store delete");
            }
        }
        ctx.metrics.checkpoints_deleted.inc();
        tracing::info!(checkpoint = %reference, "deleted by retention");
    }
    Ok(())
}

/// A restore failure reduced to something comparable (`stasis_core::lineage`'s loop guard
/// counts equal signatures): `restore: <RestoreFailure>`, from the typed cause the agent
/// reports, never from the message's wording. A status written by an agent older than
/// `status.failure` has one signature, `restore: Unknown`.
pub fn failure_signature(status: Option<&PodRestoreStatus>) -> String {
    match status.and_then(|s| s.failure) {
        Some(f) => format!("restore: {f}"),
        None => "restore: Unknown".to_owned(),
    }
}

/// `PodRestore`s: outcomes feed the restore-loop guard of the lineage, once each.
pub async fn reconcile_restore(pr: Arc<PodRestore>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled("restores");
    if pr.annotations().contains_key(names::ACCOUNTED) {
        return Ok(Action::await_change());
    }
    let status = pr.status.as_ref();
    let phase = status.and_then(|s| s.phase);
    let Some(lineage_id) = pr.spec.lineage.clone() else {
        return Ok(Action::await_change());
    };
    let Some(id) = pr
        .spec
        .checkpoint_ref
        .rsplit_once('/')
        .and_then(|(_, id)| CheckpointId::parse(id).ok())
    else {
        return Ok(Action::await_change());
    };
    let ns = pr.namespace().unwrap_or_default();
    let Some(mut r) = ctx.records.get(&lineage_id).await? else {
        return Ok(Action::await_change());
    };
    // A restore only counts for a lineage of its own namespace, and only when it restores a
    // checkpoint of the lineage it names.
    if let Some((label, why)) = restore_mismatch(&pr, &r) {
        ctx.metrics.refused(label);
        tracing::warn!(restore = %pr.name_any(), namespace = %ns, %why, "restore not counted");
        if matches!(phase, None | Some(RestorePhase::Pending)) {
            let mut status = pr.status.clone().unwrap_or_default();
            status.phase = Some(RestorePhase::Failed);
            status.message = Some(why.clone());
            status.failure = Some(RestoreFailure::Refused);
            set_condition(
                &mut status.conditions,
                condition::READY,
                false,
                reason::REFUSED,
                why,
                None,
                k8s_time(now_ms()),
            );
            Api::<PodRestore>::namespaced(ctx.client.clone(), &ns)
                .patch_status(
                    &pr.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": status})),
                )
                .await?;
        }
        return Ok(Action::await_change());
    }
    // Only the agent of the target pod's node reports its restore: another node's agent (the
    // first writer of a PodRestore that has no node label) changes no record.
    if matches!(
        phase,
        Some(RestorePhase::Restored | RestorePhase::Failed | RestorePhase::ColdStart)
    ) {
        if let Some(why) = restore_from_other_node(&pr, &ctx.pods) {
            ctx.metrics.refused("OtherNode");
            tracing::warn!(restore = %pr.name_any(), namespace = %ns, %why, "restore report not counted");
            return Ok(Action::await_change());
        }
    }
    match phase {
        Some(RestorePhase::Restored) => r.lineage.record_restore_success(),
        Some(RestorePhase::Failed) | Some(RestorePhase::ColdStart) => {
            let message = status.and_then(|s| s.message.clone()).unwrap_or_default();
            if restore_found_damage(status) {
                // Damage in the store is an alarm, never a reason to go back to older memory.
                ctx.metrics.checkpoints_damaged.inc();
                tracing::warn!(restore = %pr.name_any(), namespace = %ns, lineage = %r.lineage.id, checkpoint = %id, %message, "checkpoint damaged in the store");
                ctx.event(
                    &pr.object_ref(&()),
                    EventType::Warning,
                    reason::CHECKPOINT_DAMAGED,
                    format!("checkpoint {id} of lineage {} is gone or damaged in the store; its pods cold-start until a newer checkpoint is published (older memory is never restored for it)", r.lineage.id),
                )
                .await;
                r.lineage.record_integrity_failure(&id, &message, now_ms());
            } else {
                let signature = failure_signature(status);
                r.lineage.record_restore_failure(&id, &signature);
            }
        }
        _ => return Ok(Action::await_change()),
    }
    ctx.records.save(&r).await?;
    Api::<PodRestore>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &pr.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {names::ACCOUNTED: "true"}}})),
        )
        .await?;
    Ok(Action::await_change())
}

/// True when the agent reported that the restore found the checkpoint's objects gone or
/// damaged in the store: `status.failure`, or (from an agent older than that field) the `Ready`
/// condition's reason; never message text.
fn restore_found_damage(status: Option<&PodRestoreStatus>) -> bool {
    status.is_some_and(|s| {
        s.failure == Some(RestoreFailure::CheckpointDamaged)
            || s.conditions
                .iter()
                .any(|c| c.type_ == condition::READY && c.reason == reason::CHECKPOINT_DAMAGED)
    })
}

/// Why a `PodRestore` must not touch the record of the lineage it names (`None`: it may): the
/// lineage is of another namespace, or its `checkpointRef` is not a checkpoint of that lineage.
fn restore_mismatch(pr: &PodRestore, r: &Record) -> Option<(&'static str, String)> {
    let ns = pr.namespace().unwrap_or_default();
    let named = pr.spec.lineage.as_deref().unwrap_or_default();
    if r.namespace != ns {
        return Some((
            "OtherNamespace",
            format!("lineage {named} belongs to another namespace than {ns}"),
        ));
    }
    let of_ref = pr.spec.checkpoint_ref.rsplit_once('/').map(|(l, _)| l);
    if of_ref != Some(named) {
        return Some((
            "LineageMismatch",
            format!(
                "checkpointRef {} is not a checkpoint of lineage {named}",
                pr.spec.checkpoint_ref
            ),
        ));
    }
    None
}

/// `CheckpointPolicy` status: `Ready` (`Active`) or refused (`InvalidSpec`), with the number of
/// selected stasis pods.
pub async fn reconcile_policy(p: Arc<CheckpointPolicy>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled("policies");
    let ns = p.namespace().unwrap_or_default();
    let mut status: CheckpointPolicyStatus = p.status.clone().unwrap_or_default();
    let generation = p.metadata.generation;
    let now = k8s_time(now_ms());
    let problem = p.spec.heartbeat().err().map(|e| e.to_string()).or_else(|| {
        let max_age = p.spec.retention.max_age.as_deref()?;
        parse_duration(max_age)
            .err()
            .map(|e| format!("retention.maxAge: {e}"))
    });
    match &problem {
        Some(why) => set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            reason::INVALID_SPEC,
            why.clone(),
            generation,
            now,
        ),
        None => set_condition(
            &mut status.conditions,
            condition::READY,
            true,
            reason::ACTIVE,
            format!("heartbeat every {}", p.spec.interval),
            generation,
            now,
        ),
    }
    let selected = ctx
        .pods
        .state()
        .iter()
        .filter(|pod| {
            pod.namespace().as_deref() == Some(&ns)
                && pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.runtime_class_name.as_deref())
                    == Some(ctx.cfg.runtime_class.as_str())
                && crate::schedule::selects(&p.spec.selector, pod.labels())
        })
        .count();
    status.selected_pods = Some(selected as i32);
    status.observed_generation = generation;
    if Some(&status) != p.status.as_ref() {
        Api::<CheckpointPolicy>::namespaced(ctx.client.clone(), &ns)
            .patch_status(
                &p.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await?;
    }
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Sweep: every record whose holder pod stopped or vanished is brought up to date (the pod
/// reconciler sees stopping pods; only the sweep sees pods that are gone), and claims whose
/// pod never appeared are released.
pub async fn sweep(ctx: &Context) -> Result<()> {
    let pods: Vec<Pod> = ctx.pods.state().iter().map(|p| (**p).clone()).collect();
    let checkpoints: Vec<PodCheckpoint> = ctx
        .checkpoints
        .state()
        .iter()
        .map(|c| (**c).clone())
        .collect();
    let now = now_ms();
    // Pods no longer checkpointed (gone, stopped, no policy) lose their checkpoint-age series.
    let policies = ctx.policies.state();
    let checkpointed: std::collections::HashSet<(String, String)> = pods
        .iter()
        .filter(|p| eligible(p, &ctx.cfg.runtime_class).is_ok())
        .filter_map(|p| {
            let ns = p.namespace()?;
            policy_for(policies.iter().map(|p| p.as_ref()), &ns, p.labels())?;
            Some((ns, p.name_any()))
        })
        .collect();
    ctx.metrics
        .retain_pods(|ns, pod| checkpointed.contains(&(ns.to_owned(), pod.to_owned())));
    relabel(ctx).await?;
    for mut r in ctx.all_records() {
        let ns = r.namespace.clone();
        let in_ns: Vec<Pod> = pods
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(&ns))
            .cloned()
            .collect();
        if r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none() {
            collect(r, &in_ns, now, ctx).await?;
            continue;
        }
        let on_termination = true;
        let (state, _) = holder_state(&r, &in_ns, &checkpoints, on_termination);
        if refresh(
            &mut r,
            &state,
            now,
            ctx.cfg.phantom_after.as_millis() as u64,
        ) {
            match ctx.records.save(&r).await {
                Ok(_) | Err(Error::Conflict(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Records written before they carried the holder-UID and namespace labels (an upgrade) are
/// written again with them: the agents stamp checkpoints only from a labelled record.
async fn relabel(ctx: &Context) -> Result<()> {
    for cm in ctx.record_maps.state() {
        let Ok(r) = Record::from_config_map(&cm) else {
            continue;
        };
        let want = r.to_config_map()?.metadata.labels.unwrap_or_default();
        let have = cm.metadata.labels.clone().unwrap_or_default();
        if want.iter().any(|(k, v)| have.get(k) != Some(v)) {
            match ctx.records.save(&r).await {
                Ok(_) | Err(Error::Conflict(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// The sweep's garbage collection of one orphaned record ([`crate::record::collectable`]);
/// a record orphaned before the time was recorded gets it now.
async fn collect(mut r: Record, in_ns: &[Pod], now: u64, ctx: &Context) -> Result<()> {
    if r.orphaned_unix_ms.is_none() {
        r.orphaned_unix_ms = Some(now);
        return match ctx.records.save(&r).await {
            Ok(_) | Err(Error::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        };
    }
    let holder_uid = r.holder_uid().map(str::to_owned);
    let token = r.lineage.holder.clone();
    let holder_exists = in_ns.iter().any(|p| {
        (holder_uid.is_some() && p.metadata.uid == holder_uid)
            || (token.is_some() && p.labels().get(names::CLAIM_TOKEN) == token.as_ref())
    });
    let grace = ctx.cfg.collect_records_after.as_millis() as u64;
    if !crate::record::collectable(&r, holder_exists, now, grace) {
        return Ok(());
    }
    match ctx.records.delete(&r).await {
        Ok(()) => {
            ctx.metrics.records_collected.inc();
            tracing::info!(lineage = %r.lineage.id, namespace = %r.namespace, "lineage record deleted: orphaned, empty, its pod gone");
            Ok(())
        }
        Err(Error::Conflict(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

fn drain<T, E: std::fmt::Display>(
    controller: &'static str,
) -> impl FnMut(std::result::Result<T, E>) -> futures::future::Ready<()> {
    move |r| {
        if let Err(e) = r {
            tracing::debug!(controller, error = %e, "controller stream");
        }
        futures::future::ready(())
    }
}

fn error_policy<K>(controller: &'static str) -> impl Fn(Arc<K>, &Error, Arc<Context>) -> Action {
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

/// Everything the reconcilers need from outside.
pub struct Setup {
    pub client: Client,
    pub namespace: String,
    pub identity: String,
    pub metrics: Metrics,
    pub cfg: ControllerConfig,
    pub store: Option<stasis_store::Store>,
}

/// Runs the reconcilers and the sweep until a shutdown signal.
pub async fn run(setup: Setup) -> Result<()> {
    let client = setup.client.clone();
    let wc = watcher::Config::default;
    let pod_ctrl = Controller::new(Api::<Pod>::all(client.clone()), wc()).watches(
        Api::<PodCheckpoint>::all(client.clone()),
        wc(),
        |c| Some(ObjectRef::new(&c.spec.source_pod_name).within(&c.namespace()?)),
    );
    let ck_ctrl = Controller::new(Api::<PodCheckpoint>::all(client.clone()), wc());
    let pr_ctrl = Controller::new(Api::<PodRestore>::all(client.clone()), wc());
    let pol_ctrl = Controller::new(Api::<CheckpointPolicy>::all(client.clone()), wc());
    let (maps, maps_writer) = reflector::store();
    let maps_stream = reflector::reflector(
        maps_writer,
        watcher::watcher(
            Api::<ConfigMap>::namespaced(client.clone(), &setup.namespace),
            wc().labels(&format!("{}=true", names::LINEAGE_RECORD)),
        ),
    )
    .default_backoff()
    .applied_objects()
    .for_each(|_| futures::future::ready(()));
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
        checkpoints: ck_ctrl.store(),
        restores: pr_ctrl.store(),
        record_maps: maps,
        pods: pod_ctrl.store(),
        skips: Mutex::new(HashMap::new()),
        store: setup.store,
    });
    let cks = ck_ctrl
        .shutdown_on_signal()
        .run(
            reconcile_checkpoint,
            error_policy("checkpoints"),
            ctx.clone(),
        )
        .for_each(drain("checkpoints"));
    let prs = pr_ctrl
        .shutdown_on_signal()
        .run(reconcile_restore, error_policy("restores"), ctx.clone())
        .for_each(drain("restores"));
    let pols = pol_ctrl
        .shutdown_on_signal()
        .run(reconcile_policy, error_policy("policies"), ctx.clone())
        .for_each(drain("policies"));
    // Heartbeats wait until the checkpoints, policies and records are known: an empty cache
    // would schedule checkpoints that already exist.
    let pods = {
        let ctx = ctx.clone();
        async move {
            stasis_api::cache::wait_ready(&ctx.checkpoints).await;
            stasis_api::cache::wait_ready(&ctx.policies).await;
            stasis_api::cache::wait_ready(&ctx.record_maps).await;
            tracing::info!("caches ready: reconciling pods");
            pod_ctrl
                .shutdown_on_signal()
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
        _ = maps_stream => {}
        _ = sweeper => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::lineage::RestoreChoice;
    use stasis_core::reference::WorkloadName;
    use std::sync::Mutex as StdMutex;

    type Seen = Arc<StdMutex<Vec<(String, String, serde_json::Value)>>>;

    /// A stand-in API server: records every request (method, path, JSON body) and answers
    /// `201` with the body it got (what a create returns).
    fn recording_client() -> (Client, Seen) {
        let seen: Seen = Arc::default();
        let log = seen.clone();
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let log = log.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = http_body_util::BodyExt::collect(body)
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                log.lock().unwrap().push((
                    parts.method.to_string(),
                    parts.uri.path().to_owned(),
                    v,
                ));
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(201)
                        .header("content-type", "application/json")
                        .body(kube::client::Body::from(bytes.to_vec()))
                        .unwrap(),
                )
            }
        });
        (Client::new(svc, "default"), seen)
    }

    fn store_of<K>(items: Vec<K>) -> Store<K>
    where
        K: kube::Resource + Clone + 'static,
        K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    {
        let (reader, mut writer) = reflector::store();
        for i in items {
            writer.apply_watcher_event(&watcher::Event::Apply(i));
        }
        reader
    }

    fn running_pod(started: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "counter-7d9f8b6c5-abcde", "namespace": "prod", "uid": "uid-1",
                "labels": {"app": "counter", "pod-template-hash": "7d9f8b6c5", names::CLAIM_TOKEN: "tok"},
                "annotations": {names::LINEAGE: "prod_deploy_counter.aaaaaaaa", names::GENERATION: "2"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-7d9f8b6c5", "uid": "rs", "controller": true}]
            },
            "spec": {"runtimeClassName": "stasis", "nodeName": "worker-1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "startTime": started,
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    fn context(client: Client, checkpoints: Vec<PodCheckpoint>) -> Arc<Context> {
        let policy: CheckpointPolicy = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "counter", "namespace": "prod"},
            "spec": {"selector": {"matchLabels": {"app": "counter"}}, "interval": "10s"}
        }))
        .unwrap();
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let mut lineage = Lineage::start(&w, "aaaaaaaa", &[]);
        lineage.holder = Some("tok".into());
        lineage.generation = 2;
        let mut record = Record::new(
            "prod",
            lineage,
            Some(Holder {
                token: "tok".into(),
                claimed_unix_ms: 1,
                pod: Some("counter-7d9f8b6c5-abcde".into()),
                uid: Some("uid-1".into()),
                ..Default::default()
            }),
        );
        record.resource_version = Some("5".into());
        Arc::new(Context {
            records: Records::new(client.clone(), "stasis"),
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: MANAGER.into(),
                    instance: None,
                },
            ),
            client,
            metrics: Metrics::default(),
            cfg: ControllerConfig {
                runtime_class: "stasis".into(),
                in_flight_timeout: Duration::from_secs(900),
                phantom_after: Duration::from_secs(120),
                sweep_every: Duration::from_secs(15),
                collect_records_after: Duration::from_secs(600),
                max_records_per_namespace: 1000,
            },
            policies: store_of(vec![policy]),
            checkpoints: store_of(checkpoints),
            restores: store_of(vec![]),
            record_maps: store_of(vec![record.to_config_map().unwrap()]),
            pods: store_of(vec![]),
            skips: Mutex::new(HashMap::new()),
            store: None,
        })
    }

    /// A context over the given records, pods and policies (every other cache empty).
    fn context_with(
        client: Client,
        checkpoints: Vec<PodCheckpoint>,
        records: Vec<Record>,
        pods: Vec<Pod>,
        policies: Vec<CheckpointPolicy>,
    ) -> Arc<Context> {
        let base = context(client, checkpoints);
        Arc::new(Context {
            client: base.client.clone(),
            records: base.records.clone(),
            recorder: Recorder::new(
                base.client.clone(),
                Reporter {
                    controller: MANAGER.into(),
                    instance: None,
                },
            ),
            metrics: Metrics::default(),
            cfg: base.cfg.clone(),
            policies: store_of(policies),
            checkpoints: base.checkpoints.clone(),
            restores: store_of(vec![]),
            record_maps: store_of(records.iter().map(|r| r.to_config_map().unwrap()).collect()),
            pods: store_of(pods),
            skips: Mutex::new(HashMap::new()),
            store: None,
        })
    }

    /// Record `R` of namespace `ns`, lineage `<ns>_deploy_counter.aaaaaaaa` at generation 2,
    /// held by pod `counter-a` (UID `uid-1`, token `tok`), with a restore decided for it.
    fn record_of_a(ns: &str) -> Record {
        let w = WorkloadName::new(format!("{ns}_deploy_counter")).unwrap();
        let mut lineage = Lineage::start(&w, "aaaaaaaa", &[]);
        lineage.holder = Some("tok".into());
        lineage.generation = 2;
        let mut r = Record::new(
            ns,
            lineage,
            Some(Holder {
                token: "tok".into(),
                claimed_unix_ms: 1,
                pod: Some("counter-a".into()),
                uid: Some("uid-1".into()),
                restore: Some(format!(
                    "{ns}_deploy_counter.aaaaaaaa/{}",
                    CheckpointId::from_parts(1_700_000_000_000, 1)
                )),
                source_pod: Some("counter-old".into()),
            }),
        );
        r.resource_version = Some("5".into());
        r
    }

    fn writes(seen: &Seen) -> Vec<(String, String, serde_json::Value)> {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|(m, _, _)| m != "GET")
            .cloned()
            .collect()
    }

    /// Review H1: pod B carries the claim token of record R, held by pod A's UID, and asks for
    /// a restore: no PodRestore, R untouched (not orphaned), a Warning Event on B.
    #[tokio::test]
    async fn a_copied_claim_token_restores_nothing_and_orphans_nothing() {
        let (client, seen) = routed_client(vec![]);
        let r = record_of_a("prod");
        let mut b = running_pod("2026-01-01T00:00:00Z");
        b.metadata.name = Some("evil".into());
        b.metadata.uid = Some("uid-b".into());
        b.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(names::DECISION.into(), "Restore".into());
        let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
        reconcile_pod(Arc::new(b), ctx.clone()).await.unwrap();
        let w = writes(&seen);
        assert!(
            !w.iter().any(|(_, p, _)| p.contains("podrestores")),
            "no PodRestore: {w:#?}"
        );
        assert!(
            !w.iter().any(|(_, p, _)| p.contains("configmaps")),
            "the holder's record is not written (not orphaned): {w:#?}"
        );
        let event = w
            .iter()
            .find(|(_, p, _)| p.ends_with("/events"))
            .expect("a Warning Event");
        assert_eq!(event.2["reason"], "ClaimRefused");
        assert_eq!(event.2["type"], "Warning");
        assert_eq!(event.2["regarding"]["name"], "evil");
        assert!(
            event.2["note"].as_str().unwrap().contains("counter-a"),
            "{event:?}"
        );
        // Marked handled (its wait container, if any, stops waiting), once.
        assert!(w.iter().any(|(m, p, b)| m == "PATCH"
            && p == "/api/v1/namespaces/prod/pods/evil"
            && b["metadata"]["annotations"][names::DECISION_REPORTED] == "true"));
        let text = ctx.metrics.encode();
        assert!(
            text.contains("stasis_controller_refused_total{reason=\"ClaimTokenCopied\"} 1"),
            "{text}"
        );
    }

    /// The same token in another namespace is not even looked at: a pod of namespace `dev`
    /// with the token of a `prod` record gets nothing of it.
    #[tokio::test]
    async fn a_claim_token_counts_only_in_its_namespace() {
        let mut r = record_of_a("prod");
        r.holder.as_mut().unwrap().uid = None; // not registered yet: the token alone decides
                                               // The API server's list (the fallback when the cache lags) has the prod record too.
        let (client, seen) = routed_client(vec![(
            "/api/v1/namespaces/stasis/configmaps".into(),
            json!({"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {},
                   "items": [serde_json::to_value(r.to_config_map().unwrap()).unwrap()]}),
        )]);
        let mut b = running_pod("2026-01-01T00:00:00Z");
        b.metadata.namespace = Some("dev".into());
        b.metadata.uid = Some("uid-b".into());
        let ctx = context_with(client, vec![], vec![r], vec![], vec![]);
        reconcile_pod(Arc::new(b), ctx).await.unwrap();
        let w = writes(&seen);
        assert!(
            !w.iter()
                .any(|(_, p, _)| p.contains("configmaps") || p.contains("podrestores")),
            "{w:#?}"
        );
    }

    /// The first pod seen with an unregistered token becomes the holder (a write at the version
    /// read, with its UID: the agents' stamp comes from that label).
    #[tokio::test]
    async fn the_first_pod_with_the_token_is_registered_as_holder() {
        let (client, seen) = routed_client(vec![]);
        let mut r = record_of_a("prod");
        r.holder.as_mut().unwrap().uid = None;
        r.holder.as_mut().unwrap().restore = None;
        let a = running_pod("2026-01-01T00:00:00Z");
        let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
        reconcile_pod(Arc::new(a), ctx).await.unwrap();
        let w = writes(&seen);
        let put = w
            .iter()
            .find(|(m, p, _)| m == "PUT" && p.ends_with(&r.name()))
            .expect("registration");
        assert_eq!(put.2["metadata"]["resourceVersion"], "5");
        assert_eq!(put.2["metadata"]["labels"][names::HOLDER_UID], "uid-1");
        let saved =
            Record::from_config_map(&serde_json::from_value(put.2.clone()).unwrap()).unwrap();
        assert_eq!(saved.holder_uid(), Some("uid-1"));
        assert!(!saved.lineage.orphaned);
    }

    /// The registered holder still gets its restore from the record.
    #[tokio::test]
    async fn the_holder_gets_the_restore_its_record_says() {
        let (client, seen) = routed_client(vec![(
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podrestores/counter-a/status".into(),
            json!({"apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                   "metadata": {"name": "counter-a", "namespace": "prod"},
                   "spec": {"checkpointRef": "x/y", "targetPodName": "counter-a"}}),
        )]);
        let r = record_of_a("prod");
        let mut a = running_pod("2026-01-01T00:00:00Z");
        a.metadata.name = Some("counter-a".into());
        let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
        reconcile_pod(Arc::new(a), ctx).await.unwrap();
        let w = writes(&seen);
        let created = w
            .iter()
            .find(|(m, p, _)| m == "POST" && p.ends_with("/podrestores"))
            .expect("a PodRestore");
        assert_eq!(
            created.2["spec"]["checkpointRef"],
            r.holder.as_ref().unwrap().restore.clone().unwrap()
        );
        assert_eq!(created.2["spec"]["targetPodUID"], "uid-1");
    }

    fn succeeded_in(
        ns: &str,
        name: &str,
        lineage: &str,
        id: &CheckpointId,
        source_uid: &str,
    ) -> PodCheckpoint {
        let mut c = succeeded(name, lineage, id, 2);
        c.metadata.namespace = Some(ns.into());
        c.spec.source_pod_uid = Some(source_uid.into());
        c.status.as_mut().unwrap().source_pod_uid = Some(source_uid.into());
        c
    }

    /// Review H3: a checkpoint of namespace `a` naming a lineage of namespace `b` (or written by
    /// a pod that is not the holder) changes no record and deletes nothing; it ends `Failed`.
    #[tokio::test]
    async fn a_checkpoint_into_a_foreign_lineage_changes_nothing() {
        let r = record_of_a("b");
        let l = r.lineage.id.as_str().to_owned();
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let id = CheckpointId::from_parts(1_700_000_100_000, 7);
        for (ns, uid, why) in [
            ("a", "uid-1", "another namespace"),
            ("b", "uid-evil", "not the holder"),
        ] {
            let (client, seen) = routed_client(vec![(
                cm_path.clone(),
                serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
            )]);
            let ck = succeeded_in(ns, "inject", &l, &id, uid);
            let ctx = context_with(client, vec![ck.clone()], vec![r.clone()], vec![], vec![]);
            reconcile_checkpoint(Arc::new(ck), ctx.clone())
                .await
                .unwrap();
            let w = writes(&seen);
            assert_eq!(w.len(), 1, "{why}: only the status: {w:#?}");
            assert_eq!(
                w[0].1,
                format!("/apis/stasis.dev/v1alpha1/namespaces/{ns}/podcheckpoints/inject/status")
            );
            assert_eq!(w[0].2["status"]["phase"], "Failed");
            let message = w[0].2["status"]["conditions"][0]["message"]
                .as_str()
                .unwrap()
                .to_owned();
            assert!(message.contains(why), "{message}");
        }
    }

    /// Review H4: a `PodCheckpoint` whose status another node's agent wrote (it claims the
    /// holder's UID) is not published: the source pod is on another node.
    #[tokio::test]
    async fn a_checkpoint_written_by_another_nodes_agent_is_not_published() {
        let r = record_of_a("prod");
        let l = r.lineage.id.as_str().to_owned();
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let (client, seen) = routed_client(vec![(
            cm_path,
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let id = CheckpointId::from_parts(1_700_000_100_000, 7);
        let mut ck = succeeded_in("prod", "forged", &l, &id, "uid-1");
        ck.status.as_mut().unwrap().node = Some("worker-2".into());
        let pod = running_pod("2026-01-01T00:00:00Z");
        let ctx = context_with(
            client,
            vec![ck.clone()],
            vec![r.clone()],
            vec![pod.clone()],
            vec![],
        );
        reconcile_checkpoint(Arc::new(ck.clone()), ctx)
            .await
            .unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "only the status: {w:#?}");
        assert_eq!(w[0].2["status"]["phase"], "Failed");
        let message = w[0].2["status"]["conditions"][0]["message"].to_string();
        assert!(
            message.contains("node worker-2, but the source pod is on node worker-1"),
            "{message}"
        );
        // The pod's own node's agent passes; a pod gone from the cache leaves it to the API
        // server's policy.
        ck.status.as_mut().unwrap().node = Some("worker-1".into());
        assert_eq!(wrong_node(&ck, Some("uid-1"), &store_of(vec![pod])), None);
        assert_eq!(wrong_node(&ck, Some("uid-1"), &store_of(vec![])), None);
    }

    /// A restore failure reported by another node's agent (it wrote the status of a pending
    /// `PodRestore` of a pod on worker-1 first) changes no record: no integrity alarm, no
    /// failure against the checkpoint.
    #[tokio::test]
    async fn a_restore_reported_by_another_nodes_agent_is_not_counted() {
        let r = record_of_a("prod");
        let l = r.lineage.id.clone();
        let id = CheckpointId::from_parts(1_700_000_010_000, 1);
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let (client, seen) = routed_client(vec![(
            cm_path,
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let mut pod = running_pod("2026-01-01T00:00:00Z");
        pod.metadata.name = Some("t".into());
        let pr: PodRestore = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
            "metadata": {"name": "t", "namespace": "prod"},
            "spec": {"checkpointRef": format!("{l}/{id}"), "targetPodName": "t", "lineage": l.as_str()},
            "status": {"phase": "Failed", "node": "worker-2", "message": "cold start: store: manifest missing",
                       "conditions": [{"type": "Ready", "status": "False", "reason": reason::CHECKPOINT_DAMAGED,
                                       "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
        }))
        .unwrap();
        let ctx = context_with(client, vec![], vec![r.clone()], vec![pod.clone()], vec![]);
        reconcile_restore(Arc::new(pr.clone()), ctx).await.unwrap();
        assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
        let mut mine = pr;
        mine.status.as_mut().unwrap().node = Some("worker-1".into());
        assert_eq!(restore_from_other_node(&mine, &store_of(vec![pod])), None);
    }

    /// A termination checkpoint of another namespace's pod does not hold that lineage's claims
    /// back.
    #[tokio::test]
    async fn a_foreign_termination_checkpoint_sets_no_final_wait() {
        let r = record_of_a("b");
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let (client, seen) = routed_client(vec![(
            cm_path,
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let fin: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "p-final-1", "namespace": "a",
                         "creationTimestamp": crate::k8s_time(now_ms()).0.to_string()},
            "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Termination", "timeoutSeconds": 2000000000},
            "status": {"phase": "Running", "lineage": r.lineage.id.as_str(), "generation": 2}
        }))
        .unwrap();
        let ctx = context_with(client, vec![fin.clone()], vec![r], vec![], vec![]);
        reconcile_checkpoint(Arc::new(fin), ctx).await.unwrap();
        assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
    }

    /// A restore outcome counts only for a lineage of the restore's namespace whose checkpoint
    /// it restored; otherwise the record is untouched and a pending restore fails, saying why.
    #[tokio::test]
    async fn a_restore_naming_a_foreign_lineage_is_refused() {
        let r = record_of_a("prod");
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let l = r.lineage.id.as_str().to_owned();
        for (ns, reference, phase, why) in [
            ("evil", format!("{l}/x"), "Failed", "another namespace"),
            (
                "prod",
                "prod_pod_other.bbbbbbbb/20261129T083000.123Z-1a2b3c4d".to_owned(),
                "Failed",
                "is not a checkpoint of lineage",
            ),
            (
                "prod",
                "prod_pod_other.bbbbbbbb/20261129T083000.123Z-1a2b3c4d".to_owned(),
                "Pending",
                "is not a checkpoint of lineage",
            ),
        ] {
            let (client, seen) = routed_client(vec![(
                cm_path.clone(),
                serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
            )]);
            let pr: PodRestore = serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": "t", "namespace": ns},
                "spec": {"checkpointRef": reference, "targetPodName": "t", "lineage": l},
                "status": {"phase": phase, "message": "cold start: fetch failed: boom"}
            }))
            .unwrap();
            let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
            reconcile_restore(Arc::new(pr), ctx).await.unwrap();
            let w = writes(&seen);
            assert!(
                !w.iter().any(|(_, p, _)| p.contains("configmaps")),
                "{why}: {w:#?}"
            );
            if phase == "Pending" {
                assert_eq!(w.len(), 1, "{w:#?}");
                assert_eq!(w[0].2["status"]["phase"], "Failed");
                assert!(w[0].2["status"]["message"].as_str().unwrap().contains(why));
            }
        }
    }

    /// A restore that found its checkpoint damaged in the store (the agent's typed reason)
    /// raises the lineage's integrity alarm: the next choice is a cold start, never the older
    /// checkpoint the restore-loop guard would fall back to for an ordinary failure.
    #[tokio::test]
    async fn a_damaged_checkpoint_raises_an_alarm_instead_of_a_rollback() {
        let mut r = record_of_a("prod");
        let l = r.lineage.id.clone();
        let ids: Vec<CheckpointId> = (1..=2u64)
            .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
            .collect();
        for id in &ids {
            r.lineage
                .publish(LineageCheckpoint {
                    id: id.clone(),
                    generation: r.lineage.generation,
                    created_unix_ms: 1,
                    manifest_digest: None,
                })
                .unwrap();
        }
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        // The typed `failure`, or (an older agent) the condition's reason, raises the alarm.
        for (reason, failure, alarm) in [
            (reason::CHECKPOINT_DAMAGED, None, true),
            (reason::RESTORE_FAILED, None, false),
            (reason::RESTORE_FAILED, Some("RestoreFailed"), false),
            (reason::RESTORE_FAILED, Some("CheckpointDamaged"), true),
        ] {
            let (client, seen) = routed_client(vec![(
                cm_path.clone(),
                serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
            )]);
            let pr: PodRestore = serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": "t", "namespace": "prod"},
                "spec": {"checkpointRef": format!("{l}/{}", ids[1]), "targetPodName": "t", "lineage": l.as_str()},
                "status": {"phase": "Failed", "message": "cold start: store: manifest missing",
                           "failure": failure,
                           "conditions": [{"type": "Ready", "status": "False", "reason": reason,
                                           "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
            }))
            .unwrap();
            let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
            reconcile_restore(Arc::new(pr), ctx).await.unwrap();
            let w = writes(&seen);
            let saved = w
                .iter()
                .find(|(_, p, _)| p.contains("configmaps"))
                .unwrap_or_else(|| panic!("record not saved: {w:#?}"));
            let saved =
                Record::from_config_map(&serde_json::from_value(saved.2.clone()).unwrap()).unwrap();
            assert_eq!(saved.lineage.integrity_alarm.is_some(), alarm, "{reason}");
            let choice = saved.lineage.restore_choice();
            if alarm {
                assert!(
                    matches!(choice, RestoreChoice::ColdStart(ref why) if why.contains("damaged")),
                    "{choice:?}"
                );
            } else {
                // One ordinary failure: the same checkpoint may still be tried.
                assert!(
                    matches!(choice, RestoreChoice::Checkpoint { .. }),
                    "{choice:?}"
                );
            }
        }
    }

    /// Retention follows the policy that selects the holder pod, not a label on the checkpoint.
    #[tokio::test]
    async fn retention_ignores_a_policy_label_set_by_the_user() {
        let mut r = record_of_a("prod");
        let l = r.lineage.id.clone();
        let ids: Vec<CheckpointId> = (1..=3u64)
            .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
            .collect();
        for id in &ids[..2] {
            r.lineage
                .publish(LineageCheckpoint {
                    id: id.clone(),
                    generation: 2,
                    created_unix_ms: 1,
                    manifest_digest: None,
                })
                .unwrap();
        }
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
        let (client, seen) = routed_client(vec![(
            cm_path,
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let policy = |name: &str, app: &str, keep: u32| -> CheckpointPolicy {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": name, "namespace": "prod"},
                "spec": {"selector": {"matchLabels": {"app": app}}, "interval": "10s",
                         "retention": {"keepLast": keep}}
            }))
            .unwrap()
        };
        let mut ck = succeeded_in("prod", "ck-3", l.as_str(), &ids[2], "uid-1");
        ck.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(names::POLICY.into(), "aaa-keep-one".into());
        let holder = running_pod("2026-01-01T00:00:00Z");
        let ctx = context_with(
            client,
            vec![ck.clone()],
            vec![r],
            vec![holder],
            vec![
                policy("aaa-keep-one", "other", 1),
                policy("counter", "counter", 3),
            ],
        );
        reconcile_checkpoint(Arc::new(ck), ctx.clone())
            .await
            .unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "published, nothing deleted: {w:#?}");
        assert_eq!(ctx.metrics.checkpoints_deleted.get(), 0);
    }

    /// The sweep deletes an orphaned, empty record whose pod is gone, once the grace period
    /// has passed since it was orphaned, at the version it read; never one with checkpoints,
    /// one whose pod is still there, or one orphaned recently.
    #[tokio::test]
    async fn the_sweep_collects_empty_orphaned_records_of_gone_pods() {
        let now = now_ms();
        let mk = |token: &str, orphaned_ago_s: u64, with_checkpoint: bool| {
            let w = WorkloadName::new(format!("prod_pod_{token}")).unwrap();
            let mut l = Lineage::start(&w, token, &[]);
            if with_checkpoint {
                l.publish(LineageCheckpoint {
                    id: CheckpointId::from_parts(1_700_000_000_000, 1),
                    generation: 1,
                    created_unix_ms: 1,
                    manifest_digest: None,
                })
                .unwrap();
            }
            l.orphan();
            let mut r = Record::new(
                "prod",
                l,
                Some(Holder {
                    token: token.into(),
                    claimed_unix_ms: 1,
                    uid: Some(format!("uid-{token}")),
                    ..Default::default()
                }),
            );
            r.orphaned_unix_ms = Some(now - orphaned_ago_s * 1000);
            r.resource_version = Some("7".into());
            r
        };
        let gone = mk("aaaaaaaa", 3600, false);
        let kept = mk("bbbbbbbb", 3600, true);
        let recent = mk("cccccccc", 60, false);
        let alive = mk("dddddddd", 3600, false);
        let mut pod = running_pod("2026-01-01T00:00:00Z");
        pod.metadata.uid = Some("uid-dddddddd".into());
        pod.status.as_mut().unwrap().phase = Some("Failed".into());
        let (client, seen) = routed_client(vec![]);
        let ctx = context_with(
            client,
            vec![],
            vec![gone.clone(), kept, recent, alive],
            vec![pod],
            vec![],
        );
        sweep(&ctx).await.unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "{w:#?}");
        assert_eq!(w[0].0, "DELETE");
        assert_eq!(
            w[0].1,
            format!("/api/v1/namespaces/stasis/configmaps/{}", gone.name())
        );
        assert_eq!(w[0].2["preconditions"]["resourceVersion"], "7");
        assert_eq!(ctx.metrics.records_collected.get(), 1);
    }

    #[tokio::test]
    async fn the_sweep_drops_the_checkpoint_age_of_pods_no_longer_checkpointed() {
        let pod = running_pod("2026-01-01T00:00:00Z");
        let policies = context(routed_client(vec![]).0, vec![]).policies.state();
        let policy = (*policies[0]).clone();
        let (client, _) = routed_client(vec![]);
        let ctx = context_with(client, vec![], vec![], vec![pod.clone()], vec![policy]);
        let ten = Duration::from_secs(10);
        ctx.metrics
            .checkpoint_freshness("prod", "counter-7d9f8b6c5-abcde", 1_000, ten);
        ctx.metrics.checkpoint_freshness("prod", "gone", 1_000, ten);
        sweep(&ctx).await.unwrap();
        let text = ctx.metrics.encode();
        assert!(
            text.contains("pod=\"counter-7d9f8b6c5-abcde\"} 1.0"),
            "{text}"
        );
        assert!(!text.contains("pod=\"gone\""), "{text}");
        // Its policy deleted: the running pod is no longer checkpointed either.
        let (client, _) = routed_client(vec![]);
        let ctx2 = context_with(client, vec![], vec![], vec![pod], vec![]);
        ctx2.metrics
            .checkpoint_freshness("prod", "counter-7d9f8b6c5-abcde", 1_000, ten);
        sweep(&ctx2).await.unwrap();
        assert!(!ctx2.metrics.encode().contains("counter-7d9f8b6c5-abcde"));
    }

    /// A record written before the holder-UID label existed is written again with it (the
    /// agents stamp only from labelled records); a labelled one is left alone.
    #[tokio::test]
    async fn the_sweep_labels_records_of_an_older_version() {
        let r = record_of_a("prod");
        let mut old = r.to_config_map().unwrap();
        old.metadata
            .labels
            .as_mut()
            .unwrap()
            .remove(names::HOLDER_UID);
        let (client, seen) = routed_client(vec![]);
        let ctx = context_with(
            client,
            vec![],
            vec![],
            vec![running_pod("2026-01-01T00:00:00Z")],
            vec![],
        );
        let ctx = Arc::new(Context {
            record_maps: store_of(vec![old]),
            client: ctx.client.clone(),
            records: ctx.records.clone(),
            recorder: Recorder::new(
                ctx.client.clone(),
                Reporter {
                    controller: MANAGER.into(),
                    instance: None,
                },
            ),
            metrics: Metrics::default(),
            cfg: ctx.cfg.clone(),
            policies: store_of(vec![]),
            checkpoints: store_of(vec![]),
            restores: store_of(vec![]),
            pods: ctx.pods.clone(),
            skips: Mutex::new(HashMap::new()),
            store: None,
        });
        sweep(&ctx).await.unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "{w:#?}");
        assert_eq!(w[0].0, "PUT");
        assert_eq!(w[0].2["metadata"]["labels"][names::HOLDER_UID], "uid-1");
        // Labelled: nothing to write.
        let (client, seen) = routed_client(vec![]);
        let ctx = context_with(
            client,
            vec![],
            vec![r],
            vec![running_pod("2026-01-01T00:00:00Z")],
            vec![],
        );
        sweep(&ctx).await.unwrap();
        assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
    }

    /// A namespace at its cap of records gets no new one: the create is refused before it is
    /// sent, naming the namespace and the cap.
    #[tokio::test]
    async fn records_are_capped_per_namespace() {
        let items: Vec<serde_json::Value> = (0..2)
            .map(|i| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("lineage-{i}")}}))
            .collect();
        let (client, seen) = routed_client(vec![(
            "/api/v1/namespaces/stasis/configmaps".into(),
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": items}),
        )]);
        let records = Records::new(client, "stasis").with_cap(2);
        let w = WorkloadName::new("prod_pod_x").unwrap();
        let r = Record::new("prod", Lineage::start(&w, "aaaaaaaa", &[]), None);
        let err = records.save(&r).await.unwrap_err();
        assert!(matches!(&err, Error::RecordCap { namespace, cap: 2 } if namespace == "prod"));
        assert!(err
            .to_string()
            .contains("namespace prod has 2 lineage records"));
        assert!(writes(&seen).is_empty());
        // Under the cap, the create goes out.
        let (client, seen) = routed_client(vec![(
            "/api/v1/namespaces/stasis/configmaps".into(),
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": []}),
        )]);
        Records::new(client, "stasis")
            .with_cap(2)
            .save(&r)
            .await
            .unwrap();
        assert_eq!(writes(&seen).len(), 1);
    }

    #[tokio::test]
    async fn a_due_heartbeat_creates_one_checkpoint_and_waits_while_it_is_in_flight() {
        let (client, seen) = recording_client();
        let pod = Arc::new(running_pod("2026-01-01T00:00:00Z"));
        let ctx = context(client, vec![]);
        let action = reconcile_pod(pod.clone(), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(10)));
        let calls = seen.lock().unwrap().clone();
        assert_eq!(calls.len(), 1, "{calls:#?}");
        let (method, path, body) = &calls[0];
        assert_eq!(method, "POST");
        assert_eq!(
            path,
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints"
        );
        assert_eq!(body["spec"]["reason"], "Heartbeat");
        assert_eq!(body["spec"]["sourcePodUID"], "uid-1");
        assert_eq!(body["metadata"]["labels"][names::NODE], "worker-1");
        assert_eq!(
            body["metadata"]["annotations"][names::LINEAGE],
            "prod_deploy_counter.aaaaaaaa"
        );
        assert_eq!(body["metadata"]["annotations"][names::GENERATION], "2");
        assert_eq!(ctx.metrics.checkpoints_scheduled.get(), 1);
        // No checkpoint yet: its age counts from the pod's start, against a 10 s interval.
        let text = ctx.metrics.encode();
        for line in [
            "stasis_controller_last_checkpoint_timestamp_seconds{namespace=\"prod\",pod=\"counter-7d9f8b6c5-abcde\"} 1767225600.0",
            "stasis_controller_checkpoint_interval_seconds{namespace=\"prod\",pod=\"counter-7d9f8b6c5-abcde\"} 10.0",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }

        // With that checkpoint pending, the next reconcile asks nothing of the API server.
        let created: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": body["metadata"]["name"], "namespace": "prod",
                         "creationTimestamp": crate::k8s_time(now_ms()).0.to_string()},
            "spec": body["spec"].clone()
        }))
        .unwrap();
        let (client, seen) = recording_client();
        let ctx = context(client, vec![created]);
        reconcile_pod(pod, ctx).await.unwrap();
        assert!(seen.lock().unwrap().is_empty());
    }

    /// A stand-in API server that answers `GET`s from `gets` (404 otherwise), echoes writes
    /// and records every request.
    fn routed_client(gets: Vec<(String, serde_json::Value)>) -> (Client, Seen) {
        let seen: Seen = Arc::default();
        let log = seen.clone();
        let gets = Arc::new(gets);
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let (log, gets) = (log.clone(), gets.clone());
            async move {
                let (parts, body) = req.into_parts();
                let bytes = http_body_util::BodyExt::collect(body)
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                let (method, path) = (parts.method.to_string(), parts.uri.path().to_owned());
                log.lock()
                    .unwrap()
                    .push((method.clone(), path.clone(), v.clone()));
                let (status, out) = match method.as_str() {
                    "GET" => match gets.iter().find(|(p, _)| *p == path) {
                        Some((_, v)) => (200, v.clone()),
                        None => (
                            404,
                            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404}),
                        ),
                    },
                    "DELETE" => (
                        200,
                        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
                    ),
                    "PATCH" => {
                        // A patch answers with the whole object; these tests only need it to
                        // parse as the patched kind.
                        let mut v = v;
                        v["metadata"] = json!({"name": "x", "namespace": "prod"});
                        if path.contains("/podrestores/") {
                            v["apiVersion"] = json!("stasis.dev/v1alpha1");
                            v["kind"] = json!("PodRestore");
                            v["spec"] = json!({"checkpointRef": "x/y", "targetPodName": "x"});
                        } else if path.contains("/pods/") {
                            v["apiVersion"] = json!("v1");
                            v["kind"] = json!("Pod");
                        } else {
                            v["apiVersion"] = json!("stasis.dev/v1alpha1");
                            v["kind"] = json!("PodCheckpoint");
                            v["spec"] = json!({"sourcePodName": "p"});
                        }
                        (200, v)
                    }
                    _ => {
                        let mut v = v;
                        v["metadata"]["resourceVersion"] = json!("101");
                        (200, v)
                    }
                };
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(kube::client::Body::from(out.to_string().into_bytes()))
                        .unwrap(),
                )
            }
        });
        (Client::new(svc, "default"), seen)
    }

    fn succeeded(name: &str, lineage: &str, id: &CheckpointId, generation: u64) -> PodCheckpoint {
        serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": name, "namespace": "prod", "labels": {"stasis.dev/policy": "counter"}},
            "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Heartbeat"},
            "status": {"phase": "Succeeded", "checkpointRef": format!("{lineage}/{id}"),
                       "lineage": lineage, "generation": generation, "specHash": "blake3:x",
                       "manifestDigest": digest_of(id)}
        }))
        .unwrap()
    }

    /// A well-formed manifest digest, distinct per checkpoint.
    fn digest_of(id: &CheckpointId) -> String {
        format!(
            "sha256:{}",
            blake3::hash(id.to_string().as_bytes()).to_hex()
        )
    }

    /// The controller records each published checkpoint's manifest digest (what the restoring
    /// agent holds the manifest to), and publishes nothing without one: a `PodCheckpoint` that
    /// names no digest, or a malformed one, ends `Failed` and the record is not written.
    #[tokio::test]
    async fn a_checkpoint_is_published_with_its_manifest_digest_and_never_without() {
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let lineage = Lineage::start(&w, "tok", &[]);
        let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
        record.resource_version = Some("9".into());
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
        let id = CheckpointId::from_parts(1_700_000_010_000, 1);
        let l = lineage.id.as_str();
        for digest in [None, Some("sha256:abc"), Some("md5:0")] {
            let (client, seen) = routed_client(vec![(
                cm_path.clone(),
                serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
            )]);
            let mut ck = succeeded("ck-1", l, &id, 1);
            ck.status.as_mut().unwrap().manifest_digest = digest.map(str::to_owned);
            let ctx = context(client, vec![ck.clone()]);
            reconcile_checkpoint(Arc::new(ck), ctx.clone())
                .await
                .unwrap();
            let w = writes(&seen);
            assert_eq!(w.len(), 1, "{digest:?}: only the status: {w:#?}");
            assert!(w[0].1.ends_with("/podcheckpoints/ck-1/status"), "{w:#?}");
            assert_eq!(w[0].2["status"]["phase"], "Failed");
            let message = w[0].2["status"]["conditions"][0]["message"].to_string();
            assert!(message.contains("manifestDigest"), "{message}");
        }
        let (client, seen) = routed_client(vec![(
            cm_path.clone(),
            serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
        )]);
        let ck = succeeded("ck-1", l, &id, 1);
        let ctx = context(client, vec![ck.clone()]);
        reconcile_checkpoint(Arc::new(ck), ctx.clone())
            .await
            .unwrap();
        let w = writes(&seen);
        let put = w
            .iter()
            .find(|(m, p, _)| m == "PUT" && p == &cm_path)
            .expect("the record written");
        let published =
            Record::from_config_map(&serde_json::from_value(put.2.clone()).unwrap()).unwrap();
        assert_eq!(
            published.lineage.checkpoints[0].manifest_digest.as_deref(),
            Some(digest_of(&id).as_str())
        );
    }

    #[tokio::test]
    async fn a_succeeded_checkpoint_is_published_then_retention_deletes_the_oldest() {
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let mut lineage = Lineage::start(&w, "tok", &[]);
        let ids: Vec<CheckpointId> = (1..=3u64)
            .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
            .collect();
        for id in &ids[..2] {
            lineage
                .publish(LineageCheckpoint {
                    id: id.clone(),
                    generation: 1,
                    created_unix_ms: 1,
                    manifest_digest: None,
                })
                .unwrap();
        }
        let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
        record.resource_version = Some("9".into());
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
        let (client, seen) = routed_client(vec![(
            cm_path.clone(),
            serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
        )]);
        let l = lineage.id.as_str();
        let cks = vec![
            succeeded("ck-1", l, &ids[0], 1),
            succeeded("ck-2", l, &ids[1], 1),
            succeeded("ck-3", l, &ids[2], 1),
        ];
        // Policy: keepLast 2 (the context's policy has the default 3: use a fresh one).
        let ctx = context(client, cks.clone());
        let policy: CheckpointPolicy = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "counter", "namespace": "prod"},
            "spec": {"selector": {}, "interval": "10s", "retention": {"keepLast": 2}}
        }))
        .unwrap();
        let ctx = Arc::new(Context {
            policies: store_of(vec![policy]),
            client: ctx.client.clone(),
            records: ctx.records.clone(),
            recorder: Recorder::new(
                ctx.client.clone(),
                Reporter {
                    controller: MANAGER.into(),
                    instance: None,
                },
            ),
            metrics: Metrics::default(),
            cfg: ctx.cfg.clone(),
            checkpoints: ctx.checkpoints.clone(),
            restores: store_of(vec![]),
            record_maps: store_of(vec![]),
            pods: store_of(vec![]),
            skips: Mutex::new(HashMap::new()),
            store: None,
        });
        reconcile_checkpoint(Arc::new(cks[2].clone()), ctx.clone())
            .await
            .unwrap();
        let calls = seen.lock().unwrap().clone();
        let writes: Vec<_> = calls.iter().filter(|(m, _, _)| m != "GET").collect();
        assert_eq!(writes.len(), 3, "{calls:#?}");
        // 1. publish: the record replaced at the version read, with the third checkpoint.
        assert_eq!(
            (writes[0].0.as_str(), writes[0].1.as_str()),
            ("PUT", cm_path.as_str())
        );
        assert_eq!(writes[0].2["metadata"]["resourceVersion"], "9");
        let published =
            Record::from_config_map(&serde_json::from_value(writes[0].2.clone()).unwrap()).unwrap();
        assert_eq!(published.lineage.checkpoints.len(), 3);
        // 2. retention: the oldest leaves the record first (at the new version)...
        assert_eq!(writes[1].2["metadata"]["resourceVersion"], "101");
        let kept =
            Record::from_config_map(&serde_json::from_value(writes[1].2.clone()).unwrap()).unwrap();
        assert_eq!(
            kept.lineage
                .checkpoints
                .iter()
                .map(|c| c.id.clone())
                .collect::<Vec<_>>(),
            ids[1..].to_vec()
        );
        // 3. ...then its PodCheckpoint is deleted.
        assert_eq!(
            (writes[2].0.as_str(), writes[2].1.as_str()),
            (
                "DELETE",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints/ck-1"
            )
        );
        assert_eq!(ctx.metrics.checkpoints_deleted.get(), 1);
    }

    #[tokio::test]
    async fn a_checkpoint_from_a_fenced_generation_is_marked_failed() {
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let mut lineage = Lineage::start(&w, "tok", &[]);
        lineage.generation = 3;
        let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
        record.resource_version = Some("9".into());
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
        let (client, seen) = routed_client(vec![(
            cm_path,
            serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
        )]);
        let id = CheckpointId::from_parts(1_700_000_000_000, 1);
        let late = succeeded("late", lineage.id.as_str(), &id, 2);
        let ctx = context(client, vec![late.clone()]);
        reconcile_checkpoint(Arc::new(late), ctx.clone())
            .await
            .unwrap();
        let calls = seen.lock().unwrap().clone();
        let writes: Vec<_> = calls.iter().filter(|(m, _, _)| m != "GET").collect();
        assert_eq!(writes.len(), 1, "{calls:#?}");
        assert_eq!(
            (writes[0].0.as_str(), writes[0].1.as_str()),
            (
                "PATCH",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints/late/status"
            )
        );
        let status = &writes[0].2["status"];
        assert_eq!(status["phase"], "Failed");
        assert_eq!(status["conditions"][0]["reason"], "Fenced");
        assert_eq!(ctx.metrics.checkpoints_fenced.get(), 1);
    }

    #[tokio::test]
    async fn a_running_termination_checkpoint_holds_claims_back() {
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let lineage = Lineage::start(&w, "tok", &[]);
        let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
        record.resource_version = Some("9".into());
        let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
        let (client, seen) = routed_client(vec![(
            cm_path.clone(),
            serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
        )]);
        let created = now_ms();
        let fin: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "p-final-1", "namespace": "prod",
                         "creationTimestamp": crate::k8s_time(created).0.to_string()},
            "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Termination", "timeoutSeconds": 20},
            "status": {"phase": "Running", "lineage": lineage.id.as_str(), "generation": 1}
        }))
        .unwrap();
        let ctx = context(client, vec![fin.clone()]);
        reconcile_checkpoint(Arc::new(fin), ctx).await.unwrap();
        let calls = seen.lock().unwrap().clone();
        let puts: Vec<_> = calls.iter().filter(|(m, _, _)| m == "PUT").collect();
        assert_eq!(puts.len(), 1, "{calls:#?}");
        let saved =
            Record::from_config_map(&serde_json::from_value(puts[0].2.clone()).unwrap()).unwrap();
        let deadline = saved.lineage.final_deadline_unix_ms.unwrap();
        // Creation time has second precision.
        assert!(
            deadline + 1_000 >= created + 25_000 && deadline <= created + 25_000,
            "{deadline} vs {created}"
        );
    }

    #[tokio::test]
    async fn pods_of_other_runtime_classes_are_left_alone() {
        let (client, seen) = recording_client();
        let mut pod = running_pod("2026-01-01T00:00:00Z");
        pod.spec.as_mut().unwrap().runtime_class_name = None;
        let action = reconcile_pod(Arc::new(pod), context(client, vec![]))
            .await
            .unwrap();
        assert_eq!(action, Action::await_change());
        assert!(seen.lock().unwrap().is_empty());
    }

    /// The loop guard keys on the typed cause: two failures of one cause with different
    /// wording mark the checkpoint bad; two causes with the same wording do not; statuses of an
    /// agent without `failure` share one signature.
    #[test]
    fn failure_signatures_come_from_the_typed_cause() {
        let status = |failure: Option<RestoreFailure>, message: &str| PodRestoreStatus {
            phase: Some(RestorePhase::Failed),
            message: Some(message.into()),
            failure,
            ..Default::default()
        };
        let fetch_a = status(
            Some(RestoreFailure::FetchFailed),
            "cold start: store: timeout",
        );
        let fetch_b = status(
            Some(RestoreFailure::FetchFailed),
            "cold start: s3: 503 slow down",
        );
        let key = status(
            Some(RestoreFailure::KeyUnavailable),
            "cold start: store: timeout",
        );
        assert_eq!(failure_signature(Some(&fetch_a)), "restore: FetchFailed");
        assert_eq!(
            failure_signature(Some(&fetch_a)),
            failure_signature(Some(&fetch_b))
        );
        assert_ne!(
            failure_signature(Some(&fetch_a)),
            failure_signature(Some(&key))
        );
        let old_a = status(None, "cold start: fetch failed: boom");
        let old_b = status(None, "incompatible checkpoint: declared.engine: v1 vs v2");
        assert_eq!(failure_signature(Some(&old_a)), "restore: Unknown");
        assert_eq!(
            failure_signature(Some(&old_a)),
            failure_signature(Some(&old_b))
        );
        assert_eq!(failure_signature(None), "restore: Unknown");

        let id = CheckpointId::from_parts(1_700_000_000_000, 1);
        let mut l = record_of_a("prod").lineage;
        l.record_restore_failure(&id, &failure_signature(Some(&fetch_a)));
        l.record_restore_failure(&id, &failure_signature(Some(&key)));
        assert!(!l.bad.contains(&id), "two different causes");
        l.record_restore_failure(&id, &failure_signature(Some(&fetch_b)));
        assert!(
            l.bad.contains(&id),
            "the same cause twice, worded differently"
        );
    }

    /// The holder of the stand-in records: pod `p` (UID `uid-1`) registered by the controller.
    fn holder_uid_1() -> Option<Holder> {
        Some(Holder {
            token: "tok".into(),
            claimed_unix_ms: 1,
            pod: Some("p".into()),
            uid: Some("uid-1".into()),
            ..Default::default()
        })
    }

    #[test]
    fn checkpoint_lineage_from_status_only() {
        let mut c: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "c", "namespace": "n",
                         "annotations": {names::LINEAGE: "l.1", names::GENERATION: "2"}},
            "spec": {"sourcePodName": "p"}
        }))
        .unwrap();
        // Annotations are anyone's to set: never read.
        assert_eq!(checkpoint_lineage(&c), None);
        c.status = Some(PodCheckpointStatus {
            lineage: Some("l.2".into()),
            generation: Some(5),
            ..Default::default()
        });
        assert_eq!(checkpoint_lineage(&c), Some(("l.2".into(), 5)));
    }
}
