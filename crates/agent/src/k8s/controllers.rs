//! The agent's reconcilers: kube-runtime `Controller`s over the `PodCheckpoint`s and the
//! `PodRestore`s whose pods are bound to this node, the reflectors they read, and the start of a
//! run (work a previous run of this agent left half done).
//!
//! One reflector holds the node's pods (`spec.nodeName=<node>`); both controllers subscribe to
//! it, so a pod that lands here after its `PodRestore` was created (the usual order: the webhook
//! creates it at admission, before the pod is bound) triggers that restore, and the reconcilers
//! always find in the store the pod that triggered them. The jobs themselves (they fork and enter
//! namespaces) run on two bounded [`JobPool`]s, fair across namespaces; a reconcile awaits its
//! job. kube-runtime keeps one reconcile per object at a time and retries failures
//! ([`error_policy`], with a backoff per object).

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, ReflectHandle, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use stasis_api::{CheckpointPhase, CheckpointPolicy, PodCheckpoint, PodRestore, RestorePhase};
use stasis_service::admin::Readiness;
use stasis_service::shutdown::Shutdown;
use tokio::runtime::Handle;
use tracing::{debug, info, instrument, warn};

use super::pod_facts::{phase_is_pending_ckpt, restore_to_prepare};
use super::KubeCluster;
use crate::error::Result;
use crate::executor::Executor;
use crate::fair::{JobPool, PoolError};
use crate::node::{Agent, Busy};
use crate::status;
use stasis_api::names::{self, reason};

/// Settings of [`start`].
#[derive(Debug, Clone)]
pub struct KubeSettings {
    pub node: String,
    pub namespace: String,
    /// The RuntimeClass that opts a pod in.
    pub runtime_class: String,
    pub containerd_configs: Vec<PathBuf>,
    pub runtime_binary: PathBuf,
    pub check_interval: Duration,
}

/// Everything [`start`] started.
pub struct Running {
    pub cluster: Arc<KubeCluster>,
    /// Set once the pods of this node are known (what the reconcilers wait for).
    pub pods_ready: Arc<AtomicBool>,
}

/// Threads per job pool: with at most one job of a namespace running at a time, a namespace's
/// long job holds one of them at most.
pub const WORKERS_PER_QUEUE: usize = 2;
/// Jobs of one namespace waiting in a pool, at most (more are retried with a backoff).
pub const QUEUED_PER_NAMESPACE: usize = 64;
/// Pod events buffered for the controllers: more than a node's pods (110 by default), so the
/// initial list never waits for them.
const POD_EVENTS_BUFFER: usize = 256;
/// The first retry of a failed reconcile, doubled with each failure in a row up to
/// [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Why a reconcile did not run its job.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("cannot read it again before starting: {0}")]
    Kube(#[from] kube::Error),
}

impl ReconcileError {
    /// The `kind` label of `stasis_agent_errors_total`.
    fn kind(&self) -> &'static str {
        match self {
            Self::Pool(PoolError::Full { .. }) => "queue",
            Self::Pool(PoolError::Lost) => "job",
            Self::Kube(_) => "kube",
        }
    }
}

/// What the two reconcilers share.
struct Reconcilers {
    cluster: Arc<KubeCluster>,
    agent: Arc<Agent>,
    checkpoints: JobPool,
    restores: JobPool,
    /// Restores this node was fetching when the agent last stopped: prepared once more.
    resume: Mutex<HashSet<ObjectRef<PodRestore>>>,
    /// Failed reconciles in a row, per object (the retry's backoff).
    failures: Mutex<HashMap<String, u32>>,
}

fn object_key<K: Resource<DynamicType = ()>>(o: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        o.meta().namespace.as_deref().unwrap_or_default(),
        o.meta().name.as_deref().unwrap_or_default()
    )
}

impl Reconcilers {
    /// The reconcile of `o` is done: nothing to retry, wait for its next change.
    fn done<K: Resource<DynamicType = ()>>(&self, o: &K) -> Action {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&object_key(o));
        Action::await_change()
    }

    /// Like [`Self::done`], and `o` is looked at again after [`WAITING_RESTORE_RECHECK`] even
    /// without a change.
    fn recheck<K: Resource<DynamicType = ()>>(&self, o: &K) -> Action {
        self.done(o);
        Action::requeue(WAITING_RESTORE_RECHECK)
    }

    fn client(&self) -> Client {
        self.cluster.client.clone()
    }
}

