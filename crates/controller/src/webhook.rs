//! The mutating admission webhook (`POST /mutate`): the restore decision for a new pod with
//! `runtimeClassName: stasis` (DESIGN §3 "Restore", docs/design.md §10.8, §13.3).
//!
//! It never refuses a pod: every failure is logged and answered with "allowed" (the pod starts
//! cold), and the chart registers it with `failurePolicy: Ignore`. Whatever the outcome, the
//! `stasis.dev/` labels and annotations only stasis may write are removed from the pod
//! ([`crate::admission::is_reserved`]).
//!
//! The request itself is not authenticated (docs/design.md §13.3): so that a forged request
//! cannot make the webhook write anything for a workload that does not exist, the pod's
//! controlling owner is read from the API server and must have the UIDs the owner references
//! name ([`verified_identity`]) before any lineage is claimed or started.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ApiResource, ListParams, PostParams};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use stasis_api::lineage::declared_mismatches;
use stasis_api::names;
use stasis_api::{pod as podfacts, CheckpointPolicy, CheckpointReason, PodCheckpoint};
use stasis_core::decision::{decide, Decision, LastExit, Requester, RestoreInputs};
use stasis_core::lineage::{claim, claim_wait, Lineage, RestoreChoice};
use stasis_core::podspec::{unsafe_volumes, SpecHash};
use stasis_core::reference::WorkloadName;
use stasis_core::workload::{check_owner, OwnerFacts, ReplicaSetOwner, WorkloadIdentity};

use crate::admission::{patch, requester_without_review, Mutation, RestoreMutation, WaitConfig};
use crate::metrics::Metrics;
use crate::record::{refresh, Holder, HolderState, Record, Records};
use crate::schedule::{policy_for, CheckpointView};
use crate::{now_ms, time_ms, Error, Result};

/// Settings of the webhook.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub runtime_class: String,
    pub wait: WaitConfig,
    /// Longest time an admission waits for a source's in-flight final checkpoint (kept under
    /// the webhook's `timeoutSeconds`); after it, the claim goes ahead and fences a late one.
    pub final_wait: Duration,
    /// A claim whose pod has not appeared after this long is released.
    pub phantom_after: Duration,
}

/// What the webhook needs.
pub struct Webhook {
    pub client: Client,
    pub records: Records,
    pub metrics: Metrics,
    pub cfg: WebhookConfig,
}

/// How long an admission may wait for a final checkpoint: the configured wait, and at most the
/// API server's own timeout for this call (its `?timeout=` query parameter, e.g. `10s`) less
/// 3 s for the rest of the decision, so the answer always comes before the API server gives up.
pub fn final_wait_budget(configured: Duration, query: Option<&str>) -> Duration {
    let timeout = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("timeout="))
        .and_then(|t| stasis_core::policy::parse_duration(t).ok());
    match timeout {
        Some(t) => configured.min(t.saturating_sub(Duration::from_secs(3))),
        None => configured,
    }
}

/// Answers one AdmissionReview (the request body) with an AdmissionReview; `final_wait` is
/// [`final_wait_budget`].
pub async fn review(hook: Arc<Webhook>, body: &[u8], final_wait: Duration) -> Vec<u8> {
    let review: AdmissionReview<Pod> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return serde_json::to_vec(&AdmissionResponse::invalid(e).into_review())
                .unwrap_or_default()
        }
    };
    let req: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(e) => {
            return serde_json::to_vec(&AdmissionResponse::invalid(e).into_review())
                .unwrap_or_default()
        }
    };
    let mut resp = AdmissionResponse::from(&req);
    let ops = match mutate(&hook, &req, final_wait).await {
        Ok(ops) => ops,
        Err(e) => {
            hook.metrics.admitted("Error", e.metric_label());
            tracing::warn!(error = %e, namespace = ?req.namespace, "restore decision failed: pod admitted without stasis's keys (cold start)");
            // Still without user-supplied stasis keys: a cold start, nothing else.
            stasis_pod(&hook.cfg, &req).map(|p| patch(p, &Mutation::default()))
        }
    };
    if let Some(ops) = ops.filter(|o| o.as_array().is_some_and(|a| !a.is_empty())) {
        match serde_json::from_value::<json_patch::Patch>(ops) {
            Ok(p) => match resp.clone().with_patch(p) {
                Ok(r) => resp = r,
                Err(e) => {
                    tracing::warn!(error = %e, "patch not serialisable: pod admitted unchanged")
                }
            },
            Err(e) => tracing::warn!(error = %e, "patch invalid: pod admitted unchanged"),
        }
    }
    let review: AdmissionReview<DynamicObject> = resp.into_review();
    serde_json::to_vec(&review).unwrap_or_default()
}

