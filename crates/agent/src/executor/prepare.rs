//! A restore's preparation: the compatibility and spec-hash checks, the fetch, the digest
//! check against the published manifest, the plan file.

use super::*;

use std::time::Instant;

use stasis_core::fingerprint::RestoreTarget;
use stasis_core::{Manifest, NodeFingerprint};
use stasis_engine::node;
use stasis_node_api::planfile::{self};
use stasis_node_api::Plan;
use stasis_store::NoProgress;
use tracing::info;

use crate::error::{AgentError, Result};

/// A checkpoint fetched, verified and stamped in a pod's restore directory, its plan not
/// written yet.
pub(super) struct Fetched {
    pub(super) plan: Plan,
    pub(super) container_name: String,
    pub(super) fetch_ms: u64,
    pub(super) bytes: u64,
}

impl Executor {
    /// Fetches, verifies and unpacks a checkpoint for a pod on this node and writes the plan
    /// file the wrapper reads. Compatibility (node, image, declared versions) and the spec hash
    /// are checked before anything is fetched.
    pub fn prepare(&self, job: &PrepareJob) -> Result<Prepared> {
        let f = self.fetch_counted(job)?;
        let plan_path = self.write_plan(&job.pod_uid, &f.container_name, &f.plan)?;
        info!(checkpoint_ref = %f.plan.checkpoint_ref, pod_uid = %job.pod_uid, container = %f.container_name, fetch_ms = f.fetch_ms, "restore prepared");
        Ok(Prepared {
            checkpoint_ref: f.plan.checkpoint_ref,
            container_name: f.container_name,
            image_dir: f.plan.image_dir,
            plan_path,
            fetch_ms: f.fetch_ms,
            bytes: f.bytes,
        })
    }

    /// [`Executor::fetch_verified`], counted in the metrics.
    pub(super) fn fetch_counted(&self, job: &PrepareJob) -> Result<Fetched> {
        let r = self.fetch_verified(job);
        crate::mem::trim();
        match &r {
            Ok(f) => {
                self.metrics.restore("prepared");
                self.metrics.fetched_bytes(f.bytes);
                self.metrics.phase_ms("fetch", f.fetch_ms);
            }
            Err(e) => {
                self.metrics.restore("failed");
                self.metrics.error(e.kind());
            }
        }
        r
    }

    /// The checks, then the fetch into `<images>/<pod-uid>/<container>` (through the chunk
    /// cache when the store has one), the digest check, the verification stamp and the GPU
    /// record: everything a plan needs but the plan file.
    fn fetch_verified(&self, job: &PrepareJob) -> Result<Fetched> {
        if !safe_component(&job.pod_uid) {
            return Err(AgentError::Invalid(format!(
                "pod uid {:?} is not a safe path component",
                job.pod_uid
            )));
        }
        let key = self.keys.key(&job.namespace)?;
        let manifest = self
            .rt
            .block_on(self.store.read_manifest(&key, &job.reference))?;
        let exact = manifest.reference();
        verify_digest(&manifest, job)?;
        let container_name = job
            .container_name
            .clone()
            .or_else(|| manifest.labels.get(label::CONTAINER_NAME).cloned())
            .filter(|n| safe_component(n))
            .ok_or_else(|| {
                AgentError::Invalid(format!(
                    "{exact}: no (valid) container name to restore into"
                ))
            })?;
        // With this node's GPUs when the checkpoint recorded GPUs (else every GPU checkpoint is
        // refused as "this node has no NVIDIA driver").
        check_compatible(
            &manifest,
            job,
            node::fingerprint_for_restore(&manifest.requirements.node),
        )?;

        let pod_dir = self.pod_images(&job.pod_uid);
        private_dir(&self.cfg.images_dir)?;
        private_dir(&pod_dir)?;
        let fetch_dir = pod_dir.join(format!(
            ".fetch-{container_name}-{:08x}",
            rand::random::<u32>()
        ));
        private_dir(&fetch_dir)?;
        let t = Instant::now();
        let got =
            self.rt.block_on(
                self.store
                    .get_checkpoint(&key, &exact, &fetch_dir, &NoProgress),
            );
        // The manifest the files were fetched with (read again by the store) must be the
        // published one as well.
        if let Err(e) = got
            .map_err(AgentError::from)
            .and_then(|m| verify_digest(&m, job))
        {
            let _ = std::fs::remove_dir_all(&fetch_dir);
            return Err(e);
        }
        let fetch_ms = ms(t);
        let image_dir = pod_dir.join(&container_name);
        if image_dir.exists() {
            std::fs::remove_dir_all(&image_dir).map_err(AgentError::io(&image_dir))?;
        }
        std::fs::rename(&fetch_dir, &image_dir).map_err(AgentError::io(&image_dir))?;
        let checkpoint_ref = exact.to_string();
        planfile::write_verified_stamp(&image_dir, &checkpoint_ref)
            .map_err(AgentError::io(&image_dir))?;
        // What stasis-runc's restore must do on the GPU (it restores with runc, not the engine).
        stasis_engine::cuda::write_gpu_record(
            &image_dir,
            manifest.requirements.node.gpu.as_ref(),
            manifest.gpu_processes,
        )
        .map_err(AgentError::io(&image_dir))?;
        let tcp = manifest
            .labels
            .get(label::TCP_ESTABLISHED)
            .is_none_or(|v| v == "true");
        Ok(Fetched {
            plan: Plan {
                image_dir,
                rootfs_method: manifest.rootfs.as_ref().map(|r| r.method),
                checkpoint_ref,
                tcp_established: tcp,
            },
            container_name,
            fetch_ms,
            bytes: manifest.logical_bytes(),
        })
    }
}

