//! Command line and wiring: the controller (leader-elected reconcilers), the webhook and the
//! metrics server in one process; `wait-restore` for the injected init container.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use crate::leader::{self, LeaseConfig};
use crate::metrics::Metrics;
use crate::reconcile::{self, ControllerConfig, Setup};
use crate::record::Records;
use crate::server;
use crate::wait::{self, WaitArgs};
use crate::webhook::patch::WaitConfig;
use crate::webhook::{Webhook, WebhookConfig};
use stasis_service::admin::Readiness;
use stasis_service::shutdown::Shutdown;
use stasis_service::telemetry::LogArgs;

#[derive(Parser, Debug)]
#[command(
    name = "stasis-controller",
    version,
    about = "stasis controller and admission webhook",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once
pub enum Command {
    /// Run the controller and the webhook (the default).
    Run(RunArgs),
    /// The init container of a restoring pod: wait until its archive is ready on the node.
    WaitRestore(WaitRestoreArgs),
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Namespace stasis runs in (lineage records and the leader lease live there); default: the
    /// service account's namespace (in a pod) or the kubeconfig context's.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// This replica's name (the lease holder identity, the Events' reporting instance);
    /// default: the host name.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// RuntimeClass of opted-in pods.
    #[arg(long, env = "STASIS_RUNTIME_CLASS", default_value = "stasis")]
    pub runtime_class: String,
    /// The admin server (`/metrics`, `/livez`, `/readyz`) and the restore status endpoint.
    #[arg(long, env = "STASIS_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// The webhook's HTTPS listener (`/mutate`).
    #[arg(long, env = "STASIS_WEBHOOK_ADDR", default_value = "0.0.0.0:8443")]
    pub webhook_addr: SocketAddr,
    /// PEM certificate chain of the webhook (the chart mounts it).
    #[arg(
        long,
        env = "STASIS_TLS_CERT",
        default_value = "/etc/stasis/webhook/tls.crt"
    )]
    pub tls_cert: PathBuf,
    /// PEM private key of the webhook.
    #[arg(
        long,
        env = "STASIS_TLS_KEY",
        default_value = "/etc/stasis/webhook/tls.key"
    )]
    pub tls_key: PathBuf,
    /// PEM CA whose client certificates alone may call the webhook: the API server's, given it
    /// through its AdmissionConfiguration kubeconfig for this webhook (docs/design.md §13.3).
    /// Unset: any client (the request cannot be authenticated).
    #[arg(long, env = "STASIS_WEBHOOK_CLIENT_CA")]
    pub webhook_client_ca: Option<PathBuf>,
    /// Serve the webhook over plain HTTP (tests only: the API server requires HTTPS).
    #[arg(long)]
    pub webhook_insecure_http: bool,
    /// Secret (in `--namespace`) holding the cluster key that wraps every namespace's data key.
    /// Checked at start; see `--create-cluster-key`. Unset: not checked (tests).
    #[arg(long, env = "STASIS_CLUSTER_KEY_SECRET")]
    pub cluster_key_secret: Option<String>,
    /// Create the cluster key Secret with a random key when it does not exist (never overwrite
    /// it). Off when the operator brings their own Secret: then a missing one is an error.
    #[arg(long, env = "STASIS_CREATE_CLUSTER_KEY")]
    pub create_cluster_key: bool,
    /// Serve the key broker (`crate::broker`): agents ask it for data keys instead of holding
    /// the cluster key. Needs `--cluster-key-secret` and the TLS certificate of the webhook.
    #[arg(long, env = "STASIS_KEY_BROKER")]
    pub key_broker: bool,
    /// The key broker's HTTPS listener.
    #[arg(long, env = "STASIS_KEY_BROKER_ADDR", default_value = "0.0.0.0:8444")]
    pub key_broker_addr: SocketAddr,
    /// The agents' service account (in `--namespace`): the only one the broker serves.
    #[arg(
        long,
        env = "STASIS_AGENT_SERVICE_ACCOUNT",
        default_value = "stasis-agent"
    )]
    pub agent_service_account: String,
    /// Do not serve the webhook.
    #[arg(long)]
    pub no_webhook: bool,
    /// Path of this binary in the wait image.
    #[arg(
        long,
        env = "STASIS_WAIT_COMMAND",
        default_value = "/usr/local/bin/stasis-controller"
    )]
    pub wait_command: String,
    /// Image of the injected wait container (holds this binary).
    #[arg(
        long,
        env = "STASIS_WAIT_IMAGE",
        default_value = "stasis.local/stasis-controller:dev"
    )]
    pub wait_image: String,
    /// URL at which restoring pods reach this controller's status endpoint (`/v1/restores/...`
    /// on the metrics port, through the controller's Service).
    #[arg(
        long,
        env = "STASIS_STATUS_URL",
        default_value = "http://stasis-controller.stasis-system.svc:8080"
    )]
    pub status_url: String,
    /// Longest wait of a restoring pod for its archive before it starts cold (seconds).
    #[arg(long, env = "STASIS_RESTORE_WAIT_SECONDS", default_value_t = 300)]
    pub restore_wait_seconds: u64,
    /// Longest wait of an admission for a source's in-flight final checkpoint (seconds; keep
    /// under the webhook's timeoutSeconds).
    #[arg(long, env = "STASIS_FINAL_WAIT_SECONDS", default_value_t = 20)]
    pub final_wait_seconds: u64,
    /// After SIGTERM, the webhook and the key broker go on serving this many seconds while
    /// `/readyz` says not ready, so that requests the Service still routes here are answered.
    #[arg(long, env = "STASIS_DRAIN_SECONDS", default_value_t = 5)]
    pub drain_seconds: u64,
    /// A claim whose pod never appeared is released after this many seconds.
    #[arg(long, default_value_t = 120)]
    pub phantom_after_seconds: u64,
    /// The nodes the agents pre-stage each at-risk pod's checkpoint on (the agents'
    /// `--prestage-receivers`): a restoring pod prefers them. 0: no preference.
    #[arg(long, env = "STASIS_PRESTAGE_RECEIVERS", default_value_t = 3)]
    pub prestage_receivers: usize,
    /// A pending or running checkpoint without progress for this long is marked failed.
    #[arg(long, default_value_t = 900)]
    pub checkpoint_timeout_seconds: u64,
    /// At most this many lineage records per workload namespace: past it no new lineage is
    /// started (the pod runs without checkpoints, with a Warning Event).
    #[arg(long, env = "STASIS_MAX_RECORDS_PER_NAMESPACE", default_value_t = crate::record::DEFAULT_MAX_RECORDS_PER_NAMESPACE)]
    pub max_records_per_namespace: usize,
    /// An orphaned lineage without checkpoints whose pod is gone is deleted this many seconds
    /// after it was orphaned.
    #[arg(long, default_value_t = 600)]
    pub collect_records_after_seconds: u64,
    /// Store URL for deleting manifests by retention (`s3://bucket/prefix`, `file:///dir`;
    /// S3 credentials from the usual AWS_* variables). Without it only the CRs are deleted.
    #[arg(long, env = "STASIS_STORE_URL")]
    pub store_url: Option<String>,
    /// Chunk garbage collection of the store (`crate::gc`, leader only) every this many
    /// seconds; 0: none. Needs `--store-url` and `--cluster-key-secret`.
    #[arg(long, env = "STASIS_GC_INTERVAL_SECONDS", default_value_t = 0)]
    pub gc_interval_seconds: u64,
    /// Unreferenced chunks younger than this many seconds are left by the collection.
    #[arg(long, env = "STASIS_GC_GRACE_SECONDS", default_value_t = 3600)]
    pub gc_grace_seconds: u64,
    /// Leader lease name.
    #[arg(long, default_value = "stasis-controller")]
    pub lease_name: String,
    /// Lease duration (seconds).
    #[arg(long, default_value_t = 15)]
    pub lease_seconds: u64,
}

