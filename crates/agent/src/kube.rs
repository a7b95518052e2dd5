//! The Kubernetes side of the agent.
//!
//! - a reflector of the pods bound to this node (`spec.nodeName=<node>`), and one of the
//!   `CheckpointPolicy`s (which pods want a termination checkpoint);
//! - `PodCheckpoint`s whose source pod is on this node and whose phase is unset or `Pending`:
//!   run by a checkpoint worker thread (one at a time per pod), status `Running` →
//!   `Succeeded` / `Failed` with the `Ready` condition;
//! - `PodRestore`s whose target pod is on this node and whose phase is unset or `Pending`:
//!   `Fetching` → fetch, verify, plan file → `Ready`, or `Failed` with a `ColdStart` Event;
//! - the wrapper's reports → `PodRestore` `Restored` / `ColdStart` and a pod Event;
//! - the node labels (`stasis.dev/ready` and the fingerprint labels), refreshed periodically and
//!   `ready` removed on shutdown;
//! - namespace data keys from Secrets in stasis's namespace, created if absent (create-only:
//!   the first writer wins, a loser reads the winner's key).
//!
//! The watchers run on tokio; every job that forks (the engine) or blocks runs on plain threads,
//! which reach the API server through `Handle::block_on`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use stasis_api::{
    CheckpointPhase, CheckpointPolicy, PodCheckpoint, PodCheckpointSpec, PodRestore, RestorePhase,
};
use stasis_core::CheckpointRef;
use stasis_node_api::{ReportEvent, ReportRequest};
use stasis_store::Key;
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use crate::checks;
use crate::error::{AgentError, Result};
use crate::executor::{CheckpointJob, CheckpointOutcome, Executor, KeySource, PrepareJob, Target};
use crate::fair::FairQueue;
use crate::fence::{self, RecordFacts, Stamp, Verdict};
use crate::keys::{self, ClusterKey};
use crate::node::{Agent, Busy, Cluster, PodInfo};
use crate::selector;
use crate::status::{self, PodKey};

/// Label on the `PodCheckpoint`s the agent creates itself (termination checkpoints): its own
/// watcher leaves them alone.
pub const CREATED_BY_LABEL: &str = "stasis.dev/created-by";
/// Field manager of the agent's patches.
pub const MANAGER: &str = "stasisd";

fn api_err(e: kube::Error) -> AgentError {
    AgentError::Kube(e.to_string())
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

fn to_system_time(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> SystemTime {
    let ms = t.0.as_millisecond();
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH
    }
}

/// What the agent needs to know about a pod, from the pod and the policies (pure).
pub fn pod_info(pod: &Pod, policies: &[Arc<CheckpointPolicy>]) -> PodInfo {
    let m = &pod.metadata;
    let ns = m.namespace.clone().unwrap_or_default();
    let name = m.name.clone().unwrap_or_default();
    let uid = m.uid.clone().unwrap_or_default();
    let empty = BTreeMap::new();
    let labels = m.labels.as_ref().unwrap_or(&empty);
    let annotations = m.annotations.as_ref().unwrap_or(&empty);
    let selecting: Vec<&Arc<CheckpointPolicy>> = policies
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(&ns))
        .filter(|p| selector::matches(&p.spec.selector, labels))
        .collect();
    let final_wanted = if selecting.is_empty() {
        Err("no CheckpointPolicy selects this pod".to_owned())
    } else if selecting.iter().any(|p| p.spec.on_termination) {
        Ok(())
    } else {
        Err("its CheckpointPolicy has onTermination: false".to_owned())
    };
    PodInfo {
        key: PodKey {
            namespace: ns,
            name,
            uid,
        },
        spec_hash: stasis_api::pod::spec_hash(pod).map(|h| h.to_string()),
        declared: stasis_api::lineage::declared(labels, annotations),
        deletion_deadline: m.deletion_timestamp.as_ref().map(to_system_time),
        final_wanted,
        restarts_in_place: pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref())
            != Some("Never"),
    }
}

/// The image digest of a pod's container, when the pod says it: an image named by digest
/// (`…@sha256:…`), else the running container's `imageID` (a restart in place).
pub fn image_digest(pod: &Pod, container: &str) -> Option<String> {
    let digest_of = |s: &str| {
        s.rsplit_once('@')
            .map(|(_, d)| d.to_owned())
            .filter(|d| d.starts_with("sha256:"))
    };
    let spec = pod.spec.as_ref()?;
    if let Some(d) = spec
        .containers
        .iter()
        .find(|c| c.name == container)
        .and_then(|c| c.image.as_deref())
        .and_then(digest_of)
    {
        return Some(d);
    }
    pod.status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .find(|s| s.name == container)
        .and_then(|s| digest_of(&s.image_id))
}

