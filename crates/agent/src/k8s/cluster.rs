//! [`KubeCluster`]: the Kubernetes-backed [`Cluster`] seam of the node side (pods from the
//! node's reflector, lineage records for stamps and fencing, the wrapper's reports).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use stasis_api::{CheckpointPolicy, PodRestore, RestorePhase};
use stasis_node_api::{PodRef, ReportEvent, ReportRequest};
use tokio::runtime::Handle;
use tracing::{info, warn};

use super::{is_status, pod_info, MANAGER};
use crate::error::{AgentError, Result};
use crate::executor::{CheckpointOutcome, Executor, NotInPlace, OutOfStep};
use crate::fence::{self, RecordFacts, Stamp, Verdict};
use crate::node::{Cluster, InPlace, PodInfo};
use crate::reports::{self, Delivery};
use crate::status::{self, PodKey};
use stasis_api::names::{self, reason, AGENT_COMPONENT};

/// The Kubernetes-backed [`Cluster`].
pub struct KubeCluster {
    pub client: Client,
    pub rt: Handle,
    pub node: String,
    /// stasis's own namespace (lineage records, data key Secrets).
    pub namespace: String,
    /// The RuntimeClass that opts a pod in (only its pods are checkpointed).
    pub runtime_class: String,
    pub pods: Store<Pod>,
    pub policies: Store<CheckpointPolicy>,
    pub exec: Arc<Executor>,
}

impl KubeCluster {
    pub(crate) fn pod_by_uid(&self, uid: &str) -> Option<Arc<Pod>> {
        self.pods.find(|p| p.metadata.uid.as_deref() == Some(uid))
    }

    /// A reported pod's key: by its UID from the pods on this node, else as the report names it.
    fn key_of(&self, pod: &PodRef) -> Option<PodKey> {
        match self.pod_by_uid(&pod.pod_uid) {
            Some(p) => Some(self.info(&p).key),
            None if !pod.pod_name.is_empty() => Some(PodKey {
                namespace: pod.pod_namespace.clone(),
                name: pod.pod_name.clone(),
                uid: pod.pod_uid.clone(),
            }),
            None => None,
        }
    }

    pub(crate) fn pod_by_name(&self, ns: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.find(|p| {
            p.metadata.namespace.as_deref() == Some(ns) && p.metadata.name.as_deref() == Some(name)
        })
    }

    pub(crate) fn info(&self, pod: &Pod) -> PodInfo {
        pod_info(pod, &self.policies.state())
    }

    pub(crate) async fn lineage_record(&self, lineage: &str) -> Result<Option<RecordFacts>> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let Some(cm) = api
            .get_opt(&stasis_api::lineage::record_name(lineage))
            .await?
        else {
            return Ok(None);
        };
        RecordFacts::from_config_map(&cm)
            .map(Some)
            .map_err(AgentError::Record)
    }

    /// The lineage records whose holder-UID label is `uid` (read fresh: a stamp must not come
    /// from a stale cache).
    pub(crate) async fn records_held_by(&self, uid: &str) -> Result<Vec<RecordFacts>> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let lp = ListParams::default().labels(&format!(
            "{}=true,{}={uid}",
            names::LINEAGE_RECORD,
            names::HOLDER_UID
        ));
        let list = api.list(&lp).await?;
        Ok(list
            .items
            .iter()
            .filter_map(|cm| match RecordFacts::from_config_map(cm) {
                Ok(r) => Some(r),
                Err(e) => {
                    warn!(error = %e, "skipping an unreadable lineage record");
                    None
                }
            })
            .collect())
    }
}

