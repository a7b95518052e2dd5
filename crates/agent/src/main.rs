//! `stasisd`: flags and environment → logging → [`stasis_agent::run::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use stasis_service::shutdown::Shutdown;
use stasis_service::telemetry::{self, LogArgs};

/// The stasis node agent.
#[derive(Debug, Parser)]
#[command(name = "stasisd", version)]
struct Args {
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_name: String,
    /// stasis's own namespace (lineage records, data key Secrets).
    #[arg(long, env = "STASIS_NAMESPACE", default_value = "stasis")]
    namespace: String,
    /// The RuntimeClass that opts a pod in: a PodCheckpoint of any other pod is refused before
    /// anything is frozen.
    #[arg(long, env = "STASIS_RUNTIME_CLASS", default_value = "stasis")]
    runtime_class: String,
    /// Checkpoint store URL (`s3://bucket/prefix`, `file:///dir`); S3 credentials from AWS_*.
    #[arg(long, env = "STASIS_STORE")]
    store: String,
    /// The cluster key (32 bytes or 64 hex digits; a mounted Secret) that wraps namespace keys.
    #[arg(
        long,
        env = "STASIS_CLUSTER_KEY_FILE",
        default_value = "/etc/stasis/keys/cluster.key"
    )]
    cluster_key: PathBuf,
    /// The key broker (`https://<controller service>.<namespace>.svc:<port>`): data keys are
    /// asked of stasis-controller, which gives a namespace's only while a pod of it is bound to
    /// this node; the cluster key is then neither needed nor read.
    #[arg(long, env = "STASIS_KEY_BROKER_URL")]
    key_broker_url: Option<String>,
    /// PEM CA of the key broker's certificate.
    #[arg(
        long,
        env = "STASIS_KEY_BROKER_CA",
        default_value = "/etc/stasis/key-broker/ca.crt"
    )]
    key_broker_ca: PathBuf,
    /// The agent pod's projected service-account token for the key broker's audience.
    #[arg(
        long,
        env = "STASIS_KEY_BROKER_TOKEN",
        default_value = "/var/run/secrets/stasis/key-broker/token"
    )]
    key_broker_token: PathBuf,
    /// One data key for every namespace instead of wrapped per-namespace keys (standalone, dev).
    #[arg(long, env = "STASIS_KEY_FILE")]
    key_file: Option<PathBuf>,
    /// The runc root containerd's runc shim uses.
    #[arg(
        long,
        env = "STASIS_RUNC_ROOT",
        default_value = "/run/containerd/runc/k8s.io"
    )]
    runc_root: PathBuf,
    #[arg(long, env = "STASIS_AGENT_SOCKET", default_value = stasis_node_api::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[arg(long, env = "STASIS_PLANS_DIR", default_value = stasis_node_api::DEFAULT_PLANS_DIR)]
    plans_dir: PathBuf,
    #[arg(
        long,
        env = "STASIS_IMAGES_DIR",
        default_value = "/var/lib/stasis/images"
    )]
    images_dir: PathBuf,
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    work_dir: PathBuf,
    /// Address of the admin server: /metrics, /livez, /readyz ("" to disable).
    #[arg(long, env = "STASIS_METRICS_ADDR", default_value = "0.0.0.0:9464")]
    metrics_addr: String,
    /// Where the node installer put the runtime wrapper (a node-ready check).
    #[arg(
        long,
        env = "STASIS_RUNTIME_BINARY",
        default_value = "/opt/stasis/bin/stasis-runc"
    )]
    runtime_binary: PathBuf,
    /// containerd configuration files or drop-in directories to find the `stasis` handler in.
    #[arg(
        long = "containerd-config",
        env = "STASIS_CONTAINERD_CONFIG",
        value_delimiter = ',',
        default_value = "/etc/containerd/config.toml,/etc/containerd/conf.d"
    )]
    containerd_configs: Vec<PathBuf>,
    /// Seconds between node checks (labels) and sweeps of stale plans and images.
    #[arg(
        long = "check-interval",
        env = "STASIS_CHECK_INTERVAL",
        default_value_t = 60
    )]
    check_interval_secs: u64,
    /// Seconds a prepared restore plan stays valid.
    #[arg(long = "plan-ttl", env = "STASIS_PLAN_TTL", default_value_t = 3600)]
    plan_ttl_secs: u64,
    /// Do not dump established TCP connections.
    #[arg(long)]
    no_tcp_established: bool,
    /// Do not keep a reference to each container's latest checkpoint on the node (it makes a
    /// container killed by the OOM killer restart in place from its latest checkpoint, fetched
    /// through the chunk cache; no memory image is kept on the node).
    #[arg(long, env = "STASIS_NO_KEEP_LATEST")]
    no_keep_latest: bool,
    /// The node's chunk cache: every checkpoint's chunks as the store has them (compressed,
    /// encrypted, authenticated), read first by restores and restarts in place.
    #[arg(
        long,
        env = "STASIS_CHUNK_CACHE_DIR",
        default_value = "/var/lib/stasis/chunk-cache"
    )]
    chunk_cache_dir: PathBuf,
    /// The chunk cache's bound in bytes, least recently used evicted first (default: 10% of the
    /// size of the filesystem that holds it, at least 256 MiB; 0: no cache).
    #[arg(long, env = "STASIS_CHUNK_CACHE_BYTES")]
    chunk_cache_bytes: Option<u64>,
    /// The cloud whose notices of the node's end (spot reclaim, preemption, maintenance) trigger
    /// checkpoints: auto (from the node's providerID and labels), none, aws, gcp or azure.
    #[arg(long, env = "STASIS_CLOUD_PROVIDER", default_value = "auto")]
    cloud_provider: stasis_agent::notice::ProviderChoice,
    /// The cloud's instance metadata service, instead of the provider's own address.
    #[arg(long, env = "STASIS_CLOUD_METADATA_URL")]
    cloud_metadata_url: Option<String>,
    /// Milliseconds between polls of the metadata service (GCP is long-polled).
    #[arg(long, env = "STASIS_CLOUD_NOTICE_POLL_MS", default_value_t = 1000)]
    cloud_notice_poll_ms: u64,
    /// No Kubernetes: serve the node API and metrics only.
    #[arg(long, env = "STASIS_STANDALONE")]
    standalone: bool,
    #[command(flatten)]
    log: LogArgs,
    /// Runtime worker threads (the store's I/O; the engine runs on its own threads).
    #[arg(long, env = "STASIS_WORKER_THREADS", default_value_t = 2)]
    worker_threads: usize,
}