#[derive(Args, Debug, Clone)]
pub struct WaitRestoreArgs {
    #[arg(long, env = "STASIS_STATUS_URL")]
    pub status_url: String,
    #[arg(long, env = "STASIS_POD_NAMESPACE")]
    pub namespace: String,
    #[arg(long, env = "STASIS_POD_NAME")]
    pub pod: String,
    /// The pod's UID (downward API `metadata.uid`): the status endpoint answers only to it. A
    /// wait container injected by an older webhook has none: it does not wait (the pod starts,
    /// restoring if the node's agent has the restore ready, cold otherwise).
    #[arg(long, env = "STASIS_POD_UID", default_value = "")]
    pub uid: String,
    #[arg(long, default_value_t = 300)]
    pub timeout_seconds: u64,
    /// Give up when the controller stays unreachable this long.
    #[arg(long, default_value_t = 30)]
    pub unreachable_seconds: u64,
}

/// `wait-restore`: always succeeds (the pod starts either way).
pub fn wait_restore(a: &WaitRestoreArgs) {
    let why = wait::run(&WaitArgs {
        url: a.status_url.clone(),
        namespace: a.namespace.clone(),
        pod: a.pod.clone(),
        uid: a.uid.clone(),
        timeout: Duration::from_secs(a.timeout_seconds),
        unreachable: Duration::from_secs(a.unreachable_seconds),
    });
    eprintln!("stasis-restore-wait: {why}");
}

