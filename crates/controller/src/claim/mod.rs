//! Claiming a lineage for a new pod and deciding its restore: one piece of logic, run twice
//! (docs/design.md §13.3).
//!
//! - At admission ([`Mode::Predict`]) the webhook runs it on the pod it is asked about and
//!   writes nothing: the request is not authenticated, so its answer (the claim token, the
//!   lineage, the decision, the wait container) is only a prediction. A forged review changes
//!   no record.
//! - In the controller ([`Mode::Commit`]) the pod reconciler runs it again on the real pod (its
//!   UID, its owners verified from the API server), and stores the claim with the pod
//!   registered as holder by a write at the record's version (a conflict re-reads and decides
//!   again). The prediction only narrows what is committed: the lineage the webhook announced
//!   (claimed if it is still claimable, else the pod starts a new lineage of its own), and a
//!   restore only when the webhook prepared the pod for one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use stasis_api::lineage::declared_mismatches;
use stasis_api::names;
use stasis_api::{pod as podfacts, CheckpointPolicy, PodCheckpoint};
use stasis_core::decision::{decide, Decision, LastExit, Requester, RestoreInputs};
use stasis_core::lineage::{claim, claim_wait, Lineage, RestoreChoice};
use stasis_core::podspec::{unsafe_volumes, SpecHash};
use stasis_core::reference::WorkloadName;

use crate::cache::{Checkpoints, RecordIndex};
use crate::holder::holder_state;
use crate::record::{refresh, Holder, Record, Records};
use crate::{now_ms, Error, Result};

#[cfg(test)]
mod tests;

/// What the webhook told the pod, read back from its keys (only stasis writes them: the webhook
/// removes them from what users send, the admission policies refuse them). It never says *what*
/// to claim: only which lineage the commit may take, and whether the pod was prepared to wait
/// for a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prediction {
    /// The lineage the answer named (`stasis.dev/lineage`).
    pub lineage: Option<String>,
    /// The answer decided a restore (`stasis.dev/decision: Restore`): the requester was allowed
    /// to restore and the pod got the wait container.
    pub restore: bool,
}

impl Prediction {
    /// The prediction the webhook wrote into `pod`.
    pub fn of(pod: &Pod) -> Self {
        let a = pod.annotations();
        Self {
            lineage: a.get(names::LINEAGE).cloned(),
            restore: a.get(names::DECISION).map(String::as_str) == Some("Restore"),
        }
    }
}

/// How [`claim_and_decide`] runs.
#[derive(Debug, Clone)]
pub enum Mode {
    /// At admission: nothing is written; waits (polling) up to `final_wait` while a source's
    /// final checkpoint is in flight.
    Predict { final_wait: Duration },
    /// In the controller, for the real pod: holder refreshes and the claim are written.
    Commit {
        uid: String,
        pod_name: String,
        prediction: Prediction,
        /// While a source's final checkpoint is in flight, [`Claimed::Wait`] until then (Unix
        /// ms); after it the claim goes ahead and fences a late final checkpoint off.
        wait_until_ms: u64,
    },
}

/// The claim and the decision made under it.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub decision: Decision,
    pub lineage: WorkloadName,
    pub generation: u64,
    /// Node that took the checkpoint to restore.
    pub checkpoint_node: Option<String>,
    /// Commit: the record as stored, the pod registered as its holder.
    pub record: Option<Record>,
    /// Commit: why the pod did not get the lineage the webhook announced (another pod committed
    /// it first), in words for an Event.
    pub displaced: Option<String>,
    /// Commit: the claim was committed by an earlier reconcile (its record names the pod);
    /// nothing was decided or written now.
    pub earlier: bool,
}

/// What a claim came to.
#[derive(Debug, Clone)]
pub enum Claimed {
    Decided(Box<Outcome>),
    /// Commit: a source's final checkpoint is in flight; ask again shortly.
    Wait,
    /// Commit: the record of this claim token names another pod as holder (a copied token).
    Impostor(Box<Record>),
}

/// The facts of the restore decision that come from the pod and its policy.
pub fn restore_inputs(
    pod: &Pod,
    policy: Option<&CheckpointPolicy>,
    requester: Requester,
) -> Result<RestoreInputs> {
    Ok(RestoreInputs {
        requester,
        policy_restore_on_crash: policy.map(|p| p.spec.restore_on_crash),
        cold_start_annotation: podfacts::cold_start_annotation(pod),
        unsafe_volumes: unsafe_volumes(
            &podfacts::volume_facts(pod),
            policy.map_or(&[][..], |p| &p.spec.safe_volumes),
        ),
        last_exit: LastExit::Unknown,
        claim: None,
        pod_spec_hash: podfacts::spec_hash(pod).ok_or(Error::PodWithoutSpec)?,
        checkpoint_spec_hash: None,
        mismatches: Vec::new(),
    })
}

