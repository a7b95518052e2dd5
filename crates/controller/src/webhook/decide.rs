//! The decision for one admitted pod: identity, policy, claim, the restore or cold start, and
//! the patch that carries it.

use super::*;
use stasis_api::{PodRestore, RestorePhase};

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
    // Where an admission's time goes (debug level): each step is one or two API reads.
    let mut steps = Steps::default();
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
    let identity = verified_identity(&hook.client, hook.owners.as_ref(), &ns, &pod).await?;
    steps.done("owners");
    let workload = match identity {
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
    steps.done("requester");
    let policies = namespace_policies(hook, &ns).await?;
    steps.done("policies");
    let labels = pod.labels().clone();
    let policy = policy_for(&policies, &ns, &labels).cloned();
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
        if permitted {
            let asked = fetch_asked(hook, &ns, &pod).await;
            restore_asked(hook, &ns, &pod, asked, &mut m).await;
        }
        return Ok(Some(patch(original, &m)));
    };
    let token = new_token();
    // A prediction: nothing is written (the request is not authenticated); the controller
    // commits it against the real pod.
    let stores = Stores {
        client: &hook.client,
        records: &hook.records,
        checkpoints: &hook.checkpoints,
        record_index: hook.record_index.as_ref(),
        phantom_after: hook.cfg.phantom_after,
    };
    let mode = Mode::Predict { final_wait };
    // A restore asked by hand is looked for at the same time as the claim (one round trip
    // less; its answer is used only for a cold start).
    let (claimed, asked) = tokio::join!(
        claim_and_decide(
            &stores,
            &ns,
            &pod,
            &workload,
            &token,
            &policy,
            &mut inputs,
            &mode,
        ),
        fetch_asked(hook, &ns, &pod)
    );
    let outcome = match claimed? {
        Claimed::Decided(o) => *o,
        Claimed::Wait | Claimed::Impostor(_) => {
            return Err(Error::Invariant(
                "a prediction that neither waits nor commits",
            ))
        }
    };
    steps.done("claim");
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
            m.annotations
                .insert(names::RESTORE_FROM.into(), reference.clone());
            let prefer_nodes = prestaged_on(
                hook,
                &ns,
                lineage.as_str(),
                &reference,
                outcome.checkpoint_node.as_deref(),
                &pod,
            );
            if !prefer_nodes.is_empty() {
                tracing::info!(namespace = %ns, checkpoint = %reference, nodes = ?prefer_nodes, "the replacement prefers the nodes that pre-staged its checkpoint");
            }
            let node_requirements = node_requirements(&hook.client, outcome.checkpoint_node).await;
            m.restore = Some(RestoreMutation {
                node_requirements,
                prefer_nodes,
                wait: hook.cfg.wait.clone(),
            });
        }
        Decision::ColdStart { reason } => {
            tracing::info!(namespace = %ns, workload = %workload, reason = %reason, "cold start decided");
            cold(&mut m, reason.label(), reason.to_string());
            restore_asked(hook, &ns, &pod, asked, &mut m).await;
        }
    }
    steps.done("placement");
    tracing::debug!(namespace = %ns, steps = %steps, "admission decided");
    Ok(Some(patch(original, &m)))
}

/// The policies of `ns`: from the process's cache once it has listed them (policies are few
/// and rarely change; a policy created within the watch's lag is not seen, and the pod is
/// admitted without a claim: the controller then starts a lineage for it as for any running
/// pod the webhook did not claim for), else from the API server.
async fn namespace_policies(hook: &Webhook, ns: &str) -> Result<Vec<CheckpointPolicy>> {
    if let Some(cache) = hook.policies.as_ref().filter(|c| {
        use futures::FutureExt;
        c.wait_until_ready().now_or_never().is_some()
    }) {
        return Ok(cache
            .state()
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(ns))
            .map(|p| (**p).clone())
            .collect());
    }
    Ok(Api::<CheckpointPolicy>::namespaced(hook.client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items)
}

