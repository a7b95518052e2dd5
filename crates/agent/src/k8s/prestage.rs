//! Pre-staging: when another node is about to lose its pods (cordoned, tainted `NoExecute`,
//! being disrupted by an autoscaler, or given a cloud notice), the agents of the nodes likely to
//! receive them fetch the pods' latest published checkpoints into their chunk cache, so that
//! the replacement's restore reads its chunks from the node's disk instead of the bucket. The
//! decisions (which nodes are at risk, which nodes receive, what first) are
//! `stasis_core::prestage`'s; this module watches the Nodes and the `PodCheckpoint`s, lists the
//! pods of at-risk nodes, and runs the store's prefetch.
//!
//! - **Which checkpoint**: a pod's latest published checkpoint is its newest `Succeeded`
//!   `PodCheckpoint` (the controller publishes from those; the restore decision at admission
//!   picks the lineage's newest good one, which is that one unless it failed a restore). A
//!   newer one (a heartbeat, the final checkpoint of the drain) is pre-staged when it appears;
//!   the cache is content-addressed, so it costs only its new chunks.
//! - **Pods stay remembered** while their node is at risk: a drain deletes them, and their
//!   checkpoints matter most right then. A node that recovers (uncordoned, taint removed) cancels
//!   its pods' prefetches in flight; a node deleted from the API keeps its pods' entries for
//!   [`FORGET_AFTER`].
//! - **Never in the way of this node's own work**: a prefetch runs on a store of its own with
//!   fewer requests in flight (`--prestage-streams`, the agent's checkpoints and restores use the
//!   store's 12), at most `--prestage-concurrency` checkpoints at once, and it is cancelled while
//!   a checkpoint of this node runs (a `PodCheckpoint` `Running` on this node), then started
//!   again: what it had cached stays, so the second run fetches only the rest. A prefetch does
//!   no decryption (every read from the cache authenticates), so it costs the CPU nothing but
//!   the writes.
//! - **No key**: a prefetch reads the checkpoint's chunk list without the namespace's data key
//!   (`Store::prefetch`: the manifest envelope is authenticated, not encrypted), so this node
//!   pre-staged namespaces it runs no pod of even with the key broker on, which hands a node a
//!   namespace's key only while it runs one. The restore authenticates what it reads.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use stasis_api::{CheckpointPhase, PodCheckpoint};
use stasis_core::prestage::{self as rule, NodeFacts, Placement, Staging};
use stasis_core::CheckpointRef;
use stasis_service::shutdown::Shutdown;
use stasis_store::{PrefetchReport, StoreError};
use tokio::sync::{watch, Notify, Semaphore};
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::status::PodKey;

/// The Event on a pod whose checkpoint was pre-staged.
pub const PRESTAGED: &str = "Prestaged";
/// How often the pods of an at-risk node are listed again (new pods, and the facts of those
/// already known).
const RELIST: Duration = Duration::from_secs(10);
/// How long the pods of a node deleted from the API stay remembered.
pub const FORGET_AFTER: Duration = Duration::from_secs(1800);
/// Events are gathered this long before the decision runs again (a drain changes many objects
/// at once).
const SETTLE: Duration = Duration::from_millis(200);
/// The decision also runs this often without events (the cache's metrics, relists).
const TICK: Duration = Duration::from_secs(5);

/// The flags (`--prestage-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrestageSettings {
    /// Nodes that pre-stage each pod's checkpoint (0: every eligible node).
    pub receivers: usize,
    /// Checkpoints pre-staged at once (0: no pre-staging).
    pub concurrency: usize,
}

/// What pre-staging needs of the agent.
pub struct PrestageContext {
    pub client: Client,
    pub node: String,
    pub runtime_class: String,
    /// A store of its own (fewer requests in flight), with the node's chunk cache.
    pub store: stasis_store::Store,
    pub metrics: Arc<Metrics>,
    pub settings: PrestageSettings,
}

