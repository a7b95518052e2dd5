//! [`Config`]: everything the agent is configured with, parsed by clap straight from the flags
//! and their environment variables (the binary flattens it into its command line).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::notice::{NoticeSettings, ProviderChoice};

/// The agent's flags (each also read from the environment variable it names).
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    pub node_name: String,
    /// stasis's own namespace (lineage records, data key Secrets).
    #[arg(long, env = "STASIS_NAMESPACE", default_value = "stasis")]
    pub namespace: String,
    /// The RuntimeClass that opts a pod in: a PodCheckpoint of any other pod is refused before
    /// anything is frozen.
    #[arg(long, env = "STASIS_RUNTIME_CLASS", default_value = "stasis")]
    pub runtime_class: String,
    /// Checkpoint store URL (`s3://bucket/prefix`, `file:///dir`); S3 credentials from AWS_*.
    #[arg(long, env = "STASIS_STORE")]
    pub store: String,
    /// The cluster key (32 bytes or 64 hex digits; a mounted Secret) that wraps namespace keys.
    #[arg(
        long = "cluster-key",
        env = "STASIS_CLUSTER_KEY_FILE",
        default_value = "/etc/stasis/keys/cluster.key"
    )]
    pub cluster_key_file: PathBuf,
    #[command(flatten)]
    pub key_broker: KeyBroker,
    /// One data key for every namespace instead of wrapped per-namespace keys (standalone, dev).
    #[arg(long, env = "STASIS_KEY_FILE")]
    pub key_file: Option<PathBuf>,
    /// The runc root containerd's runc shim uses.
    #[arg(
        long,
        env = "STASIS_RUNC_ROOT",
        default_value = "/run/containerd/runc/k8s.io"
    )]
    pub runc_root: PathBuf,
    /// The node API's socket (stasis-runc's requests and reports).
    #[arg(long, env = "STASIS_AGENT_SOCKET", default_value = stasis_node_api::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Where prepared restore plans are written for stasis-runc.
    #[arg(long, env = "STASIS_PLANS_DIR", default_value = stasis_node_api::DEFAULT_PLANS_DIR)]
    pub plans_dir: PathBuf,
    /// Where restores' images are fetched to.
    #[arg(
        long,
        env = "STASIS_IMAGES_DIR",
        default_value = "/var/lib/stasis/images"
    )]
    pub images_dir: PathBuf,
    /// Scratch space of checkpoints (memory images until they are uploaded).
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
    /// Address of the admin server: /metrics, /livez, /readyz ("" to disable).
    // (the fully qualified `Option` keeps clap from making the flag optional: "" is the
    // documented way to turn the server off)
    #[arg(
        long,
        env = "STASIS_METRICS_ADDR",
        default_value = "0.0.0.0:9464",
        value_parser = address_or_none
    )]
    pub metrics_addr: ::std::option::Option<SocketAddr>,
    /// Where the node installer put the runtime wrapper (a node-ready check).
    #[arg(
        long,
        env = "STASIS_RUNTIME_BINARY",
        default_value = stasis_engine::containerd::DEFAULT_RUNTIME_BINARY
    )]
    pub runtime_binary: PathBuf,
    /// containerd configuration files or drop-in directories to find the `stasis` handler in.
    #[arg(
        long = "containerd-config",
        env = "STASIS_CONTAINERD_CONFIG",
        value_delimiter = ',',
        default_values = stasis_engine::containerd::DEFAULT_CONFIGS
    )]
    pub containerd_configs: Vec<PathBuf>,
    /// Seconds between node checks (labels) and sweeps of stale plans and images.
    #[arg(long, env = "STASIS_CHECK_INTERVAL", default_value = "60", value_parser = seconds)]
    pub check_interval: Duration,
    /// Seconds a prepared restore plan stays valid.
    #[arg(long, env = "STASIS_PLAN_TTL", default_value = "3600", value_parser = seconds)]
    pub plan_ttl: Duration,
    /// Do not dump established TCP connections.
    #[arg(long)]
    pub no_tcp_established: bool,
    /// Restore lazily where the checkpoint and the node allow it (`auto`): the container runs
    /// before its memory has arrived, which the agent serves until it is all in place; `off`:
    /// every restore fetches all of its memory before the container is created.
    #[arg(long, env = "STASIS_LAZY_RESTORE", value_enum, default_value = "auto")]
    pub lazy_restore: crate::executor::LazyRestore,
    /// Do not keep a reference to each container's latest checkpoint on the node (it makes a
    /// container killed by the OOM killer restart in place from its latest checkpoint, fetched
    /// through the chunk cache; no memory image is kept on the node).
    #[arg(long, env = "STASIS_NO_KEEP_LATEST")]
    pub no_keep_latest: bool,
    /// The node's chunk cache: every checkpoint's chunks as the store has them (compressed,
    /// encrypted, authenticated), read first by restores and restarts in place.
    #[arg(
        long,
        env = "STASIS_CHUNK_CACHE_DIR",
        default_value = "/var/lib/stasis/chunk-cache"
    )]
    pub chunk_cache_dir: PathBuf,
    /// The chunk cache's bound in bytes, least recently used evicted first (default: 10% of the
    /// size of the filesystem that holds it, at least 256 MiB; 0: no cache).
    #[arg(long, env = "STASIS_CHUNK_CACHE_BYTES")]
    pub chunk_cache_bytes: Option<u64>,
    #[command(flatten)]
    pub cloud: Cloud,
    #[command(flatten)]
    pub prestage: Prestage,
    /// No Kubernetes: serve the node API and metrics only.
    #[arg(long, env = "STASIS_STANDALONE")]
    pub standalone: bool,
}

