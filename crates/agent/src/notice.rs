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

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use stasis_api::{
    CheckpointPhase, CheckpointPolicy, CheckpointReason, PodCheckpoint, PodCheckpointSpec,
};
use stasis_core::notice::{self, Candidate, Notice, NoticeKind, Provider};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::status::PodKey;

/// The label a node gets once its cloud announced its end (the value: the notice's kind).
pub const NOTICE_LABEL: &str = "stasis.dev/notice";

/// Set once this node's end was announced: the node-readiness loop then keeps the node's
/// `stasis.dev/ready` label withdrawn (one agent per node and process).
static NODE_ENDING: AtomicBool = AtomicBool::new(false);

/// Whether this node's cloud announced its end.
pub fn node_ending() -> bool {
    NODE_ENDING.load(Ordering::SeqCst)
}

/// Where each provider's metadata service answers.
fn default_base(p: Provider) -> &'static str {
    match p {
        Provider::Aws | Provider::Azure => "http://169.254.169.254",
        Provider::Gcp => "http://metadata.google.internal",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NoticeError {
    #[error("{provider} metadata service at {url}: {source}")]
    Http {
        provider: &'static str,
        url: String,
        source: reqwest::Error,
    },
    #[error("{provider} metadata service at {url} answered {status}")]
    Status {
        provider: &'static str,
        url: String,
        status: u16,
    },
    #[error(transparent)]
    Malformed(#[from] notice::MalformedAnswer),
}

/// Asks one provider's metadata service for notices.
pub struct MetadataClient {
    provider: Provider,
    base: String,
    http: reqwest::Client,
    /// AWS IMDSv2 session token and when it was taken.
    aws_token: Option<(String, std::time::Instant)>,
    /// GCP: the ETag of each long-polled value, so `wait_for_change` waits for a new one.
    gcp_etags: BTreeMap<&'static str, String>,
    /// Azure: this VM's name (Scheduled Events name the VMs they affect).
    azure_vm: Option<String>,
}

const AWS_TOKEN_TTL_S: u64 = 21_600;
/// How long one GCP long poll waits for a change before asking again.
const GCP_WAIT_S: u64 = 20;

impl MetadataClient {
    pub fn new(provider: Provider, base: Option<&str>) -> Self {
        let http = reqwest::Client::builder()
            // The link-local service answers at once or not at all; GCP's long polls set
            // their own, longer timeout per request.
            .connect_timeout(Duration::from_secs(2))
            .no_proxy()
            .build()
            .expect("an HTTP client without TLS or proxy always builds");
        Self {
            provider,
            base: base
                .unwrap_or(default_base(provider))
                .trim_end_matches('/')
                .to_owned(),
            http,
            aws_token: None,
            gcp_etags: BTreeMap::new(),
            azure_vm: None,
        }
    }

    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Sends a request (headers, timeout) and reads the whole answer.
    async fn send(
        &self,
        method: reqwest::Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
        timeout: Duration,
    ) -> Result<Answer, NoticeError> {
        let mut req = self.http.request(method, url).timeout(timeout);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.header("Content-Type", "application/json").body(b);
        }
        let http = |source| NoticeError::Http {
            provider: self.provider.name(),
            url: url.to_owned(),
            source,
        };
        let r = req.send().await.map_err(http)?;
        let status = r.status().as_u16();
        // Only an ETag of hex digits goes back into a URL.
        let etag = r
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .filter(|e| e.len() <= 64 && e.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(str::to_owned);
        let body = r.text().await.map_err(http)?;
        Ok(Answer {
            url: url.to_owned(),
            status,
            etag,
            body,
        })
    }

    /// A GET whose answer must be a success.
    async fn get_ok(&self, url: &str, headers: &[(&str, &str)]) -> Result<Answer, NoticeError> {
        let a = self
            .send(
                reqwest::Method::GET,
                url,
                headers,
                None,
                Duration::from_secs(5),
            )
            .await?;
        self.success(a)
    }

    fn success(&self, a: Answer) -> Result<Answer, NoticeError> {
        if (200..300).contains(&a.status) {
            Ok(a)
        } else {
            Err(NoticeError::Status {
                provider: self.provider.name(),
                url: a.url,
                status: a.status,
            })
        }
    }

    /// One round: every notice the provider states now.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        match self.provider {
            Provider::Aws => self.poll_aws().await,
            Provider::Gcp => self.poll_gcp().await,
            Provider::Azure => self.poll_azure().await,
        }
    }

    async fn aws_token(&mut self) -> Result<String, NoticeError> {
        if let Some((t, at)) = &self.aws_token {
            if at.elapsed() < Duration::from_secs(AWS_TOKEN_TTL_S / 2) {
                return Ok(t.clone());
            }
        }
        let url = format!("{}/latest/api/token", self.base);
        let ttl = AWS_TOKEN_TTL_S.to_string();
        let a = self
            .send(
                reqwest::Method::PUT,
                &url,
                &[("X-aws-ec2-metadata-token-ttl-seconds", &ttl)],
                None,
                Duration::from_secs(5),
            )
            .await?;
        let t = self.success(a)?.body;
        self.aws_token = Some((t.clone(), std::time::Instant::now()));
        Ok(t)
    }

    /// An AWS metadata path: `Some(body)` on 200, `None` on 404 (nothing announced).
    async fn aws_get(&mut self, path: &str) -> Result<Option<String>, NoticeError> {
        let token = self.aws_token().await?;
        let url = format!("{}/latest/meta-data/{path}", self.base);
        let a = self
            .send(
                reqwest::Method::GET,
                &url,
                &[("X-aws-ec2-metadata-token", &token)],
                None,
                Duration::from_secs(5),
            )
            .await?;
        match a.status {
            404 => Ok(None),
            401 => {
                // The token expired or the service restarted: a new one next round.
                self.aws_token = None;
                self.success(a).map(|_| None)
            }
            _ => Ok(Some(self.success(a)?.body)),
        }
    }

    async fn poll_aws(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let mut out = Vec::new();
        if let Some(b) = self.aws_get("spot/instance-action").await? {
            out.push(notice::aws_instance_action(&b)?);
        }
        if let Some(b) = self.aws_get("events/recommendations/rebalance").await? {
            out.push(notice::aws_rebalance(&b)?);
        }
        if let Some(b) = self.aws_get("events/maintenance/scheduled").await? {
            out.extend(notice::aws_scheduled_events(&b)?);
        }
        Ok(out)
    }

    /// A GCP value, long-polled: answers when it changes (or after [`GCP_WAIT_S`]).
    async fn gcp_get(&self, key: &str) -> Result<Answer, NoticeError> {
        let mut url = format!(
            "{}/computeMetadata/v1/instance/{key}?wait_for_change=true&timeout_sec={GCP_WAIT_S}",
            self.base
        );
        if let Some(e) = self.gcp_etags.get(key) {
            url.push_str("&last_etag=");
            url.push_str(e);
        }
        let a = self
            .send(
                reqwest::Method::GET,
                &url,
                &[("Metadata-Flavor", "Google")],
                None,
                Duration::from_secs(GCP_WAIT_S + 10),
            )
            .await?;
        self.success(a)
    }

    async fn poll_gcp(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let now = now_unix_ms();
        // Both values long-polled at once; whichever changes first answers (the other request
        // is dropped and asked again next round, its last ETag unchanged).
        let (key, answer) = {
            let pre = self.gcp_get("preempted");
            let maint = self.gcp_get("maintenance-event");
            tokio::pin!(pre, maint);
            tokio::select! {
                r = &mut pre => ("preempted", r),
                r = &mut maint => ("maintenance-event", r),
            }
        };
        let a = answer?;
        if let Some(e) = a.etag {
            self.gcp_etags.insert(key, e);
        }
        Ok(if key == "preempted" {
            notice::gcp_preempted(&a.body, now)?.into_iter().collect()
        } else {
            notice::gcp_maintenance_event(&a.body)?
                .into_iter()
                .collect()
        })
    }

    fn azure_events_url(&self) -> String {
        format!(
            "{}/metadata/scheduledevents?api-version=2020-07-01",
            self.base
        )
    }

    async fn poll_azure(&mut self) -> Result<Vec<Notice>, NoticeError> {
        if self.azure_vm.is_none() {
            let url = format!(
                "{}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                self.base
            );
            let name = self.get_ok(&url, &[("Metadata", "true")]).await?.body;
            self.azure_vm = Some(name.trim().to_owned());
        }
        let a = self
            .get_ok(&self.azure_events_url(), &[("Metadata", "true")])
            .await?;
        Ok(notice::azure_scheduled_events(
            &a.body,
            self.azure_vm.as_deref().unwrap_or_default(),
        )?)
    }

    /// Lets an Azure event start now (its checkpoints are done); nothing elsewhere.
    pub async fn acknowledge(&self, n: &Notice) -> Result<(), NoticeError> {
        if n.provider != Provider::Azure {
            return Ok(());
        }
        let body = serde_json::json!({"StartRequests": [{"EventId": n.id}]});
        let a = self
            .send(
                reqwest::Method::POST,
                &self.azure_events_url(),
                &[("Metadata", "true")],
                Some(body.to_string()),
                Duration::from_secs(5),
            )
            .await?;
        self.success(a).map(drop)
    }
}