/// A pod of an at-risk node, as last listed.
#[derive(Debug, Clone)]
struct KnownPod {
    key: PodKey,
    placement: Placement,
    uses_gpu: bool,
}

/// An at-risk node and its pods.
struct AtRisk {
    facts: NodeFacts,
    listed: Option<Instant>,
    /// When it was last seen in the API (and at risk).
    seen: Instant,
    pods: HashMap<String, KnownPod>,
}

/// A checkpoint to pre-stage.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    pod: PodKey,
    node: String,
}

#[derive(Default)]
struct State {
    at_risk: BTreeMap<String, AtRisk>,
    /// Prefetches started and not ended, by checkpoint reference: the pod's name, and the
    /// prefetch's cancel switch.
    running: HashMap<String, (String, watch::Sender<bool>)>,
    /// References pre-staged (or failed: a newer checkpoint is the next try).
    done: HashSet<String>,
    /// References left out for the cache's bound (said once).
    told: HashSet<String>,
}

/// Runs pre-staging until `shutdown`.
pub async fn run(ctx: PrestageContext, shutdown: Shutdown) {
    if ctx.settings.concurrency == 0 {
        info!("pre-staging off (--prestage-concurrency 0)");
        return;
    }
    let Some(cache) = ctx.store.cache().cloned() else {
        info!("pre-staging off: the node has no chunk cache");
        return;
    };
    let changed = Arc::new(Notify::new());
    let nodes = watch_waking::<Node>(&ctx.client, &changed);
    let ckpts = watch_waking::<PodCheckpoint>(&ctx.client, &changed);
    tokio::select! {
        _ = async { tokio::join!(stasis_api::cache::wait_ready(&nodes), stasis_api::cache::wait_ready(&ckpts)) } => {}
        _ = shutdown.wait() => return,
    }
    info!(
        receivers = ctx.settings.receivers,
        concurrency = ctx.settings.concurrency,
        cache_bytes = cache.max_bytes(),
        "pre-staging the checkpoints of pods on at-risk nodes"
    );
    let ctx = Arc::new(ctx);
    let state = Arc::new(Mutex::new(State::default()));
    let slots = Arc::new(Semaphore::new(ctx.settings.concurrency));
    let (busy_tx, busy_rx) = watch::channel(false);
    loop {
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(SETTLE).await,
            _ = tokio::time::sleep(TICK) => {}
            _ = shutdown.wait() => break,
        }
        ctx.metrics.chunk_cache(cache.stats());
        let own_busy = ckpts.state().iter().any(|c| {
            c.status.as_ref().is_some_and(|s| {
                s.phase == Some(CheckpointPhase::Running) && s.node.as_deref() == Some(&ctx.node)
            })
        });
        busy_tx.send_if_modified(|b| std::mem::replace(b, own_busy) != own_busy);
        let wanted = decide(&ctx, &state, &nodes, &ckpts, cache.max_bytes()).await;
        start_and_cancel(&ctx, &state, wanted, &slots, &busy_rx);
    }
    for (_, (_, cancel)) in state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .running
        .drain()
    {
        cancel.send_replace(true);
    }
}

/// Starts pre-staging on `rt` (unless the flags turn it off or the node has no chunk cache): a
/// store of its own over the node's cache with `--prestage-streams` requests in flight. It
/// needs no data key: it caches chunk objects as stored, and every read from the cache
/// authenticates.
pub fn start(
    rt: &tokio::runtime::Runtime,
    cluster: &super::KubeCluster,
    cfg: &crate::config::Config,
    cache: Option<Arc<stasis_store::ChunkCache>>,
    shutdown: Shutdown,
) {
    let Some(cache) = cache else {
        info!("pre-staging off: the node has no chunk cache");
        return;
    };
    let opts = stasis_store::StoreOptions {
        concurrency: cfg.prestage.streams.max(1),
        ..Default::default()
    };
    let store = match stasis_store::Store::open_with(&cfg.store, opts) {
        Ok(s) => s.with_cache(cache),
        Err(e) => {
            warn!(error = %e, "pre-staging off: cannot open the store");
            return;
        }
    };
    let ctx = PrestageContext {
        client: cluster.client.clone(),
        node: cluster.node.clone(),
        runtime_class: cluster.runtime_class.clone(),
        store,
        metrics: cluster.exec.metrics.clone(),
        settings: PrestageSettings {
            receivers: cfg.prestage.receivers,
            concurrency: cfg.prestage.concurrency,
        },
    };
    rt.spawn(run(ctx, shutdown));
}