/// The pod of a request that is stasis's concern: the creation of a pod of its RuntimeClass.
fn stasis_pod<'a>(cfg: &WebhookConfig, req: &'a AdmissionRequest<Pod>) -> Option<&'a Pod> {
    let pod = req.object.as_ref()?;
    let class = pod.spec.as_ref()?.runtime_class_name.as_deref();
    (req.operation == Operation::Create && class == Some(cfg.runtime_class.as_str())).then_some(pod)
}

/// The decision for one request: `None` for pods that are not stasis's concern.
async fn mutate(
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
            Requester::classify(&user, crate::admission::controller_kind(&pod), may)
        }
    };
    let policies = Api::<CheckpointPolicy>::namespaced(hook.client.clone(), &ns)
        .list(&ListParams::default())
        .await?;
    let labels = pod.labels().clone();
    let policy = policy_for(&policies.items, &ns, &labels).cloned();
    let pod_hash = podfacts::spec_hash(&pod).ok_or(Error::Missing("pod without a spec"))?;
    let mut inputs = RestoreInputs {
        requester: requester.clone(),
        policy_restore_on_crash: policy.as_ref().map(|p| p.spec.restore_on_crash),
        cold_start_annotation: podfacts::cold_start_annotation(&pod),
        unsafe_volumes: unsafe_volumes(
            &podfacts::volume_facts(&pod),
            policy.as_ref().map_or(&[][..], |p| &p.spec.safe_volumes),
        ),
        last_exit: LastExit::Unknown,
        claim: None,
        pod_spec_hash: pod_hash,
        checkpoint_spec_hash: None,
        mismatches: Vec::new(),
    };
    let permitted = match &requester {
        Requester::WorkloadController => true,
        Requester::Direct { may_restore, .. } => *may_restore,
    };
    let Some(policy) = policy.filter(|_| permitted) else {
        // Nothing to claim: no policy checkpoints this pod, or its creator may not restore.
        let Decision::ColdStart { reason } = decide(&inputs) else {
            return Err(Error::Missing("a restore without a claim"));
        };
        cold(&mut m, reason.label(), reason.to_string());
        return Ok(Some(patch(original, &m)));
    };
    let token = new_token();
    let outcome = claim_and_decide(
        hook,
        &ns,
        &pod,
        &workload,
        &token,
        &policy,
        &mut inputs,
        final_wait,
    )
    .await?;
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

/// The workload of a pod at admission, its owners read from the API server: the controlling
/// owner must exist with the UID its reference names, and a ReplicaSet's own controlling
/// Deployment too (`stasis_core::workload::check_owner`); the Deployment of a ReplicaSet is the
/// one the ReplicaSet names, never one guessed from names (docs/design.md §10.2). `Err` with a
/// metric label and the reason when the pod has no identity, or names owners that are not
/// there (a forged request, a stale reference).
pub async fn verified_identity(
    client: &Client,
    ns: &str,
    pod: &Pod,
) -> Result<std::result::Result<WorkloadIdentity, (&'static str, String)>> {
    let mut facts = podfacts::pod_facts(pod);
    if let Some(owner) = facts.controller.clone() {
        let api_version = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| o.api_version.clone())
            .unwrap_or_default();
        let found = owner_meta(client, ns, &api_version, &owner.kind, &owner.name).await?;
        if let Err(e) = check_owner(&owner, found.as_ref().and_then(|m| m.uid.as_deref())) {
            return Ok(Err(("UnverifiedOwner", e.to_string())));
        }
        if owner.kind == "ReplicaSet" {
            let rs_owner = found
                .as_ref()
                .and_then(|m| m.owner_references.as_ref())
                .and_then(|refs| refs.iter().find(|o| o.controller == Some(true)))
                .map(|o| {
                    (
                        o.api_version.clone(),
                        OwnerFacts {
                            kind: o.kind.clone(),
                            name: o.name.clone(),
                            uid: o.uid.clone(),
                        },
                    )
                });
            if let Some((api_version, d)) =
                rs_owner.as_ref().filter(|(_, d)| d.kind == "Deployment")
            {
                let found = owner_meta(client, ns, api_version, &d.kind, &d.name).await?;
                if let Err(e) = check_owner(d, found.as_ref().and_then(|m| m.uid.as_deref())) {
                    return Ok(Err((
                        "UnverifiedOwner",
                        format!("its ReplicaSet {:?}: {e}", owner.name),
                    )));
                }
            }
            facts.replicaset_owner = ReplicaSetOwner::Verified(rs_owner.map(|(_, d)| d));
        }
    }
    Ok(WorkloadIdentity::of(&facts).map_err(|e| ("NoIdentity", e.to_string())))
}

