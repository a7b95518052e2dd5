//! A restore's preparation: the compatibility and spec-hash checks, the fetch, the digest
//! check against the published manifest, the plan file.

use super::*;

use super::pod;

use std::time::Instant;

use stasis_core::fingerprint::RestoreTarget;
use stasis_core::manifest::{pod_container_dir, PodIndex, POD_INDEX_FILE};
use stasis_core::{Manifest, NodeFingerprint};
use stasis_engine::node;
use stasis_node_api::planfile::{self};
use stasis_node_api::Plan;
use stasis_store::NoProgress;
use tracing::{info, warn};

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
    /// file the wrapper reads for each container it restores, and a skip note for each init
    /// container the restored pod must not run again. Compatibility (node, image, declared
    /// versions, the pod's containers) and the spec hash are checked before anything is fetched.
    pub fn prepare(&self, job: &PrepareJob) -> Result<Prepared> {
        let fetched = self.fetch_counted(job)?;
        let mut plan_paths = Vec::with_capacity(fetched.len());
        for f in &fetched {
            plan_paths.push(self.write_plan(&job.pod_uid, &f.container_name, &f.plan)?);
        }
        let first = &fetched[0];
        if let Some(layout) = &job.layout {
            for name in &layout.run_once {
                self.write_skip(&job.pod_uid, name, &first.plan.checkpoint_ref)?;
            }
        }
        // Until a container takes a checkpoint of its own, the one it restores is its latest:
        // a restart in place (an OOM kill, a create given up after it had restored) restores
        // it again, as on the node that took it.
        if self.cfg.keep_latest {
            for f in &fetched {
                let kept = KeptLatest {
                    checkpoint_ref: f.plan.checkpoint_ref.clone(),
                    rootfs_method: f.plan.rootfs_method,
                    tcp_established: f.plan.tcp_established,
                    namespace: job.namespace.clone(),
                    manifest_digest: job.manifest_digest.clone(),
                    bytes: f.bytes,
                    image_digest: job.image_digest.clone(),
                };
                if let Err(e) = self.keep_latest(&job.pod_uid, &f.container_name, &kept) {
                    warn!(checkpoint_ref = %kept.checkpoint_ref, error = %e, "could not keep the restored checkpoint's reference on the node");
                }
            }
        }
        let names: Vec<&str> = fetched.iter().map(|f| f.container_name.as_str()).collect();
        self.restoring_members(&job.pod_uid, &names);
        info!(checkpoint_ref = %first.plan.checkpoint_ref, pod_uid = %job.pod_uid, containers = ?names, fetch_ms = first.fetch_ms, "restore prepared");
        Ok(Prepared {
            checkpoint_ref: first.plan.checkpoint_ref.clone(),
            container_name: names.join(","),
            image_dir: first.plan.image_dir.clone(),
            plan_path: plan_paths.swap_remove(0),
            fetch_ms: first.fetch_ms,
            bytes: first.bytes,
        })
    }

    /// [`Executor::fetch_verified`], counted in the metrics.
    pub(super) fn fetch_counted(&self, job: &PrepareJob) -> Result<Vec<Fetched>> {
        let r = self.fetch_verified(job);
        crate::mem::trim();
        match &r {
            Ok(f) => {
                self.metrics.restore("prepared");
                self.metrics.fetched_bytes(f[0].bytes);
                self.metrics.phase_ms("fetch", f[0].fetch_ms);
            }
            Err(e) => {
                self.metrics.restore("failed");
                self.metrics.error(e.kind());
            }
        }
        r
    }

    /// The checks, then the fetch (through the chunk cache when the store has one), the digest
    /// check, and for each container restored its directory `<images>/<pod-uid>/<container>`
    /// (laid out as a one-container checkpoint), the verification stamp and the GPU record:
    /// everything its plan needs but the plan file. Every container, or none.
    fn fetch_verified(&self, job: &PrepareJob) -> Result<Vec<Fetched>> {
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
        let names = pod::restore_set(
            &manifest,
            job.container_name.as_deref(),
            job.layout.as_ref(),
        )?;
        // With this node's GPUs when the checkpoint recorded GPUs (else every GPU checkpoint is
        // refused as "this node has no NVIDIA driver").
        check_compatible(
            &manifest,
            job,
            node::fingerprint_for_restore(&manifest.requirements.node),
        )?;
        self.make_room(&manifest)?;

        let pod_dir = self.pod_images(&job.pod_uid);
        private_dir(&self.cfg.images_dir)?;
        private_dir(&pod_dir)?;
        // Lazily where the checkpoint and the node allow it: the container runs before its
        // memory has arrived (DESIGN §6.2a); otherwise, or when that cannot start, in full.
        match self.lazy_choice(&manifest) {
            Ok(()) => match self.stage_lazy_all(job, &key, &manifest, &names) {
                Ok(f) => return Ok(f),
                Err(e) => {
                    warn!(reference = %exact, error = %e, "the lazy restore could not start: restoring in full")
                }
            },
            Err(why) => info!(reference = %exact, %why, "restoring in full"),
        }
        let fetch_dir = pod_dir.join(format!(".fetch-{}-{:08x}", names[0], rand::random::<u32>()));
        private_dir(&fetch_dir)?;
        let t = Instant::now();
        let got =
            self.rt.block_on(
                self.store
                    .get_checkpoint(&key, &exact, &fetch_dir, &NoProgress),
            );
        // The manifest the files were fetched with (read again by the store) must be the
        // published one as well; a pod checkpoint's index must name its containers.
        let index = got
            .map_err(AgentError::from)
            .and_then(|m| verify_digest(&m, job))
            .and_then(|()| read_index(&fetch_dir, &manifest));
        let index = match index {
            Ok(i) => i,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&fetch_dir);
                return Err(e);
            }
        };
        let fetch_ms = ms(t);
        let checkpoint_ref = exact.to_string();
        let tcp = restores_established_tcp(&manifest);
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let (src, rootfs, gpu_processes) = match &index {
                None => (
                    fetch_dir.clone(),
                    manifest.rootfs.as_ref(),
                    manifest.gpu_processes,
                ),
                Some(i) => {
                    let c = i
                        .containers
                        .iter()
                        .find(|c| c.name == name)
                        .expect("the index names the manifest's containers");
                    (
                        fetch_dir.join(pod_container_dir(&name)),
                        c.rootfs.as_ref(),
                        c.gpu_processes,
                    )
                }
            };
            let image_dir = pod_dir.join(&name);
            if image_dir.exists() {
                std::fs::remove_dir_all(&image_dir).map_err(AgentError::io(&image_dir))?;
            }
            std::fs::rename(&src, &image_dir).map_err(AgentError::io(&image_dir))?;
            planfile::write_verified_stamp(&image_dir, &checkpoint_ref)
                .map_err(AgentError::io(&image_dir))?;
            // What stasis-runc's restore must do on the GPU (it restores with runc, not the
            // engine).
            stasis_engine::cuda::write_gpu_record(
                &image_dir,
                manifest.requirements.node.gpu.as_ref(),
                gpu_processes,
            )
            .map_err(AgentError::io(&image_dir))?;
            out.push(Fetched {
                plan: Plan {
                    image_dir,
                    rootfs_method: rootfs.map(|r| r.method),
                    checkpoint_ref: checkpoint_ref.clone(),
                    tcp_established: tcp,
                    lazy: false,
                    work_dir: None,
                },
                container_name: name,
                fetch_ms,
                bytes: manifest.logical_bytes(),
            });
        }
        // What is left of a pod checkpoint: its index, the containers not restored here.
        let _ = std::fs::remove_dir_all(&fetch_dir);
        Ok(out)
    }
}