/// A watch cache of every `K` whose every event wakes `changed` (pre-staging decides again).
fn watch_waking<K>(client: &Client, changed: &Arc<Notify>) -> Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let changed = changed.clone();
    let (store, watch) =
        stasis_api::cache::watch_all::<K, _>(client.clone(), move || changed.notify_one());
    tokio::spawn(watch);
    store
}

pub use stasis_api::prestage::node_facts;

/// What decides where a pod's replacement can go, and whether it asks for a GPU.
fn known_pod(p: &Pod) -> KnownPod {
    let spec = p.spec.clone().unwrap_or_default();
    KnownPod {
        key: PodKey {
            namespace: p.namespace().unwrap_or_default(),
            name: p.name_any(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
        },
        uses_gpu: spec.containers.iter().any(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.keys().any(|k| k.ends_with("/gpu")))
        }),
        placement: stasis_api::prestage::placement(&spec),
    }
}

/// The newest published checkpoint of a pod: its newest `Succeeded` `PodCheckpoint` with a
/// reference (reference, captured bytes, completion in Unix ms).
fn latest_published(ckpts: &[Arc<PodCheckpoint>], pod: &PodKey) -> Option<(String, u64, i64)> {
    ckpts
        .iter()
        .filter(|c| c.namespace().as_deref() == Some(pod.namespace.as_str()))
        .filter_map(|c| {
            let s = c.status.as_ref()?;
            let mine = s.source_pod_uid.as_deref() == Some(pod.uid.as_str())
                || c.spec.source_pod_uid.as_deref() == Some(pod.uid.as_str());
            (mine && s.phase == Some(CheckpointPhase::Succeeded)).then_some(())?;
            Some((
                s.checkpoint_ref.clone()?,
                s.size_bytes.unwrap_or(0).max(0) as u64,
                s.completion_time
                    .as_ref()
                    .map_or(0, |t| t.0.as_millisecond()),
            ))
        })
        .max_by(|a, b| a.2.cmp(&b.2).then(a.0.cmp(&b.0)))
}