/// What serves the API server and the agents (the webhook, the key broker) stops `drain`
/// after `shutdown`, and `ready` turns false at once. A replica is stopped by the kubelet
/// without being deleted when its node shuts down gracefully: its endpoint stays in the
/// Service until the kubelet reports it not ready, and an admission routed to it in that
/// window failed open (the pod started cold) when the server stopped on the signal.
fn drain_after(shutdown: &Shutdown, ready: &Readiness, drain: Duration) -> Shutdown {
    let serving = Shutdown::new();
    let (stop, ready, done) = (shutdown.clone(), ready.clone(), serving.clone());
    tokio::spawn(async move {
        stop.wait().await;
        ready.set(false);
        tracing::info!(
            ?drain,
            "stopping: still serving admissions and keys while the Service forgets this replica"
        );
        tokio::time::sleep(drain).await;
        done.trigger();
    });
    serving
}

/// Runs the webhook and metrics servers on every replica, and the reconcilers while this
/// replica holds the lease. Returns when the reconcilers stop (`shutdown`: the binary's
/// SIGTERM or SIGINT; a follower waiting for the lease stops on it too) or leadership is lost.
pub async fn run(a: RunArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    // Both of rustls's providers are linked (the store's HTTP client brings aws-lc-rs); the
    // process uses ring, like the Kubernetes client.
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default().await?;
    let namespace = a
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let identity = a
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "stasis-controller".to_owned());
    tracing::info!(%namespace, %identity, "starting");
    if let Some(name) = &a.cluster_key_secret {
        let outcome =
            crate::cluster_key::ensure(&client, &namespace, name, a.create_cluster_key).await?;
        tracing::info!(secret = %name, ?outcome, "cluster key");
    }
    let metrics = Metrics::default();
    // Every replica keeps the PodCheckpoints in a watch cache: the webhook's claims read it
    // (instead of listing a namespace per admission), and the leader's reconcilers share it.
    let (checkpoints, watch) = crate::cache::Checkpoints::watch(client.clone());
    tokio::spawn(watch);
    // And the metadata of ReplicaSets and Deployments: a pod's owners, verified at each
    // admission and registration, read without a request (crate::owners).
    let (owners, watch) = crate::owners::OwnerCache::watch(client.clone());
    tokio::spawn(watch);
    // And the lineage records: the admission's prediction reads its workload's from it, as the
    // leader's reconcilers do (the commit reads them fresh from the API server).
    let (records, watch) = crate::cache::RecordCache::watch(client.clone(), &namespace, {
        let metrics = metrics.clone();
        move |e| metrics.failed("records", e)
    });
    tokio::spawn(watch);
    // Ready once the servers are up: what a replica serves (the webhook, the restore status,
    // the key broker) reads the API server directly; the reconcilers' caches are the leader's.
    let ready = Readiness::default();
    let serving = drain_after(&shutdown, &ready, Duration::from_secs(a.drain_seconds));
    if a.key_broker {
        let name = a.cluster_key_secret.as_deref().ok_or_else(|| {
            anyhow::anyhow!("--key-broker needs --cluster-key-secret (the key it unwraps with)")
        })?;
        let ring = crate::broker::load_ring(&client, &namespace, name).await?;
        tracing::info!(cluster_key = %ring.id(), retired = ?ring.retired_ids(), "key broker: cluster key loaded");
        let tls =
            server::tls_acceptor(&a.tls_cert, &a.tls_key, None).map_err(anyhow::Error::msg)?;
        let broker = Arc::new(crate::broker::Broker::new(
            client.clone(),
            &namespace,
            &format!(
                "system:serviceaccount:{namespace}:{}",
                a.agent_service_account
            ),
            &a.runtime_class,
            ring,
        ));
        let (addr, metrics, stop) = (a.key_broker_addr, metrics.clone(), serving.clone());
        tokio::spawn(async move {
            if let Err(e) = server::serve_broker(addr, tls, broker, metrics, stop).await {
                tracing::error!(error = %e, "key broker");
            }
        });
    }
    let admin = stasis_service::admin::bind(a.metrics_addr).await?;
    tokio::spawn(server::serve_metrics(
        admin,
        metrics.clone(),
        ready.clone(),
        client.clone(),
        shutdown.clone(),
    ));
    if !a.no_webhook {
        let tls = if a.webhook_insecure_http {
            None
        } else {
            let client_ca = a.webhook_client_ca.as_deref();
            Some(
                server::tls_acceptor(&a.tls_cert, &a.tls_key, client_ca)
                    .map_err(anyhow::Error::msg)?,
            )
        };
        use stasis_api::cache::watch_all;
        let (policies, watch) = watch_all::<stasis_api::CheckpointPolicy, _>(client.clone(), || {});
        tokio::spawn(watch);
        let nodes = (a.prestage_receivers > 0).then(|| {
            let (nodes, watch) =
                watch_all::<k8s_openapi::api::core::v1::Node, _>(client.clone(), || {});
            tokio::spawn(watch);
            nodes
        });
        let hook = Arc::new(Webhook {
            client: client.clone(),
            records: Records::new(client.clone(), &namespace).with_cap(a.max_records_per_namespace),
            checkpoints: checkpoints.clone(),
            record_index: Some(records.index.clone()),
            policies: Some(policies),
            nodes,
            owners: Some(owners.clone()),
            metrics: metrics.clone(),
            cfg: WebhookConfig {
                runtime_class: a.runtime_class.clone(),
                wait: WaitConfig {
                    image: a.wait_image.clone(),
                    command: a.wait_command.clone(),
                    status_url: a.status_url.clone(),
                    timeout_seconds: a.restore_wait_seconds,
                },
                final_wait: Duration::from_secs(a.final_wait_seconds),
                phantom_after: Duration::from_secs(a.phantom_after_seconds),
                prestage_receivers: a.prestage_receivers,
            },
        });
        let addr = a.webhook_addr;
        let stop = serving.clone();
        tokio::spawn(async move {
            if let Err(e) = server::serve_webhook(addr, tls, hook, stop).await {
                tracing::error!(error = %e, "webhook server");
            }
        });
    }
    let store = match &a.store_url {
        Some(url) => Some(stasis_store::Store::open(url)?),
        None => None,
    };
    let gc = gc_setup(&a, &client, &namespace)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let lease = LeaseConfig {
        namespace: namespace.clone(),
        name: a.lease_name.clone(),
        identity: identity.clone(),
        duration: Duration::from_secs(a.lease_seconds),
        renew_every: Duration::from_secs((a.lease_seconds / 3).max(1)),
    };
    ready.set(true);
    tracing::info!(identity = %lease.identity, lease = %lease.name, "waiting for the leader lease");
    tokio::select! {
        _ = leader::acquire(&leases, &lease) => {}
        _ = shutdown.wait() => {
            serving.wait().await;
            return Ok(());
        }
    }
    metrics.leader.set(1);
    tracing::info!(identity = %lease.identity, "leading");
    if let Some(gc) = gc {
        tokio::spawn(crate::gc::run(gc, metrics.clone(), shutdown.clone()));
    }
    let setup = Setup {
        client,
        namespace: namespace.clone(),
        identity: identity.clone(),
        metrics: metrics.clone(),
        cfg: ControllerConfig {
            runtime_class: a.runtime_class.clone(),
            in_flight_timeout: Duration::from_secs(a.checkpoint_timeout_seconds),
            phantom_after: Duration::from_secs(a.phantom_after_seconds),
            final_wait: Duration::from_secs(a.final_wait_seconds),
            sweep_every: Duration::from_secs(15),
            collect_records_after: Duration::from_secs(a.collect_records_after_seconds),
            max_records_per_namespace: a.max_records_per_namespace,
        },
        store,
        checkpoints,
        owners: Some(owners),
        records,
        shutdown: shutdown.clone(),
    };
    tokio::select! {
        r = reconcile::run(setup) => {
            // Stopped by a signal: hand the lease over now.
            metrics.leader.set(0);
            leader::release(&leases, &lease).await;
            r?;
            serving.wait().await;
        }
        lost = leader::keep(&leases, &lease) => {
            metrics.leader.set(0);
            return Err(anyhow::anyhow!("{lost}: exiting so a new leader takes over"));
        }
    }
    Ok(())
}