/// The time of each step of one admission, for the debug log.
struct Steps {
    last: std::time::Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Default for Steps {
    fn default() -> Self {
        Self {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }
}

impl Steps {
    fn done(&mut self, step: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((step, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (step, d)) in self.done.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{step}={:.1}ms", d.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}

/// A restore a user asked for before creating the pod (`kubectl stasis restore POD --from ...`):
/// a `PodRestore` named as the pod, for a pod of that name without a UID yet, not begun. A pod
/// that would start cold and whose creator may restore gets the wait container, so that its
/// container is created only once its node's agent has prepared that restore (or failed to);
/// without the wait the container raced the fetch and started cold whenever it lost. The pod
/// still starts a lineage of its own (the decision stays `ColdStart`, its reason says where the
/// state comes from).
async fn restore_asked(
    hook: &Webhook,
    ns: &str,
    pod: &Pod,
    asked: Option<PodRestore>,
    m: &mut Mutation,
) {
    let (Some(name), Some(pr)) = (pod.metadata.name.as_deref(), asked) else {
        return;
    };
    tracing::info!(namespace = %ns, pod = %name, checkpoint = %pr.spec.checkpoint_ref, "restore asked by a PodRestore: the pod waits for it");
    let why = m
        .annotations
        .remove(names::DECISION_REASON)
        .unwrap_or_default();
    m.annotations.insert(
        names::DECISION_REASON.into(),
        format!(
            "{why}; its state comes from checkpoint {} as PodRestore {name} asks",
            pr.spec.checkpoint_ref
        ),
    );
    // The agent prepares a PodRestore without a target UID only for a pod marked so: what a
    // user who may not restore creates under that name never gets the checkpoint (the webhook
    // strips user-supplied stasis.dev/ keys, the admission policies refuse them).
    m.annotations
        .insert(names::RESTORE_REQUEST.into(), name.to_string());
    m.restore = Some(RestoreMutation {
        node_requirements: node_requirements(&hook.client, None).await,
        prefer_nodes: Vec::new(),
        wait: hook.cfg.wait.clone(),
    });
}

/// Whether the API server generated the pod's name (its `generateName` and the 5 characters it
/// adds; it names the pod before admission): nobody could have made a `PodRestore` named as
/// the pod before it was created, so none is asked for (a ReplicaSet's, a Job's pods).
fn name_generated(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> bool {
    match (m.generate_name.as_deref(), m.name.as_deref()) {
        (Some(prefix), Some(name)) if !prefix.is_empty() => name
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.len() == 5 && rest.bytes().all(|b| b.is_ascii_alphanumeric())),
        _ => false,
    }
}

/// The `PodRestore` named as the pod, if a user made it for the pod not created yet
/// ([`asked_by_hand`]).
async fn fetch_asked(hook: &Webhook, ns: &str, pod: &Pod) -> Option<PodRestore> {
    let name = pod.metadata.name.as_deref()?;
    if name_generated(&pod.metadata) {
        return None;
    }
    match Api::<PodRestore>::namespaced(hook.client.clone(), ns)
        .get_opt(name)
        .await
    {
        Ok(Some(pr)) if asked_by_hand(&pr, name) => Some(pr),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(namespace = %ns, pod = %name, error = %e, "cannot read a PodRestore named as the pod: it starts without waiting for one");
            None
        }
    }
}

/// A `PodRestore` a user made for a pod not created yet: it targets `pod` by name only, and no
/// agent has begun it (the webhook's own restores are made after admission, with the UID).
pub(crate) fn asked_by_hand(pr: &PodRestore, pod: &str) -> bool {
    pr.spec.target_pod_name == pod
        && pr.spec.target_pod_uid.is_none()
        && matches!(
            pr.status.as_ref().and_then(|s| s.phase),
            None | Some(RestorePhase::Pending)
        )
}

/// A random claim token: 32 hex digits (a valid label value).
pub(crate) fn new_token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

#[cfg(test)]
mod asked_tests {
    use super::*;
    use serde_json::json;

    fn pr(target: &str, uid: Option<&str>, phase: Option<&str>) -> PodRestore {
        let mut v = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
            "metadata": {"name": target, "namespace": "n"},
            "spec": {"checkpointRef": "n_pod_a.1/0000000001", "targetPodName": target}
        });
        if let Some(u) = uid {
            v["spec"]["targetPodUID"] = json!(u);
        }
        if let Some(p) = phase {
            v["status"] = json!({"phase": p});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_a_restore_made_for_a_pod_not_created_yet_is_waited_for() {
        assert!(asked_by_hand(&pr("b", None, None), "b"));
        assert!(asked_by_hand(&pr("b", None, Some("Pending")), "b"));
        // Another pod's, an earlier pod's of the same name (it has a UID), or one already begun.
        assert!(!asked_by_hand(&pr("c", None, None), "b"));
        assert!(!asked_by_hand(&pr("b", Some("u1"), None), "b"));
        for phase in ["Fetching", "Ready", "Restored", "Failed", "ColdStart"] {
            assert!(!asked_by_hand(&pr("b", None, Some(phase)), "b"), "{phase}");
        }
    }
}

#[cfg(test)]
mod name_tests {
    use super::name_generated;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn meta(generate: Option<&str>, name: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            generate_name: generate.map(str::to_owned),
            name: name.map(str::to_owned),
            ..Default::default()
        }
    }

    /// A PodRestore asked by hand is looked for only where someone could have named it first.
    #[test]
    fn a_generated_name_is_told_from_a_chosen_one() {
        assert!(name_generated(&meta(
            Some("web-7d9f8b6c5-"),
            Some("web-7d9f8b6c5-x2b9q")
        )));
        // Chosen names: a bare pod, a StatefulSet's, one that only looks generated.
        assert!(!name_generated(&meta(None, Some("bare-2"))));
        assert!(!name_generated(&meta(None, Some("web-0"))));
        assert!(!name_generated(&meta(Some("web-"), Some("web-0"))));
        assert!(!name_generated(&meta(Some("web-"), Some("other-x2b9q"))));
        assert!(!name_generated(&meta(Some(""), Some("x2b9q"))));
    }
}