/// How often a `PodRestore` that waits for a pod not on this node is looked at again (besides the
/// pod's own events, which trigger it at once).
const WAITING_RESTORE_RECHECK: Duration = Duration::from_secs(5);

/// The delay before retrying an object whose reconcile failed `failures` times in a row.
pub fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (RETRY_FIRST * 2u32.pow(doublings)).min(RETRY_MAX)
}

fn error_policy<K: Resource<DynamicType = ()>>(
    o: Arc<K>,
    err: &ReconcileError,
    ctx: Arc<Reconcilers>,
) -> Action {
    let failures = {
        let mut f = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = f.entry(object_key(&*o)).or_default();
        *n += 1;
        *n
    };
    let delay = retry_delay(failures);
    warn!(kind = %K::kind(&()), namespace = o.meta().namespace.as_deref().unwrap_or_default(),
        name = o.meta().name.as_deref().unwrap_or_default(), error = %err,
        retry_in_ms = delay.as_millis() as u64, "not started; retrying");
    ctx.cluster.exec.metrics.error(err.kind());
    Action::requeue(delay)
}

/// Whether this agent takes `c`: pending, not one of its own termination records (it runs those
/// itself), of a pod bound here (`pod_here`), and not taken on by another node already.
fn checkpoint_to_take(c: &PodCheckpoint, node: &str, pod_here: bool) -> bool {
    let elsewhere = c
        .status
        .as_ref()
        .and_then(|s| s.node.as_deref())
        .is_some_and(|n| n != node);
    pod_here
        && !elsewhere
        && phase_is_pending_ckpt(c)
        && !c.labels().contains_key(names::CREATED_BY)
}

#[instrument(name = "checkpoint", skip_all,
    fields(namespace = %c.namespace().unwrap_or_default(), name = %c.name_any()))]
async fn reconcile_checkpoint(
    c: Arc<PodCheckpoint>,
    ctx: Arc<Reconcilers>,
) -> std::result::Result<Action, ReconcileError> {
    let (ns, node) = (c.namespace().unwrap_or_default(), &ctx.cluster.node);
    let here = ctx
        .cluster
        .pod_by_name(&ns, &c.spec.source_pod_name)
        .is_some();
    if !checkpoint_to_take(&c, node, here) {
        return Ok(ctx.done(&*c));
    }
    // The cache can lag behind this agent's own status writes (an event of the pod can trigger
    // a reconcile right after a job, before the watch brought its `Running`): read it again
    // rather than take a checkpoint twice.
    let api: Api<PodCheckpoint> = Api::namespaced(ctx.client(), &ns);
    let Some(fresh) = api.get_opt(&c.name_any()).await? else {
        return Ok(ctx.done(&*c));
    };
    if !checkpoint_to_take(&fresh, node, here) {
        return Ok(ctx.done(&*c));
    }
    let (cluster, agent) = (ctx.cluster.clone(), ctx.agent.clone());
    ctx.checkpoints
        .run(&ns, move || cluster.run_checkpoint(&agent, &fresh))
        .await?;
    Ok(ctx.done(&*c))
}

#[instrument(name = "restore", skip_all,
    fields(namespace = %r.namespace().unwrap_or_default(), name = %r.name_any()))]
