//! Wiring: the store, keys, executor, node-api server, metrics endpoint and (unless standalone)
//! the Kubernetes side; runs until SIGTERM/SIGINT, then removes the node-ready label.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use stasis_store::{Key, Store};
use tracing::{info, warn};

use crate::error::{AgentError, Result};
use crate::executor::{Executor, ExecutorConfig, KeySource, StaticKey};
use crate::keys::ClusterKey;
use crate::metrics::Metrics;
use crate::node::{Agent, Busy, Standalone};
use stasis_service::admin::{self, Readiness};
use stasis_service::shutdown::Shutdown;

pub use crate::config::{Config, KeyBroker};

/// How long a stopping agent waits for the checkpoints in progress (each also has its own
/// deadline, and the kubelet ends the agent at the end of its grace period).
const STOP_WAIT: Duration = Duration::from_secs(300);

/// The default bound of the chunk cache: this share of the size of the filesystem that holds it.
pub const CACHE_SHARE_PERCENT: u64 = 10;
/// ... and never less than this (a small filesystem still caches a small pod's checkpoint).
pub const CACHE_MIN_BYTES: u64 = 256 << 20;

/// The chunk cache's bound: the configured one, else [`CACHE_SHARE_PERCENT`] of `fs_bytes` (the
/// size of the filesystem that holds it, when known), at least [`CACHE_MIN_BYTES`].
pub fn chunk_cache_bound(configured: Option<u64>, fs_bytes: Option<u64>) -> u64 {
    configured.unwrap_or_else(|| {
        fs_bytes.map_or(CACHE_MIN_BYTES, |b| {
            (b / 100 * CACHE_SHARE_PERCENT).max(CACHE_MIN_BYTES)
        })
    })
}

/// The size of the filesystem holding `dir` (or its nearest existing parent).
fn filesystem_bytes(dir: &std::path::Path) -> Option<u64> {
    crate::executor::room::filesystem_space(dir).map(|s| s.total)
}

/// Opens the node's chunk cache and gives it to the store: every checkpoint's chunks are cached
/// as they upload, and restores (restarts in place first) read it before the bucket. A cache
/// that cannot be opened is logged and left out: restores then fetch from the bucket.
fn open_chunk_cache(store: &Store, dir: &std::path::Path, configured: Option<u64>) {
    let bound = chunk_cache_bound(configured, filesystem_bytes(dir));
    if bound == 0 {
        info!("no chunk cache (--chunk-cache-bytes 0): restarts in place fetch from the store");
        return;
    }
    match stasis_store::ChunkCache::open(dir, bound) {
        Ok(cache) => {
            let stats = cache.stats();
            info!(dir = %dir.display(), max_bytes = bound, bytes = stats.bytes, entries = stats.entries, "chunk cache open");
            store.set_cache(Arc::new(cache));
        }
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "cannot open the chunk cache; restores fetch from the store")
        }
    }
}

