//! `PodCheckpoint`s: publishing a succeeded checkpoint into its lineage with fencing, refusing
//! foreign or other-node reports, failing stuck ones, and final checkpoints in flight.

use super::*;

/// The lineage and generation of a checkpoint, as the agent that took it wrote them into its
/// status (the status subresource; the agent takes them from the lineage record that names the
/// source pod as holder). Annotations and labels of a `PodCheckpoint` are never read: anyone
/// who may create one may set them.
pub(super) fn checkpoint_lineage(c: &PodCheckpoint) -> Option<(String, u64)> {
    let s = c.status.as_ref()?;
    let lineage = s.lineage.clone()?;
    let generation = s.generation.and_then(|g| u64::try_from(g).ok())?;
    Some((lineage, generation))
}

/// The source pod's UID as the agent found it (status), else as the spec pins it.
pub(super) fn checkpoint_source_uid(c: &PodCheckpoint) -> Option<String> {
    c.status
        .as_ref()
        .and_then(|s| s.source_pod_uid.clone())
        .or_else(|| c.spec.source_pod_uid.clone())
}

/// Why an object in `namespace` naming a checkpoint of its source pod `source_uid` must not
/// touch the lineage record `r` (`None`: it may). The label is the metric's reason.
pub(super) fn foreign(
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
pub(super) fn wrong_node(
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

/// `sha256:` and 64 lowercase hex digits: the form of `PodCheckpoint.status.manifestDigest`.
pub(super) fn is_manifest_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Marks a checkpoint `Failed` with `Ready=False/<reason>` and the message.
pub(super) async fn fail_checkpoint(
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
    let applied = json!({"phase": status.phase, "conditions": ready_only(&status.conditions)});
    apply_status::<PodCheckpoint>(&ctx.client, &ns, &ck.name_any(), applied).await?;
    Ok(())
}

/// `PodCheckpoint`s: a succeeded one is published into its lineage (or fenced), then retention
/// runs on the lineage; a failed final checkpoint ends the wait for it; a stuck one fails.
#[tracing::instrument(name = "reconcile_checkpoint", skip_all, fields(namespace = %ck.namespace().unwrap_or_default(), name = %ck.name_any()))]
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
    let reference_lineage = reference.rsplit_once('/').map(|(l, _)| l);
    // Published already (this is a reconcile after a restart or a relist, and its source pod
    // may no longer be the holder): nothing to do, and nothing to refuse.
    if r.namespace == ns
        && reference_lineage == Some(lineage_id.as_str())
        && r.lineage.checkpoints.iter().any(|c| c.id == id)
    {
        return Ok(Action::await_change());
    }
    // Only the holder's own checkpoints, in its own namespace, enter a lineage: anything else
    // changes nothing and deletes nothing.
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
pub(super) async fn note_final_in_flight(
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