/// A metadata service's answer, read whole.
#[derive(Debug)]
struct Answer {
    url: String,
    status: u16,
    etag: Option<String>,
    body: String,
}

/// Memory of a pod's containers (limits, else requests), bytes.
fn pod_memory(pod: &Pod) -> u64 {
    let qty = |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| {
        notice::memory_quantity_bytes(&q.0).unwrap_or(0)
    };
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .filter_map(|c| c.resources.as_ref())
        .map(|r| {
            r.limits
                .as_ref()
                .and_then(|l| l.get("memory"))
                .or_else(|| r.requests.as_ref().and_then(|l| l.get("memory")))
                .map(qty)
                .unwrap_or(0)
        })
        .sum()
}

fn pod_uses_gpu(pod: &Pod) -> bool {
    pod.spec.iter().flat_map(|s| s.containers.iter()).any(|c| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.keys().any(|k| k.ends_with("/gpu")))
    })
}

/// The pods of `node` a notice checkpoints, most valuable first: running, opted in through the
/// RuntimeClass, selected by a policy of their namespace that wants notices.
pub fn notice_targets(
    pods: &[Arc<Pod>],
    policies: &[Arc<CheckpointPolicy>],
    node: &str,
    runtime_class: &str,
) -> Vec<PodKey> {
    let candidates = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_deref())
                == Some(runtime_class)
        })
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| {
            let ns = p.namespace().unwrap_or_default();
            policies.iter().any(|pol| {
                pol.metadata.namespace.as_deref() == Some(ns.as_str())
                    && pol.spec.triggers.spot_notice
                    && crate::selector::matches(&pol.spec.selector, p.labels())
            })
        })
        .map(|p| Candidate {
            key: PodKey {
                namespace: p.namespace().unwrap_or_default(),
                name: p.name_any(),
                uid: p.metadata.uid.clone().unwrap_or_default(),
            },
            uses_gpu: pod_uses_gpu(p),
            memory_bytes: pod_memory(p),
            started_unix_ms: p
                .status
                .as_ref()
                .and_then(|s| s.start_time.as_ref())
                .map(|t| t.0.as_millisecond())
                .unwrap_or(0),
        })
        .collect();
    notice::most_valuable_first(candidates)
        .into_iter()
        .map(|c| c.key)
        .collect()
}

