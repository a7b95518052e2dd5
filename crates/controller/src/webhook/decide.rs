//! The decision for one admitted pod: identity, policy, claim, the restore or cold start, and
//! the patch that carries it.

use super::*;

/// The decision for one request: `None` for pods that are not stasis's concern.
#[tracing::instrument(name = "admission", skip_all, fields(namespace = %req.namespace.as_deref().unwrap_or_default(), uid = %req.uid))]
pub(crate) async fn mutate(
    hook: &Webhook,
    req: &AdmissionRequest<Pod>,
    final_wait: Duration,
) -> Result<Option<serde_json::Value>> {
    let Some(original) = stasis_pod(&hook.cfg, req) else {
        return Ok(None);
    };
    if req.dry_run {
        // Nothing is claimed on a dry run; the answer still shows the keys a user may not set
        // removed.
        return Ok(Some(patch(original, &Mutation::default())));
    }
    let ns = req.namespace.clone().unwrap_or_default();
    let mut pod = original.clone();
    pod.metadata.namespace = Some(ns.clone());
    let mut m = Mutation::default();
    let cold = |m: &mut Mutation, label: &str, why: String| {
        m.annotations
            .insert(names::DECISION.into(), "ColdStart".into());
        m.annotations.insert(names::DECISION_REASON.into(), why);
        hook.metrics.admitted("ColdStart", label);
    };
    // The owners the pod names must exist with those UIDs: otherwise nothing is claimed or
    // written, and the answer names no lineage.
    let workload = match verified_identity(&hook.client, &ns, &pod).await? {
        Ok(w) => w.key(),
        Err((label, why)) => {
            cold(&mut m, label, format!("no workload identity: {why}"));
            return Ok(Some(patch(original, &m)));
        }
    };
    // Who is asking: the workload's own controller, or someone who needs the restore permission.
    let user = req.user_info.username.clone().unwrap_or_default();
    let requester = match requester_without_review(&user, &pod) {
        Some(r) => r,
        None => {
            let may = may_restore(&hook.client, &ns, &req.user_info).await?;
            Requester::classify(&user, controller_kind(&pod), may)
        }
    };
    let policies = Api::<CheckpointPolicy>::namespaced(hook.client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    let labels = pod.labels().clone();
    let policy = policy_for(&policies.items, &ns, &labels).cloned();
    let mut inputs = restore_inputs(&pod, policy.as_ref(), requester.clone())?;
    let permitted = match &requester {
        Requester::WorkloadController => true,
        Requester::Direct { may_restore, .. } => *may_restore,
    };
    let Some(policy) = policy.filter(|_| permitted) else {
        // Nothing to claim: no policy checkpoints this pod, or its creator may not restore.
        let Decision::ColdStart { reason } = decide(&inputs) else {
            return Err(Error::Invariant("a restore decided without a claim"));
        };
        cold(&mut m, reason.label(), reason.to_string());
        return Ok(Some(patch(original, &m)));
    };
    let token = new_token();
    // A prediction: nothing is written (the request is not authenticated); the controller
    // commits it against the real pod.
    let stores = Stores {
        client: &hook.client,
        records: &hook.records,
        phantom_after: hook.cfg.phantom_after,
    };
    let mode = Mode::Predict { final_wait };
    let outcome = match claim_and_decide(
        &stores,
        &ns,
        &pod,
        &workload,
        &token,
        &policy,
        &mut inputs,
        &mode,
    )
    .await?
    {
        Claimed::Decided(o) => *o,
        Claimed::Wait | Claimed::Impostor(_) => {
            return Err(Error::Invariant(
                "a prediction that neither waits nor commits",
            ))
        }
    };
    m.labels.insert(names::CLAIM_TOKEN.into(), token.clone());
    m.annotations.insert(names::CLAIM_TOKEN.into(), token);
    m.annotations
        .insert(names::LINEAGE.into(), outcome.lineage.as_str().to_owned());
    m.annotations
        .insert(names::GENERATION.into(), outcome.generation.to_string());
    match outcome.decision {
        Decision::Restore {
            lineage,
            checkpoint,
            ..
        } => {
            let reference = format!("{lineage}/{checkpoint}");
            tracing::info!(namespace = %ns, workload = %workload, checkpoint = %reference, "restore decided");
            hook.metrics.admitted("Restore", "Restore");
            m.annotations
                .insert(names::DECISION.into(), "Restore".into());
            m.annotations.insert(names::RESTORE_FROM.into(), reference);
            let node_requirements = node_requirements(&hook.client, outcome.checkpoint_node).await;
            m.restore = Some(RestoreMutation {
                node_requirements,
                wait: hook.cfg.wait.clone(),
            });
        }
        Decision::ColdStart { reason } => {
            tracing::info!(namespace = %ns, workload = %workload, reason = %reason, "cold start decided");
            cold(&mut m, reason.label(), reason.to_string());
        }
    }
    Ok(Some(patch(original, &m)))
}

/// A random claim token: 32 hex digits (a valid label value).
pub(crate) fn new_token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}
