//! What a notice sets off: the node marked, the checkpoints created, Azure's event acknowledged
//! once they ended.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::Client;
use stasis_api::{
    CheckpointPhase, CheckpointPolicy, CheckpointReason, PodCheckpoint, PodCheckpointSpec,
};
use stasis_core::notice::{self, Notice, NoticeKind, Provider};
use tracing::{info, warn};

use super::{notice_targets, MetadataClient, NODE_ENDING};
use crate::metrics::Metrics;
use crate::status::PodKey;
use stasis_api::names;

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
                names::NODE.to_owned(),
                self.node.clone(),
            )]));
            match api.create(&crate::k8s::created_by_agent(), &c).await {
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
            names::event::CLOUD_NOTICE,
            message,
            true,
            &self.node,
            crate::status::now(),
        );
        if let Err(e) = api.create(&crate::k8s::created_by_agent(), &ev).await {
            warn!(pod = %pod.name, error = %e, "cannot create an Event");
        }
    }

    /// Marks the node: `stasis.dev/notice=<kind>`, `stasis.dev/ready` withdrawn (and kept so).
    async fn mark_node(&self, n: &Notice) -> crate::Result<()> {
        NODE_ENDING.store(true, Ordering::SeqCst);
        let labels = BTreeMap::from([
            (names::node::READY.to_owned(), None),
            (
                names::node::NOTICE.to_owned(),
                Some(n.kind.name().to_owned()),
            ),
        ]);
        crate::k8s::patch_node_labels(&self.client, &self.node, &labels).await
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
    pub(super) async fn act(&self, mc: &MetadataClient, n: &Notice) {
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

pub(super) fn now_unix_ms() -> i64 {
    stasis_core::time::now_ms() as i64
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
