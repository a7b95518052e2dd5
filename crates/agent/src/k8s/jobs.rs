//! The two jobs the watchers hand to worker threads: run a `PodCheckpoint`, prepare a
//! `PodRestore` (both block: the engine forks, the store is reached through `block_on`).

use std::time::{Duration, Instant};

use stasis_api::names::reason;
use stasis_api::{CheckpointReason, PodCheckpoint, PodRestore, RestoreFailure, RestorePhase};
use stasis_core::CheckpointRef;
use tracing::{info, warn};

use super::{image_digest, not_opted_in, restore_mismatch, single_container, KubeCluster};
use crate::error::{AgentError, Result};
use crate::executor::{CheckpointJob, CheckpointOutcome, PrepareJob, Target};
use crate::fence;
use crate::node::{Agent, Cluster, PodInfo};
use crate::status;

/// How long a restore that finds no room on the node's disk tries again.
const NO_ROOM_RETRY: Duration = Duration::from_secs(30);

impl KubeCluster {
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
                reason::CHECKPOINT_FAILED,
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
                    reason::SOURCE_POD_REPLACED,
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
        // One checkpoint at a time per pod: wait for the one in progress. A checkpoint taken
        // because the pod is about to end (the eviction responder's, a cloud notice's) holds
        // newer state than a heartbeat uploading, and stops that upload as a termination does.
        let uid = info.key.uid.as_str();
        let taken = if matches!(
            c.spec.reason,
            CheckpointReason::Termination
                | CheckpointReason::SpotNotice
                | CheckpointReason::MaintenanceNotice
        ) {
            let fits = |left| agent.exec.new_checkpoint_fits(uid, left);
            agent.busy.take_superseding(uid, deadline, fits)
        } else {
            agent.busy.take_by(uid, deadline)
        };
        let r = match taken {
            None => Err(AgentError::Deadline(
                "another checkpoint of this pod ran until the timeout".into(),
            )),
            Some(_g) => agent.checkpoint(&CheckpointJob {
                // A heartbeat's upload gives way to the pod's final checkpoint (busy.rs).
                upload_stop: (c.spec.reason == CheckpointReason::Heartbeat)
                    .then(|| agent.busy.upload_stop(&info.key.uid)),
                ahead_of_stop: false,
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
                expected: info.layout.members.clone(),
                // A spot notice: the instance stops at the notice's end; held until then, the
                // pod does nothing its replacement, restored from this checkpoint, does again.
                hold: (c.spec.reason == CheckpointReason::SpotNotice && info.hold_until_evicted)
                    .then(|| stasis_core::policy::hold_limit(timeout, &info.liveness)),
            }),
        };
        self.finish_checkpoint(&ns, &name, &running, &info, &r);
    }

    pub(crate) fn finish_checkpoint(
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
                if matches!(e, AgentError::Superseded(_)) {
                    // Said on the PodCheckpoint only: the pod's final checkpoint has its own
                    // Events.
                    info!(checkpoint = %name, why = %e, "checkpoint superseded");
                } else {
                    warn!(checkpoint = %name, error = %e, "checkpoint failed");
                    self.rt.block_on(self.emit(
                        &info.key,
                        reason::CHECKPOINT_FAILED,
                        &e.to_string(),
                        true,
                    ));
                }
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
        if !super::pod_facts::restore_is_for(r, &pod) {
            if r.spec.target_pod_uid.is_none() {
                warn!(namespace = %ns, restore = %name, pod = %r.spec.target_pod_name,
                    "PodRestore not prepared: the pod of that name was not admitted for it (its creator may not restore, or it was created without stasis's webhook)");
            }
            return;
        }
        let info = self.info(&pod);
        let prev = r.status.clone().unwrap_or_default();
        let fetching = status::restore(
            &prev,
            RestorePhase::Fetching,
            &self.node,
            None,
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
                container_name: None,
                layout: Some(info.layout.clone()),
                spec_hash: info.spec_hash.clone(),
                image_digest: single_container(&pod).and_then(|c| image_digest(&pod, &c)),
                declared: info.declared.clone(),
            });
        // A disk that is full now may not be in a moment (another pod's files, a log burst): a
        // restore that finds no room tries again for a while before its pod starts cold (its
        // wait container keeps the pod waiting meanwhile).
        let started = Instant::now();
        let prepared = job.and_then(|j| loop {
            match self.exec.prepare(&j) {
                Err(e) if e.is_out_of_space() && started.elapsed() < NO_ROOM_RETRY => {
                    warn!(restore = %name, error = %e, "no room on the node's disk for the restore: trying again in 2 s");
                    std::thread::sleep(Duration::from_secs(2));
                }
                r => break r,
            }
        });
        match prepared {
            Ok(p) => {
                // A restore prepared again (after an agent restart) whose create's outcome was
                // reported meanwhile (a report the next agent took from its file): `Ready` must
                // not overwrite what the container did.
                let now = self.rt.block_on(async {
                    kube::Api::<PodRestore>::namespaced(self.client.clone(), &ns)
                        .get_opt(&name)
                        .await
                });
                let phase = now.ok().flatten().and_then(|r| r.status?.phase);
                if matches!(
                    phase,
                    Some(RestorePhase::ColdStart | RestorePhase::Restored | RestorePhase::Failed)
                ) {
                    info!(restore = %name, ?phase, "the restore's outcome was reported while it was prepared: its status stays, the plan goes");
                    self.exec.forget(&info.key.uid, &p.container_name);
                    return;
                }
                let mut s = status::restore(
                    &fetching,
                    RestorePhase::Ready,
                    &self.node,
                    Some(format!(
                        "{} fetched and verified ({} bytes in {} ms); the container restores when it is created",
                        p.checkpoint_ref, p.bytes, p.fetch_ms
                    )),
                    None,
                    status::now(),
                );
                s.fetch_millis = Some(p.fetch_ms as i64);
                self.rt.block_on(self.patch_restore_status(&ns, &name, &s));
            }
            Err(e) => {
                // The typed cause is what the controller acts on: the restore-loop guard counts
                // it, and a damaged checkpoint raises an integrity alarm on the lineage instead
                // of the fallback to an older checkpoint.
                let failure = e.restore_failure();
                let damaged = failure == RestoreFailure::CheckpointDamaged;
                let msg = if damaged {
                    format!("cold start: the checkpoint is damaged in the store, which only a writer to the bucket can cause; stasis does not fall back to older memory: {e}")
                } else {
                    format!("cold start: {e}")
                };
                warn!(restore = %name, error = %e, %failure, "restore preparation failed: the pod cold-starts");
                let s = status::restore(
                    &fetching,
                    RestorePhase::Failed,
                    &self.node,
                    Some(msg.clone()),
                    Some(failure),
                    status::now(),
                );
                let event = if damaged {
                    self.exec.metrics.restore("damaged");
                    reason::CHECKPOINT_DAMAGED
                } else {
                    reason::COLD_START
                };
                self.rt.block_on(async {
                    self.patch_restore_status(&ns, &name, &s).await;
                    self.emit(&info.key, event, &msg, true).await;
                });
            }
        }
    }
}
