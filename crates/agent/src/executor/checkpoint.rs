//! A checkpoint: resolve the container, fence, capture, draft the manifest, upload, fence
//! again, keep the reference for a restart in place.

use super::kept::KeptLatest;
use super::pod;
use super::*;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stasis_core::manifest::{
    pod_container_dir, PodContainer, PodIndex, POD_CONTAINERS_LABEL, POD_INDEX_FILE,
};
use stasis_core::{
    CheckpointId, Manifest, NodeFingerprint, ProcessInfo, Requirements, RootfsCapture,
    RootfsMethod, Source, Timings, SCHEMA_VERSION,
};
use stasis_engine::checkpoint::{
    checkpoint_pod, checkpoint_pod_holding, Captured, PodCheckpoint, PodMember,
};
use stasis_engine::image::ImageDir;
use stasis_engine::node;
use stasis_engine::runc::Runc;
use stasis_store::NoProgress;
use tracing::{info, warn};

use crate::error::{AgentError, Result};
use crate::fence::Verdict;

impl Executor {
    /// Takes a checkpoint. `fence` is asked before the freeze and again after the upload; a
    /// fenced checkpoint's manifest is deleted again and the result is `AgentError::Fenced`.
    pub fn checkpoint(
        &self,
        job: &CheckpointJob,
        fence: &dyn Fn() -> Verdict,
    ) -> Result<CheckpointOutcome> {
        let r = self.checkpoint_inner(job, fence);
        if let Some(s) = &job.upload_stop {
            s.finished(&r);
        }
        crate::mem::trim();
        match &r {
            Ok(o) => {
                self.note_published(
                    &o.pod_uid,
                    &o.reference,
                    stasis_core::interval::Measured {
                        freeze_ms: o.freeze_ms,
                        upload_ms: o.upload_ms,
                    },
                );
                self.metrics.checkpoint("succeeded");
                self.metrics
                    .checkpoint_bytes(o.logical_bytes, o.uploaded_bytes);
                self.metrics.phase_ms("freeze", o.freeze_ms);
                self.metrics.phase_ms("dump", o.dump_ms);
                self.metrics.phase_ms("upload", o.upload_ms);
                self.metrics.phase_ms("checkpoint_total", o.total_ms);
            }
            Err(AgentError::Fenced(_)) => {
                self.metrics.checkpoint("fenced");
                self.metrics.error("fenced");
            }
            // Not a failure: the pod's final checkpoint, taken after it, replaces it.
            Err(AgentError::Superseded(_)) => self.metrics.checkpoint("superseded"),
            Err(e) => {
                self.metrics.checkpoint("failed");
                self.metrics.error(e.kind());
            }
        }
        r
    }