async fn reconcile_restore(
    r: Arc<PodRestore>,
    ctx: Arc<Reconcilers>,
) -> std::result::Result<Action, ReconcileError> {
    let ns = r.namespace().unwrap_or_default();
    if ctx
        .cluster
        .pod_by_name(&ns, &r.spec.target_pod_name)
        .is_none()
    {
        // Its pod is not (yet) on this node: the pod's event triggers it. A restore that still
        // waits is also looked at again now and then, so that a trigger lost between the two
        // watches cannot leave its pod waiting for a restore nobody prepares (seen once: a
        // hand-made PodRestore's pod waited out its wait container's timeout). The look is a
        // read of the node's pod store.
        return Ok(if restore_to_prepare(&r) {
            ctx.recheck(&*r)
        } else {
            ctx.done(&*r)
        });
    }
    let key = ObjectRef::from_obj(&*r);
    let resumed = ctx
        .resume
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&key);
    let fetching =
        |r: &PodRestore| r.status.as_ref().and_then(|s| s.phase) == Some(RestorePhase::Fetching);
    let ready =
        |r: &PodRestore| r.status.as_ref().and_then(|s| s.phase) == Some(RestorePhase::Ready);
    let wanted = |r: &PodRestore| restore_to_prepare(r) || (resumed && (fetching(r) || ready(r)));
    if !wanted(&r) {
        return Ok(ctx.done(&*r));
    }
    // As for checkpoints: never prepare twice from a cache that has not seen `Fetching` yet.
    let api: Api<PodRestore> = Api::namespaced(ctx.client(), &ns);
    let fresh = api.get_opt(&r.name_any()).await?.filter(|f| wanted(f));
    if let Some(fresh) = fresh {
        if resumed {
            info!("preparing a restore again after an agent restart");
        }
        let cluster = ctx.cluster.clone();
        ctx.restores
            .run(&ns, move || cluster.run_restore(&fresh))
            .await?;
    }
    ctx.resume
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    Ok(ctx.done(&*r))
}

/// The `K`s waiting for `pod` (in its namespace, naming it, still `waiting`), for a trigger.
fn waiting_for<K>(
    store: &Store<K>,
    pod: &Pod,
    names_pod: impl Fn(&K) -> &str,
    waiting: impl Fn(&K) -> bool,
) -> Vec<ObjectRef<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let (ns, name) = (pod.metadata.namespace.as_deref(), pod.name_any());
    store
        .state()
        .iter()
        .filter(|o| o.meta().namespace.as_deref() == ns && names_pod(o) == name && waiting(o))
        .map(|o| ObjectRef::from_obj(&**o))
        .collect()
}

/// A controller of every `K`, also triggered by the events of this node's pods (`pod_events`):
/// a pod's event triggers the `K`s that name it (`names_pod`) and still wait; it stops taking
/// new work on `shutdown`.
fn with_pod_triggers<K>(
    client: Client,
    pod_events: ReflectHandle<Pod>,
    names_pod: fn(&K) -> &str,
    waiting: fn(&K) -> bool,
    shutdown: &Shutdown,
) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let controller = Controller::new(Api::<K>::all(client), Default::default());
    let of_pod = controller.store();
    controller
        .watches_shared_stream(pod_events, move |pod| {
            waiting_for(&of_pod, &pod, names_pod, waiting)
        })
        .graceful_shutdown_on(shutdown.stopped())
}

