//! A checkpoint: resolve the container, fence, capture, draft the manifest, upload, fence
//! again, keep the reference for a restart in place.

use super::kept::KeptLatest;
use super::*;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stasis_core::{CheckpointId, Manifest, NodeFingerprint, Requirements, SCHEMA_VERSION};
use stasis_engine::checkpoint::{checkpoint_container, ContainerCheckpoint};
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
        crate::mem::trim();
        match &r {
            Ok(o) => {
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
        let c = self.resolve(&job.target)?;
        let pod = c.pod().unwrap_or_default();
        let container_name = match &job.target {
            Target::Pod {
                container_name: Some(n),
                ..
            } => n.clone(),
            _ => pod.container_name.clone(),
        };
        if let Verdict::Fenced(why) = fence() {
            return Err(AgentError::Fenced(why));
        }
        let key = self.keys.key(&job.namespace)?;
        let runc = Runc::new(Some(&self.cfg.runc_root))?;
        let scratch = Scratch::new(&self.cfg.work_dir, "checkpoint")?;
        let image = ImageDir::new(&scratch.0);
        let captured = checkpoint_container(&ContainerCheckpoint {
            runc: &runc,
            id: &c.id,
            image: &image,
            leave_running: job.leave_running,
            tcp_established: self.cfg.tcp_established,
        })?;
        info!(container = %c.id, frozen_ms = captured.timings.frozen_ms, dump_ms = captured.timings.dump_ms, "dumped");

        let id = CheckpointId::from_parts(now_ms(), rand::random());
        if let Some(tx) = &job.on_captured {
            let _ = tx.send(format!("{}/{}", job.stamp.lineage, id));
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
            (label::CONTAINER_NAME.to_owned(), container_name.clone()),
            (label::NODE.to_owned(), self.cfg.node_name.clone()),
            (
                label::TCP_ESTABLISHED.to_owned(),
                self.cfg.tcp_established.to_string(),
            ),
            (label::REASON.to_owned(), job.reason.clone()),
        ]);
        if let Some(h) = &job.spec_hash {
            labels.insert(label::SPEC_HASH.to_owned(), h.clone());
        }
        let draft = Manifest {
            schema_version: SCHEMA_VERSION,
            workload: job.stamp.lineage.clone(),
            created_at: id.created_rfc3339(),
            id,
            key_id: String::new(),
            source: captured.source,
            leave_running: captured.leave_running,
            requirements: Requirements {
                node: NodeFingerprint {
                    gpu: captured.gpu,
                    ..node::fingerprint()
                },
                needs_runc: captured.needs_runc,
                image_digest: captured.image_digest,
                declared: job.declared.clone(),
            },
            processes: captured.processes,
            rootfs: captured.rootfs,
            timings: captured.timings,
            stats: Default::default(),
            files: Vec::new(),
            gpu_processes: captured.gpu_processes,
            labels,
        };
        let (freeze_ms, dump_ms) = (draft.timings.frozen_ms, draft.timings.dump_ms);
        let left = remaining("for the upload")?;
        let t = Instant::now();
        let put = self
            .store
            .put_checkpoint(&key, draft, &scratch.0, &NoProgress);
        let manifest = match left {
            None => self.rt.block_on(put)?,
            Some(left) => self
                .rt
                .block_on(async { tokio::time::timeout(left, put).await })
                .map_err(|_| {
                    AgentError::Deadline(format!(
                        "upload cut off after {} ms; nothing was published",
                        left.as_millis()
                    ))
                })??,
        };
        let upload_ms = ms(t);
        let reference = manifest.reference();
        let verdict = fence();
        // The images go with the scratch directory, as for any checkpoint: what stays on the
        // node for a restart in place is the reference (its chunks are in the chunk cache,
        // encrypted as in the store).
        drop(scratch);
        if self.cfg.keep_latest && !matches!(verdict, Verdict::Fenced(_)) {
            let kept = KeptLatest {
                checkpoint_ref: reference.to_string(),
                rootfs_method: manifest.rootfs.as_ref().map(|r| r.method),
                tcp_established: self.cfg.tcp_established,
                namespace: job.namespace.clone(),
                manifest_digest: Some(crate::fence::manifest_digest(&manifest)),
                bytes: manifest.stats.logical_bytes,
                image_digest: manifest.requirements.image_digest.clone(),
            };
            if let Err(e) = self.keep_latest(&pod.pod_uid, &container_name, &kept) {
                warn!(%reference, error = %e, "could not keep the checkpoint's reference on the node");
            }
        }
        if let Verdict::Fenced(why) = &verdict {
            warn!(%reference, %why, "fenced after upload: deleting the manifest");
            if let Err(e) = self.rt.block_on(self.store.delete_checkpoint(&reference)) {
                warn!(%reference, error = %e, "could not delete a fenced checkpoint's manifest");
            }
            return Err(AgentError::Fenced(why.clone()));
        }
        Ok(CheckpointOutcome {
            reference: reference.to_string(),
            container_id: c.id,
            container_name,
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
