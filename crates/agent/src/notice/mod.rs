//! Watches this node's cloud for notices that the node is about to go (spot reclaim,
//! preemption, maintenance) and acts on them at once: a checkpoint of every opted-in pod of the
//! node whose policy wants notices, most valuable first, each with the time left before the
//! deadline; the node's `stasis.dev/ready` label withdrawn (and `stasis.dev/notice=<kind>` set)
//! so that opted-in replacements, which the RuntimeClass schedules only onto ready nodes, land
//! elsewhere; on Azure, the event is acknowledged (allowed to start early) only once those
//! checkpoints ended.
//!
//! The provider comes from the node (its `providerID` and labels, [`Provider::of_node`]) or the
//! `--cloud-provider` flag; its metadata service is asked as each provider documents it
//! (`stasis_core::notice`). The service's address can be overridden (`--cloud-metadata-url`):
//! the tests and the local cluster use a stand-in that speaks the providers' documented
//! requests and answers, since no cloud is reachable there.

mod act;
mod metadata;
mod targets;

pub use act::NoticeContext;
pub use metadata::{MetadataClient, NoticeError};
pub use targets::notice_targets;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::{Client, ResourceExt};
use stasis_core::notice::Provider;
use tracing::{info, warn};

/// Set once this node's end was announced: the node-readiness loop then keeps the node's
/// `stasis.dev/ready` label withdrawn (one agent per node and process).
static NODE_ENDING: AtomicBool = AtomicBool::new(false);

/// Whether this node's cloud announced its end.
pub fn node_ending() -> bool {
    NODE_ENDING.load(Ordering::SeqCst)
}

/// The provider of this node: the flag's, else the node's own.
pub async fn node_provider(client: &Client, node: &str) -> Option<Provider> {
    let api: Api<Node> = Api::all(client.clone());
    let n = api.get(node).await.ok()?;
    Provider::of_node(
        n.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
        n.labels().iter().map(|(k, v)| (k.as_str(), v.as_str())),
    )
}

/// Polls the metadata service until `stop`, acting once on each new notice.
pub async fn watch(
    ctx: Arc<NoticeContext>,
    mut mc: MetadataClient,
    period: Duration,
    stop: Arc<AtomicBool>,
) {
    info!(
        provider = mc.provider().name(),
        "watching the cloud's notices for this node"
    );
    let mut seen = HashSet::new();
    let mut failing = false;
    while !stop.load(Ordering::Relaxed) {
        match mc.poll().await {
            Ok(notices) => {
                if failing {
                    info!("the metadata service answers again");
                    failing = false;
                }
                for n in notices {
                    if seen.insert(n.id.clone()) {
                        warn!(provider = n.provider.name(), notice = %n.detail, id = %n.id, "the cloud announced this node's end");
                        let (ctx, n) = (ctx.clone(), n.clone());
                        // Checkpoints start at once; the next poll does not wait for them.
                        let mc2 = MetadataClient::new(mc.provider(), Some(&mc.base));
                        tokio::spawn(async move { ctx.act(&mc2, &n).await });
                    }
                }
            }
            Err(e) => {
                if !failing {
                    warn!(error = %e, "cannot read the cloud's notices (retrying)");
                    failing = true;
                }
                ctx.metrics.error("notice");
            }
        }
        if mc.provider() != Provider::Gcp {
            tokio::time::sleep(period).await;
        }
    }
}

/// Which cloud to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderChoice {
    /// From the node's providerID and labels; no watcher where they name no known cloud.
    Auto,
    /// No watcher.
    Off,
    Given(Provider),
}

impl std::str::FromStr for ProviderChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(ProviderChoice::Auto),
            "none" | "off" => Ok(ProviderChoice::Off),
            other => Provider::parse(other)
                .map(ProviderChoice::Given)
                .ok_or_else(|| {
                    format!("unknown cloud provider {other:?}: auto, none, aws, gcp or azure")
                }),
        }
    }
}

/// The watcher's settings (flags `--cloud-provider`, `--cloud-metadata-url`,
/// `--cloud-notice-poll-ms`).
#[derive(Debug, Clone)]
pub struct NoticeSettings {
    pub provider: ProviderChoice,
    /// The metadata service's base URL instead of the provider's own.
    pub metadata_url: Option<String>,
    /// Time between polls (GCP long-polls instead).
    pub poll: Duration,
}

/// Starts watching, unless no cloud is configured or recognised (said once in the log).
pub async fn run(cluster: Arc<crate::k8s::KubeCluster>, s: NoticeSettings, stop: Arc<AtomicBool>) {
    // A notice of an earlier life of this node (a maintenance reboot it came back from) is
    // over: its mark goes.
    let clear = BTreeMap::from([(stasis_api::names::node::NOTICE.to_owned(), None)]);
    if let Err(e) = crate::k8s::patch_node_labels(&cluster.client, &cluster.node, &clear).await {
        warn!(node = %cluster.node, error = %e, "cannot clear an earlier notice's label");
    }
    let provider = match &s.provider {
        ProviderChoice::Off => return,
        ProviderChoice::Given(p) => *p,
        ProviderChoice::Auto => match node_provider(&cluster.client, &cluster.node).await {
            Some(p) => p,
            None => {
                info!(node = %cluster.node, "no cloud recognised from the node's providerID and labels: not watching for cloud notices (--cloud-provider names one)");
                return;
            }
        },
    };
    let ctx = Arc::new(NoticeContext {
        client: cluster.client.clone(),
        node: cluster.node.clone(),
        runtime_class: cluster.runtime_class.clone(),
        pods: cluster.pods.clone(),
        policies: cluster.policies.clone(),
        metrics: cluster.exec.metrics.clone(),
    });
    let mc = MetadataClient::new(provider, s.metadata_url.as_deref());
    watch(ctx, mc, s.poll, stop).await;
}