fn main() -> anyhow::Result<()> {
    // Before any thread exists (it changes the environment); logged once tracing is up.
    let env_changes = stasis_engine::cuda::prepare_process_env();
    let a = Args::parse();
    stasis_agent::mem::limit_arenas(2);
    // kube enables rustls's ring provider and the S3 client aws-lc-rs: choose one explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    telemetry::init(&a.log);
    for change in env_changes {
        tracing::info!("{change}");
    }
    if a.node_name.is_empty() && !a.standalone {
        anyhow::bail!("NODE_NAME is not set (the DaemonSet gives it from spec.nodeName)");
    }
    let metrics_addr: Option<SocketAddr> = if a.metrics_addr.is_empty() {
        None
    } else {
        Some(a.metrics_addr.parse().context("--metrics-addr")?)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.worker_threads.max(1))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let cfg = stasis_agent::run::Config {
        node_name: a.node_name,
        namespace: a.namespace,
        runtime_class: a.runtime_class,
        store: a.store,
        cluster_key_file: Some(a.cluster_key),
        key_broker: a.key_broker_url.map(|url| stasis_agent::run::KeyBroker {
            url,
            ca: a.key_broker_ca,
            token: a.key_broker_token,
        }),
        key_file: a.key_file,
        runc_root: a.runc_root,
        socket: a.socket,
        plans_dir: a.plans_dir,
        images_dir: a.images_dir,
        work_dir: a.work_dir,
        metrics_addr,
        runtime_binary: a.runtime_binary,
        containerd_configs: a.containerd_configs,
        check_interval: Duration::from_secs(a.check_interval_secs.max(1)),
        plan_ttl: Duration::from_secs(a.plan_ttl_secs.max(1)),
        tcp_established: !a.no_tcp_established,
        keep_latest: !a.no_keep_latest,
        chunk_cache_dir: a.chunk_cache_dir,
        chunk_cache_bytes: a.chunk_cache_bytes,
        standalone: a.standalone,
        cloud: stasis_agent::notice::NoticeSettings {
            provider: a.cloud_provider,
            metadata_url: a.cloud_metadata_url,
            poll: std::time::Duration::from_millis(a.cloud_notice_poll_ms.max(100)),
        },
    };
    let shutdown = {
        let _in_runtime = rt.enter();
        Shutdown::on_signal()
    };
    stasis_agent::run::run(cfg, &rt, shutdown).context("stasisd")?;
    Ok(())
}