/// Where the claim reads and writes.
pub struct Stores<'a> {
    pub client: &'a Client,
    pub records: &'a Records,
    /// The process's `PodCheckpoint` cache (every replica keeps one).
    pub checkpoints: &'a Checkpoints,
    /// The process's lineage record cache, for a prediction's read ([`Mode::Predict`]); the
    /// commit reads the API server. `None`, or not synced yet: the API server's watch cache.
    pub record_index: Option<&'a RecordIndex>,
    /// A claim whose pod has not appeared after this long is released (holder refreshes).
    pub phantom_after: Duration,
}

/// Claims a lineage of `workload` for the pod with claim token `token`, waiting for a source's
/// in-flight final checkpoint, and decides; in [`Mode::Commit`] stores the claim with the
/// decision, retrying from a fresh read when another writer got there first.
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(name = "claim_and_decide", skip_all, fields(namespace = %ns, workload = %workload))]
pub async fn claim_and_decide(
    at: &Stores<'_>,
    ns: &str,
    pod: &Pod,
    workload: &WorkloadName,
    token: &str,
    policy: &CheckpointPolicy,
    inputs: &mut RestoreInputs,
    mode: &Mode,
) -> Result<Claimed> {
    let pods_api = Api::<Pod>::namespaced(at.client.clone(), ns);
    let started = Instant::now();
    let phantom = at.phantom_after.as_millis() as u64;
    let commit = matches!(mode, Mode::Commit { .. });
    'attempt: for _attempt in 0..50 {
        // At admission the records may come from this process's watch cache, and the holder
        // pods from the API server's, as they are: the answer is a prediction that the commit
        // makes again from fresh reads and stores by a write at the record's version. The
        // caches are not behind what matters here in practice: the workload controller
        // creating this pod saw its predecessor stop through a watch too, and a record that
        // still names a holder gone is brought up to date from its pods (below).
        let mut recs = match at.record_index.filter(|i| !commit && i.is_ready()) {
            Some(index) => index.of_workload(workload),
            None => at.records.of_workload(workload, commit).await?,
        };
        if let Mode::Commit { uid, .. } = mode {
            // Committed already (the reconciler's cache lags behind its own write), or the
            // token is another pod's.
            if let Some(r) = recs.iter().find(|r| r.held_by(ns, uid)) {
                return Ok(Claimed::Decided(Box::new(committed(r))));
            }
            if let Some(r) = recs.iter().find(|r| {
                r.namespace == ns
                    && r.lineage.holder.as_deref() == Some(token)
                    && r.holder_uid().is_some()
            }) {
                return Ok(Claimed::Impostor(Box::new(r.clone())));
            }
        }
        let (mut checkpoints, from_cache) = workload_checkpoints(at, ns, &recs).await?;
        let now = now_ms();
        // Bring the records up to date with their holders (orphaning stopped pods, noting
        // in-flight final checkpoints), remembering the holder pods: one may be the source.
        let mut holder_pods: BTreeMap<usize, Pod> = BTreeMap::new();
        let pods = holder_candidates(&pods_api, &recs, commit).await?;
        for (i, r) in recs.iter_mut().enumerate() {
            if r.lineage.holder.is_none()
                || (r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none())
            {
                continue;
            }
            let (state, holder_pod) =
                holder_state(r, &pods, &checkpoints, policy.spec.on_termination);
            if let Some(p) = holder_pod {
                holder_pods.insert(i, p);
            }
            // At admission only in memory: the controller writes the same change itself.
            if refresh(r, &state, now, phantom) && commit {
                match at.records.save(r).await {
                    Ok(saved) => *r = saved,
                    Err(Error::Conflict(_)) => continue 'attempt,
                    Err(e) => return Err(e),
                }
            }
        }
        let mut lineages: Vec<Lineage> = recs.iter().map(|r| r.lineage.clone()).collect();
        if claim_wait(&lineages, workload, now).is_some() {
            match mode {
                Mode::Predict { final_wait } if started.elapsed() < *final_wait => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
                Mode::Commit { wait_until_ms, .. } if now < *wait_until_ms => {
                    return Ok(Claimed::Wait)
                }
                _ => {}
            }
        }
        let (claimed, displaced) =
            match mode {
                Mode::Predict { .. } => match claim(&mut lineages, workload, token) {
                    Some(c) => {
                        let i = lineages.iter().position(|l| l.id == c.lineage).ok_or(
                            Error::Invariant("the claimed lineage vanished from the records"),
                        )?;
                        (Some((i, c)), None)
                    }
                    None => (None, None),
                },
                Mode::Commit { prediction, .. } => {
                    let (mut claimed, mut displaced) =
                        commit_claim(&recs, &mut lineages, workload, token, prediction);
                    if displaced.is_some() && prediction.restore {
                        // Two pods admitted at once are predicted the same lineage: the one
                        // committed second may restore another orphaned lineage of the
                        // workload instead, if its checkpoint's node fits the node
                        // requirements the pod was admitted with.
                        let mut trial = lineages.clone();
                        if let Some(c) = claim(&mut trial, workload, token) {
                            if let RestoreChoice::Checkpoint { id, .. } = &c.choice {
                                let node = node_of(&checkpoints, &format!("{}/{id}", c.lineage));
                                let i = trial.iter().position(|l| l.id == c.lineage);
                                if let (Some(i), true) =
                                    (i, fits_node(at.client, pod, node.as_deref()).await?)
                                {
                                    lineages = trial;
                                    claimed = Some((i, c));
                                    displaced = None;
                                }
                            }
                        }
                    }
                    (claimed, displaced)
                }
            };
        let (mut record, source) = match claimed {
            Some((i, c)) => {
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
            let known = checkpoints.iter().any(|c| {
                c.status.as_ref().and_then(|s| s.checkpoint_ref.as_deref()) == Some(&reference)
            });
            if !known && from_cache {
                // The record (read from the API server) names a checkpoint the cache does not
                // have yet, or no longer: read the namespace's checkpoints from the API server
                // rather than decide without its spec hash (a cold start).
                tracing::debug!(checkpoint = %reference, "not in the checkpoint cache: listing");
                checkpoints = Api::<PodCheckpoint>::namespaced(at.client.clone(), ns)
                    .list(&ListParams::default())
                    .await?
                    .items;
            }
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
        let mut outcome = Outcome {
            lineage: record.lineage.id.clone(),
            generation: record.lineage.generation,
            decision,
            checkpoint_node,
            record: None,
            displaced,
            earlier: false,
        };
        let Mode::Commit {
            uid,
            pod_name,
            prediction,
            ..
        } = mode
        else {
            return Ok(Claimed::Decided(Box::new(outcome)));
        };
        // A restore only into a pod the webhook prepared for one (the wait container, and a
        // requester allowed to restore); a predicted cold start stays one.
        let restore = match &outcome.decision {
            Decision::Restore {
                lineage,
                checkpoint,
                ..
            } if prediction.restore => Some(format!("{lineage}/{checkpoint}")),
            _ => None,
        };
        record.holder = Some(Holder {
            token: token.to_owned(),
            claimed_unix_ms: now,
            pod: Some(pod_name.clone()),
            uid: Some(uid.clone()),
            restore,
            source_pod: source_pod.map(|p| p.name_any()).or(source_name),
        });
        match at.records.save(&record).await {
            Ok(saved) => {
                outcome.record = Some(saved);
                return Ok(Claimed::Decided(Box::new(outcome)));
            }
            Err(Error::Conflict(_)) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Error::Conflict(format!(
        "lineages of {workload}: too many concurrent writers"
    )))
}

/// The checkpoints the claim reads: those of the workload's lineages and of their holder pods
/// (a holder's final checkpoint in flight), from the process's cache instead of a list of the
/// namespace per admission, which grew with every checkpoint there.
///
/// What the cache's staleness (the watch's lag behind the API server, normally milliseconds;
/// longer while it relists) can change: a checkpoint created or finished within the lag is
/// not seen, so an admission may not wait for a final checkpoint that has just started, and a
/// record naming a checkpoint the cache does not have yet would have no spec hash (then the
/// namespace is listed, as before). What it cannot change: which lineage a pod gets and at
/// what generation. The records are read from the API server at each attempt, and the commit
/// is a write of the record at the version read (a conflict reads and decides again), with
/// the checkpoint fenced by generation at publication; so two pods never hold one lineage and
/// no checkpoint older than the record's newest is chosen. A replica whose cache has not
/// completed its first list lists from the API server, as before.
/// Returns whether they came from the cache.
async fn workload_checkpoints(
    at: &Stores<'_>,
    ns: &str,
    recs: &[Record],
) -> Result<(Vec<PodCheckpoint>, bool)> {
    if !at.checkpoints.is_ready() {
        let api = Api::<PodCheckpoint>::namespaced(at.client.clone(), ns);
        return Ok((api.list(&ListParams::default()).await?.items, false));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for r in recs {
        let of_holder = r
            .holder_uid()
            .map(|uid| at.checkpoints.of_pod(ns, uid))
            .unwrap_or_default();
        for c in at
            .checkpoints
            .of_lineage(ns, r.lineage.id.as_str())
            .into_iter()
            .chain(of_holder)
        {
            if seen.insert(c.name_any()) {
                out.push((*c).clone());
            }
        }
    }
    Ok((out, true))
}

/// The pods carrying the claim tokens of the records that have a holder to look at: one list
/// by a set selector (in slices of 50 tokens) instead of one list per record.
async fn holder_candidates(pods_api: &Api<Pod>, recs: &[Record], fresh: bool) -> Result<Vec<Pod>> {
    let tokens: std::collections::BTreeSet<&str> = recs
        .iter()
        .filter(|r| !(r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none()))
        .filter_map(|r| r.lineage.holder.as_deref())
        .collect();
    let tokens: Vec<&str> = tokens.into_iter().collect();
    let mut pods = Vec::new();
    for slice in tokens.chunks(50) {
        let lp = ListParams::default();
        let lp = if fresh { lp } else { lp.match_any() };
        let lp = lp.labels(&format!("{} in ({})", names::CLAIM_TOKEN, slice.join(",")));
        pods.extend(pods_api.list(&lp).await?.items);
    }
    Ok(pods)
}

/// The commit's claim: only the lineage the webhook announced, if it is still this workload's
/// and claimable (or already held under this token); `None` (a new lineage) otherwise, with why
/// when the announced lineage was an existing one.
fn commit_claim(
    recs: &[Record],
    lineages: &mut [Lineage],
    workload: &WorkloadName,
    token: &str,
    prediction: &Prediction,
) -> (Option<(usize, stasis_core::lineage::Claim)>, Option<String>) {
    let Some(want) = prediction.lineage.as_deref() else {
        return (None, None);
    };
    let Some(i) = lineages.iter().position(|l| l.id.as_str() == want) else {
        // A new lineage was announced (its id comes from the token): nothing displaced.
        return (None, None);
    };
    if let Some(c) = claim(&mut lineages[i..=i], workload, token) {
        return (Some((i, c)), None);
    }
    let by = recs[i]
        .holder
        .as_ref()
        .and_then(|h| h.pod.clone())
        .map_or_else(|| "another pod".to_owned(), |p| format!("pod {p}"));
    (
        None,
        Some(format!(
            "lineage {want}, which this pod was admitted to continue, was taken by {by} first"
        )),
    )
}

/// The node that took checkpoint `reference` (`<lineage>/<id>`), from its `PodCheckpoint`.
fn node_of(checkpoints: &[PodCheckpoint], reference: &str) -> Option<String> {
    checkpoints
        .iter()
        .filter_map(|c| c.status.as_ref())
        .find(|s| s.checkpoint_ref.as_deref() == Some(reference))
        .and_then(|s| s.node.clone())
}

/// Whether `node` has the CPU architecture and GPU driver branch the pod's required node
/// affinity asks for (what the webhook added for the checkpoint it predicted); a pod that asks
/// for neither fits anywhere, a node that is unknown or gone fits no such pod.
async fn fits_node(client: &Client, pod: &Pod, node: Option<&str>) -> Result<bool> {
    let keys = [names::node::CPU_ARCH, names::node::GPU_DRIVER_BRANCH];
    let wanted: Vec<(String, Vec<String>)> = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .into_iter()
        .flat_map(|r| r.node_selector_terms.iter())
        .flat_map(|t| t.match_expressions.iter().flatten())
        .filter(|e| e.operator == "In" && keys.contains(&e.key.as_str()))
        .map(|e| (e.key.clone(), e.values.clone().unwrap_or_default()))
        .collect();
    if wanted.is_empty() {
        return Ok(true);
    }
    let Some(node) = node else { return Ok(false) };
    let Some(n) = Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .get_opt(node)
        .await?
    else {
        return Ok(false);
    };
    let labels = n.labels();
    Ok(wanted
        .iter()
        .all(|(k, vs)| labels.get(k).is_some_and(|v| vs.contains(v))))
}

/// The outcome of a claim committed earlier, from its record.
fn committed(r: &Record) -> Outcome {
    let decision = match r
        .holder
        .as_ref()
        .and_then(|h| h.restore.as_deref())
        .and_then(|c| c.rsplit_once('/'))
        .and_then(|(_, id)| stasis_core::reference::CheckpointId::parse(id).ok())
    {
        Some(checkpoint) => Decision::Restore {
            lineage: r.lineage.id.clone(),
            checkpoint,
            generation: r.lineage.generation,
        },
        None => Decision::ColdStart {
            reason: stasis_core::decision::ColdStartReason::NoLineage,
        },
    };
    Outcome {
        decision,
        lineage: r.lineage.id.clone(),
        generation: r.lineage.generation,
        checkpoint_node: None,
        record: Some(r.clone()),
        displaced: None,
        earlier: true,
    }
}