/// What the watcher needs of the cluster.
pub struct NoticeContext {
    pub client: Client,
    pub node: String,
    pub runtime_class: String,
    pub pods: Store<Pod>,
    pub policies: Store<CheckpointPolicy>,
    pub metrics: Arc<Metrics>,
}

fn reason_of(kind: NoticeKind) -> CheckpointReason {
    match kind {
        NoticeKind::Reclaim | NoticeKind::RebalanceRecommendation => CheckpointReason::SpotNotice,
        NoticeKind::Maintenance => CheckpointReason::MaintenanceNotice,
    }
}

impl NoticeContext {
    /// Creates the checkpoints a notice asks for; returns their names (namespace, name).
    async fn checkpoint_all(&self, n: &Notice) -> Vec<(String, String)> {
        let targets = notice_targets(
            &self.pods.state(),
            &self.policies.state(),
            &self.node,
            &self.runtime_class,
        );
        let budget = notice::checkpoint_budget_s(n.deadline_unix_ms, now_unix_ms(), 600);
        let mut made = Vec::new();
        for pod in targets {
            let api: Api<PodCheckpoint> = Api::namespaced(self.client.clone(), &pod.namespace);
            let base: String = pod.name.chars().take(200).collect();
            let name = format!("{base}-notice-{:08x}", rand::random::<u32>());
            let mut c = PodCheckpoint::new(
                &name,
                PodCheckpointSpec {
                    source_pod_name: pod.name.clone(),
                    source_pod_uid: Some(pod.uid.clone()),
                    reason: reason_of(n.kind),
                    timeout_seconds: Some(budget.min(3600) as i32),
                },
            );
            // Executed by this agent's own PodCheckpoint watcher like any other (so without
            // the created-by label, which marks the records it keeps of checkpoints it ran
            // itself); the node label lets the API server accept it from this node's agent.
            c.metadata.labels = Some(BTreeMap::from([(
                stasis_api::lineage::NODE_LABEL.to_owned(),
                self.node.clone(),
            )]));
            match api.create(&PostParams::default(), &c).await {
                Ok(_) => {
                    info!(pod = %pod.name, namespace = %pod.namespace, checkpoint = %name, notice = %n.detail, "checkpoint on the cloud's notice");
                    self.event(
                        &pod,
                        &format!(
                            "{} announced {} of node {}{}: checkpoint {name} started",
                            n.provider.name(),
                            n.detail,
                            self.node,
                            deadline_text(n)
                        ),
                    )
                    .await;
                    made.push((pod.namespace.clone(), name));
                }
                Err(e) => {
                    warn!(pod = %pod.name, error = %e, "cannot create the checkpoint a notice asks for");
                    self.metrics.error("kube");
                }
            }
        }
        made
    }