    fn checkpoint_inner(
        &self,
        job: &CheckpointJob,
        fence: &dyn Fn() -> Verdict,
    ) -> Result<CheckpointOutcome> {
        let started = Instant::now();
        let remaining = |what: &str| -> Result<Option<Duration>> {
            match job.deadline {
                None => Ok(None),
                Some(d) => d
                    .checked_duration_since(Instant::now())
                    .filter(|r| !r.is_zero())
                    .map(Some)
                    .ok_or_else(|| AgentError::Deadline(format!("no time left {what}"))),
            }
        };
        remaining("before the checkpoint")?;
        let mut members = self.resolve_members(&job.target)?;
        let name_of = |c: &crate::resolve::RuncContainer| {
            c.pod().map(|p| p.container_name).unwrap_or_default()
        };
        let narrowed = matches!(
            &job.target,
            Target::Pod {
                container_name: Some(_),
                ..
            }
        );
        if !narrowed && !job.expected.is_empty() {
            // Only the pod's own containers: an ephemeral debug container is left out.
            members.retain(|c| job.expected.contains(&name_of(c)));
            let names: Vec<String> = members.iter().map(name_of).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            pod::check_complete(&names, &job.expected)?;
        }
        let pod = members[0].pod().unwrap_or_default();
        let names: Vec<String> = match &job.target {
            Target::Pod {
                container_name: Some(n),
                ..
            } => vec![n.clone()],
            _ => members.iter().map(name_of).collect(),
        };
        if let Verdict::Fenced(why) = fence() {
            return Err(AgentError::Fenced(why));
        }
        let key = self.keys.key(&job.namespace)?;
        let runc = Runc::new(Some(&self.cfg.runc_root))?;
        let scratch = Scratch::new(&self.cfg.work_dir, "checkpoint")?;
        // One container: its images at the root, the layout of every checkpoint before pods
        // had several; a pod: one directory per container and the pod index.
        let is_pod = members.len() > 1;
        let images: Vec<ImageDir> = if is_pod {
            names
                .iter()
                .map(|n| ImageDir::new(scratch.0.join(pod_container_dir(n))))
                .collect()
        } else {
            vec![ImageDir::new(&scratch.0)]
        };
        let pod_members: Vec<PodMember<'_>> = members
            .iter()
            .zip(&images)
            .map(|(c, image)| PodMember { id: &c.id, image })
            .collect();
        let request = PodCheckpoint {
            runc: &runc,
            members: &pod_members,
            leave_running: job.leave_running,
            tcp_established: self.cfg.tcp_established,
        };
        // Held: the containers stay frozen through the upload (every error below resumes them
        // as `held` drops) and after it, until the stop comes.
        let (captured, held) = if job.hold.is_some() {
            let (captured, held) = checkpoint_pod_holding(&request)?;
            if held.is_none() {
                info!(containers = ?names, "not held after the checkpoint: it has CUDA processes, or was paused by someone else");
            }
            (captured, held)
        } else {
            (checkpoint_pod(&request)?, None)
        };
        let ids: Vec<String> = members.iter().map(|c| c.id.clone()).collect();
        info!(containers = ?names, frozen_ms = captured[0].timings.frozen_ms, "dumped");

        let id = CheckpointId::from_parts(now_ms(), rand::random());
        let reference = format!("{}/{}", job.stamp.lineage, id);
        if job.reason == "Termination" {
            let cover = FinalCover {
                reference: reference.clone(),
                ahead_of_stop: job.ahead_of_stop,
            };
            self.record_final(&pod.pod_uid, cover, ids.clone());
        }
        if let Some(tx) = &job.on_captured {
            let _ = tx.send(reference.clone());
        }
        let mut labels = BTreeMap::from([
            (label::LINEAGE.to_owned(), job.stamp.lineage.to_string()),
            (
                label::GENERATION.to_owned(),
                job.stamp.generation.to_string(),
            ),
            (label::NAMESPACE.to_owned(), job.namespace.clone()),
            (label::POD_NAME.to_owned(), job.pod_name.clone()),
            (label::POD_UID.to_owned(), pod.pod_uid.clone()),
            (label::NODE.to_owned(), self.cfg.node_name.clone()),
            (
                label::TCP_ESTABLISHED.to_owned(),
                self.cfg.tcp_established.to_string(),
            ),
            (label::REASON.to_owned(), job.reason.clone()),
        ]);
        if is_pod {
            labels.insert(POD_CONTAINERS_LABEL.to_owned(), names.join(","));
        } else {
            labels.insert(label::CONTAINER_NAME.to_owned(), names[0].clone());
        }
        if let Some(h) = &job.spec_hash {
            labels.insert(label::SPEC_HASH.to_owned(), h.clone());
        }
        let kept: Vec<(String, Option<RootfsMethod>, Option<String>)> = names
            .iter()
            .zip(&captured)
            .map(|(n, c)| {
                (
                    n.clone(),
                    c.rootfs.as_ref().map(|r| r.method),
                    c.image_digest.clone(),
                )
            })
            .collect();
        let draft = if is_pod {
            pod_draft(&scratch.0, &names, captured)?
        } else {
            let c = captured.into_iter().next().expect("one capture");
            Draft {
                source: c.source,
                processes: c.processes,
                rootfs: c.rootfs,
                timings: c.timings,
                image_digest: c.image_digest,
                gpu: c.gpu,
                gpu_processes: c.gpu_processes,
            }
        };
        let draft = Manifest {
            schema_version: SCHEMA_VERSION,
            workload: job.stamp.lineage.clone(),
            created_at: id.created_rfc3339(),
            id,
            key_id: String::new(),
            source: draft.source,
            leave_running: job.leave_running,
            requirements: Requirements {
                node: NodeFingerprint {
                    gpu: draft.gpu,
                    ..node::fingerprint()
                },
                needs_runc: true,
                image_digest: draft.image_digest,
                declared: job.declared.clone(),
            },
            processes: draft.processes,
            rootfs: draft.rootfs,
            timings: draft.timings,
            stats: Default::default(),
            files: Vec::new(),
            gpu_processes: draft.gpu_processes,
            labels,
        };
        let (freeze_ms, dump_ms) = (draft.timings.frozen_ms, draft.timings.dump_ms);
        let left = remaining("for the upload")?;
        let stop = job.upload_stop.as_ref().map(|s| s.uploading(&reference));
        let t = Instant::now();
        let put =
            self.store
                .put_checkpoint_until(&key, draft, &scratch.0, &NoProgress, stopped(stop));
        let put = match left {
            None => self.rt.block_on(put),
            Some(left) => self
                .rt
                .block_on(async { tokio::time::timeout(left, put).await })
                .map_err(|_| {
                    AgentError::Deadline(format!(
                        "upload cut off after {} ms; nothing was published",
                        left.as_millis()
                    ))
                })?,
        };
        let manifest = match put {
            Err(stasis_store::StoreError::Cancelled) => {
                info!(containers = ?names, upload_ms = ms(t), "upload stopped: the pod's final checkpoint replaces this one");
                return Err(AgentError::Superseded(format!(
                    "the pod began to stop {} ms into this checkpoint's upload, and its final \
                     checkpoint, taken after it, replaces it; nothing of this one was published",
                    ms(t)
                )));
            }
            r => r?,
        };
        let upload_ms = ms(t);
        let reference = manifest.reference();
        let verdict = fence();
        // The images go with the scratch directory, as for any checkpoint: what stays on the
        // node for a restart in place is the reference (its chunks are in the chunk cache,
        // encrypted as in the store).
        drop(scratch);
        if self.cfg.keep_latest && !matches!(verdict, Verdict::Fenced(_)) {
            for (name, rootfs_method, image_digest) in kept {
                let kept = KeptLatest {
                    checkpoint_ref: reference.to_string(),
                    rootfs_method,
                    tcp_established: self.cfg.tcp_established,
                    namespace: job.namespace.clone(),
                    manifest_digest: Some(crate::fence::manifest_digest(&manifest)),
                    bytes: manifest.stats.logical_bytes,
                    image_digest,
                };
                if let Err(e) = self.keep_latest(&pod.pod_uid, &name, &kept) {
                    warn!(%reference, error = %e, "could not keep the checkpoint's reference on the node");
                }
            }
        }
        if let Verdict::Fenced(why) = &verdict {
            warn!(%reference, %why, "fenced after upload: deleting the manifest");
            if let Err(e) = self.rt.block_on(self.store.delete_checkpoint(&reference)) {
                warn!(%reference, error = %e, "could not delete a fenced checkpoint's manifest");
            }
            return Err(AgentError::Fenced(why.clone()));
        }
        if let (Some(held), Some(limit)) = (held, job.hold) {
            self.hold(&pod.pod_uid, held, limit.saturating_sub(started.elapsed()));
        }
        Ok(CheckpointOutcome {
            reference: reference.to_string(),
            container_id: ids.join(","),
            container_name: names.join(","),
            pod_uid: pod.pod_uid,
            logical_bytes: manifest.stats.logical_bytes,
            uploaded_bytes: manifest.stats.written_bytes,
            freeze_ms,
            dump_ms,
            upload_ms,
            total_ms: ms(started),
            manifest_digest: crate::fence::manifest_digest(&manifest),
            verdict,
        })
    }
}

