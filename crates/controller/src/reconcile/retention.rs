//! Retention: a lineage keeps what its policy says; the rest is deleted from the API and the
//! store.

use super::*;

/// Retention of one lineage under the checkpoint's policy: drops the ids from the record first
/// (so no restore picks them), then deletes their `PodCheckpoint`s and, with a store, their
/// manifests (chunks go with the store's garbage collection).
pub(super) async fn apply_retention(mut r: Record, ctx: &Context) -> Result<()> {
    let ns = r.namespace.clone();
    let policies = ctx.policies.state();
    // The policy that selects the lineage's holder pod (by the record's namespace and the
    // policies' selectors), else the namespace's only policy, else the defaults.
    let holder = holder_pod(&r, ctx);
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
        let mut complete = true;
        for c in ctx
            .checkpoints
            .of_lineage(&ns, r.lineage.id.as_str())
            .iter()
            .filter(|c| {
                c.status.as_ref().and_then(|s| s.checkpoint_ref.as_deref()) == Some(&reference)
            })
        {
            match api.delete(&c.name_any(), &DeleteParams::default()).await {
                Ok(_) => {}
                // Already gone: what retention wanted.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                // Refused (403, 422, ...): the object stays; say so instead of counting it
                // deleted. The record no longer lists the checkpoint, so no retry would.
                Err(kube::Error::Api(s)) => {
                    complete = false;
                    let e = Error::Kube(kube::Error::Api(s));
                    ctx.metrics.failed("retention", &e);
                    tracing::warn!(error = %e, checkpoint = %reference, podcheckpoint = %c.name_any(), "retention could not delete the PodCheckpoint; delete it by hand");
                }
                Err(e) => return Err(e.into()),
            }
        }
        if let Some(store) = &ctx.store {
            let cref = CheckpointRef::exact(r.lineage.id.clone(), id.clone());
            if let Err(e) = store.delete_checkpoint(&cref).await {
                complete = false;
                tracing::warn!(error = %e, checkpoint = %reference, "retention could not delete the checkpoint from the store; `stasis gc` removes what no manifest references");
            }
        }
        if complete {
            ctx.metrics.checkpoints_deleted.inc();
            tracing::info!(checkpoint = %reference, "deleted by retention");
        }
    }
    Ok(())
}

/// The record's registered holder pod, from the pod cache: by the name the record keeps with
/// the UID (a lookup, not a scan of every pod per publish), and only if that pod still has the
/// UID (a pod of the same name created since is another pod). A record that names no pod (a
/// holder registered before names were kept) is looked up by UID among all pods.
pub(super) fn holder_pod(r: &Record, ctx: &Context) -> Option<Arc<Pod>> {
    let uid = r.holder_uid()?;
    let same = |p: &Pod| {
        p.metadata.uid.as_deref() == Some(uid) && p.namespace().as_deref() == Some(&r.namespace)
    };
    match r.holder.as_ref().and_then(|h| h.pod.as_deref()) {
        Some(name) => ctx
            .pods
            .get(&ObjectRef::new(name).within(&r.namespace))
            .filter(|p| same(p)),
        None => ctx.pods.find(|p| same(p)),
    }
}