/// Where the key broker is and how to reach it.
#[derive(Debug, Clone, Args)]
pub struct KeyBroker {
    /// The key broker (`https://<controller service>.<namespace>.svc:<port>`): data keys are
    /// asked of stasis-controller, which gives a namespace's only while a pod of it is bound to
    /// this node; the cluster key is then neither needed nor read.
    #[arg(long = "key-broker-url", env = "STASIS_KEY_BROKER_URL")]
    pub url: Option<String>,
    /// PEM CA of the key broker's certificate.
    #[arg(
        long = "key-broker-ca",
        env = "STASIS_KEY_BROKER_CA",
        default_value = "/etc/stasis/key-broker/ca.crt"
    )]
    pub ca: PathBuf,
    /// The agent pod's projected service-account token for the key broker's audience.
    #[arg(
        long = "key-broker-token",
        env = "STASIS_KEY_BROKER_TOKEN",
        default_value = "/var/run/secrets/stasis/key-broker/token"
    )]
    pub token: PathBuf,
}

/// The cloud notice watcher's flags (spot reclaim, preemption, maintenance).
#[derive(Debug, Clone, Args)]
pub struct Cloud {
    /// The cloud whose notices of the node's end (spot reclaim, preemption, maintenance) trigger
    /// checkpoints: auto (from the node's providerID and labels), none, aws, gcp or azure.
    #[arg(
        long = "cloud-provider",
        env = "STASIS_CLOUD_PROVIDER",
        default_value = "auto"
    )]
    pub provider: ProviderChoice,
    /// The cloud's instance metadata service, instead of the provider's own address.
    #[arg(long = "cloud-metadata-url", env = "STASIS_CLOUD_METADATA_URL")]
    pub metadata_url: Option<String>,
    /// Milliseconds between polls of the metadata service (GCP is long-polled).
    #[arg(
        long = "cloud-notice-poll-ms",
        env = "STASIS_CLOUD_NOTICE_POLL_MS",
        default_value_t = 1000
    )]
    pub poll_ms: u64,
}

impl Cloud {
    /// The watcher's settings (a poll at most every 100 ms).
    pub fn settings(&self) -> NoticeSettings {
        NoticeSettings {
            provider: self.provider.clone(),
            metadata_url: self.metadata_url.clone(),
            poll: Duration::from_millis(self.poll_ms.max(100)),
        }
    }
}

/// Pre-staging's flags: other nodes' checkpoints fetched into this node's chunk cache while
/// their node is at risk (cordoned, tainted, disrupted, given a notice).
#[derive(Debug, Clone, Args)]
pub struct Prestage {
    /// Nodes that pre-stage each at-risk pod's latest checkpoint, of the nodes likely to
    /// receive it (0: every one).
    #[arg(
        long = "prestage-receivers",
        env = "STASIS_PRESTAGE_RECEIVERS",
        default_value_t = 3
    )]
    pub receivers: usize,
    /// Checkpoints pre-staged at once (0: no pre-staging).
    #[arg(
        long = "prestage-concurrency",
        env = "STASIS_PRESTAGE_CONCURRENCY",
        default_value_t = 2
    )]
    pub concurrency: usize,
    /// Chunk requests in flight per pre-staged checkpoint (the node's own checkpoints and
    /// restores have 12).
    #[arg(
        long = "prestage-streams",
        env = "STASIS_PRESTAGE_STREAMS",
        default_value_t = 4
    )]
    pub streams: usize,
}

/// `host:port`, or "" for none.
fn address_or_none(s: &str) -> Result<Option<SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|e| format!("{s:?} is not an address (host:port, or \"\" for none): {e}"))
}

/// Whole seconds, at least one.
fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(|n| Duration::from_secs(n.max(1)))
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: Config,
    }

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Cli::try_parse_from(["stasisd", "--store", "file:///s"].iter().chain(args)).map(|c| c.cfg)
    }

    #[test]
    fn flags_become_the_config() {
        let c = parse(&[
            "--metrics-addr=",
            "--check-interval=0",
            "--plan-ttl=90",
            "--key-broker-url=https://broker",
            "--cloud-notice-poll-ms=5",
            "--containerd-config=/a,/b",
            "--prestage-receivers=0",
        ])
        .unwrap();
        assert_eq!(c.metrics_addr, None, "\"\" turns the admin server off");
        assert_eq!(
            c.check_interval,
            Duration::from_secs(1),
            "at least a second"
        );
        assert_eq!(c.plan_ttl, Duration::from_secs(90));
        assert_eq!(c.key_broker.url.as_deref(), Some("https://broker"));
        assert_eq!(c.cloud.settings().poll, Duration::from_millis(100));
        assert_eq!(c.containerd_configs, [PathBuf::from("/a"), "/b".into()]);
        assert_eq!(c.prestage.receivers, 0, "0: every likely receiver");
        let d = parse(&[]).unwrap();
        assert_eq!(d.metrics_addr, Some("0.0.0.0:9464".parse().unwrap()));
        assert_eq!(
            d.cluster_key_file,
            PathBuf::from("/etc/stasis/keys/cluster.key")
        );
        assert!(!d.no_tcp_established && !d.no_keep_latest && !d.standalone);
        assert_eq!(
            (
                d.prestage.receivers,
                d.prestage.concurrency,
                d.prestage.streams
            ),
            (3, 2, 4)
        );
        let bad = parse(&["--metrics-addr=nowhere"]).unwrap_err().to_string();
        assert!(bad.contains("is not an address"), "{bad}");
    }
}