/// Completes when the upload is to stop: never without a stop handle, or once its sender is
/// gone without having asked.
async fn stopped(stop: Option<tokio::sync::watch::Receiver<bool>>) {
    if let Some(mut rx) = stop {
        if rx.wait_for(|stop| *stop).await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// What the manifest says of the capture, for one container or a whole pod.
struct Draft {
    source: Source,
    processes: Vec<ProcessInfo>,
    rootfs: Option<RootfsCapture>,
    timings: Timings,
    image_digest: Option<String>,
    gpu: Option<stasis_core::gpu::GpuFingerprint>,
    gpu_processes: u32,
}

/// A pod checkpoint's manifest fields, and its pod index written beside the containers'
/// directories (`pod.json`, one of the checkpoint's files). The manifest's own fields sum the
/// pod up: the first container as the source, every process, no rootfs of its own (each
/// container's is in the index), one freeze, the dumps and captures added up.
fn pod_draft(dir: &std::path::Path, names: &[String], captured: Vec<Captured>) -> Result<Draft> {
    let first = captured[0].source.clone();
    let mut timings = Timings {
        frozen_ms: captured[0].timings.frozen_ms,
        ..Timings::default()
    };
    let mut processes = Vec::new();
    let mut gpu = None;
    let mut gpu_processes = 0;
    let mut containers = Vec::with_capacity(captured.len());
    for (name, c) in names.iter().zip(captured) {
        timings.frozen_ms = timings.frozen_ms.max(c.timings.frozen_ms);
        timings.dump_ms += c.timings.dump_ms;
        timings.rootfs_ms += c.timings.rootfs_ms;
        processes.extend(c.processes.iter().cloned());
        gpu = gpu.or(c.gpu);
        gpu_processes += c.gpu_processes;
        containers.push(PodContainer {
            name: name.clone(),
            source: c.source,
            processes: c.processes,
            rootfs: c.rootfs,
            image_digest: c.image_digest,
            gpu_processes: c.gpu_processes,
        });
    }
    let path = dir.join(POD_INDEX_FILE);
    let body = serde_json::to_vec(&PodIndex { containers })
        .map_err(|e| AgentError::Invalid(format!("the pod index: {e}")))?;
    std::fs::write(&path, body).map_err(AgentError::io(&path))?;
    Ok(Draft {
        source: first,
        processes,
        rootfs: None,
        timings,
        image_digest: None,
        gpu,
        gpu_processes,
    })
}