/// The metadata of a pod's owner object, `None` when there is no such object. The built-in
/// workload kinds are read only in their own API group (an owner reference to a `ReplicaSet` of
/// another group is no ReplicaSet controller's); other kinds through their group and version
/// (the controller needs `get` on them).
async fn owner_meta(
    client: &Client,
    ns: &str,
    api_version: &str,
    kind: &str,
    name: &str,
) -> Result<Option<ObjectMeta>> {
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let c = client.clone();
    let meta = match (group, kind) {
        ("apps", "ReplicaSet") => meta_of(Api::<ReplicaSet>::namespaced(c, ns), name).await?,
        ("apps", "Deployment") => meta_of(Api::<Deployment>::namespaced(c, ns), name).await?,
        ("apps", "StatefulSet") => meta_of(Api::<StatefulSet>::namespaced(c, ns), name).await?,
        ("apps", "DaemonSet") => meta_of(Api::<DaemonSet>::namespaced(c, ns), name).await?,
        ("batch", "Job") => meta_of(Api::<Job>::namespaced(c, ns), name).await?,
        (_, "ReplicaSet" | "Deployment" | "StatefulSet" | "DaemonSet" | "Job") => None,
        _ => {
            let gvk = GroupVersionKind::gvk(group, version, kind);
            let api = Api::<DynamicObject>::namespaced_with(c, ns, &ApiResource::from_gvk(&gvk));
            meta_of(api, name).await?
        }
    };
    Ok(meta)
}

/// The metadata of object `name`, `None` when there is none.
async fn meta_of<K>(api: Api<K>, name: &str) -> Result<Option<ObjectMeta>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api.get_opt(name).await?.map(|o| o.meta().clone()))
}

/// A random claim token: 32 hex digits (a valid label value).
fn new_token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// SubjectAccessReview: may this user create `podrestores.stasis.dev` in the namespace?
async fn may_restore(
    client: &Client,
    ns: &str,
    user: &k8s_openapi::api::authentication::v1::UserInfo,
) -> Result<bool> {
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            groups: user.groups.clone(),
            uid: user.uid.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_owned()),
                verb: Some("create".into()),
                group: Some(stasis_api::GROUP.into()),
                resource: Some("podrestores".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &sar)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// Node labels a restoring pod needs: an agent ready to restore, the checkpointing node's CPU
/// architecture and GPU driver branch (when that node is still known).
async fn node_requirements(client: &Client, node: Option<String>) -> Vec<(String, Vec<String>)> {
    let mut reqs = vec![(names::node::READY.to_owned(), vec!["true".to_owned()])];
    let Some(node) = node else { return reqs };
    if let Ok(Some(n)) = Api::<Node>::all(client.clone()).get_opt(&node).await {
        let labels = n.labels();
        for key in [names::node::CPU_ARCH, names::node::GPU_DRIVER_BRANCH] {
            if let Some(v) = labels.get(key) {
                reqs.push((key.to_owned(), vec![v.clone()]));
            }
        }
    }
    reqs
}

/// The claim and the decision made under it.
struct Outcome {
    decision: Decision,
    lineage: WorkloadName,
    generation: u64,
    /// Node that took the checkpoint to restore.
    checkpoint_node: Option<String>,
}

/// The state of a lineage's holder, from the pods carrying its token and the checkpoints of the
/// namespace. Returns the holder pod too (the source of a restore).
pub fn holder_state(
    record: &Record,
    pods: &[Pod],
    checkpoints: &[PodCheckpoint],
    on_termination: bool,
) -> (HolderState, Option<Pod>) {
    let holder = record.holder.as_ref();
    let token = record.lineage.holder.as_deref().unwrap_or_default();
    let want_uid = holder.and_then(|h| h.uid.as_deref());
    let pod = pods.iter().find(|p| {
        p.labels().get(names::CLAIM_TOKEN).map(String::as_str) == Some(token)
            && want_uid.is_none_or(|u| p.metadata.uid.as_deref() == Some(u))
    });
    let Some(pod) = pod else {
        let seen = holder.is_some_and(|h| h.uid.is_some());
        if !seen {
            return (HolderState::Unseen, None);
        }
        let uid = want_uid.unwrap_or_default();
        let final_in_flight = checkpoints.iter().any(|c| {
            c.spec.reason == CheckpointReason::Termination
                && checkpoint_pod_uid(c).as_deref() == Some(uid)
                && CheckpointView::of(c).in_flight()
        });
        return (HolderState::Gone { final_in_flight }, None);
    };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let state = if let Some(del) = &pod.metadata.deletion_timestamp {
        let deadline = time_ms(del);
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64;
        HolderState::Terminating {
            started_unix_ms: deadline.saturating_sub(grace * 1000),
            // Slack for the agent to report the checkpoint it finished at the deadline.
            deadline_unix_ms: deadline + 5_000,
            // A pod whose node is lost is not Ready: no agent will checkpoint it.
            final_expected: on_termination && phase == Some("Running") && pod_ready(pod),
        }
    } else if matches!(phase, Some("Failed" | "Succeeded")) {
        HolderState::Ended
    } else {
        HolderState::Running
    };
    (state, Some(pod.clone()))
}