    async fn event(&self, pod: &PodKey, message: &str) {
        let api: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client.clone(), &pod.namespace);
        let ev = crate::status::pod_event(
            pod,
            "CloudNotice",
            message,
            true,
            &self.node,
            crate::status::now(),
        );
        if let Err(e) = api.create(&PostParams::default(), &ev).await {
            warn!(pod = %pod.name, error = %e, "cannot create an Event");
        }
    }

    /// Marks the node: `stasis.dev/notice=<kind>`, `stasis.dev/ready` withdrawn (and kept so).
    async fn mark_node(&self, n: &Notice) -> crate::Result<()> {
        NODE_ENDING.store(true, Ordering::SeqCst);
        let labels = BTreeMap::from([
            (crate::checks::READY_LABEL.to_owned(), None),
            (NOTICE_LABEL.to_owned(), Some(n.kind.name().to_owned())),
        ]);
        crate::kube::patch_node_labels(&self.client, &self.node, &labels).await
    }

    /// Waits until every checkpoint has ended (succeeded or failed) or the deadline is near.
    async fn wait_ended(&self, made: &[(String, String)], n: &Notice) {
        let end = match n.deadline_unix_ms {
            Some(d) => d - 2_000,
            None => now_unix_ms() + 600_000,
        };
        let mut left: HashSet<&(String, String)> = made.iter().collect();
        while !left.is_empty() && now_unix_ms() < end {
            let mut done = Vec::new();
            for k in &left {
                let api: Api<PodCheckpoint> = Api::namespaced(self.client.clone(), &k.0);
                match api.get_opt(&k.1).await {
                    Ok(Some(c)) => {
                        let phase = c.status.as_ref().and_then(|s| s.phase);
                        if matches!(
                            phase,
                            Some(CheckpointPhase::Succeeded) | Some(CheckpointPhase::Failed)
                        ) {
                            done.push(*k);
                        }
                    }
                    Ok(None) => done.push(*k),
                    Err(_) => {}
                }
            }
            for k in done {
                left.remove(k);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Everything a new notice asks for.
    async fn act(&self, mc: &MetadataClient, n: &Notice) {
        self.metrics.notice(n.kind.name());
        // The mark first: opted-in pods stop landing here while the checkpoints run.
        if n.kind.node_ends() {
            if let Err(e) = self.mark_node(n).await {
                warn!(node = %self.node, error = %e, "cannot mark the node after a cloud notice");
                self.metrics.error("kube");
            }
        }
        let made = self.checkpoint_all(n).await;
        if n.provider == Provider::Azure {
            self.wait_ended(&made, n).await;
            match mc.acknowledge(n).await {
                Ok(()) => {
                    info!(event = %n.id, "acknowledged the scheduled event: its checkpoints ended")
                }
                Err(e) => {
                    warn!(event = %n.id, error = %e, "cannot acknowledge the scheduled event")
                }
            }
        }
    }
}

fn now_unix_ms() -> i64 {
    crate::executor::now_ms() as i64
}

fn deadline_text(n: &Notice) -> String {
    match n.deadline_unix_ms {
        Some(d) => {
            let left = (d - now_unix_ms()) / 1000;
            format!(" (in {left} s)")
        }
        None => String::new(),
    }
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
pub async fn run(cluster: Arc<crate::kube::KubeCluster>, s: NoticeSettings, stop: Arc<AtomicBool>) {
    // A notice of an earlier life of this node (a maintenance reboot it came back from) is
    // over: its mark goes.
    let clear = BTreeMap::from([(NOTICE_LABEL.to_owned(), None)]);
    if let Err(e) = crate::kube::patch_node_labels(&cluster.client, &cluster.node, &clear).await {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, node: &str, rc: &str, phase: &str, mem: &str, gpu: bool) -> Arc<Pod> {
        let mut limits = json!({"memory": mem});
        if gpu {
            limits["nvidia.com/gpu"] = json!("1");
        }
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                             "labels": {"app": "serve"}},
                "spec": {"nodeName": node, "runtimeClassName": rc,
                         "containers": [{"name": "c", "image": "i",
                                         "resources": {"limits": limits}}]},
                "status": {"phase": phase, "startTime": "2026-12-01T10:00:00Z"}
            }))
            .unwrap(),
        )
    }

    fn policy(ns: &str, spot_notice: bool) -> Arc<CheckpointPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": "p", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": "serve"}}, "interval": "5m",
                         "triggers": {"spotNotice": spot_notice}}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn targets_are_this_nodes_opted_in_running_pods_gpu_and_large_first() {
        let pods = vec![
            pod("small", "w1", "stasis", "Running", "256Mi", false),
            pod("gpu", "w1", "stasis", "Running", "1Gi", true),
            pod("large", "w1", "stasis", "Running", "16Gi", false),
            pod("elsewhere", "w2", "stasis", "Running", "64Gi", false),
            pod("not-opted-in", "w1", "runc", "Running", "64Gi", false),
            pod("pending", "w1", "stasis", "Pending", "64Gi", false),
        ];
        let names = |ks: Vec<PodKey>| ks.into_iter().map(|k| k.name).collect::<Vec<_>>();
        assert_eq!(
            names(notice_targets(&pods, &[policy("ml", true)], "w1", "stasis")),
            ["gpu", "large", "small"]
        );
        assert!(
            notice_targets(&pods, &[policy("ml", false)], "w1", "stasis").is_empty(),
            "a policy with spotNotice: false"
        );
        assert!(
            notice_targets(&pods, &[policy("other", true)], "w1", "stasis").is_empty(),
            "a policy of another namespace"
        );
    }

    #[test]
    fn notices_are_on_by_default_in_a_policy() {
        let p: CheckpointPolicy = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"selector": {}, "interval": "5m"}
        }))
        .unwrap();
        assert!(p.spec.triggers.spot_notice);
    }

    #[test]
    fn provider_choice_parses() {
        assert_eq!("auto".parse(), Ok(ProviderChoice::Auto));
        assert_eq!("none".parse(), Ok(ProviderChoice::Off));
        assert_eq!("gke".parse(), Ok(ProviderChoice::Given(Provider::Gcp)));
        assert!("ibm".parse::<ProviderChoice>().is_err());
    }
}