/// Why the agent must not checkpoint `pod` (`None`: it may): only pods that opted in, with
/// `runtimeClassName` set to stasis's RuntimeClass, are ever frozen or dumped.
pub fn not_opted_in(pod: &Pod, runtime_class: &str) -> Option<String> {
    let class = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    (class != Some(runtime_class)).then(|| {
        format!(
            "pod {} did not opt in to checkpoints: its runtimeClassName is {}, not {runtime_class}",
            pod.metadata.name.as_deref().unwrap_or_default(),
            class.map_or("unset".to_owned(), |c| format!("{c:?}"))
        )
    })
}

/// Why a `PodRestore` must not be prepared (`None`: it may): the lineage it names, when it
/// names one, is not the lineage of its `checkpointRef`.
pub fn restore_mismatch(r: &PodRestore) -> Option<String> {
    let named = r.spec.lineage.as_deref()?;
    let of_ref = r.spec.checkpoint_ref.rsplit_once('/').map(|(l, _)| l);
    (of_ref != Some(named)).then(|| {
        format!(
            "checkpointRef {} is not a checkpoint of lineage {named}",
            r.spec.checkpoint_ref
        )
    })
}

/// The one app container's name, when the pod has exactly one.
pub fn single_container(pod: &Pod) -> Option<String> {
    let cs = &pod.spec.as_ref()?.containers;
    (cs.len() == 1).then(|| cs[0].name.clone())
}

fn phase_is_pending_ckpt(c: &PodCheckpoint) -> bool {
    matches!(
        c.status.as_ref().and_then(|s| s.phase),
        None | Some(CheckpointPhase::Pending)
    )
}