impl KubeCluster {
    /// Another agent pod running on this node (a rolling update's new pod), by name: pods of
    /// the node labelled `app.kubernetes.io/component: agent`, Running, not deleting, other
    /// than this one (`HOSTNAME` is the pod's name).
    pub fn successor_agent(&self) -> Option<String> {
        let me = std::env::var("HOSTNAME").unwrap_or_default();
        let label = |p: &Pod, k: &str| p.labels().get(k).cloned().unwrap_or_default();
        self.pods
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && p.name_any() != me)
            .filter(|p| {
                label(p, "app.kubernetes.io/name") == "stasis"
                    && label(p, AGENT_COMPONENT.0) == AGENT_COMPONENT.1
            })
            .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .map(|p| p.name_any())
    }

    /// A container of `pod` lost its restore before it started (its create was given up) and
    /// its checkpoint is prepared again for the next create (whose report turns the pod's
    /// PodRestore `Restored` as usual): a Normal Event says so. (When it cannot be prepared
    /// again, the node side reports the cold start as a wrapper's.)
    fn restore_retried(&self, pod: &PodInfo, container: &str, lost: &str, checkpoint: &str) {
        let msg = format!(
            "container {container} {lost}; {checkpoint} is prepared again for its next create"
        );
        self.rt
            .block_on(self.emit(&pod.key, names::event::RESTORE_RETRIED, &msg, false));
    }
}

impl Cluster for KubeCluster {
    fn pod(&self, pod: &stasis_node_api::PodRef) -> Option<PodInfo> {
        self.pod_by_uid(&pod.pod_uid).map(|p| self.info(&p))
    }

    fn stamp(&self, pod: &PodKey) -> std::result::Result<Stamp, String> {
        let records = self
            .rt
            .block_on(self.records_held_by(&pod.uid))
            .map_err(|e| format!("cannot read the lineage records: {e}"))?;
        fence::stamp_from_records(&pod.namespace, &pod.uid, &records)
    }

    fn fence(&self, stamp: &Stamp) -> Verdict {
        // Fail closed: a node that cannot read the lineage record (cut off from the API server)
        // must not publish.
        match self
            .rt
            .block_on(self.lineage_record(stamp.lineage.as_str()))
        {
            Ok(rec) => fence::decide(rec.as_ref(), stamp),
            Err(e) => Verdict::Fenced(format!("cannot read the lineage record: {e}")),
        }
    }

    fn checkpoint_started(
        &self,
        pod: &PodInfo,
        stamp: &Stamp,
        _reason: &str,
        timeout: Duration,
    ) -> Option<String> {
        self.rt
            .block_on(self.create_final_record(pod, stamp, timeout))
    }

    fn checkpoint_finished(
        &self,
        record: Option<&str>,
        pod: &PodInfo,
        stamp: &Stamp,
        result: &Result<CheckpointOutcome>,
    ) {
        if let Some(name) = record {
            let prev = status::checkpoint_running(
                &Default::default(),
                &self.node,
                &pod.key.uid,
                stamp,
                status::now(),
            );
            self.finish_checkpoint(&pod.key.namespace, name, &prev, pod, result);
        }
    }

    fn restart_in_place(
        &self,
        pod: &PodInfo,
        container: &str,
        cause: InPlace,
        decision: std::result::Result<&str, &NotInPlace>,
    ) {
        if let Some(lost) = cause.lost_words() {
            if let Ok(checkpoint) = decision {
                self.restore_retried(pod, container, lost, checkpoint);
            }
            return;
        }
        let key = pod.key.clone();
        let checkpoint = match decision {
            Ok(c) => c.to_owned(),
            Err(why) => {
                let msg = format!("container {container} was OOM-killed; it restarts cold: {why}");
                self.rt
                    .block_on(self.emit(&key, reason::COLD_START, &msg, true));
                return;
            }
        };
        // The auditable record of the restore (DESIGN §3), named after the pod and the
        // checkpoint; the wrapper's report turns it Restored (or ColdStart) like any other.
        let (lineage, id) = checkpoint.rsplit_once('/').unwrap_or(("", &checkpoint));
        let id = id.to_ascii_lowercase();
        let base: String = key.name.chars().take(180).collect();
        let name = format!("{base}-oom-{id}");
        let mut r = PodRestore::new(
            &name,
            stasis_api::PodRestoreSpec {
                checkpoint_ref: checkpoint.clone(),
                target_pod_name: key.name.clone(),
                target_pod_uid: Some(key.uid.clone()),
                source_pod_name: Some(key.name.clone()),
                // The kept checkpoint's own lineage (what the restore-loop guard counts
                // against); the generation is the pod's claim when the record still says so.
                lineage: Some(lineage.to_owned()),
                generation: self
                    .stamp(&key)
                    .ok()
                    .filter(|s| s.lineage.as_str() == lineage)
                    .map(|s| s.generation as i64),
            },
        );
        r.metadata.labels = Some(BTreeMap::from([
            (names::CREATED_BY.to_owned(), MANAGER.to_owned()),
            (names::NODE.to_owned(), self.node.clone()),
        ]));
        self.rt.block_on(async {
            let api: Api<PodRestore> = Api::namespaced(self.client.clone(), &key.namespace);
            match api
                .create(&super::status_writer::created_by_agent(), &r)
                .await
            {
                Ok(_) => {}
                // (a second OOM kill of the same checkpoint never gets here: no restore loop)
                Err(e) if is_status(&e, 409) => {}
                Err(e) => warn!(pod = %key.name, error = %e, "cannot record the restore in place"),
            }
            let s = status::restore(
                &Default::default(),
                RestorePhase::Ready,
                &self.node,
                Some(format!(
                    "restart in place after an OOM kill, from {checkpoint} (kept on this node)"
                )),
                None,
                status::now(),
            );
            self.patch_restore_status(&key.namespace, &name, &s).await;
        });
    }