/// Runs the agent on `rt` until `shutdown` (the binary's: SIGTERM or SIGINT).
pub fn run(cfg: Config, rt: &tokio::runtime::Runtime, shutdown: Shutdown) -> Result<()> {
    let metrics = Arc::new(Metrics::default());
    // Ready once every cache the Kubernetes side reads has synced (at once without Kubernetes).
    let ready = Readiness::default();
    let store = Arc::new(Store::open(&cfg.store)?);
    open_chunk_cache(&store, &cfg.chunk_cache_dir, cfg.chunk_cache_bytes);
    let client = if cfg.standalone {
        None
    } else {
        Some(
            rt.block_on(kube::Client::try_default())
                .map_err(AgentError::NoClient)?,
        )
    };
    let keys: Arc<dyn KeySource> = match (&cfg.key_file, &cfg.key_broker.url, &client) {
        (Some(k), _, _) => Arc::new(StaticKey(Key::load(k)?)),
        (None, Some(url), Some(_)) => {
            let b = &cfg.key_broker;
            let _guard = rt.enter();
            let broker = crate::k8s::BrokerClient::new(url, &b.ca, &b.token)?;
            tracing::info!(%url, "data keys from the key broker; no cluster key on this node");
            Arc::new(crate::k8s::SecretKeys::new(
                rt.handle().clone(),
                crate::k8s::KeyOrigin::Broker(broker),
            ))
        }
        (None, None, Some(client)) => {
            let ck = &cfg.cluster_key_file;
            let ring = ClusterKey::load(ck).map_err(AgentError::io(ck))??;
            tracing::info!(cluster_key = %ring.id(), retired = ?ring.retired_ids(), "cluster key loaded");
            Arc::new(crate::k8s::SecretKeys::new(
                rt.handle().clone(),
                crate::k8s::KeyOrigin::ClusterKey {
                    client: client.clone(),
                    namespace: cfg.namespace.clone(),
                    ring: Arc::new(ring),
                },
            ))
        }
        _ => {
            return Err(AgentError::Invalid(
                "no key: give --key-file, or --cluster-key with Kubernetes".into(),
            ))
        }
    };
    // (pre-staging fetches into the same cache; it needs no key)
    let prestage_cache = store.cache().cloned();
    let exec = Arc::new(Executor::new(
        ExecutorConfig {
            runc_root: cfg.runc_root.clone(),
            work_dir: cfg.work_dir.clone(),
            images_dir: cfg.images_dir.clone(),
            plans_dir: cfg.plans_dir.clone(),
            node_name: cfg.node_name.clone(),
            plan_ttl: cfg.plan_ttl,
            tcp_established: !cfg.no_tcp_established,
            keep_latest: !cfg.no_keep_latest,
        },
        store,
        keys,
        rt.handle().clone(),
        metrics.clone(),
    ));
    crate::executor::private_dir(&cfg.images_dir)?;
    crate::executor::private_dir(&cfg.plans_dir)?;

    if let Some(addr) = cfg.metrics_addr {
        let listener = rt
            .block_on(admin::bind(addr))
            .map_err(AgentError::io(addr.to_string()))?;
        let stop = shutdown.clone();
        rt.spawn(admin::serve(
            listener,
            metrics.clone(),
            ready.clone(),
            async move { stop.wait().await },
        ));
        info!(%addr, "serving /metrics, /livez and /readyz");
    }

    let busy = Arc::new(Busy::default());
    let in_progress = busy.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let settings = crate::k8s::KubeSettings {
        node: cfg.node_name.clone(),
        namespace: cfg.namespace.clone(),
        runtime_class: cfg.runtime_class.clone(),
        containerd_configs: cfg.containerd_configs.clone(),
        runtime_binary: cfg.runtime_binary.clone(),
        check_interval: cfg.check_interval,
    };
    let (agent, label_thread, successor) = match &client {
        None => (
            Arc::new(Agent {
                exec: exec.clone(),
                cluster: Arc::new(Standalone),
                busy,
            }),
            None,
            None,
        ),
        Some(client) => {
            let running = rt.block_on(crate::k8s::start(
                client.clone(),
                settings.clone(),
                exec.clone(),
                busy.clone(),
                shutdown.clone(),
                ready.clone(),
            ))?;
            let t = crate::k8s::label_loop(&running, settings.clone(), stop.clone());
            rt.spawn(crate::notice::run(
                running.cluster.clone(),
                cfg.cloud.settings(),
                stop.clone(),
            ));
            crate::k8s::prestage::start(
                rt,
                &running.cluster,
                &cfg,
                prestage_cache.clone(),
                shutdown.clone(),
            );
            rt.spawn(crate::memory::run(
                crate::memory::MemoryContext {
                    client: running.cluster.client.clone(),
                    node: running.cluster.node.clone(),
                    runtime_class: running.cluster.runtime_class.clone(),
                    pods: running.cluster.pods.clone(),
                    policies: running.cluster.policies.clone(),
                    metrics: metrics.clone(),
                    runc_root: cfg.runc_root.clone(),
                },
                stop.clone(),
            ));
            (
                Arc::new(Agent {
                    exec: exec.clone(),
                    cluster: running.cluster.clone(),
                    busy,
                }),
                Some(t),
                Some(running.cluster.clone()),
            )
        }
    };

    // Lazy restores: a failure after the container ran is reported as the wrapper reports a
    // failed restore (the restore's status and a Warning Event).
    exec.set_lazy_restore(cfg.lazy_restore);
    let lazy_agent = agent.clone();
    exec.on_lazy_failure(move |f| lazy_agent.relay_report(&f.report()));

    if let Some(cluster) = &successor {
        // The eviction responder takes final checkpoints through the same agent as the socket.
        rt.spawn(crate::k8s::eviction_request::run(
            cluster.clone(),
            agent.clone(),
            shutdown.clone(),
        ));
    }
    let reports_agent = agent.clone();
    // The reports a predecessor claimed and died handling, listed before this agent's socket
    // listens: none of them is this agent's own claim in progress.
    let predecessors = stasis_node_api::planfile::claimed_reports(&cfg.plans_dir);
    let listener =
        stasis_node_api::server::bind(&cfg.socket).map_err(AgentError::io(&cfg.socket))?;
    let socket_inode = std::fs::metadata(&cfg.socket).map(|m| m.ino()).ok();
    let server =
        crate::server::serve(listener, agent, stop.clone()).map_err(AgentError::io(&cfg.socket))?;
    info!(socket = %cfg.socket.display(), node = %cfg.node_name, store = %cfg.store, "stasisd running");
    // Reports no agent handled (a restore or a cold start during an agent restart, or sent to
    // an agent killed before it handled it): the predecessor's claimed ones now, whatever their
    // age, then every few seconds those no one claimed for a while (`reports`).
    {
        let (dir, stop) = (cfg.plans_dir.clone(), stop.clone());
        std::thread::Builder::new()
            .name("undelivered-reports".into())
            .spawn(move || {
                reports_agent.take_predecessors_reports(&predecessors);
                while !stop.load(Ordering::SeqCst) {
                    reports_agent.take_undelivered_reports(&dir);
                    for _ in 0..25 {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(200));
                    }
                }
            })
            .map_err(|e| AgentError::Invalid(format!("cannot start a thread: {e}")))?;
    }

    if client.is_none() {
        ready.set(true);
    }

    rt.block_on(shutdown.wait());
    info!("stopping");
    stop.store(true, Ordering::SeqCst);
    server.stop();
    // A final checkpoint answered when captured is still uploading: the node's own shutdown (the
    // kubelet ends the agent right after the workloads) must not cut it off. The kubelet's
    // SIGKILL at the end of the agent's grace period bounds this wait too.
    let busy_at_stop = in_progress.wait_idle(std::time::Instant::now());
    if !busy_at_stop.is_empty() {
        info!(pods = ?busy_at_stop, "waiting for the checkpoints in progress before stopping");
        let left = in_progress.wait_idle(std::time::Instant::now() + STOP_WAIT);
        if left.is_empty() {
            info!("the checkpoints in progress ended");
        } else {
            warn!(pods = ?left, "checkpoints still in progress: stopping without them");
        }
    }
    // A rolling update starts the new agent first (surge): it has bound the socket path anew,
    // and it keeps the node ready. Remove only what is still ours.
    if std::fs::metadata(&cfg.socket).map(|m| m.ino()).ok() == socket_inode {
        let _ = std::fs::remove_file(&cfg.socket);
    }
    if let Some(t) = label_thread {
        let _ = t.join();
    }
    let successor = successor.as_ref().and_then(|c| c.successor_agent());
    if let Some(name) = &successor {
        info!(successor = %name, "a newer agent runs on this node: leaving the ready label");
    }
    if let (Some(client), None) = (&client, &successor) {
        let labels = std::collections::BTreeMap::from([(
            stasis_api::names::node::READY.to_owned(),
            None::<String>,
        )]);
        match rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                crate::k8s::patch_node_labels(client, &cfg.node_name, &labels),
            )
            .await
        }) {
            Ok(Ok(())) => info!("removed {} from the node", stasis_api::names::node::READY),
            Ok(Err(e)) => warn!(error = %e, "cannot remove the ready label"),
            Err(_) => warn!("timed out removing the ready label"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_cache_bound_is_a_share_of_the_filesystem_or_the_flag() {
        assert_eq!(chunk_cache_bound(Some(5 << 30), Some(100 << 30)), 5 << 30);
        assert_eq!(
            chunk_cache_bound(Some(0), Some(100 << 30)),
            0,
            "0: no cache"
        );
        assert_eq!(chunk_cache_bound(None, Some(100 << 30)), 10 << 30);
        assert_eq!(chunk_cache_bound(None, Some(1 << 30)), CACHE_MIN_BYTES);
        assert_eq!(chunk_cache_bound(None, None), CACHE_MIN_BYTES);
        let here = filesystem_bytes(std::path::Path::new("/no/such/dir/below/root"));
        assert!(
            here.is_some_and(|b| b > 0),
            "the size of / is found: {here:?}"
        );
    }
}