fn phase_is_pending_restore(r: &PodRestore) -> bool {
    matches!(
        r.status.as_ref().and_then(|s| s.phase),
        None | Some(RestorePhase::Pending)
    )
}

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
    fn pod_by_uid(&self, uid: &str) -> Option<Arc<Pod>> {
        self.pods.find(|p| p.metadata.uid.as_deref() == Some(uid))
    }

    fn pod_by_name(&self, ns: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.find(|p| {
            p.metadata.namespace.as_deref() == Some(ns) && p.metadata.name.as_deref() == Some(name)
        })
    }

    fn info(&self, pod: &Pod) -> PodInfo {
        pod_info(pod, &self.policies.state())
    }

    async fn lineage_record(&self, lineage: &str) -> Result<Option<RecordFacts>> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let Some(cm) = api
            .get_opt(&stasis_api::lineage::record_name(lineage))
            .await
            .map_err(api_err)?
        else {
            return Ok(None);
        };
        RecordFacts::from_config_map(&cm)
            .map(Some)
            .map_err(AgentError::Kube)
    }

    /// The lineage records whose holder-UID label is `uid` (read fresh: a stamp must not come
    /// from a stale cache).
    async fn records_held_by(&self, uid: &str) -> Result<Vec<RecordFacts>> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        let lp = ListParams::default().labels(&format!(
            "{}=true,{}={uid}",
            stasis_api::lineage::RECORD_LABEL,
            stasis_api::lineage::HOLDER_UID_LABEL
        ));
        let list = api.list(&lp).await.map_err(api_err)?;
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

    async fn emit(&self, pod: &PodKey, reason: &str, message: &str, warning: bool) {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &pod.namespace);
        let ev = status::pod_event(pod, reason, message, warning, &self.node, status::now());
        if let Err(e) = api.create(&PostParams::default(), &ev).await {
            warn!(pod = %pod.name, %reason, error = %e, "cannot create an Event");
            self.exec.metrics.error("kube");
        }
    }

    async fn patch_ckpt_status(&self, ns: &str, name: &str, s: &stasis_api::PodCheckpointStatus) {
        let api: Api<PodCheckpoint> = Api::namespaced(self.client.clone(), ns);
        let patch = serde_json::json!({ "status": s });
        if let Err(e) = api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(checkpoint = %name, error = %e, "cannot update a PodCheckpoint status");
            self.exec.metrics.error("kube");
        }
    }

    async fn patch_restore_status(&self, ns: &str, name: &str, s: &stasis_api::PodRestoreStatus) {
        let api: Api<PodRestore> = Api::namespaced(self.client.clone(), ns);
        let patch = serde_json::json!({ "status": s });
        if let Err(e) = api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(restore = %name, error = %e, "cannot update a PodRestore status");
            self.exec.metrics.error("kube");
        }
    }

    /// The `PodRestore` of a pod (by `spec.targetPodName`, the target UID when set), newest.
    async fn restore_of(&self, pod: &PodKey) -> Option<PodRestore> {
        let api: Api<PodRestore> = Api::namespaced(self.client.clone(), &pod.namespace);
        let lp = ListParams::default().fields(&format!("spec.targetPodName={}", pod.name));
        let list = match api.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                warn!(pod = %pod.name, error = %e, "cannot list PodRestores");
                return None;
            }
        };
        list.into_iter()
            .filter(|r| {
                r.spec
                    .target_pod_uid
                    .as_deref()
                    .is_none_or(|u| u == pod.uid)
            })
            .max_by(|a, b| {
                a.metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|t| t.0)
                    .cmp(&b.metadata.creation_timestamp.as_ref().map(|t| t.0))
            })
    }

    // ------------------------------------------------------------------ jobs

    /// Runs a `PodCheckpoint` whose source pod is on this node (a worker thread).
    pub fn run_checkpoint(&self, agent: &Agent, c: &PodCheckpoint) {
        let ns = c.metadata.namespace.clone().unwrap_or_default();
        let name = c.metadata.name.clone().unwrap_or_default();
        let Some(pod) = self.pod_by_name(&ns, &c.spec.source_pod_name) else {
            return;
        };
        let info = self.info(&pod);
        let prev = c.status.clone().unwrap_or_default();
        // Before anything is frozen: only pods that opted in.
        if let Some(why) = not_opted_in(&pod, &self.runtime_class) {
            warn!(checkpoint = %name, %why, "checkpoint refused");
            let s = status::checkpoint_failed(
                &prev,
                &self.node,
                stasis_api::condition::reason::CHECKPOINT_FAILED,
                &why,
                status::now(),
            );
            self.rt.block_on(self.patch_ckpt_status(&ns, &name, &s));
            return;
        }
        if let Some(want) = c.spec.source_pod_uid.as_deref() {
            if want != info.key.uid {
                let s = status::checkpoint_failed(
                    &prev,
                    &self.node,
                    stasis_api::condition::reason::SOURCE_POD_REPLACED,
                    &format!(
                        "pod {} now has UID {}, not {want}",
                        info.key.name, info.key.uid
                    ),
                    status::now(),
                );
                self.rt.block_on(self.patch_ckpt_status(&ns, &name, &s));
                return;
            }
        }
        let stamp = match self.stamp(&info.key) {
            Ok(s) => s,
            Err(why) => {
                self.exec.metrics.checkpoint("fenced");
                self.finish_checkpoint(&ns, &name, &prev, &info, &Err(AgentError::Fenced(why)));
                return;
            }
        };
        let running =
            status::checkpoint_running(&prev, &self.node, &info.key.uid, &stamp, status::now());
        self.rt
            .block_on(self.patch_ckpt_status(&ns, &name, &running));
        let timeout =
            Duration::from_secs(c.spec.timeout_seconds.filter(|t| *t > 0).map_or(600, |t| {
                t.min(stasis_api::checkpoint::MAX_TIMEOUT_SECONDS) as u64
            }));
        let deadline = Instant::now() + timeout;
        // One checkpoint at a time per pod: wait for the one in progress.
        let guard = loop {
            if let Some(g) = agent.busy.try_take(&info.key.uid) {
                break Some(g);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let r = match guard {
            None => Err(AgentError::Deadline(
                "another checkpoint of this pod ran until the timeout".into(),
            )),
            Some(_g) => agent.checkpoint(&CheckpointJob {
                target: Target::Pod {
                    uid: info.key.uid.clone(),
                    container_name: None,
                },
                namespace: ns.clone(),
                pod_name: info.key.name.clone(),
                stamp,
                spec_hash: info.spec_hash.clone(),
                declared: info.declared.clone(),
                reason: serde_json::to_value(c.spec.reason)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_else(|| "Manual".into()),
                leave_running: true,
                deadline: Some(deadline),
                on_captured: None,
            }),
        };
        self.finish_checkpoint(&ns, &name, &running, &info, &r);
    }

    fn finish_checkpoint(
        &self,
        ns: &str,
        name: &str,
        prev: &stasis_api::PodCheckpointStatus,
        info: &PodInfo,
        r: &Result<CheckpointOutcome>,
    ) {
        let s = match r {
            Ok(o) => {
                info!(checkpoint = %name, reference = %o.reference, total_ms = o.total_ms, "checkpoint succeeded");
                status::checkpoint_succeeded(prev, o, info.spec_hash.as_deref(), status::now())
            }
            Err(e) => {
                warn!(checkpoint = %name, error = %e, "checkpoint failed");
                self.rt
                    .block_on(self.emit(&info.key, "CheckpointFailed", &e.to_string(), true));
                status::checkpoint_failed(
                    prev,
                    &self.node,
                    status::failure_reason(e),
                    &e.to_string(),
                    status::now(),
                )
            }
        };
        self.rt.block_on(self.patch_ckpt_status(ns, name, &s));
    }

    /// Prepares a `PodRestore` whose target pod is on this node (a worker thread).
    pub fn run_restore(&self, r: &PodRestore) {
        let ns = r.metadata.namespace.clone().unwrap_or_default();
        let name = r.metadata.name.clone().unwrap_or_default();
        let Some(pod) = self.pod_by_name(&ns, &r.spec.target_pod_name) else {
            return;
        };
        let info = self.info(&pod);
        let prev = r.status.clone().unwrap_or_default();
        if r.spec
            .target_pod_uid
            .as_deref()
            .is_some_and(|u| u != info.key.uid)
        {
            return;
        }
        let fetching = status::restore(
            &prev,
            RestorePhase::Fetching,
            &self.node,
            None,
            status::now(),
        );
        self.rt
            .block_on(self.patch_restore_status(&ns, &name, &fetching));
        let job = restore_mismatch(r)
            .map_or(Ok(()), |why| Err(AgentError::Invalid(why)))
            .and_then(|()| {
                r.spec
                    .checkpoint_ref
                    .parse::<CheckpointRef>()
                    .map_err(|e| AgentError::Invalid(format!("checkpointRef: {e}")))
            })
            .and_then(|reference| {
                // Only a published checkpoint, and only the manifest the controller recorded.
                let record = self
                    .rt
                    .block_on(self.lineage_record(reference.workload.as_str()))?;
                let digest = fence::published_digest(record.as_ref(), &ns, &reference)
                    .map_err(AgentError::Invalid)?;
                if digest.is_none() {
                    warn!(restore = %name, %reference, "checkpoint published before manifest digests were recorded: its manifest is not checked against one");
                }
                Ok((reference, digest))
            })
            .map(|(reference, manifest_digest)| PrepareJob {
                reference,
                manifest_digest,
                namespace: ns.clone(),
                pod_uid: info.key.uid.clone(),
                container_name: single_container(&pod),
                spec_hash: info.spec_hash.clone(),
                image_digest: single_container(&pod).and_then(|c| image_digest(&pod, &c)),
                declared: info.declared.clone(),
            });
        match job.and_then(|j| self.exec.prepare(&j)) {
            Ok(p) => {
                let mut s = status::restore(
                    &fetching,
                    RestorePhase::Ready,
                    &self.node,
                    Some(format!(
                        "{} fetched and verified ({} bytes in {} ms); the container restores when it is created",
                        p.checkpoint_ref, p.bytes, p.fetch_ms
                    )),
                    status::now(),
                );
                s.fetch_millis = Some(p.fetch_ms as i64);
                self.rt.block_on(self.patch_restore_status(&ns, &name, &s));
            }
            Err(e) => {
                let damaged = e.is_integrity_failure();
                let msg = if damaged {
                    format!("cold start: the checkpoint is damaged in the store, which only a writer to the bucket can cause; stasis does not fall back to older memory: {e}")
                } else {
                    format!("cold start: {e}")
                };
                warn!(restore = %name, error = %e, damaged, "restore preparation failed: the pod cold-starts");
                let mut s = status::restore(
                    &fetching,
                    RestorePhase::Failed,
                    &self.node,
                    Some(msg.clone()),
                    status::now(),
                );
                let mut event = "ColdStart";
                if damaged {
                    // The reason is the typed signal the controller acts on (an integrity
                    // alarm on the lineage instead of the restore-loop fallback).
                    event = stasis_api::condition::reason::CHECKPOINT_DAMAGED;
                    stasis_api::condition::set_condition(
                        &mut s.conditions,
                        stasis_api::condition::READY,
                        false,
                        stasis_api::condition::reason::CHECKPOINT_DAMAGED,
                        msg.clone(),
                        None,
                        status::now(),
                    );
                    self.exec.metrics.restore("damaged");
                }
                self.rt.block_on(async {
                    self.patch_restore_status(&ns, &name, &s).await;
                    self.emit(&info.key, event, &msg, true).await;
                });
            }
        }
    }

    async fn create_final_record(
        &self,
        pod: &PodInfo,
        stamp: &Stamp,
        timeout: Duration,
    ) -> Option<String> {
        let api: Api<PodCheckpoint> = Api::namespaced(self.client.clone(), &pod.key.namespace);
        let base: String = pod.key.name.chars().take(200).collect();
        let name = format!("{base}-final-{:08x}", rand::random::<u32>());
        let mut c = PodCheckpoint::new(
            &name,
            PodCheckpointSpec {
                source_pod_name: pod.key.name.clone(),
                source_pod_uid: Some(pod.key.uid.clone()),
                reason: stasis_api::CheckpointReason::Termination,
                timeout_seconds: Some(timeout.as_secs().max(1) as i32),
            },
        );
        c.metadata.labels = Some(BTreeMap::from([
            (CREATED_BY_LABEL.to_owned(), MANAGER.to_owned()),
            // (the API server lets an agent create it only for its own node)
            (
                stasis_api::lineage::NODE_LABEL.to_owned(),
                self.node.clone(),
            ),
        ]));
        match api.create(&PostParams::default(), &c).await {
            Ok(_) => {
                let s = status::checkpoint_running(
                    &Default::default(),
                    &self.node,
                    &pod.key.uid,
                    stamp,
                    status::now(),
                );
                self.patch_ckpt_status(&pod.key.namespace, &name, &s).await;
                Some(name)
            }
            Err(e) => {
                warn!(pod = %pod.key.name, error = %e, "cannot record the termination checkpoint");
                None
            }
        }
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
                    && label(p, "app.kubernetes.io/component") == "agent"
            })
            .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .map(|p| p.name_any())
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
        decision: std::result::Result<&str, &str>,
    ) {
        let key = pod.key.clone();
        let checkpoint = match decision {
            Ok(c) => c.to_owned(),
            Err(reason) => {
                let msg =
                    format!("container {container} was OOM-killed; it restarts cold: {reason}");
                self.rt.block_on(self.emit(&key, "ColdStart", &msg, true));
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
            (CREATED_BY_LABEL.to_owned(), MANAGER.to_owned()),
            (
                stasis_api::lineage::NODE_LABEL.to_owned(),
                self.node.clone(),
            ),
        ]));
        self.rt.block_on(async {
            let api: Api<PodRestore> = Api::namespaced(self.client.clone(), &key.namespace);
            match api.create(&PostParams::default(), &r).await {
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
                status::now(),
            );
            self.patch_restore_status(&key.namespace, &name, &s).await;
        });
    }

    fn report(&self, req: &ReportRequest) {
        let key = match self.pod_by_uid(&req.pod.pod_uid) {
            Some(p) => self.info(&p).key,
            None if !req.pod.pod_name.is_empty() => PodKey {
                namespace: req.pod.pod_namespace.clone(),
                name: req.pod.pod_name.clone(),
                uid: req.pod.pod_uid.clone(),
            },
            None => return,
        };
        self.rt.block_on(async {
            let restore = self.restore_of(&key).await;
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
                            status::now(),
                        );
                        s.restore_millis = Some(*restore_ms as i64);
                        let name = r.metadata.name.clone().unwrap_or_default();
                        self.patch_restore_status(&key.namespace, &name, &s).await;
                    }
                    self.emit(
                        &key,
                        "Restored",
                        &format!("restored from checkpoint {checkpoint_ref} in {restore_ms} ms"),
                        false,
                    )
                    .await;
                }
                ReportEvent::ColdStart {
                    reason,
                    checkpoint_ref,
                    ..
                } => {
                    if let Some(r) = &restore {
                        let s = status::restore(
                            &r.status.clone().unwrap_or_default(),
                            RestorePhase::ColdStart,
                            &self.node,
                            Some(reason.clone()),
                            status::now(),
                        );
                        let name = r.metadata.name.clone().unwrap_or_default();
                        self.patch_restore_status(&key.namespace, &name, &s).await;
                    }
                    let msg = match checkpoint_ref {
                        Some(c) => format!("cold start instead of restoring {c}: {reason}"),
                        None => format!("cold start: {reason}"),
                    };
                    self.emit(&key, "ColdStart", &msg, restore.is_some()).await;
                }
            }
        });
    }
}