/// The pod's `Ready` condition is `True`.
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The UID of a checkpoint's source pod (spec, label or status).
pub fn checkpoint_pod_uid(c: &PodCheckpoint) -> Option<String> {
    c.spec
        .source_pod_uid
        .clone()
        .or_else(|| c.labels().get(names::POD_UID).cloned())
        .or_else(|| c.status.as_ref().and_then(|s| s.source_pod_uid.clone()))
}

/// Claims a lineage for `token` (waiting, within `final_wait`, for a source's in-flight final
/// checkpoint), decides, and stores the claim with the decision in the lineage record, retrying
/// from a fresh read when another writer got there first.
#[allow(clippy::too_many_arguments)]
async fn claim_and_decide(
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
                    .ok_or(Error::Missing("claimed lineage vanished"))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn record_held_by(token: &str, uid: Option<&str>) -> Record {
        let w = WorkloadName::new("prod_deploy_c").unwrap();
        Record::new(
            "prod",
            Lineage::start(&w, token, &[]),
            Some(Holder {
                token: token.into(),
                claimed_unix_ms: 0,
                uid: uid.map(str::to_owned),
                pod: uid.map(|_| "c-1".to_owned()),
                ..Default::default()
            }),
        )
    }

    #[test]
    fn holder_states() {
        let r = record_held_by("tok", Some("u1"));
        let running = pod(json!({
            "metadata": {"name": "c-1", "uid": "u1", "labels": {names::CLAIM_TOKEN: "tok"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }));
        assert_eq!(
            holder_state(&r, std::slice::from_ref(&running), &[], true).0,
            HolderState::Running
        );
        let mut deleting = running.clone();
        deleting.metadata.deletion_timestamp = Some(crate::k8s_time(40_000));
        deleting.metadata.deletion_grace_period_seconds = Some(30);
        assert_eq!(
            holder_state(&r, std::slice::from_ref(&deleting), &[], true).0,
            HolderState::Terminating {
                started_unix_ms: 10_000,
                deadline_unix_ms: 45_000,
                final_expected: true
            }
        );
        // Its node lost (not Ready): no final checkpoint is coming.
        let mut lost = deleting.clone();
        lost.status.as_mut().unwrap().conditions = Some(vec![serde_json::from_value(
            json!({"type": "Ready", "status": "False"}),
        )
        .unwrap()]);
        assert!(matches!(
            holder_state(&r, &[lost], &[], true).0,
            HolderState::Terminating {
                final_expected: false,
                ..
            }
        ));
        // Another pod with a copied token but another UID is not the holder.
        let mut impostor = running.clone();
        impostor.metadata.uid = Some("u2".into());
        assert_eq!(
            holder_state(&r, &[impostor], &[], true).0,
            HolderState::Gone {
                final_in_flight: false
            }
        );
        let fin: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "f", "namespace": "prod"},
            "spec": {"sourcePodName": "c-1", "sourcePodUID": "u1", "reason": "Termination"},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        assert_eq!(
            holder_state(&r, &[], &[fin], true).0,
            HolderState::Gone {
                final_in_flight: true
            }
        );
        // A fresh claim whose pod is not there yet.
        let fresh = record_held_by("tok", None);
        assert_eq!(holder_state(&fresh, &[], &[], true).0, HolderState::Unseen);
        let mut failed = running;
        failed.status.as_mut().unwrap().phase = Some("Failed".into());
        assert_eq!(holder_state(&r, &[failed], &[], true).0, HolderState::Ended);
    }

    #[test]
    fn final_wait_fits_the_api_servers_timeout() {
        let d = Duration::from_secs(20);
        assert_eq!(final_wait_budget(d, None), d);
        assert_eq!(final_wait_budget(d, Some("timeout=30s")), d);
        assert_eq!(
            final_wait_budget(d, Some("x=1&timeout=10s")),
            Duration::from_secs(7)
        );
        assert_eq!(final_wait_budget(d, Some("timeout=2s")), Duration::ZERO);
        assert_eq!(final_wait_budget(d, Some("timeout=1m0s")), d);
    }

    /// A client whose API server fails every call.
    fn offline_client() -> Client {
        let svc = tower::service_fn(|_req: http::Request<kube::client::Body>| async move {
            Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
                "no API server in unit tests",
            ))
        });
        Client::new(svc, "default")
    }

    fn offline_hook() -> Arc<Webhook> {
        let client = offline_client();
        Arc::new(Webhook {
            records: Records::new(client.clone(), "stasis"),
            client,
            metrics: Metrics::default(),
            cfg: WebhookConfig {
                runtime_class: "stasis".into(),
                wait: WaitConfig {
                    image: "i".into(),
                    command: "/c".into(),
                    status_url: "http://s:8080".into(),
                    timeout_seconds: 5,
                },
                final_wait: Duration::from_secs(1),
                phantom_after: Duration::from_secs(60),
            },
        })
    }

    fn admission_review(user: &str, pod: serde_json::Value, dry_run: bool) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "req-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "prod",
                "operation": "CREATE",
                "userInfo": {"username": user},
                "object": pod,
                "dryRun": dry_run
            }
        }))
        .unwrap()
    }

    fn response(out: &[u8]) -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(out).unwrap();
        assert_eq!(v["kind"], "AdmissionReview");
        v["response"].clone()
    }

    #[tokio::test]
    async fn admits_unchanged_what_is_not_stasis_and_anything_it_cannot_decide() {
        let hook = offline_hook();
        let wait = Duration::from_secs(1);
        let plain = json!({"metadata": {"generateName": "c-"}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
        let r =
            response(&review(hook.clone(), &admission_review("alice", plain, false), wait).await);
        assert_eq!(
            (r["uid"].as_str(), r["allowed"].as_bool()),
            (Some("req-1"), Some(true))
        );
        assert!(r.get("patch").is_none());
        let stasis = json!({
            "metadata": {"generateName": "c-", "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "c-7f", "uid": "u", "controller": true}
            ], "labels": {"pod-template-hash": "7f"}},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
        });
        // A dry run decides nothing (no claim may be written).
        let r = response(
            &review(
                hook.clone(),
                &admission_review(
                    "system:serviceaccount:kube-system:replicaset-controller",
                    stasis.clone(),
                    true,
                ),
                wait,
            )
            .await,
        );
        assert!(r["allowed"].as_bool().unwrap() && r.get("patch").is_none());
        // The API server cannot be reached: the pod is admitted unchanged (a cold start), for the
        // workload's controller and for a person (whose SubjectAccessReview fails) alike.
        for user in [
            "system:serviceaccount:kube-system:replicaset-controller",
            "alice",
        ] {
            let r = response(
                &review(
                    hook.clone(),
                    &admission_review(user, stasis.clone(), false),
                    wait,
                )
                .await,
            );
            assert!(
                r["allowed"].as_bool().unwrap() && r.get("patch").is_none(),
                "{user}: {r}"
            );
        }
        assert!(hook.metrics.encode().contains("decision=\"Error\""));
    }

    #[tokio::test]
    async fn cold_start_without_identity_is_annotated() {
        // A bare generateName pod has no identity at admission (it needs its own name).
        let hook = offline_hook();
        let pod = json!({"metadata": {"generateName": "x-"}, "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c"}]}});
        let r = response(
            &review(
                hook,
                &admission_review("alice", pod, false),
                Duration::from_secs(1),
            )
            .await,
        );
        assert_eq!(r["patchType"], "JSONPatch");
        // kube serialises the patch bytes as a JSON array of numbers (the API server's Go
        // decoder takes that as well as base64).
        let bytes: Vec<u8> = serde_json::from_value(r["patch"].clone()).unwrap();
        let patch: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(patch[0]["value"][names::DECISION], "ColdStart");
    }

    type Writes = Arc<std::sync::Mutex<Vec<(String, String, serde_json::Value)>>>;

    /// A stand-in API server for one admission: answers by method and path from `routes`
    /// (404 otherwise) and records what was written.
    fn routed_client(routes: Vec<(&'static str, String, serde_json::Value)>) -> (Client, Writes) {
        let writes: Writes = Arc::default();
        let log = writes.clone();
        let routes = Arc::new(routes);
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let (routes, log) = (routes.clone(), log.clone());
            async move {
                let (parts, body) = req.into_parts();
                let bytes = http_body_util::BodyExt::collect(body)
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let method = parts.method.to_string();
                let path = parts.uri.path().to_owned();
                let (status, out) = if method == "GET" {
                    match routes.iter().find(|(m, p, _)| *m == "GET" && *p == path) {
                        Some((_, _, v)) => (200, v.clone()),
                        None => (
                            404,
                            json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                   "status": "Failure", "reason": "NotFound", "code": 404,
                                   "message": format!("{path} not found")}),
                        ),
                    }
                } else {
                    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                    log.lock().unwrap().push((method, path, v.clone()));
                    let mut v = v;
                    if v.get("metadata").is_some() {
                        v["metadata"]["resourceVersion"] = json!("100");
                    }
                    (200, v)
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
        (Client::new(svc, "default"), writes)
    }

    fn list(kind: &str, items: Vec<serde_json::Value>) -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items})
    }

    #[tokio::test]
    async fn a_replacement_claims_the_orphaned_lineage_and_is_patched_to_restore() {
        let new_pod = json!({
            "metadata": {"generateName": "counter-7d9f8b6c5-", "labels": {"app": "counter", "pod-template-hash": "7d9f8b6c5"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-7d9f8b6c5", "uid": "rs", "controller": true}]},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "stasis-counter:dev"}]}
        });
        let mut as_pod: Pod = serde_json::from_value(new_pod.clone()).unwrap();
        as_pod.metadata.namespace = Some("prod".into());
        let hash = podfacts::spec_hash(&as_pod).unwrap().0;
        // The source's lineage, orphaned (its pod is gone), with one checkpoint.
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let mut lineage = Lineage::start(&w, "old-token", &[]);
        let id = stasis_core::reference::CheckpointId::from_parts(1_700_000_000_000, 1);
        lineage
            .publish(stasis_core::lineage::LineageCheckpoint {
                id: id.clone(),
                generation: 1,
                created_unix_ms: 1_700_000_000_000,
                manifest_digest: None,
            })
            .unwrap();
        lineage.orphan();
        let mut record = Record::new(
            "prod",
            lineage.clone(),
            Some(Holder {
                token: "old-token".into(),
                claimed_unix_ms: 1,
                pod: Some("counter-7d9f8b6c5-old".into()),
                uid: Some("old-uid".into()),
                ..Default::default()
            }),
        );
        record.resource_version = Some("7".into());
        let cm = serde_json::to_value(record.to_config_map().unwrap()).unwrap();
        let reference = format!("{}/{}", lineage.id, id);
        let checkpoint = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "counter-7d9f8b6c5-old-1700000000", "namespace": "prod"},
            "spec": {"sourcePodName": "counter-7d9f8b6c5-old", "sourcePodUID": "old-uid", "reason": "Heartbeat"},
            "status": {"phase": "Succeeded", "node": "worker-1", "checkpointRef": reference,
                       "lineage": lineage.id.as_str(), "generation": 1, "specHash": hash}
        });
        let policy = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "counter", "namespace": "prod"},
            "spec": {"selector": {"matchLabels": {"app": "counter"}}, "interval": "10s"}
        });
        let node = json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "worker-1", "labels": {names::node::CPU_ARCH: "amd64", names::node::READY: "true"}}});
        let (client, writes) = routed_client(vec![
            (
                "GET",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/checkpointpolicies".into(),
                list("CheckpointPolicyList", vec![policy]),
            ),
            (
                "GET",
                "/api/v1/namespaces/stasis/configmaps".into(),
                list("ConfigMapList", vec![cm]),
            ),
            (
                "GET",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints".into(),
                list("PodCheckpointList", vec![checkpoint]),
            ),
            (
                "GET",
                "/api/v1/namespaces/prod/pods".into(),
                list("PodList", vec![]),
            ),
            ("GET", "/api/v1/nodes/worker-1".into(), node),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/replicasets/counter-7d9f8b6c5".into(),
                replicaset("counter-7d9f8b6c5", "rs", Some(("counter", "dep"))),
            ),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/deployments/counter".into(),
                json!({"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": "counter", "namespace": "prod", "uid": "dep"}}),
            ),
        ]);
        let hook = Arc::new(Webhook {
            records: Records::new(client.clone(), "stasis"),
            client,
            metrics: Metrics::default(),
            cfg: offline_hook().cfg.clone(),
        });
        let out = review(
            hook.clone(),
            &admission_review(
                "system:serviceaccount:kube-system:replicaset-controller",
                new_pod.clone(),
                false,
            ),
            Duration::from_secs(1),
        )
        .await;
        let r = response(&out);
        assert_eq!(r["allowed"], true);
        let bytes: Vec<u8> = serde_json::from_value(r["patch"].clone()).expect("a patch");
        let ops: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let mut patched = new_pod.clone();
        json_patch::patch(
            &mut patched,
            &serde_json::from_value::<json_patch::Patch>(ops).unwrap(),
        )
        .unwrap();
        let ann = &patched["metadata"]["annotations"];
        assert_eq!(ann[names::DECISION], "Restore", "{ann}");
        assert_eq!(ann[names::RESTORE_FROM], reference.as_str());
        assert_eq!(ann[names::LINEAGE], lineage.id.as_str());
        assert_eq!(ann[names::GENERATION], "2");
        let token = ann[names::CLAIM_TOKEN].as_str().unwrap();
        assert_eq!(patched["metadata"]["labels"][names::CLAIM_TOKEN], token);
        assert_eq!(
            patched["spec"]["initContainers"][0]["name"],
            stasis_api::pod::RESTORE_WAIT_CONTAINER
        );
        let exprs = &patched["spec"]["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
            ["matchExpressions"];
        assert_eq!(exprs[0]["key"], names::node::READY);
        assert_eq!(exprs[1]["key"], names::node::CPU_ARCH);
        assert_eq!(exprs[1]["values"][0], "amd64");
        // One write: the record, replaced at the version read, claimed by the new token at
        // generation 2, with the decided restore and its source.
        let writes = writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1, "{writes:#?}");
        let (method, path, cm) = &writes[0];
        assert_eq!(
            (method.as_str(), path.as_str()),
            (
                "PUT",
                &*format!("/api/v1/namespaces/stasis/configmaps/{}", record.name())
            )
        );
        assert_eq!(cm["metadata"]["resourceVersion"], "7");
        let saved = Record::from_config_map(&serde_json::from_value(cm.clone()).unwrap()).unwrap();
        assert_eq!(saved.lineage.generation, 2);
        assert_eq!(saved.lineage.holder.as_deref(), Some(token));
        assert!(!saved.lineage.orphaned);
        let h = saved.holder.unwrap();
        assert_eq!(h.restore.as_deref(), Some(reference.as_str()));
        assert_eq!(h.source_pod.as_deref(), Some("counter-7d9f8b6c5-old"));
        assert!(hook.metrics.encode().contains("decision=\"Restore\""));
    }

    /// A ReplicaSet as the API server returns it, controlled by `deployment` (name, UID).
    fn replicaset(name: &str, uid: &str, deployment: Option<(&str, &str)>) -> serde_json::Value {
        let owners: Vec<serde_json::Value> = deployment
            .map(|(n, u)| json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": n, "uid": u, "controller": true}))
            .into_iter()
            .collect();
        json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
               "metadata": {"name": name, "namespace": "prod", "uid": uid, "ownerReferences": owners},
               "spec": {"selector": {}}})
    }

    /// The patch of an answer applied to `pod`.
    fn patched(out: &[u8], pod: &serde_json::Value) -> serde_json::Value {
        let r = response(out);
        assert_eq!(r["allowed"], true);
        let mut doc = pod.clone();
        if let Some(p) = r.get("patch") {
            let bytes: Vec<u8> = serde_json::from_value(p.clone()).unwrap();
            let ops: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
            json_patch::patch(&mut doc, &ops).unwrap();
        }
        doc
    }

    /// A pod of ReplicaSet `rs` (UID `uid`), as the M1 and H2 attacks write it.
    fn rs_pod(rs: &str, uid: &str, hash: &str) -> serde_json::Value {
        json!({
            "metadata": {"generateName": format!("{rs}-"), "labels": {"app": "web", "pod-template-hash": hash},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs, "uid": uid, "controller": true}]},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "web:1"}]}
        })
    }

    fn hook_with(client: Client) -> Arc<Webhook> {
        Arc::new(Webhook {
            records: Records::new(client.clone(), "stasis"),
            client,
            metrics: Metrics::default(),
            cfg: offline_hook().cfg.clone(),
        })
    }

    const RS_CONTROLLER: &str = "system:serviceaccount:kube-system:replicaset-controller";

    #[tokio::test]
    async fn a_review_naming_owners_that_are_not_there_claims_nothing_and_names_no_lineage() {
        let policy = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "web", "namespace": "prod"},
            "spec": {"selector": {"matchLabels": {"app": "web"}}, "interval": "10s"}
        });
        let routes = || {
            vec![
                (
                    "GET",
                    "/apis/stasis.dev/v1alpha1/namespaces/prod/checkpointpolicies".to_owned(),
                    list("CheckpointPolicyList", vec![policy.clone()]),
                ),
                (
                    "GET",
                    "/api/v1/namespaces/stasis/configmaps".to_owned(),
                    list("ConfigMapList", vec![]),
                ),
                (
                    "GET",
                    "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints".to_owned(),
                    list("PodCheckpointList", vec![]),
                ),
                (
                    "GET",
                    "/apis/apps/v1/namespaces/prod/replicasets/web-6d4f9".to_owned(),
                    replicaset("web-6d4f9", "rs-real", Some(("web", "dep-real"))),
                ),
                (
                    "GET",
                    "/apis/apps/v1/namespaces/prod/replicasets/web-zz9".to_owned(),
                    replicaset("web-zz9", "rs-user", None),
                ),
                (
                    "GET",
                    "/apis/apps/v1/namespaces/prod/replicasets/web-gone".to_owned(),
                    replicaset("web-gone", "rs-gone", Some(("web", "dep-old"))),
                ),
                (
                    "GET",
                    "/apis/apps/v1/namespaces/prod/deployments/web".to_owned(),
                    json!({"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": "web", "namespace": "prod", "uid": "dep-real"}}),
                ),
            ]
        };
        // A forged review (any user may claim to be the ReplicaSet controller): a ReplicaSet
        // that does not exist, one whose UID differs, one whose Deployment is another object
        // of the same name.
        for (rs, uid, hash, why) in [
            ("web-nope", "rs-x", "nope", "does not exist"),
            ("web-6d4f9", "rs-forged", "6d4f9", "another UID"),
            ("web-gone", "rs-gone", "gone", "another UID"),
        ] {
            let (client, writes) = routed_client(routes());
            let hook = hook_with(client);
            let pod = rs_pod(rs, uid, hash);
            let out = review(
                hook.clone(),
                &admission_review(RS_CONTROLLER, pod.clone(), false),
                Duration::from_secs(1),
            )
            .await;
            let doc = patched(&out, &pod);
            let ann = &doc["metadata"]["annotations"];
            assert_eq!(ann[names::DECISION], "ColdStart", "{rs}: {doc}");
            let reason = ann[names::DECISION_REASON].as_str().unwrap();
            assert!(reason.contains(why), "{rs}: {reason}");
            assert!(ann.get(names::LINEAGE).is_none(), "{rs}: {ann}");
            assert!(ann.get(names::CLAIM_TOKEN).is_none(), "{rs}: {ann}");
            assert!(writes.lock().unwrap().is_empty(), "{rs}: nothing written");
            assert!(hook.metrics.encode().contains("UnverifiedOwner"));
        }
        // M1: a ReplicaSet `web-zz9` a user created, shaped like Deployment web's: it is its
        // own workload (keyed by its UID), never Deployment web's.
        let (client, writes) = routed_client(routes());
        let pod = rs_pod("web-zz9", "rs-user", "zz9");
        let out = review(
            hook_with(client),
            &admission_review(RS_CONTROLLER, pod.clone(), false),
            Duration::from_secs(1),
        )
        .await;
        let doc = patched(&out, &pod);
        let lineage = doc["metadata"]["annotations"][names::LINEAGE]
            .as_str()
            .unwrap();
        assert!(lineage.starts_with("prod_rs_web-zz9_"), "{lineage}");
        let writes = writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1);
        assert!(writes[0].2["metadata"]["annotations"][names::WORKLOAD]
            .as_str()
            .unwrap()
            .starts_with("prod_rs_web-zz9_"));
        // The real ReplicaSet of Deployment web, named by its UIDs: Deployment web's workload.
        let (client, _) = routed_client(routes());
        let pod = rs_pod("web-6d4f9", "rs-real", "6d4f9");
        let out = review(
            hook_with(client),
            &admission_review(RS_CONTROLLER, pod.clone(), false),
            Duration::from_secs(1),
        )
        .await;
        let doc = patched(&out, &pod);
        assert!(doc["metadata"]["annotations"][names::LINEAGE]
            .as_str()
            .unwrap()
            .starts_with("prod_deploy_web."));
    }

    #[tokio::test]
    async fn user_supplied_stasis_keys_are_removed_even_when_nothing_can_be_decided() {
        // The H1 pod: a copied claim token and a Restore decision, the label that used to skip
        // the webhook; the API server cannot be reached (the decision fails).
        let pod = json!({
            "metadata": {"name": "evil",
                "labels": {"stasis.dev/system": "true", "stasis.dev/claim-token": "T"},
                "annotations": {"stasis.dev/decision": "Restore", "stasis.dev/cold-start": "false"}},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
        });
        for dry_run in [false, true] {
            let out = review(
                offline_hook(),
                &admission_review("alice", pod.clone(), dry_run),
                Duration::from_secs(1),
            )
            .await;
            let doc = patched(&out, &pod);
            assert_eq!(doc["metadata"]["labels"], json!({}), "dry run {dry_run}");
            assert_eq!(
                doc["metadata"]["annotations"],
                json!({"stasis.dev/cold-start": "false"}),
                "dry run {dry_run}"
            );
        }
        // Not stasis's pod: untouched.
        let mut other = pod.clone();
        other["spec"]["runtimeClassName"] = json!("runc");
        let r = response(
            &review(
                offline_hook(),
                &admission_review("alice", other, false),
                Duration::from_secs(1),
            )
            .await,
        );
        assert!(r.get("patch").is_none());
    }

    #[test]
    fn tokens_are_label_values() {
        let t = new_token();
        assert_eq!(t.len(), 32);
        assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(t, new_token());
    }
}