    fn final_skipped(&self, pod: &PodInfo, message: &str) {
        let skipped = names::event::CHECKPOINT_SKIPPED;
        self.rt
            .block_on(self.emit(&pod.key, skipped, message, true));
    }

    fn final_adopted(&self, pod: &PodInfo, reference: &str) {
        let message = format!(
            "the final checkpoint is the heartbeat {reference}, captured as the pod began to stop; \
             the pod stops now and the heartbeat's upload goes on (the replacement waits for it)"
        );
        let checkpointed = names::event::CHECKPOINTED;
        self.rt
            .block_on(self.emit(&pod.key, checkpointed, &message, false));
    }

    fn out_of_step(&self, pod: &PodRef, what: &OutOfStep) {
        if let Some(key) = self.key_of(pod) {
            self.rt
                .block_on(self.emit(&key, reason::COLD_START, &what.message(), true));
        }
    }

    /// A report's PodRestore status and Event. One that may have been handled before is
    /// dropped when its PodRestore already shows it ([`reports::already_reported`]); with no
    /// PodRestore nothing shows it, and its Event may be emitted a second time.
    fn report(&self, req: &ReportRequest, delivery: Delivery) {
        let Some(key) = self.key_of(&req.pod) else {
            return;
        };
        self.rt.block_on(async {
            let restore = self.restore_of(&key).await;
            let phase = restore.as_ref().and_then(|r| r.status.as_ref()?.phase);
            if delivery == Delivery::MaybeAgain && reports::already_reported(phase, &req.event) {
                info!(pod = %key.name, container = %req.container_id, ?phase, "a report its PodRestore already shows: not applied again");
                return;
            }
            match &req.event {
                ReportEvent::Restored {
                    checkpoint_ref,
                    restore_ms,
                } => {
                    if let Some(r) = &restore {
                        let mut s = status::restore(
                            &r.status.clone().unwrap_or_default(),
                            RestorePhase::Restored,
                            &self.node,
                            Some(format!("restored from {checkpoint_ref}")),
                            None,
                            status::now(),
                        );
                        s.restore_millis = Some(*restore_ms as i64);
                        let name = r.metadata.name.clone().unwrap_or_default();
                        self.patch_restore_status(&key.namespace, &name, &s).await;
                    }
                    self.emit(
                        &key,
                        reason::RESTORED,
                        &format!("restored from checkpoint {checkpoint_ref} in {restore_ms} ms"),
                        false,
                    )
                    .await;
                }
                ReportEvent::ColdStart {
                    cause,
                    reason: why,
                    checkpoint_ref,
                } => {
                    if let Some(r) = &restore {
                        let s = status::restore(
                            &r.status.clone().unwrap_or_default(),
                            RestorePhase::ColdStart,
                            &self.node,
                            Some(why.clone()),
                            Some(crate::error::cold_start_failure(*cause)),
                            status::now(),
                        );
                        let name = r.metadata.name.clone().unwrap_or_default();
                        self.patch_restore_status(&key.namespace, &name, &s).await;
                    }
                    let msg = match checkpoint_ref {
                        Some(c) => format!("cold start instead of restoring {c}: {why}"),
                        None => format!("cold start: {why}"),
                    };
                    self.emit(&key, reason::COLD_START, &msg, restore.is_some())
                        .await;
                }
            }
        });
    }
}