/// Where the data keys come from.
pub enum KeyOrigin {
    /// The Secrets in stasis's namespace, unwrapped here with the cluster key (every agent holds
    /// it: the chart's default until the key broker is on).
    ClusterKey {
        client: Client,
        namespace: String,
        ring: Arc<ClusterKey>,
    },
    /// stasis-controller's key broker, which hands this node a namespace's key only while a pod
    /// of that namespace is bound to it ([`BrokerClient`]).
    Broker(BrokerClient),
}

/// How long a key the broker handed out is used before it is asked for again (the broker then
/// refuses once no pod of the namespace is bound to this node any more).
pub const BROKER_KEY_TTL: Duration = Duration::from_secs(300);

/// Namespace data keys (see [`crate::keys`]), cached.
pub struct SecretKeys {
    pub rt: Handle,
    pub origin: KeyOrigin,
    cache: Mutex<HashMap<String, (Key, Instant)>>,
}

impl SecretKeys {
    pub fn new(rt: Handle, origin: KeyOrigin) -> Self {
        Self {
            rt,
            origin,
            cache: Mutex::new(HashMap::new()),
        }
    }

    async fn load(&self, ns: &str) -> Result<Key> {
        let secret = match &self.origin {
            KeyOrigin::ClusterKey {
                client,
                namespace,
                ring,
            } => keys::load_or_create(client, namespace, ns, ring)
                .await
                .map_err(|e| match e {
                    keys::DataKeyError::Key(k) => AgentError::Key(k),
                    keys::DataKeyError::Kube(m) => AgentError::Kube(m),
                })?,
            KeyOrigin::Broker(b) => b.key(ns).await?,
        };
        Ok(Key::from_secret(&secret))
    }
}