/// Starts the reflectors and, once the pods of this node are known, the controllers, on the
/// current runtime; they stop taking new work on `shutdown`. `ready` is set once every cache the
/// agent reads has its first complete list: the node's pods, the `CheckpointPolicy`s and the
/// controllers' `PodCheckpoint`s and `PodRestore`s.
pub async fn start(
    client: Client,
    settings: KubeSettings,
    exec: Arc<Executor>,
    busy: Arc<Busy>,
    shutdown: Shutdown,
    ready: Readiness,
) -> Result<Running> {
    let (pods, pods_writer) = reflector::store_shared::<Pod>(POD_EVENTS_BUFFER);
    // (subscribed before the reflector runs: no event reaches the store without them)
    let pod_events = [pods_writer.subscribe(), pods_writer.subscribe()];
    let [Some(ckpt_pod_events), Some(restore_pod_events)] = pod_events else {
        unreachable!("a shared store can be subscribed to");
    };
    let pod_stream = watcher(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={}", settings.node)),
    )
    .default_backoff()
    // (`reflect_shared`, not `reflect`: only it passes the events on to the subscribers)
    .reflect_shared(pods_writer)
    .applied_objects();
    tokio::spawn(pod_stream.for_each(|ev| async move {
        if let Err(e) = ev {
            warn!(error = %e, "pod watch");
        }
    }));
    let (policies, policy_watch) =
        stasis_api::cache::watch_all::<CheckpointPolicy, _>(client.clone(), || {});
    tokio::spawn(policy_watch);
    let cluster = Arc::new(KubeCluster {
        client: client.clone(),
        rt: Handle::current(),
        node: settings.node.clone(),
        namespace: settings.namespace.clone(),
        runtime_class: settings.runtime_class.clone(),
        pods: pods.clone(),
        policies: policies.clone(),
        exec: exec.clone(),
    });
    let pool = |name| {
        JobPool::new(name, WORKERS_PER_QUEUE, QUEUED_PER_NAMESPACE)
            .map_err(crate::error::AgentError::io(name))
    };
    let ctx = Arc::new(Reconcilers {
        cluster: cluster.clone(),
        agent: Arc::new(Agent {
            exec,
            cluster: cluster.clone(),
            busy,
        }),
        checkpoints: pool("checkpoints")?,
        restores: pool("restores")?,
        resume: Mutex::default(),
        failures: Mutex::default(),
    });
    let pods_ready = Arc::new(AtomicBool::new(false));
    let pods_known = pods_ready.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = stasis_api::cache::wait_ready(&pods) => {}
            _ = shutdown.wait() => return,
        }
        pods_known.store(true, Ordering::SeqCst);
        info!(pods = pods.state().len(), "pods of this node known");
        // Before the controllers: their first reconciles must see what to resume.
        *ctx.resume.lock().unwrap_or_else(|e| e.into_inner()) =
            recover(&ctx.cluster.client, &ctx.cluster).await;
        let checkpoints = with_pod_triggers(
            ctx.client(),
            ckpt_pod_events,
            |c: &PodCheckpoint| c.spec.source_pod_name.as_str(),
            phase_is_pending_ckpt,
            &shutdown,
        );
        let restores = with_pod_triggers(
            ctx.client(),
            restore_pod_events,
            |r: &PodRestore| r.spec.target_pod_name.as_str(),
            restore_to_prepare,
            &shutdown,
        );
        // (the controllers' own stores fill as their streams run: awaited beside them)
        let synced = {
            let (ckpts, restores) = (checkpoints.store(), restores.store());
            let shutdown = shutdown.clone();
            async move {
                let caches = async {
                    stasis_api::cache::wait_ready(&policies).await;
                    stasis_api::cache::wait_ready(&ckpts).await;
                    stasis_api::cache::wait_ready(&restores).await;
                };
                tokio::select! {
                    _ = caches => {}
                    _ = shutdown.wait() => return,
                }
                ready.set(true);
                info!(
                    checkpoints = ckpts.state().len(),
                    restores = restores.state().len(),
                    "caches synced: ready"
                );
            }
        };
        let checkpoints = checkpoints
            .run(reconcile_checkpoint, error_policy, ctx.clone())
            .for_each(drain("PodCheckpoint"));
        let restores = restores
            .run(reconcile_restore, error_policy, ctx.clone())
            .for_each(drain("PodRestore"));
        tokio::join!(checkpoints, restores, synced);
    });
    Ok(Running {
        cluster,
        pods_ready,
    })
}

/// Logs what a controller's stream reports that its reconciler did not (watch errors, objects
/// gone before their turn).
fn drain<T, E: std::fmt::Display>(
    kind: &'static str,
) -> impl FnMut(std::result::Result<T, E>) -> futures::future::Ready<()> {
    move |r| {
        if let Err(e) = r {
            debug!(kind, error = %e, "controller");
        }
        futures::future::ready(())
    }
}

