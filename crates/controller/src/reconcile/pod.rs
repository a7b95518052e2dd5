//! Pods: a stasis pod gets its holder registered, its admission decision reported, its lineage
//! orphaned when it stops, and its heartbeat checkpoints; a pod without a lineage starts one.

use super::*;
use crate::claim::{claim_and_decide, restore_inputs, Claimed, Mode, Prediction, Stores};
use stasis_core::decision::{Decision, Requester};

pub(super) fn pod_uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// Pods: a stasis pod gets its holder registered, its admission decision materialised, its
/// lineage orphaned when it stops, and its heartbeat checkpoints.
#[tracing::instrument(name = "reconcile_pod", skip_all, fields(namespace = %pod.namespace().unwrap_or_default(), name = %pod.name_any()))]
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
    // one its claim token holds (a claim an older webhook wrote, which the pod registers as the
    // first pod seen with the token), else the claim the webhook predicted, committed now.
    let mut record = ctx.record_of_holder(&ns, &uid);
    let mut reported = pod.annotations().contains_key(names::DECISION_REPORTED);
    if let (None, Some(t)) = (&record, token.as_deref()) {
        match ctx.record_with_token(&ns, t) {
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
            _ => match commit(&pod, t, policy.as_ref(), &ctx).await? {
                Committed::Record(r, now_reported) => {
                    record = Some(*r);
                    reported |= now_reported;
                }
                Committed::Wait => return Ok(Action::requeue(Duration::from_millis(500))),
                Committed::Impostor(r) => return impostor(&pod, &r, &ctx).await,
                // Nothing to commit: below, a running pod starts its own lineage like a pod
                // the webhook never saw.
                Committed::Nothing => {}
            },
        }
    }

    // A decision made at admission becomes a PodRestore (restore) or an Event (cold start),
    // only for the registered holder and only from what its record says.
    let annotations = pod.annotations();
    let restore_decided = record
        .as_ref()
        .and_then(|r| r.holder.as_ref())
        .is_some_and(|h| h.restore.is_some());
    if (annotations.contains_key(names::DECISION) || restore_decided) && !reported {
        report_decision(&pod, record.as_ref(), &ctx).await?;
    }

    // A stopping or ended pod orphans its lineage (and its final checkpoint is waited for).
    if let Some(r) = record.as_mut() {
        let on_termination = policy.as_ref().is_none_or(|p| p.spec.on_termination);
        let checkpoints = ctx.holder_checkpoints(r);
        let (state, _) = holder_state(r, std::slice::from_ref(&*pod), &checkpoints, on_termination);
        let was_orphaned = r.lineage.orphaned;
        if refresh(
            r,
            &state,
            now_ms(),
            ctx.cfg.phantom_after.as_millis() as u64,
        ) {
            *r = ctx.records.save(r).await?;
        }
        if !was_orphaned && r.lineage.orphaned {
            super::heartbeat::note_end(&ctx, &pod_uid(&pod));
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
                    names::event::CHECKPOINT_SKIPPED,
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
                    names::event::CHECKPOINT_SKIPPED,
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
pub(super) async fn impostor(pod: &Pod, r: &Record, ctx: &Context) -> Result<Action> {
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
        names::event::CLAIM_REFUSED,
        format!(
            "label {} of this pod is the claim of pod {holder}: this pod holds no lineage, is not restored and gets no checkpoints",
            names::CLAIM_TOKEN
        ),
    )
    .await;
    let patch = json!({"metadata": {"annotations": {names::DECISION_REPORTED: "true"}}});
    add_metadata::<Pod>(&ctx.client, &ns, &pod.name_any(), patch["metadata"].clone()).await?;
    Ok(Action::await_change())
}

/// What committing a pod's predicted claim came to.
pub(super) enum Committed {
    /// The record the pod holds, and whether the decision was reported on the way (a restore
    /// the commit did not confirm).
    Record(Box<Record>, bool),
    /// A source's final checkpoint is in flight: ask again shortly.
    Wait,
    /// The pod's claim token is another pod's.
    Impostor(Box<Record>),
    /// Nothing to commit: the pod is stopping or ended, no policy selects it any more, or its
    /// owners cannot be verified.
    Nothing,
}

/// Commits the claim the webhook predicted for `pod` (claim token `token`): the same claim and
/// decision as at admission ([`crate::claim`]), now against the real pod and stored with the
/// pod registered as holder (docs/design.md §13.3). What to claim comes from the records and
/// the pod's verified owners; the pod's keys only narrow it (the lineage announced, a restore
/// only when the pod was prepared for one). A pod that was prepared for a restore and does not
/// get it is told why (a Warning Event) and its decision is marked reported, so its wait
/// container stops waiting.
pub(super) async fn commit(
    pod: &Pod,
    token: &str,
    policy: Option<&CheckpointPolicy>,
    ctx: &Context,
) -> Result<Committed> {
    let ns = pod.namespace().unwrap_or_default();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let Some(policy) = policy else {
        return Ok(Committed::Nothing);
    };
    if pod.metadata.deletion_timestamp.is_some() || matches!(phase, Some("Failed" | "Succeeded")) {
        return Ok(Committed::Nothing);
    }
    let workload = match ctx.verified_identity(&ns, pod).await? {
        Ok(identity) => identity.key(),
        Err((_, reason)) => {
            tracing::warn!(pod = %pod.name_any(), namespace = %ns, %reason, "claim not committed: the pod's owners could not be verified");
            return Ok(Committed::Nothing);
        }
    };
    let prediction = Prediction::of(pod);
    // The webhook decided a restore only for a requester allowed to restore (and a pod's keys
    // are only stasis's to write); a predicted cold start stays one whatever is decided here.
    let mut inputs = restore_inputs(pod, Some(policy), Requester::WorkloadController)?;
    let created = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or_else(now_ms, time_ms);
    let mode = Mode::Commit {
        uid: pod_uid(pod),
        pod_name: pod.name_any(),
        prediction: prediction.clone(),
        wait_until_ms: created + ctx.cfg.final_wait.as_millis() as u64,
    };
    let stores = Stores {
        client: &ctx.client,
        records: &ctx.records,
        checkpoints: &ctx.checkpoints,
        record_index: None,
        phantom_after: ctx.cfg.phantom_after,
    };
    let outcome = match claim_and_decide(
        &stores,
        &ns,
        pod,
        &workload,
        token,
        policy,
        &mut inputs,
        &mode,
    )
    .await
    {
        Ok(Claimed::Decided(o)) => o,
        Ok(Claimed::Wait) => return Ok(Committed::Wait),
        Ok(Claimed::Impostor(r)) => return Ok(Committed::Impostor(r)),
        Err(Error::RecordCap { namespace, cap }) => {
            // The start-lineage path below reports it on the pod.
            tracing::warn!(pod = %pod.name_any(), %namespace, cap, "claim not committed: the namespace has the most lineage records allowed");
            return Ok(Committed::Nothing);
        }
        Err(e) => return Err(e),
    };
    let record = outcome
        .record
        .clone()
        .ok_or(Error::Invariant("a committed claim without its record"))?;
    let a = pod.annotations();
    let mut keys = serde_json::Map::new();
    if a.get(names::LINEAGE).map(String::as_str) != Some(record.lineage.id.as_str()) {
        keys.insert(names::LINEAGE.into(), json!(record.lineage.id.as_str()));
    }
    if a.get(names::GENERATION) != Some(&record.lineage.generation.to_string()) {
        keys.insert(
            names::GENERATION.into(),
            json!(record.lineage.generation.to_string()),
        );
    }
    let restoring = record.holder.as_ref().is_some_and(|h| h.restore.is_some());
    let mut untold = prediction.restore && !restoring && !a.contains_key(names::DECISION_REPORTED);
    if untold && outcome.earlier {
        // Committed by an earlier reconcile, which told the pod unless it failed after the
        // write: the pod as the API server has it now says which (this one may be older).
        let live = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&pod.name_any())
            .await?;
        untold = live.is_some_and(|p| !p.annotations().contains_key(names::DECISION_REPORTED));
    }
    if untold {
        // Prepared for a restore that the commit does not confirm: say why, and let the wait
        // container go (the controller reports the decision handled without a PodRestore).
        let taken = prediction
            .lineage
            .as_deref()
            .filter(|l| *l != record.lineage.id.as_str());
        let why = match (&outcome.displaced, taken, &outcome.decision) {
            (Some(d), _, _) => format!("{d}: this pod starts cold with a new lineage of its own"),
            (None, Some(l), _) => format!(
                "lineage {l}, which this pod was admitted to continue, was taken by another pod first: this pod starts cold with a new lineage of its own"
            ),
            (None, None, Decision::ColdStart { reason }) if !outcome.earlier => format!(
                "the restore decided at admission no longer holds: {reason}; this pod starts cold"
            ),
            _ => "the restore decided at admission no longer holds: this pod starts cold".into(),
        };
        tracing::warn!(pod = %pod.name_any(), namespace = %ns, lineage = %record.lineage.id, %why, "restore not committed");
        ctx.metrics.admitted("ColdStart", "NotCommitted");
        ctx.event(
            &pod.object_ref(&()),
            EventType::Warning,
            reason::COLD_START,
            why.clone(),
        )
        .await;
        keys.insert(names::DECISION.into(), json!("ColdStart"));
        keys.insert(names::DECISION_REASON.into(), json!(why));
        keys.insert(names::DECISION_REPORTED.into(), json!("true"));
    }
    if !keys.is_empty() {
        let patch = json!({ "annotations": keys.clone() });
        add_metadata::<Pod>(&ctx.client, &ns, &pod.name_any(), patch).await?;
    }
    tracing::info!(pod = %pod.name_any(), namespace = %ns, lineage = %record.lineage.id, generation = record.lineage.generation, restore = restoring, "claim committed");
    // Such a pod's decision is reported, now or before: nothing more to report for it.
    Ok(Committed::Record(
        Box::new(record),
        prediction.restore && !restoring,
    ))
}

/// A new lineage for a running pod without one; the pod is labelled and annotated with it.
pub(super) async fn start_lineage(pod: &Pod, ctx: &Context) -> Result<Record> {
    let ns = pod.namespace().unwrap_or_default();
    let uid = pod_uid(pod);
    // Owners verified by UID, as at admission: a guess from names would let a user's
    // ReplicaSet `web-zz9` start a lineage of Deployment `web`, which web's replacements could
    // then claim (docs/design.md §10.2).
    let workload = match ctx.verified_identity(&ns, pod).await? {
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
    add_metadata::<Pod>(&ctx.client, &ns, &pod.name_any(), patch["metadata"].clone()).await?;
    tracing::info!(pod = %pod.name_any(), namespace = %ns, lineage = %record.lineage.id, "new lineage for a pod admitted without the webhook");
    Ok(record)
}