impl KeySource for SecretKeys {
    fn key(&self, namespace: &str) -> Result<Key> {
        let ttl = match self.origin {
            KeyOrigin::ClusterKey { .. } => None,
            KeyOrigin::Broker(_) => Some(BROKER_KEY_TTL),
        };
        if let Some((k, at)) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(namespace)
        {
            if ttl.is_none_or(|t| at.elapsed() < t) {
                return Ok(k.clone());
            }
        }
        let k = self.rt.block_on(self.load(namespace))?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(namespace.to_owned(), (k.clone(), Instant::now()));
        Ok(k)
    }
}

/// The agent's side of stasis-controller's key broker: `GET /v1/keys/<namespace>` over HTTPS
/// (the controller's certificate checked against the CA the chart gives), authenticated by the
/// agent pod's projected service-account token for the broker's audience (re-read from its file
/// as the kubelet renews it).
pub struct BrokerClient {
    client: Client,
}

impl BrokerClient {
    /// A client of the broker at `url` (`https://<service>.<namespace>.svc:<port>`), trusting
    /// the PEM CA in `ca`, presenting the token in `token_file`.
    pub fn new(url: &str, ca: &std::path::Path, token_file: &std::path::Path) -> Result<Self> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::CertificateDer;
        let bad = |what: String| AgentError::Invalid(format!("key broker: {what}"));
        let roots = CertificateDer::pem_file_iter(ca)
            .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| bad(format!("CA {}: {e}", ca.display())))?
            .into_iter()
            .map(|c| c.as_ref().to_vec())
            .collect::<Vec<_>>();
        if roots.is_empty() {
            return Err(bad(format!("CA {} holds no certificate", ca.display())));
        }
        let mut cfg = kube::Config::new(url.parse().map_err(|e| bad(format!("URL {url}: {e}")))?);
        cfg.root_cert = Some(roots);
        // Re-read as the CA rotates, like the token.
        cfg.root_cert_file = Some(ca.to_owned());
        cfg.auth_info.token_file = Some(token_file.display().to_string());
        let client = Client::try_from(cfg).map_err(|e| bad(e.to_string()))?;
        Ok(Self { client })
    }

    async fn key(&self, ns: &str) -> Result<[u8; 32]> {
        let req = http::Request::get(format!("{}{ns}", keys::BROKER_PATH))
            .body(Vec::new())
            .map_err(|e| AgentError::Invalid(e.to_string()))?;
        let grant: keys::KeyGrant = self.client.request(req).await.map_err(|e| {
            AgentError::Kube(format!(
                "the key broker gave no data key for namespace {ns}: {e}"
            ))
        })?;
        grant.secret().map_err(|why| {
            AgentError::Kube(format!("the key broker's answer for namespace {ns}: {why}"))
        })
    }
}

