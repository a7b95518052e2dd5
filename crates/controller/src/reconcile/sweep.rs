//! The sweep over lineage records: holders refreshed, empty orphaned records of gone workloads
//! collected, records of an older version relabelled.

use super::*;

/// Sweep: every record whose holder pod stopped or vanished is brought up to date (the pod
/// reconciler sees stopping pods; only the sweep sees pods that are gone), and claims whose
/// pod never appeared are released.
#[tracing::instrument(name = "sweep", skip_all)]
pub async fn sweep(ctx: &Context) -> Result<()> {
    let pods = ctx.pods.state();
    // A record's holder is found by its claim token (and UID): the pods carrying each token,
    // once per sweep, instead of a scan of the namespace's pods per record.
    let mut by_token: HashMap<(String, String), Vec<Pod>> = HashMap::new();
    let mut uids: std::collections::HashSet<(String, String)> = Default::default();
    for p in &pods {
        if let (Some(ns), Some(uid)) = (p.namespace(), p.metadata.uid.clone()) {
            uids.insert((ns, uid));
        }
        if let (Some(ns), Some(t)) = (p.namespace(), p.labels().get(names::CLAIM_TOKEN)) {
            by_token
                .entry((ns, t.clone()))
                .or_default()
                .push((**p).clone());
        }
    }
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
        let holders: &[Pod] = r
            .lineage
            .holder
            .as_ref()
            .and_then(|t| by_token.get(&(ns.clone(), t.clone())))
            .map_or(&[], Vec::as_slice);
        if r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none() {
            let holder_exists = r
                .holder_uid()
                .is_some_and(|uid| uids.contains(&(ns.clone(), uid.to_owned())));
            collect(r, holder_exists || !holders.is_empty(), now, ctx).await?;
            continue;
        }
        let checkpoints = ctx.holder_checkpoints(&r);
        let on_termination = true;
        let (state, _) = holder_state(&r, holders, &checkpoints, on_termination);
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
/// `holder_exists`: a pod of the record's namespace has its holder's UID or its claim token.
pub(super) async fn collect(
    mut r: Record,
    holder_exists: bool,
    now: u64,
    ctx: &Context,
) -> Result<()> {
    if r.orphaned_unix_ms.is_none() {
        r.orphaned_unix_ms = Some(now);
        return match ctx.records.save(&r).await {
            Ok(_) | Err(Error::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        };
    }
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