/// Updates the at-risk nodes and their pods; the checkpoints this node pre-stages now, in
/// order.
async fn decide(
    ctx: &PrestageContext,
    state: &Mutex<State>,
    nodes: &Store<Node>,
    ckpts: &Store<PodCheckpoint>,
    budget: u64,
) -> Vec<Staging<Target>> {
    let facts: Vec<NodeFacts> = nodes.state().iter().map(|n| node_facts(n)).collect();
    if !facts.iter().any(|n| n.name == ctx.node) {
        return Vec::new();
    }
    // Which nodes are at risk now; which recovered; which need their pods listed.
    let relist: Vec<String> = {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        for f in facts.iter().filter(|f| f.name != ctx.node) {
            match rule::risk(f) {
                Some(why) => {
                    let e = st.at_risk.entry(f.name.clone()).or_insert_with(|| {
                        info!(node = %f.name, risk = %why, "a node is at risk: pre-staging its pods' checkpoints where this node is a likely receiver");
                        AtRisk {
                            facts: f.clone(),
                            listed: None,
                            seen: now,
                            pods: HashMap::new(),
                        }
                    });
                    e.facts = f.clone();
                    e.seen = now;
                }
                None => {
                    if st.at_risk.remove(&f.name).is_some() {
                        info!(node = %f.name, "the node recovered: its pods' pre-staging stops");
                    }
                }
            }
        }
        st.at_risk
            .retain(|_, a| now.duration_since(a.seen) < FORGET_AFTER);
        st.at_risk
            .iter()
            .filter(|(_, a)| a.listed.is_none_or(|l| now.duration_since(l) >= RELIST))
            .map(|(n, _)| n.clone())
            .collect()
    };
    for node in relist {
        let pods = Api::<Pod>::all(ctx.client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await;
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(a) = st.at_risk.get_mut(&node) else {
            continue;
        };
        match pods {
            Ok(l) => {
                a.listed = Some(Instant::now());
                for p in l.items.iter().filter(|p| {
                    p.spec
                        .as_ref()
                        .and_then(|s| s.runtime_class_name.as_deref())
                        == Some(ctx.runtime_class.as_str())
                }) {
                    let k = known_pod(p);
                    a.pods.insert(k.key.uid.clone(), k);
                }
            }
            Err(e) => warn!(node = %node, error = %e, "cannot list the pods of an at-risk node"),
        }
    }
    let all_ckpts = ckpts.state();
    let st = state.lock().unwrap_or_else(|e| e.into_inner());
    let mut candidates = Vec::new();
    for (name, a) in &st.at_risk {
        for p in a.pods.values() {
            let to = rule::receivers(
                &facts,
                &a.facts,
                &p.key.uid,
                &p.placement,
                ctx.settings.receivers,
            );
            if !to.contains(&ctx.node.as_str()) {
                let why = facts
                    .iter()
                    .find(|n| n.name == ctx.node)
                    .map(|me| rule::can_receive(me, &a.facts, &p.placement));
                debug!(pod = %p.key.name, from_node = %name, receivers = ?to, ?why, "this node is not one of the pod's likely receivers");
                continue;
            }
            let latest = latest_published(&all_ckpts, &p.key);
            if latest.is_none() {
                debug!(pod = %p.key.name, "no published checkpoint of the pod yet");
            }
            if let Some((reference, bytes, done)) = latest {
                candidates.push(Staging {
                    key: Target {
                        pod: p.key.clone(),
                        node: name.clone(),
                    },
                    checkpoint_ref: reference,
                    bytes,
                    completed_unix_ms: done,
                    uses_gpu: p.uses_gpu,
                });
            }
        }
    }
    drop(st);
    let (take, left) = rule::plan(candidates, budget);
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    for s in left {
        if st.told.insert(s.checkpoint_ref.clone()) {
            info!(checkpoint_ref = %s.checkpoint_ref, pod = %s.key.pod.name, bytes = s.bytes, cache_bytes = budget,
                "not pre-staged: it does not fit the chunk cache's bound (beside the more valuable checkpoints pre-staged); its restore fetches it from the store");
        }
    }
    take
}

/// Cancels the prefetches no longer wanted and starts the wanted ones not started yet, in
/// order (the slots are taken first come, first served).
fn start_and_cancel(
    ctx: &Arc<PrestageContext>,
    state: &Arc<Mutex<State>>,
    wanted: Vec<Staging<Target>>,
    slots: &Arc<Semaphore>,
    busy: &watch::Receiver<bool>,
) {
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let refs: HashSet<&str> = wanted.iter().map(|s| s.checkpoint_ref.as_str()).collect();
    st.running.retain(|r, (pod, cancel)| {
        let keep = refs.contains(r.as_str());
        if !keep {
            info!(checkpoint_ref = %r, pod = %pod, "pre-staging cancelled: its node recovered, or a newer checkpoint replaced it");
            cancel.send_replace(true);
        }
        keep
    });
    for s in wanted {
        if st.done.contains(&s.checkpoint_ref) || st.running.contains_key(&s.checkpoint_ref) {
            continue;
        }
        let (cancel, cancelled) = watch::channel(false);
        tokio::spawn(prestage_one(
            ctx.clone(),
            state.clone(),
            s.clone(),
            slots.clone(),
            Switches {
                busy: busy.clone(),
                cancelled,
            },
        ));
        st.running
            .insert(s.checkpoint_ref.clone(), (s.key.pod.name.clone(), cancel));
    }
}

/// What stops a prefetch: a checkpoint of this node running (for a while), or cancelled (for
/// good).
#[derive(Clone)]
struct Switches {
    busy: watch::Receiver<bool>,
    cancelled: watch::Receiver<bool>,
}

/// Why one pre-stage failed.
#[derive(Debug, thiserror::Error)]
enum PrestageError {
    #[error("{0:?} is not a checkpoint reference")]
    Reference(String),
    #[error(transparent)]
    Store(Box<stasis_store::StoreError>),
    #[error("cancelled")]
    Cancelled,
}

impl From<stasis_store::StoreError> for PrestageError {
    fn from(e: stasis_store::StoreError) -> Self {
        PrestageError::Store(Box::new(e))
    }
}

/// Pre-stages one checkpoint: waits for a slot, then prefetches it, stopping while a checkpoint
/// of this node runs.
async fn prestage_one(
    ctx: Arc<PrestageContext>,
    state: Arc<Mutex<State>>,
    s: Staging<Target>,
    slots: Arc<Semaphore>,
    switches: Switches,
) {
    let Ok(_slot) = slots.acquire().await else {
        return;
    };
    let t = Instant::now();
    let r = fetch(&ctx, &s, switches).await;
    let ms = t.elapsed().as_millis() as u64;
    {
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        st.running.remove(&s.checkpoint_ref);
        st.done.insert(s.checkpoint_ref.clone());
    }
    let pod = &s.key.pod;
    match r {
        Ok(rep) => {
            ctx.metrics.prestaged(rep.fetched_bytes);
            info!(checkpoint_ref = %s.checkpoint_ref, namespace = %pod.namespace, pod = %pod.name,
                from_node = %s.key.node, chunks = rep.chunks, cached_already = rep.cached_already,
                fetched = rep.fetched, fetched_bytes = rep.fetched_bytes, ms, "checkpoint pre-staged");
            let message = format!(
                "checkpoint {} pre-staged on node {} ({} MiB fetched in {} ms, {} of {} chunks there already)",
                s.checkpoint_ref,
                ctx.node,
                rep.fetched_bytes >> 20,
                ms,
                rep.cached_already,
                rep.chunks
            );
            let ev = crate::status::pod_event(
                pod,
                PRESTAGED,
                &message,
                false,
                &ctx.node,
                crate::status::now(),
            );
            let api: Api<Event> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            if let Err(e) = api.create(&super::created_by_agent(), &ev).await {
                debug!(pod = %pod.name, error = %e, "cannot create the pre-staged Event");
            }
        }
        Err(PrestageError::Cancelled) => {}
        Err(PrestageError::Store(e)) if matches!(*e, StoreError::ExceedsCache { .. }) => {
            info!(checkpoint_ref = %s.checkpoint_ref, namespace = %pod.namespace, pod = %pod.name, error = %e,
                "not pre-staged: it does not fit the chunk cache's bound; its restore fetches it from the store");
        }
        Err(PrestageError::Store(e)) if manifest_unreadable(&e) => {
            ctx.metrics.error("prestage");
            warn!(checkpoint_ref = %s.checkpoint_ref, namespace = %pod.namespace, pod = %pod.name, error = %e,
                "not pre-staged: the checkpoint's manifest in the store is not readable as a manifest (damaged or replaced in the bucket?); nothing was fetched, and its restore checks the manifest with the namespace's key");
        }
        Err(e) => {
            ctx.metrics.error("prestage");
            warn!(checkpoint_ref = %s.checkpoint_ref, namespace = %pod.namespace, pod = %pod.name, error = %e,
                "cannot pre-stage a checkpoint; its restore will fetch it from the store");
        }
    }
}

/// Whether a prefetch failed on the manifest itself, before fetching anything: not a manifest
/// of this checkpoint, or not well formed.
fn manifest_unreadable(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::ManifestUnreadable { .. } | StoreError::ManifestInvalid { .. }
    )
}

