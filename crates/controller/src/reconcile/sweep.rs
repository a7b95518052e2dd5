//! The sweep over lineage records: holders refreshed, empty orphaned records of gone workloads
//! collected, records of an older version relabelled.

use super::*;

/// Sweep: every record whose holder pod stopped or vanished is brought up to date (the pod
/// reconciler sees stopping pods; only the sweep sees pods that are gone), and claims whose
/// pod never appeared are released.
#[tracing::instrument(name = "sweep", skip_all)]
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
        let (was_orphaned, holder) = (r.lineage.orphaned, r.holder_uid().map(str::to_owned));
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
        if let (false, true, Some(uid)) = (was_orphaned, r.lineage.orphaned, holder) {
            super::heartbeat::note_end(ctx, &uid);
        }
    }
    Ok(())
}

/// Records written before they carried the holder-UID and namespace labels (an upgrade) are
/// written again with them: the agents stamp checkpoints only from a labelled record.
pub(super) async fn relabel(ctx: &Context) -> Result<()> {
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
pub(super) async fn collect(mut r: Record, in_ns: &[Pod], now: u64, ctx: &Context) -> Result<()> {
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
