//! The reflectors, the `PodCheckpoint` / `PodRestore` watchers, the fair work queues and
//! their worker threads, and the recovery of work a previous run left half done.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use stasis_api::{CheckpointPhase, CheckpointPolicy, PodCheckpoint, PodRestore, RestorePhase};
use tokio::runtime::Handle;
use tracing::{debug, info, info_span, warn};

use super::pod_facts::{phase_is_pending_ckpt, restore_to_prepare};
use super::KubeCluster;
use crate::error::Result;
use crate::executor::Executor;
use crate::fair::FairQueue;
use crate::node::{Agent, Busy};
use crate::status::{self};
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
    pub pods_ready: Arc<AtomicBool>,
}

enum Job {
    Checkpoint(Arc<PodCheckpoint>),
    Restore(Arc<PodRestore>),
}

fn job_key(j: &Job) -> String {
    match j {
        Job::Checkpoint(c) => format!(
            "c/{}/{}",
            c.metadata.namespace.as_deref().unwrap_or(""),
            c.metadata.name.as_deref().unwrap_or("")
        ),
        Job::Restore(r) => format!(
            "r/{}/{}",
            r.metadata.namespace.as_deref().unwrap_or(""),
            r.metadata.name.as_deref().unwrap_or("")
        ),
    }
}

fn job_namespace(j: &Job) -> &str {
    match j {
        Job::Checkpoint(c) => c.metadata.namespace.as_deref(),
        Job::Restore(r) => r.metadata.namespace.as_deref(),
    }
    .unwrap_or("")
}

/// Workers per queue: with at most one job of a namespace running at a time, a namespace's
/// long job holds one of them at most (review M7).
pub const WORKERS_PER_QUEUE: usize = 2;
/// Jobs of one namespace waiting in a queue, at most (more are retried at the next resync).
pub const QUEUED_PER_NAMESPACE: usize = 64;

/// [`WORKERS_PER_QUEUE`] worker threads draining one queue, fair across namespaces
/// ([`FairQueue`]); `queued` deduplicates jobs until they finish.
fn worker(
    name: &str,
    q: Arc<FairQueue<Job>>,
    cluster: Arc<KubeCluster>,
    agent: Arc<Agent>,
    queued: Arc<Mutex<HashSet<String>>>,
) {
    for i in 0..WORKERS_PER_QUEUE {
        let (q, cluster, agent, queued) =
            (q.clone(), cluster.clone(), agent.clone(), queued.clone());
        std::thread::Builder::new()
            .name(format!("{name}-{i}"))
            .spawn(move || loop {
                let (ns, job) = q.pop();
                let key = job_key(&job);
                // One span per job: every line it logs (and those of the calls it makes on
                // the runtime through `block_on`) names the object it works for.
                match &job {
                    Job::Checkpoint(c) => {
                        let _span = info_span!("checkpoint", namespace = %ns, name = %c.name_any())
                            .entered();
                        cluster.run_checkpoint(&agent, c)
                    }
                    Job::Restore(r) => {
                        let _span =
                            info_span!("restore", namespace = %ns, name = %r.name_any()).entered();
                        cluster.run_restore(r)
                    }
                }
                queued
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&key);
                q.done(&ns);
            })
            .expect("spawn a worker thread");
    }
}