/// Refuses a manifest whose digest is not the one the controller recorded for the checkpoint
/// (`job.manifest_digest`; nothing to check when `None`).
pub fn verify_digest(manifest: &Manifest, job: &PrepareJob) -> Result<()> {
    let Some(recorded) = &job.manifest_digest else {
        return Ok(());
    };
    let found = crate::fence::manifest_digest(manifest);
    if &found != recorded {
        return Err(AgentError::ManifestMismatch {
            reference: manifest.reference().to_string(),
            recorded: recorded.clone(),
            found,
        });
    }
    Ok(())
}

/// The checks before a fetch: the spec hash (never restore into a pod whose security-relevant
/// spec differs) and the compatibility rule.
pub fn check_compatible(
    manifest: &Manifest,
    job: &PrepareJob,
    node: NodeFingerprint,
) -> Result<()> {
    match (manifest.labels.get(label::SPEC_HASH), &job.spec_hash) {
        (Some(a), Some(b)) if a != b => {
            return Err(AgentError::SpecHash(format!(
                "pod spec hash differs: checkpoint has {a}, pod has {b}"
            )))
        }
        (None, Some(_)) => {
            return Err(AgentError::SpecHash(
                "the checkpoint records no pod spec hash".into(),
            ))
        }
        _ => {}
    }
    let target = RestoreTarget {
        node,
        image_digest: job.image_digest.clone(),
        declared: job.declared.clone(),
    };
    let mismatches = manifest.requirements.check(&target);
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(AgentError::Incompatible(mismatches))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use stasis_core::{CheckpointId, Requirements, Source, WorkloadName, SCHEMA_VERSION};
    use stasis_store::Key;

    /// A manifest of this node's checkpoint (also the restart in place's tests).
    pub(in crate::executor) fn manifest(
        labels: &[(&str, &str)],
        declared: &[(&str, &str)],
    ) -> Manifest {
        Manifest {
            schema_version: SCHEMA_VERSION,
            workload: WorkloadName::new("default_pod_x.0000beef").unwrap(),
            id: CheckpointId::from_parts(1_700_000_000_000, 7),
            created_at: String::new(),
            key_id: String::new(),
            source: Source::Container {
                container_id: "c".into(),
            },
            leave_running: true,
            requirements: Requirements {
                node: node::fingerprint(),
                needs_runc: false,
                image_digest: None,
                declared: declared
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
            processes: Vec::new(),
            rootfs: None,
            timings: Default::default(),
            stats: Default::default(),
            files: Vec::new(),
            gpu_processes: 0,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn job(spec_hash: Option<&str>, declared: &[(&str, &str)]) -> PrepareJob {
        PrepareJob {
            reference: "default_pod_x.0000beef/latest".parse().unwrap(),
            namespace: "default".into(),
            pod_uid: "u".into(),
            container_name: None,
            spec_hash: spec_hash.map(str::to_owned),
            image_digest: None,
            declared: declared
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            manifest_digest: None,
        }
    }

    /// The digest the writing agent reports is the one the restoring agent computes from the
    /// manifest it reads back through the store's envelope; a manifest replaced by a holder of
    /// the data key (validly sealed, one label changed) is refused as damage in the store, the
    /// typed `CheckpointDamaged` path, and so is one whose digest was never recorded right.
    #[test]
    fn a_manifest_other_than_the_published_one_is_refused() {
        let key = Key::random();
        let mut m = manifest(&[(label::SPEC_HASH, "blake3:aa")], &[]);
        m.key_id = key.id().to_owned();
        let written = crate::fence::manifest_digest(&m);
        assert!(
            written.starts_with("sha256:") && written.len() == 71,
            "{written}"
        );
        let sealed = stasis_store::envelope::seal(&key, &m).unwrap();
        let read = stasis_store::envelope::open(&key, "m", &m.workload, &m.id, &sealed).unwrap();
        assert_eq!(crate::fence::manifest_digest(&read), written);

        let mut j = job(Some("blake3:aa"), &[]);
        j.manifest_digest = Some(written.clone());
        verify_digest(&read, &j).unwrap();
        // No recorded digest (standalone, or published before digests): nothing to check.
        verify_digest(&read, &job(None, &[])).unwrap();

        let mut forged = m.clone();
        forged
            .labels
            .insert(label::SPEC_HASH.into(), "blake3:ff".into());
        let sealed = stasis_store::envelope::seal(&key, &forged).unwrap();
        let read = stasis_store::envelope::open(&key, "m", &m.workload, &m.id, &sealed).unwrap();
        let e = verify_digest(&read, &j).unwrap_err();
        assert!(
            matches!(&e, AgentError::ManifestMismatch { recorded, .. } if recorded == &written),
            "{e}"
        );
        assert!(e.is_integrity_failure());
        assert_eq!(e.kind(), "integrity");
    }

    /// Only the parts under test: the node itself may lack CRIU where unit tests run.
    fn blames(r: Result<()>, what: &str) -> bool {
        matches!(&r, Err(e @ (AgentError::Incompatible(_) | AgentError::SpecHash(_))) if e.to_string().contains(what))
    }

    #[test]
    fn spec_hash_and_declared_versions_are_checked_before_a_fetch() {
        let node = node::fingerprint();
        let m = manifest(&[(label::SPEC_HASH, "blake3:aa")], &[("engine", "v1")]);
        for what in ["spec hash", "declared"] {
            let r = check_compatible(
                &m,
                &job(Some("blake3:aa"), &[("engine", "v1")]),
                node.clone(),
            );
            assert!(!blames(r, what));
        }
        assert!(blames(
            check_compatible(
                &m,
                &job(Some("blake3:bb"), &[("engine", "v1")]),
                node.clone()
            ),
            "pod spec hash differs: checkpoint has blake3:aa, pod has blake3:bb"
        ));
        assert!(blames(
            check_compatible(
                &m,
                &job(Some("blake3:aa"), &[("engine", "v2")]),
                node.clone()
            ),
            "declared.engine"
        ));
        let unhashed = manifest(&[], &[]);
        assert!(blames(
            check_compatible(&unhashed, &job(Some("blake3:aa"), &[]), node.clone()),
            "records no pod spec hash"
        ));
        // Neither side hashed (standalone use): not a spec hash refusal.
        assert!(!blames(
            check_compatible(&unhashed, &job(None, &[]), node),
            "spec hash"
        ));
    }
}