/// Prefetches one checkpoint, waiting while a checkpoint of this node runs.
async fn fetch(
    ctx: &PrestageContext,
    s: &Staging<Target>,
    Switches {
        mut busy,
        mut cancelled,
    }: Switches,
) -> Result<PrefetchReport, PrestageError> {
    if *cancelled.borrow() {
        return Err(PrestageError::Cancelled);
    }
    let reference: CheckpointRef = s
        .checkpoint_ref
        .parse()
        .map_err(|_| PrestageError::Reference(s.checkpoint_ref.clone()))?;
    loop {
        tokio::select! {
            r = busy.wait_for(|b| !*b) => if r.is_err() { return Err(PrestageError::Cancelled) },
            _ = cancelled.wait_for(|c| *c) => return Err(PrestageError::Cancelled),
        }
        tokio::select! {
            r = ctx.store.prefetch(&reference) => return Ok(r?),
            _ = cancelled.wait_for(|c| *c) => return Err(PrestageError::Cancelled),
            _ = busy.wait_for(|b| *b) => {
                info!(checkpoint_ref = %s.checkpoint_ref, "pre-staging paused while this node takes a checkpoint");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn node_facts_from_a_node() {
        let n: Node = serde_json::from_value(json!({
            "metadata": {"name": "w1", "labels": {"stasis.dev/ready": "true"}},
            "spec": {"unschedulable": true,
                     "taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let f = node_facts(&n);
        assert!(f.ready && f.unschedulable);
        assert_eq!(f.taints[0].key, "karpenter.sh/disrupted");
        assert_eq!(
            rule::risk(&f),
            Some(rule::Risk::Disruption("karpenter.sh/disrupted".into()))
        );
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "w2"}})).unwrap();
        assert!(!node_facts(&bare).ready, "no Ready condition: not ready");
    }

    #[test]
    fn the_latest_published_checkpoint_of_a_pod() {
        let ck = |name: &str, uid: &str, phase: &str, r: &str, done: &str| -> Arc<PodCheckpoint> {
            Arc::new(
                serde_json::from_value(json!({
                    "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
                    "metadata": {"name": name, "namespace": "ml"},
                    "spec": {"sourcePodName": "p"},
                    "status": {"phase": phase, "sourcePodUID": uid, "checkpointRef": r,
                               "sizeBytes": 100, "completionTime": done}
                }))
                .unwrap(),
            )
        };
        let all = vec![
            ck("a", "u1", "Succeeded", "l/1", "2026-12-02T05:00:00Z"),
            ck("b", "u1", "Succeeded", "l/2", "2026-12-02T05:01:00Z"),
            ck("c", "u1", "Failed", "l/3", "2026-12-02T05:02:00Z"),
            ck("d", "u2", "Succeeded", "m/9", "2026-12-02T05:03:00Z"),
        ];
        let pod = |uid: &str, ns: &str| PodKey {
            namespace: ns.into(),
            name: "p".into(),
            uid: uid.into(),
        };
        assert_eq!(
            latest_published(&all, &pod("u1", "ml")).map(|l| l.0),
            Some("l/2".into()),
            "the newest Succeeded one of this pod"
        );
        assert_eq!(latest_published(&all, &pod("u1", "other")), None);
        assert_eq!(latest_published(&all, &pod("u3", "ml")), None);
    }

    #[test]
    fn a_pods_placement_and_gpu() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u"},
            "spec": {"nodeSelector": {"pool": "gpu"},
                     "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                     "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
        }))
        .unwrap();
        let k = known_pod(&p);
        assert!(k.uses_gpu);
        assert_eq!(k.placement.node_selector["pool"], "gpu");
        assert_eq!(
            k.placement.tolerations[0].operator.as_deref(),
            Some("Exists")
        );
    }
}