/// Starts the reflectors, watchers and workers on the current runtime.
pub async fn start(
    client: Client,
    settings: KubeSettings,
    exec: Arc<Executor>,
    busy: Arc<Busy>,
) -> Result<Running> {
    let rt = Handle::current();
    let pods_api: Api<Pod> = Api::all(client.clone());
    let (pods, pods_writer) = reflector::store();
    let pod_stream = reflector::reflector(
        pods_writer,
        watcher(
            pods_api,
            watcher::Config::default().fields(&format!("spec.nodeName={}", settings.node)),
        ),
    )
    .default_backoff()
    .applied_objects();
    tokio::spawn(async move {
        futures::pin_mut!(pod_stream);
        while let Some(ev) = pod_stream.next().await {
            if let Err(e) = ev {
                warn!(error = %e, "pod watch");
            }
        }
    });
    let (policies, pol_writer) = reflector::store();
    let pol_stream = reflector::reflector(
        pol_writer,
        watcher(
            Api::<CheckpointPolicy>::all(client.clone()),
            Default::default(),
        ),
    )
    .default_backoff()
    .applied_objects();
    tokio::spawn(async move {
        futures::pin_mut!(pol_stream);
        while let Some(ev) = pol_stream.next().await {
            if let Err(e) = ev {
                debug!(error = %e, "policy watch");
            }
        }
    });
    let cluster = Arc::new(KubeCluster {
        client: client.clone(),
        rt: rt.clone(),
        node: settings.node.clone(),
        namespace: settings.namespace.clone(),
        runtime_class: settings.runtime_class.clone(),
        pods: pods.clone(),
        policies,
        exec: exec.clone(),
    });
    let agent = Arc::new(Agent {
        exec: exec.clone(),
        cluster: cluster.clone(),
        busy,
    });
    let pods_ready = Arc::new(AtomicBool::new(false));
    {
        let (pods, ready) = (pods.clone(), pods_ready.clone());
        tokio::spawn(async move {
            stasis_api::cache::wait_ready(&pods).await;
            ready.store(true, Ordering::SeqCst);
            info!(pods = pods.state().len(), "pods of this node known");
        });
    }

    let queued = Arc::new(Mutex::new(HashSet::<String>::new()));
    let ckpt_tx = Arc::new(FairQueue::<Job>::new(QUEUED_PER_NAMESPACE));
    let rest_tx = Arc::new(FairQueue::<Job>::new(QUEUED_PER_NAMESPACE));
    let rest_tx2 = rest_tx.clone();
    worker(
        "checkpoints",
        ckpt_tx.clone(),
        cluster.clone(),
        agent.clone(),
        queued.clone(),
    );
    worker(
        "restores",
        rest_tx.clone(),
        cluster.clone(),
        agent,
        queued.clone(),
    );
    let enqueue = move |tx: &Arc<FairQueue<Job>>, job: Job| {
        let key = job_key(&job);
        let fresh = queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone());
        let ns = job_namespace(&job).to_owned();
        if fresh && tx.push(&ns, job).is_err() {
            warn!(job = %key, "this namespace's work queue is full; the job is retried at the next resync");
            queued
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        }
    };

    // Work a previous run of this agent left half done: checkpoints it was taking fail (their
    // images died with it), restores it was fetching start again.
    recover(&client, &settings.node, &cluster, &enqueue, &rest_tx2).await;

    // PodCheckpoints: pending ones whose source pod is on this node.
    {
        let (pods, enqueue, pods_ready) = (pods.clone(), enqueue.clone(), pods_ready.clone());
        let node = settings.node.clone();
        let stream = watcher(
            Api::<PodCheckpoint>::all(client.clone()),
            Default::default(),
        )
        .default_backoff()
        .touched_objects();
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let c = match ev {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(error = %e, "PodCheckpoint watch");
                        continue;
                    }
                };
                if !phase_is_pending_ckpt(&c) || c.labels().get(names::CREATED_BY).is_some() {
                    continue;
                }
                while !pods_ready.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let ns = c.metadata.namespace.clone().unwrap_or_default();
                let ours = pods
                    .find(|p| {
                        p.metadata.namespace.as_deref() == Some(&ns)
                            && p.metadata.name.as_deref() == Some(&c.spec.source_pod_name)
                    })
                    .is_some();
                let elsewhere = c
                    .status
                    .as_ref()
                    .and_then(|s| s.node.as_deref())
                    .is_some_and(|n| n != node);
                if ours && !elsewhere {
                    enqueue(&ckpt_tx, Job::Checkpoint(Arc::new(c)));
                }
            }
        });
    }
    // PodRestores: pending ones whose target pod is bound to this node.
    {
        let (pods, pods_ready, enqueue) = (pods.clone(), pods_ready.clone(), enqueue.clone());
        let stream = watcher(Api::<PodRestore>::all(client.clone()), Default::default())
            .default_backoff()
            .touched_objects();
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let r = match ev {
                    Ok(r) => r,
                    Err(e) => {
                        warn!(error = %e, "PodRestore watch");
                        continue;
                    }
                };
                if !restore_to_prepare(&r) {
                    continue;
                }
                while !pods_ready.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let ns = r.metadata.namespace.clone().unwrap_or_default();
                let ours = pods
                    .find(|p| {
                        p.metadata.namespace.as_deref() == Some(&ns)
                            && p.metadata.name.as_deref() == Some(&r.spec.target_pod_name)
                    })
                    .is_some();
                if ours {
                    enqueue(&rest_tx, Job::Restore(Arc::new(r)));
                }
            }
        });
    }
    // A pod that lands on this node after its PodRestore was created (the usual order: the
    // webhook creates it at admission, before the pod is bound): look for pending PodRestores
    // of every pod newly seen here.
    {
        let (client, pods, cluster) = (client.clone(), pods.clone(), cluster.clone());
        tokio::spawn(async move {
            let mut seen: HashSet<String> = HashSet::new();
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let now: Vec<Arc<Pod>> = pods.state();
                let uids: HashSet<String> =
                    now.iter().filter_map(|p| p.metadata.uid.clone()).collect();
                for p in now
                    .iter()
                    .filter(|p| p.metadata.uid.as_ref().is_some_and(|u| !seen.contains(u)))
                {
                    let key = cluster.info(p).key;
                    let api: Api<PodRestore> = Api::namespaced(client.clone(), &key.namespace);
                    let lp =
                        ListParams::default().fields(&format!("spec.targetPodName={}", key.name));
                    match api.list(&lp).await {
                        Ok(l) => {
                            for r in l.items.into_iter().filter(restore_to_prepare) {
                                enqueue(&rest_tx2, Job::Restore(Arc::new(r)));
                            }
                        }
                        Err(e) => warn!(pod = %key.name, error = %e, "cannot list PodRestores"),
                    }
                }
                seen = uids;
            }
        });
    }
    Ok(Running {
        cluster,
        pods_ready,
    })
}

/// At start: `Running` checkpoints of this node → `Failed` (the agent restarted during them);
/// `Fetching` restores of this node → prepared again.
async fn recover(
    client: &Client,
    node: &str,
    cluster: &Arc<KubeCluster>,
    enqueue: &(impl Fn(&Arc<FairQueue<Job>>, Job) + Send + Sync),
    rest_tx: &Arc<FairQueue<Job>>,
) {
    let mine = |n: Option<&String>| n.is_some_and(|n| n == node);
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
                    node,
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
    // A restore is prepared only for a pod known to be here: wait for the pods of the node.
    let _ = tokio::time::timeout(
        Duration::from_secs(30),
        stasis_api::cache::wait_ready(&cluster.pods),
    )
    .await;
    match Api::<PodRestore>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => {
            for r in l.items.into_iter().filter(|r| {
                r.status.as_ref().is_some_and(|s| {
                    s.phase == Some(RestorePhase::Fetching) && mine(s.node.as_ref())
                })
            }) {
                info!(restore = %r.name_any(), "preparing a restore again after an agent restart");
                enqueue(rest_tx, Job::Restore(Arc::new(r)));
            }
        }
        Err(e) => warn!(error = %e, "cannot list PodRestores at start"),
    }
}