/// The chunk collection's setup, when `--gc-interval-seconds` asks for one.
fn gc_setup(
    a: &RunArgs,
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<Option<crate::gc::GcSetup>> {
    if a.gc_interval_seconds == 0 {
        return Ok(None);
    }
    let (Some(url), Some(secret)) = (&a.store_url, &a.cluster_key_secret) else {
        anyhow::bail!("--gc-interval-seconds needs --store-url (the store to collect) and --cluster-key-secret (the key that unwraps the namespaces' data keys)");
    };
    Ok(Some(crate::gc::GcSetup {
        client: client.clone(),
        namespace: namespace.to_owned(),
        cluster_key_secret: secret.clone(),
        store: stasis_store::Store::open(url)?,
        interval: Duration::from_secs(a.gc_interval_seconds),
        grace: Duration::from_secs(a.gc_grace_seconds),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stopping replica says not ready at once and serves for the drain, then stops.
    #[tokio::test]
    async fn the_servers_outlive_the_signal_by_the_drain() {
        let shutdown = Shutdown::new();
        let ready = Readiness::ready();
        let serving = drain_after(&shutdown, &ready, Duration::from_millis(300));
        let t = std::time::Instant::now();
        shutdown.trigger();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!ready.is_ready(), "not ready once the signal came");
        assert!(!serving.is_triggered(), "still serving during the drain");
        tokio::time::timeout(Duration::from_secs(5), serving.wait())
            .await
            .expect("the servers stop after the drain");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn command_lines() {
        let c = Cli::try_parse_from(["stasis-controller", "run", "--no-webhook", "--lease-name=x"])
            .unwrap();
        match c.command {
            Some(Command::Run(a)) => assert!(a.no_webhook && a.lease_name == "x"),
            other => panic!("{other:?}"),
        }
        let c = Cli::try_parse_from(["stasis-controller", "--no-webhook"]).unwrap();
        assert!(c.command.is_none() && c.run.no_webhook);
        let c = Cli::try_parse_from([
            "stasis-controller",
            "wait-restore",
            "--status-url=http://x:8080",
            "--namespace=n",
            "--pod=p",
            "--uid=u-1",
            "--timeout-seconds=5",
        ])
        .unwrap();
        assert!(matches!(c.command, Some(Command::WaitRestore(ref w)) if w.timeout_seconds == 5));
        // The shared logging flags, and the older `--log-json` the chart may still set.
        use stasis_service::telemetry::LogFormat;
        let c = Cli::try_parse_from(["stasis-controller", "--log-json"]).unwrap();
        assert_eq!(c.log.format(), LogFormat::Json);
        let c = Cli::try_parse_from(["stasis-controller", "run", "--log-format=json"]).unwrap();
        assert_eq!(c.log.format(), LogFormat::Json);
        let c = Cli::try_parse_from(["stasis-controller"]).unwrap();
        assert_eq!(c.log.format(), LogFormat::Text);
    }
}