/// Sets (or removes) the agent's labels on its node.
pub async fn patch_node_labels(
    client: &Client,
    node: &str,
    labels: &BTreeMap<String, Option<String>>,
) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    api.patch(
        node,
        &PatchParams::default(),
        &Patch::Merge(&checks::labels_patch(labels)),
    )
    .await
    .map_err(api_err)?;
    Ok(())
}

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
                match &job {
                    Job::Checkpoint(c) => cluster.run_checkpoint(&agent, c),
                    Job::Restore(r) => cluster.run_restore(r),
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
                if !phase_is_pending_ckpt(&c) || c.labels().get(CREATED_BY_LABEL).is_some() {
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
                if !phase_is_pending_restore(&r) {
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
                            for r in l.items.into_iter().filter(phase_is_pending_restore) {
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
                    stasis_api::condition::reason::CHECKPOINT_FAILED,
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

/// Periodically runs the node checks, publishes the labels and sweeps stale plans and images
/// (a plain thread: the checks fork `criu` and `runc`).
pub fn label_loop(
    running: &Running,
    settings: KubeSettings,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let cluster = running.cluster.clone();
    let pods_ready = running.pods_ready.clone();
    std::thread::Builder::new()
        .name("node-checks".into())
        .spawn(move || {
            let mut last_ready = None;
            while !stop.load(Ordering::SeqCst) {
                let c = checks::run(&settings.containerd_configs, &settings.runtime_binary);
                let ready = c.ready();
                if last_ready != Some(ready) {
                    if ready {
                        info!(criu = ?c.criu, runc = ?c.runc, handler = ?c.handler, "node ready for restores");
                    } else {
                        warn!(problems = ?c.problems(), "node not ready for restores");
                    }
                }
                cluster.exec.metrics.set_ready(ready);
                let gpu = stasis_engine::cuda::gpu_fingerprint();
                // A node whose end its cloud announced takes no more restores.
                let labels = checks::node_labels(
                    ready && !crate::notice::node_ending(),
                    &stasis_engine::node::arch(),
                    gpu.as_ref(),
                );
                match cluster
                    .rt
                    .block_on(patch_node_labels(&cluster.client, &settings.node, &labels))
                {
                    Ok(()) => last_ready = Some(ready),
                    Err(e) => warn!(error = %e, "cannot label the node"),
                }
                if pods_ready.load(Ordering::SeqCst) {
                    let live: HashSet<String> = cluster
                        .pods
                        .state()
                        .iter()
                        .filter_map(|p| p.metadata.uid.clone())
                        .collect();
                    cluster.exec.sweep(&live);
                }
                let until = Instant::now() + settings.check_interval;
                while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        })
        .expect("spawn the node-checks thread")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn policy(ns: &str, app: &str, on_term: bool) -> Arc<CheckpointPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": "p", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": app}}, "interval": "10s",
                         "onTermination": on_term}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn pod_info_from_pod_and_policies() {
        let p = pod(json!({
            "metadata": {
                "name": "counter-7d9f-x2", "namespace": "default", "uid": "0b5c7e1a-1111",
                "labels": {"app": "counter", "pod-template-hash": "7d9f",
                           "declare.stasis.dev/engine": "v1"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "counter-7d9f", "uid": "rs", "controller": true}],
                "annotations": {"stasis.dev/lineage": "default_deployment_counter.aa",
                                "stasis.dev/generation": "3"},
                "deletionTimestamp": "2026-11-29T09:00:30Z"
            },
            "spec": {"containers": [{"name": "counter", "image": "stasis-counter:dev"}]}
        }));
        let i = pod_info(&p, &[policy("default", "counter", true)]);
        assert_eq!(i.key.uid, "0b5c7e1a-1111");
        assert!(i.spec_hash.as_deref().unwrap().starts_with("blake3:"));
        assert_eq!(i.declared["engine"], "v1");
        assert_eq!(
            i.deletion_deadline,
            Some(UNIX_EPOCH + Duration::from_secs(1_795_942_830))
        );
        assert!(i.final_wanted.is_ok());
        assert_eq!(single_container(&p).as_deref(), Some("counter"));
        assert_eq!(image_digest(&p, "counter"), None);
        let by_digest = pod(json!({
            "metadata": {"name": "d", "namespace": "n", "uid": "u"},
            "spec": {"containers": [{"name": "c", "image": "reg/x@sha256:abc"}]},
            "status": {"containerStatuses": [{"name": "c", "image": "x", "imageID": "reg/x@sha256:def",
                "ready": true, "restartCount": 0}]}
        }));
        assert_eq!(image_digest(&by_digest, "c").as_deref(), Some("sha256:abc"));
        let mut restarted = by_digest.clone();
        restarted.spec.as_mut().unwrap().containers[0].image = Some("reg/x:1".into());
        assert_eq!(image_digest(&restarted, "c").as_deref(), Some("sha256:def"));
        // Policy in another namespace, another app, or onTermination false.
        assert!(pod_info(&p, &[policy("other", "counter", true)])
            .final_wanted
            .is_err());
        assert!(pod_info(&p, &[policy("default", "x", true)])
            .final_wanted
            .unwrap_err()
            .contains("no CheckpointPolicy"));
        assert!(pod_info(&p, &[policy("default", "counter", false)])
            .final_wanted
            .unwrap_err()
            .contains("onTermination"));

        let bare = pod(json!({
            "metadata": {"name": "solo", "namespace": "ns1", "uid": "abcdef12-3"},
            "spec": {"containers": [{"name": "a", "image": "i"}, {"name": "b", "image": "i"}]}
        }));
        assert_eq!(single_container(&bare), None);
    }

    /// Review M7: a pod of another RuntimeClass (or none) is never checkpointed.
    #[test]
    fn only_opted_in_pods_are_checkpointed() {
        let mut p = pod(json!({
            "metadata": {"name": "web", "namespace": "default", "uid": "u"},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
        }));
        assert_eq!(not_opted_in(&p, "stasis"), None);
        p.spec.as_mut().unwrap().runtime_class_name = Some("gvisor".into());
        let why = not_opted_in(&p, "stasis").unwrap();
        assert!(
            why.contains("pod web did not opt in") && why.contains("\"gvisor\""),
            "{why}"
        );
        p.spec.as_mut().unwrap().runtime_class_name = None;
        assert!(not_opted_in(&p, "stasis").unwrap().contains("is unset"));
    }

    #[test]
    fn a_restore_names_the_lineage_of_its_checkpoint() {
        let r = |lineage: Option<&str>| -> PodRestore {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": "t", "namespace": "default"},
                "spec": {"checkpointRef": "default_pod_a.0a/20261129T083000.123Z-1a2b3c4d",
                         "targetPodName": "t", "lineage": lineage}
            }))
            .unwrap()
        };
        assert_eq!(restore_mismatch(&r(Some("default_pod_a.0a"))), None);
        assert_eq!(restore_mismatch(&r(None)), None);
        assert!(restore_mismatch(&r(Some("default_pod_b.0b")))
            .unwrap()
            .contains("is not a checkpoint of lineage default_pod_b.0b"));
    }

    #[test]
    fn pending_phases() {
        let mut c = PodCheckpoint::new(
            "c",
            PodCheckpointSpec {
                source_pod_name: "p".into(),
                source_pod_uid: None,
                reason: Default::default(),
                timeout_seconds: None,
            },
        );
        assert!(phase_is_pending_ckpt(&c));
        c.status = Some(stasis_api::PodCheckpointStatus {
            phase: Some(CheckpointPhase::Running),
            ..Default::default()
        });
        assert!(!phase_is_pending_ckpt(&c));
        let mut r = PodRestore::new(
            "r",
            stasis_api::PodRestoreSpec {
                checkpoint_ref: "l/x".into(),
                target_pod_name: "p".into(),
                target_pod_uid: None,
                source_pod_name: None,
                lineage: None,
                generation: None,
            },
        );
        assert!(phase_is_pending_restore(&r));
        r.status = Some(stasis_api::PodRestoreStatus {
            phase: Some(RestorePhase::Pending),
            ..Default::default()
        });
        assert!(phase_is_pending_restore(&r));
        r.status.as_mut().unwrap().phase = Some(RestorePhase::Ready);
        assert!(!phase_is_pending_restore(&r));
    }
}