/// At start: `Running` checkpoints of this node → `Failed` (their images died with the agent
/// that took them); returns the restores of this node to prepare again: the `Fetching` ones,
/// and the `Ready` ones whose lazy restore no create has taken (its page server died with the
/// agent that served it; its plan is withdrawn and its create waits for the new one).
async fn recover(client: &Client, cluster: &KubeCluster) -> HashSet<ObjectRef<PodRestore>> {
    let mine = |n: Option<&String>| n.is_some_and(|n| *n == cluster.node);
    let orphaned = cluster
        .exec
        .withdraw_orphaned_lazy_plans(stasis_node_api::MAX_PREPARE_WAIT_MS);
    match Api::<PodCheckpoint>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => {
            for c in l.items.into_iter().filter(|c| {
                c.status.as_ref().is_some_and(|s| {
                    s.phase == Some(CheckpointPhase::Running) && mine(s.node.as_ref())
                })
            }) {
                let (ns, name) = (c.namespace().unwrap_or_default(), c.name_any());
                let s = status::checkpoint_failed(
                    &c.status.clone().unwrap_or_default(),
                    &cluster.node,
                    reason::CHECKPOINT_FAILED,
                    "the node agent restarted while taking this checkpoint",
                    status::now(),
                );
                info!(checkpoint = %name, "marking a checkpoint interrupted by an agent restart as failed");
                cluster.patch_ckpt_status(&ns, &name, &s).await;
            }
        }
        Err(e) => warn!(error = %e, "cannot list PodCheckpoints at start"),
    }
    match Api::<PodRestore>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => l
            .items
            .iter()
            .filter(|r| {
                let lazy_orphan = r
                    .spec
                    .target_pod_uid
                    .as_ref()
                    .is_some_and(|u| orphaned.contains(u));
                r.status.as_ref().is_some_and(|s| {
                    mine(s.node.as_ref())
                        && (s.phase == Some(RestorePhase::Fetching)
                            || (s.phase == Some(RestorePhase::Ready) && lazy_orphan))
                })
            })
            .map(ObjectRef::from_obj)
            .collect(),
        Err(e) => {
            warn!(error = %e, "cannot list PodRestores at start");
            HashSet::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn retries_back_off_to_a_bound() {
        assert_eq!(retry_delay(1), RETRY_FIRST);
        assert_eq!(retry_delay(2), RETRY_FIRST * 2);
        assert_eq!(retry_delay(4), RETRY_FIRST * 8);
        assert_eq!(retry_delay(40), RETRY_MAX);
        assert_eq!(retry_delay(u32::MAX), RETRY_MAX);
    }

    #[test]
    fn which_checkpoints_this_agent_takes() {
        let ckpt = |labels: serde_json::Value, status: serde_json::Value| -> PodCheckpoint {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
                "metadata": {"name": "c", "namespace": "default", "labels": labels},
                "spec": {"sourcePodName": "p"}, "status": status
            }))
            .unwrap()
        };
        let pending = ckpt(json!({}), json!({}));
        assert!(checkpoint_to_take(&pending, "n1", true));
        assert!(
            !checkpoint_to_take(&pending, "n1", false),
            "its pod is elsewhere"
        );
        let running = ckpt(json!({}), json!({"phase": "Running", "node": "n1"}));
        assert!(!checkpoint_to_take(&running, "n1", true));
        let other_node = ckpt(json!({}), json!({"phase": "Pending", "node": "n2"}));
        assert!(!checkpoint_to_take(&other_node, "n1", true));
        let mut own = pending.clone();
        own.metadata.labels = Some([(names::CREATED_BY.to_owned(), "stasisd".to_owned())].into());
        assert!(
            !checkpoint_to_take(&own, "n1", true),
            "its termination record"
        );
    }

    /// A pod's event triggers the objects that name it and still wait, in its namespace only.
    #[test]
    fn a_pod_triggers_the_restores_that_wait_for_it() {
        let restore = |ns: &str, name: &str, target: &str, phase: Option<&str>| -> PodRestore {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"checkpointRef": "l/x", "targetPodName": target},
                "status": phase.map(|p| json!({"phase": p}))
            }))
            .unwrap()
        };
        let (store, mut writer) = reflector::store::<PodRestore>();
        for r in [
            restore("a", "r1", "web-0", None),
            restore("a", "r2", "web-0", Some("Ready")),
            restore("a", "r3", "web-1", None),
            restore("b", "r4", "web-0", Some("Pending")),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(r));
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "a", "uid": "u"}
        }))
        .unwrap();
        let refs = waiting_for(
            &store,
            &pod,
            |r| &r.spec.target_pod_name,
            restore_to_prepare,
        );
        assert_eq!(refs, [ObjectRef::new("r1").within("a")]);
    }
}
