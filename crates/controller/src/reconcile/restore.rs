//! `PodRestore`s: each outcome feeds the restore-loop guard of its lineage once; a damaged
//! checkpoint raises the lineage's integrity alarm instead.

use super::*;

/// Why a `PodRestore`'s status was not written by the agent of its target pod's node (`None`:
/// it was, or the pod is not in the cache).
pub(super) fn restore_from_other_node(pr: &PodRestore, pods: &Store<Pod>) -> Option<String> {
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
#[tracing::instrument(name = "reconcile_restore", skip_all, fields(namespace = %pr.namespace().unwrap_or_default(), name = %pr.name_any()))]
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
            let applied = json!({
                "phase": status.phase,
                "message": status.message,
                "failure": status.failure,
                "conditions": ready_only(&status.conditions),
            });
            apply_status::<PodRestore>(&ctx.client, &ns, &pr.name_any(), applied).await?;
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
    add_metadata::<PodRestore>(
        &ctx.client,
        &ns,
        &pr.name_any(),
        json!({"annotations": {names::ACCOUNTED: "true"}}),
    )
    .await?;
    Ok(Action::await_change())
}

/// True when the agent reported that the restore found the checkpoint's objects gone or
/// damaged in the store: `status.failure`, or (from an agent older than that field) the `Ready`
/// condition's reason; never message text.
pub(super) fn restore_found_damage(status: Option<&PodRestoreStatus>) -> bool {
    status.is_some_and(|s| {
        s.failure == Some(RestoreFailure::CheckpointDamaged)
            || s.conditions
                .iter()
                .any(|c| c.type_ == condition::READY && c.reason == reason::CHECKPOINT_DAMAGED)
    })
}

/// Why a `PodRestore` must not touch the record of the lineage it names (`None`: it may): the
/// lineage is of another namespace, or its `checkpointRef` is not a checkpoint of that lineage.
pub(super) fn restore_mismatch(pr: &PodRestore, r: &Record) -> Option<(&'static str, String)> {
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