/// A pod checkpoint's index, fetched with its files and checked against its manifest; `None`
/// for a one-container checkpoint.
fn read_index(dir: &std::path::Path, manifest: &Manifest) -> Result<Option<PodIndex>> {
    let exact = manifest.reference();
    if manifest
        .pod_containers()
        .map_err(|e| AgentError::Invalid(format!("{exact}: {e}")))?
        .is_none()
    {
        return Ok(None);
    }
    let path = dir.join(POD_INDEX_FILE);
    let raw = std::fs::read(&path).map_err(AgentError::io(&path))?;
    parse_index(&raw, manifest).map(Some)
}

/// A pod checkpoint's index from its bytes (fetched with the files, or read through the store
/// by a lazy restore), checked against its manifest: it names the manifest's containers.
pub(super) fn parse_index(raw: &[u8], manifest: &Manifest) -> Result<PodIndex> {
    let exact = manifest.reference();
    let index: PodIndex = serde_json::from_slice(raw)
        .map_err(|e| AgentError::Invalid(format!("{exact}: its pod index: {e}")))?;
    index
        .check(manifest)
        .map_err(|e| AgentError::Invalid(format!("{exact}: {e}")))?;
    Ok(index)
}

/// Refuses a manifest whose digest is not the one the controller recorded for the checkpoint
/// (`job.manifest_digest`; nothing to check when `None`).
/// Whether a restore of `manifest` restores its established TCP connections: as its checkpoint
/// dumped them (a checkpoint without the label, from before it, did).
pub(super) fn restores_established_tcp(manifest: &Manifest) -> bool {
    manifest
        .labels
        .get(label::TCP_ESTABLISHED)
        .is_none_or(|v| v == "true")
}

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
            layout: None,
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
