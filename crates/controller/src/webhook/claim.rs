//! Claiming a lineage for a new pod and deciding, stored with the decision in the lineage
//! record, retried from a fresh read when another writer got there first.

use super::*;

/// The claim and the decision made under it.
pub(super) struct Outcome {
    pub(super) decision: Decision,
    pub(super) lineage: WorkloadName,
    pub(super) generation: u64,
    /// Node that took the checkpoint to restore.
    pub(super) checkpoint_node: Option<String>,
}

/// Claims a lineage for `token` (waiting, within `final_wait`, for a source's in-flight final
/// checkpoint), decides, and stores the claim with the decision in the lineage record, retrying
/// from a fresh read when another writer got there first.
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(name = "claim_and_decide", skip_all, fields(namespace = %ns, workload = %workload))]
pub(crate) async fn claim_and_decide(
    hook: &Webhook,
    ns: &str,
    pod: &Pod,
    workload: &WorkloadName,
    token: &str,
    policy: &CheckpointPolicy,
    inputs: &mut RestoreInputs,
    final_wait: Duration,
) -> Result<Outcome> {
    let pods_api = Api::<Pod>::namespaced(hook.client.clone(), ns);
    let cks_api = Api::<PodCheckpoint>::namespaced(hook.client.clone(), ns);
    let started = Instant::now();
    let phantom = hook.cfg.phantom_after.as_millis() as u64;
    for _attempt in 0..50 {
        let mut recs = hook.records.of_workload(workload).await?;
        let checkpoints = cks_api.list(&ListParams::default()).await?.items;
        let now = now_ms();
        // Bring the records up to date with their holders (orphaning stopped pods, noting
        // in-flight final checkpoints), remembering the holder pods: one may be the source.
        let mut holder_pods: BTreeMap<usize, Pod> = BTreeMap::new();
        let mut conflict = false;
        for (i, r) in recs.iter_mut().enumerate() {
            let Some(token) = r.lineage.holder.clone() else {
                continue;
            };
            if r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none() {
                continue;
            }
            let lp = ListParams::default().labels(&format!("{}={token}", names::CLAIM_TOKEN));
            let pods = pods_api.list(&lp).await?.items;
            let (state, holder_pod) =
                holder_state(r, &pods, &checkpoints, policy.spec.on_termination);
            if let Some(p) = holder_pod {
                holder_pods.insert(i, p);
            }
            if refresh(r, &state, now, phantom) {
                match hook.records.save(r).await {
                    Ok(saved) => *r = saved,
                    Err(Error::Conflict(_)) => {
                        conflict = true;
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if conflict {
            continue;
        }
        let mut lineages: Vec<Lineage> = recs.iter().map(|r| r.lineage.clone()).collect();
        if claim_wait(&lineages, workload, now).is_some() && started.elapsed() < final_wait {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        }
        let (mut record, source) = match claim(&mut lineages, workload, token) {
            Some(c) => {
                let i = lineages
                    .iter()
                    .position(|l| l.id == c.lineage)
                    .ok_or(Error::Invariant(
                        "the claimed lineage vanished from the records",
                    ))?;
                let mut rec = recs[i].clone();
                let source_pod_name = rec.holder.as_ref().and_then(|h| h.pod.clone());
                rec.lineage = lineages[i].clone();
                inputs.claim = Some(c);
                (rec, (holder_pods.remove(&i), source_pod_name))
            }
            None => {
                inputs.claim = None;
                let l = Lineage::start(workload, token, &lineages);
                (Record::new(ns, l, None), (None, None))
            }
        };
        let (mut source_pod, source_name) = source;
        if source_pod.is_none() {
            // Orphaned earlier (by the controller): the source pod may still be there.
            if let Some(name) = &source_name {
                let want = record.holder.as_ref().and_then(|h| h.uid.clone());
                source_pod = pods_api
                    .get_opt(name)
                    .await?
                    .filter(|p| want.is_none() || p.metadata.uid == want);
            }
        }
        inputs.last_exit = source_pod
            .as_ref()
            .map_or(LastExit::Unknown, podfacts::last_exit);
        inputs.mismatches = source_pod
            .as_ref()
            .map(|s| declared_mismatches(s, pod))
            .unwrap_or_default();
        let mut checkpoint_node = None;
        inputs.checkpoint_spec_hash = None;
        if let Some(RestoreChoice::Checkpoint { id, .. }) = inputs.claim.as_ref().map(|c| &c.choice)
        {
            let reference = format!("{}/{}", record.lineage.id, id);
            if let Some(s) = checkpoints
                .iter()
                .filter_map(|c| c.status.as_ref())
                .find(|s| s.checkpoint_ref.as_deref() == Some(&reference))
            {
                inputs.checkpoint_spec_hash = s.spec_hash.clone().map(SpecHash);
                checkpoint_node = s.node.clone();
            }
        }
        let decision = decide(inputs);
        let restore = match &decision {
            Decision::Restore {
                lineage,
                checkpoint,
                ..
            } => Some(format!("{lineage}/{checkpoint}")),
            Decision::ColdStart { .. } => None,
        };
        record.holder = Some(Holder {
            token: token.to_owned(),
            claimed_unix_ms: now,
            pod: None,
            uid: None,
            restore,
            source_pod: source_pod.map(|p| p.name_any()).or(source_name),
        });
        match hook.records.save(&record).await {
            Ok(saved) => {
                return Ok(Outcome {
                    decision,
                    lineage: saved.lineage.id.clone(),
                    generation: saved.lineage.generation,
                    checkpoint_node,
                })
            }
            Err(Error::Conflict(_)) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Error::Conflict(format!(
        "lineages of {workload}: too many concurrent writers"
    )))
}
