//! The synchronous executor: checkpoints (engine + store upload) and restore preparation
//! (store fetch + verification + plan file). It runs on plain threads; the store's async calls
//! go through a tokio [`Handle`] (`block_on` from a non-runtime thread). Nothing here is async,
//! and the engine (which forks runc and CRIU) never runs on a runtime thread.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use stasis_core::fingerprint::RestoreTarget;
use stasis_core::{
    CheckpointId, CheckpointRef, Manifest, NodeFingerprint, Requirements, WorkloadName,
    SCHEMA_VERSION,
};
use stasis_engine::checkpoint::{checkpoint_container, ContainerCheckpoint};
use stasis_engine::image::ImageDir;
use stasis_engine::node;
use stasis_engine::runc::Runc;
use stasis_node_api::planfile::{self, PlanFile};
use stasis_node_api::{Plan, PROTOCOL_VERSION};
use stasis_store::{Key, NoProgress, Store};
use tokio::runtime::Handle;
use tracing::{info, warn};

use crate::error::{AgentError, Result};
use crate::fence::{Stamp, Verdict};
use crate::metrics::Metrics;
use crate::resolve;

/// Manifest labels the agent writes (and reads back when preparing a restore).
pub mod label {
    pub const LINEAGE: &str = "stasis.dev/lineage";
    pub const GENERATION: &str = "stasis.dev/generation";
    pub const NAMESPACE: &str = "stasis.dev/namespace";
    pub const POD_NAME: &str = "stasis.dev/pod-name";
    pub const POD_UID: &str = "stasis.dev/pod-uid";
    pub const CONTAINER_NAME: &str = "stasis.dev/container-name";
    pub const SPEC_HASH: &str = "stasis.dev/spec-hash";
    pub const NODE: &str = "stasis.dev/node";
    pub const TCP_ESTABLISHED: &str = "stasis.dev/tcp-established";
    pub const REASON: &str = "stasis.dev/reason";
}

/// Where things live on the node.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// The runc root containerd's runc shim uses (`/run/containerd/runc/k8s.io`).
    pub runc_root: PathBuf,
    /// Scratch space for CRIU images before upload (`/var/lib/stasis/work`).
    pub work_dir: PathBuf,
    /// Fetched, verified images (`/var/lib/stasis/images/<pod-uid>/<container>`).
    pub images_dir: PathBuf,
    /// Plan files the wrapper reads (`/run/stasis/plans`).
    pub plans_dir: PathBuf,
    pub node_name: String,
    /// How long a plan file stays valid.
    pub plan_ttl: Duration,
    /// Dump established TCP connections (`--tcp-established`).
    pub tcp_established: bool,
    /// Keep each container's latest checkpoint images (`<images>/<pod-uid>/.latest-<container>`)
    /// after the upload, for a restart in place (an OOM kill) without a fetch.
    pub keep_latest: bool,
}

/// What a kept latest checkpoint is (`.stasis-latest.json` in its directory).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct KeptLatest {
    checkpoint_ref: String,
    rootfs_method: Option<stasis_core::manifest::RootfsMethod>,
    tcp_established: bool,
}
const KEPT_LATEST: &str = ".stasis-latest.json";
/// Written when a kept checkpoint is planned for a restart in place: a second OOM kill before
/// the next checkpoint does not restore it again (no restore loop).
const RESTORED_IN_PLACE: &str = ".stasis-restored-in-place";

/// Which container to checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    ContainerId(String),
    /// The pod's one app container (or the named one).
    Pod {
        uid: String,
        container_name: Option<String>,
    },
}

/// One checkpoint to take.
#[derive(Debug, Clone)]
pub struct CheckpointJob {
    pub target: Target,
    pub namespace: String,
    pub pod_name: String,
    pub stamp: Stamp,
    pub spec_hash: Option<String>,
    pub declared: BTreeMap<String, String>,
    /// `Heartbeat`, `Termination`, ... (a manifest label).
    pub reason: String,
    pub leave_running: bool,
    /// Bound on the whole checkpoint; the upload is cut off at it (nothing is published then).
    pub deadline: Option<Instant>,
    /// Told the reference the checkpoint will publish as soon as the container is captured and
    /// running again, before the upload (a termination checkpoint lets the stop go on).
    pub on_captured: Option<std::sync::mpsc::Sender<String>>,
}

/// What a checkpoint produced.
#[derive(Debug, Clone)]
pub struct CheckpointOutcome {
    pub reference: String,
    pub container_id: String,
    pub container_name: String,
    pub pod_uid: String,
    pub logical_bytes: u64,
    pub uploaded_bytes: u64,
    pub freeze_ms: u64,
    pub dump_ms: u64,
    pub upload_ms: u64,
    pub total_ms: u64,
    /// [`crate::fence::manifest_digest`] of the published manifest (the controller records it).
    pub manifest_digest: String,
    pub verdict: Verdict,
}

/// One restore to prepare.
#[derive(Debug, Clone)]
pub struct PrepareJob {
    pub reference: CheckpointRef,
    pub namespace: String,
    pub pod_uid: String,
    /// The container to restore into; the manifest's label when `None`.
    pub container_name: Option<String>,
    /// The target pod's normalised spec hash; must equal the checkpoint's.
    pub spec_hash: Option<String>,
    pub image_digest: Option<String>,
    pub declared: BTreeMap<String, String>,
    /// The manifest digest the controller recorded when it published the checkpoint: the
    /// manifest read from the store must have it, before anything is fetched and again for the
    /// one the files were fetched with. `None`: not checked (the standalone agent, which has no
    /// records; a checkpoint published before digests were recorded).
    pub manifest_digest: Option<String>,
}

/// A prepared restore.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub checkpoint_ref: String,
    pub container_name: String,
    pub image_dir: PathBuf,
    pub plan_path: PathBuf,
    pub fetch_ms: u64,
    pub bytes: u64,
}

/// Gives the data key of a namespace.
pub trait KeySource: Send + Sync {
    fn key(&self, namespace: &str) -> Result<Key>;
}

/// One key for every namespace (tests, single-tenant setups).
pub struct StaticKey(pub Key);

impl KeySource for StaticKey {
    fn key(&self, _namespace: &str) -> Result<Key> {
        Ok(self.0.clone())
    }
}

pub struct Executor {
    pub cfg: ExecutorConfig,
    store: Arc<Store>,
    keys: Arc<dyn KeySource>,
    rt: Handle,
    pub metrics: Arc<Metrics>,
}

/// The wall clock, Unix milliseconds.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ms(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// Creates a root-only (0700) directory and its parents.
pub fn private_dir(p: &Path) -> Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(p)
        .map_err(AgentError::io(p))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700)).map_err(AgentError::io(p))
}

/// A scratch directory removed on drop; `<what>-<pid>-<rand>` so a later run removes the ones a
/// killed agent left.
struct Scratch(PathBuf);

impl Scratch {
    fn new(dir: &Path, what: &str) -> Result<Self> {
        private_dir(dir)?;
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let name = e.file_name();
                let pid = name
                    .to_str()
                    .and_then(|n| n.split('-').nth(1))
                    .and_then(|p| p.parse::<i32>().ok());
                if let Some(pid) = pid {
                    if !Path::new(&format!("/proc/{pid}")).exists() {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
            }
        }
        let p = dir.join(format!(
            "{what}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        private_dir(&p)?;
        Ok(Scratch(p))
    }
}

impl Scratch {
    /// Keeps the directory: moves it to `to` (same filesystem), replacing what is there.
    fn keep(self, to: &Path) -> Result<()> {
        if to.exists() {
            std::fs::remove_dir_all(to).map_err(AgentError::io(to))?;
        }
        let r = std::fs::rename(&self.0, to).map_err(AgentError::io(to));
        drop(self);
        r
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn safe_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl Executor {
    pub fn new(
        cfg: ExecutorConfig,
        store: Arc<Store>,
        keys: Arc<dyn KeySource>,
        rt: Handle,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            cfg,
            store,
            keys,
            rt,
            metrics,
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The container a target names.
    pub fn resolve(&self, target: &Target) -> Result<resolve::RuncContainer> {
        match target {
            Target::ContainerId(id) => resolve::by_id(&self.cfg.runc_root, id)
                .filter(|c| c.kind() != resolve::Kind::Sandbox)
                .ok_or_else(|| AgentError::UnknownContainer(id.clone())),
            Target::Pod {
                uid,
                container_name,
            } => resolve::app_container(
                &resolve::list(&self.cfg.runc_root),
                &self.cfg.runc_root,
                uid,
                container_name.as_deref(),
            ),
        }
    }

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
        if self.cfg.keep_latest && !matches!(verdict, Verdict::Fenced(_)) {
            let kept = KeptLatest {
                checkpoint_ref: reference.to_string(),
                rootfs_method: manifest.rootfs.as_ref().map(|r| r.method),
                tcp_established: self.cfg.tcp_established,
            };
            let gpu = (
                manifest.requirements.node.gpu.as_ref(),
                manifest.gpu_processes,
            );
            if let Err(e) = self.keep_latest(scratch, &pod.pod_uid, &container_name, &kept, gpu) {
                warn!(%reference, error = %e, "could not keep the checkpoint's images on the node");
            }
        } else {
            drop(scratch);
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

    fn pod_images(&self, pod_uid: &str) -> PathBuf {
        self.cfg.images_dir.join(pod_uid)
    }

    fn kept_dir(&self, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
        (safe_component(pod_uid) && safe_component(container_name)).then(|| {
            self.pod_images(pod_uid)
                .join(format!(".latest-{container_name}"))
        })
    }

    fn keep_latest(
        &self,
        scratch: Scratch,
        pod_uid: &str,
        container_name: &str,
        kept: &KeptLatest,
        (gpu, gpu_processes): (Option<&stasis_core::gpu::GpuFingerprint>, u32),
    ) -> Result<()> {
        let Some(dir) = self.kept_dir(pod_uid, container_name) else {
            return Ok(());
        };
        private_dir(&self.cfg.images_dir)?;
        private_dir(&self.pod_images(pod_uid))?;
        scratch.keep(&dir)?;
        planfile::write_verified_stamp(&dir, &kept.checkpoint_ref).map_err(AgentError::io(&dir))?;
        // What stasis-runc's restore must do on the GPU (it restores with runc, not the engine).
        stasis_engine::cuda::write_gpu_record(&dir, gpu, gpu_processes)
            .map_err(AgentError::io(&dir))?;
        let f = dir.join(KEPT_LATEST);
        std::fs::write(&f, serde_json::to_vec(kept).unwrap_or_default()).map_err(AgentError::io(&f))
    }

    /// A restart in place (the container was OOM-killed): a plan file for the container's kept
    /// latest checkpoint, which the wrapper's `create` of the restarted container takes. `Err`
    /// says why not: nothing kept, or the kept checkpoint was restored in place already (it
    /// ended the same way: a cold start, not a restore loop).
    pub fn plan_in_place(
        &self,
        pod_uid: &str,
        container_name: &str,
    ) -> std::result::Result<Plan, String> {
        let dir = self
            .kept_dir(pod_uid, container_name)
            .ok_or_else(|| "no valid pod UID and container name".to_owned())?;
        let kept: KeptLatest = std::fs::read(dir.join(KEPT_LATEST))
            .ok()
            .and_then(|raw| serde_json::from_slice(&raw).ok())
            .ok_or_else(|| "no checkpoint of this container kept on this node".to_owned())?;
        if dir.join(RESTORED_IN_PLACE).exists() {
            return Err(format!(
                "its latest checkpoint {} was restored in place already and the container was OOM-killed again (no restore loop)",
                kept.checkpoint_ref
            ));
        }
        let plan = Plan {
            image_dir: dir.clone(),
            rootfs_method: kept.rootfs_method,
            checkpoint_ref: kept.checkpoint_ref.clone(),
            tcp_established: kept.tcp_established,
        };
        self.write_plan(pod_uid, container_name, &plan)
            .map_err(|e| e.to_string())?;
        std::fs::write(dir.join(RESTORED_IN_PLACE), b"").map_err(|e| e.to_string())?;
        info!(checkpoint_ref = %kept.checkpoint_ref, %pod_uid, container = %container_name, "restart in place prepared");
        Ok(plan)
    }

    /// Fetches, verifies and unpacks a checkpoint for a pod on this node and writes the plan
    /// file the wrapper reads. Compatibility (node, image, declared versions) and the spec hash
    /// are checked before anything is fetched.
    pub fn prepare(&self, job: &PrepareJob) -> Result<Prepared> {
        let r = self.prepare_inner(job);
        crate::mem::trim();
        match &r {
            Ok(p) => {
                self.metrics.restore("prepared");
                self.metrics.fetched_bytes(p.bytes);
                self.metrics.phase_ms("fetch", p.fetch_ms);
            }
            Err(e) => {
                self.metrics.restore("failed");
                self.metrics.error(e.kind());
            }
        }
        r
    }

    fn prepare_inner(&self, job: &PrepareJob) -> Result<Prepared> {
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
        let plan_path = self.write_plan(
            &job.pod_uid,
            &container_name,
            &Plan {
                image_dir: image_dir.clone(),
                rootfs_method: manifest.rootfs.as_ref().map(|r| r.method),
                checkpoint_ref: checkpoint_ref.clone(),
                tcp_established: tcp,
            },
        )?;
        info!(%checkpoint_ref, pod_uid = %job.pod_uid, container = %container_name, fetch_ms, "restore prepared");
        Ok(Prepared {
            checkpoint_ref,
            container_name,
            image_dir,
            plan_path,
            fetch_ms,
            bytes: manifest.logical_bytes(),
        })
    }

    /// Writes the plan file `pod_<uid>_<container>.json` the wrapper's `create` of that
    /// container takes (valid for `plan_ttl`).
    fn write_plan(&self, pod_uid: &str, container_name: &str, plan: &Plan) -> Result<PathBuf> {
        let path = planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name)
            .ok_or_else(|| AgentError::Invalid("no plan path for this pod".into()))?;
        private_dir(&self.cfg.plans_dir)?;
        planfile::write(
            &path,
            &PlanFile {
                v: PROTOCOL_VERSION,
                container_id: None,
                pod_uid: Some(pod_uid.to_owned()),
                container_name: Some(container_name.to_owned()),
                plan: plan.clone(),
                expires_at_unix_ms: Some(now_ms() + self.cfg.plan_ttl.as_millis() as u64),
            },
        )
        .map_err(AgentError::io(&path))?;
        Ok(path)
    }

    /// The plan for a container, from the plan files (the `restore_plan` request).
    pub fn plan_for(
        &self,
        container_id: &str,
        pod_uid: &str,
        container_name: &str,
    ) -> Option<Plan> {
        let candidates = [
            planfile::path_for_container(&self.cfg.plans_dir, container_id),
            planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name),
        ];
        candidates
            .into_iter()
            .flatten()
            .find_map(|p| planfile::read(&p).ok().flatten())
            .filter(|f| f.expires_at_unix_ms.is_none_or(|t| t > now_ms()))
            .map(|f| f.plan)
    }

    /// Forgets a pod container's restore: its plan files (consumed or not) and image dir.
    pub fn forget(&self, pod_uid: &str, container_name: &str) {
        if let Some(p) = planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name) {
            let _ = std::fs::remove_file(&p);
            let mut c = p.into_os_string();
            c.push(".consumed");
            let _ = std::fs::remove_file(PathBuf::from(c));
        }
        if safe_component(pod_uid) && safe_component(container_name) {
            let d = self.pod_images(pod_uid);
            let _ = std::fs::remove_dir_all(d.join(container_name));
            let _ = std::fs::remove_dir(d);
        }
    }

    /// Removes consumed plans, and the plans and images of pods no longer on this node.
    pub fn sweep(&self, live_pod_uids: &HashSet<String>) {
        if let Ok(rd) = std::fs::read_dir(&self.cfg.plans_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let stale = name.ends_with(".consumed")
                    || name
                        .strip_prefix("pod_")
                        .and_then(|r| r.split('_').next())
                        .is_some_and(|uid| !live_pod_uids.contains(uid));
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.cfg.images_dir) {
            for e in rd.flatten() {
                let uid = e.file_name().to_string_lossy().into_owned();
                if !live_pod_uids.contains(&uid) {
                    info!(pod_uid = %uid, "removing the restore images of a pod no longer here");
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
}

/// The checks before a fetch: the spec hash (never restore into a pod whose security-relevant
/// spec differs) and the compatibility rule.
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

pub fn check_compatible(
    manifest: &Manifest,
    job: &PrepareJob,
    node: NodeFingerprint,
) -> Result<()> {
    match (manifest.labels.get(label::SPEC_HASH), &job.spec_hash) {
        (Some(a), Some(b)) if a != b => {
            return Err(AgentError::Incompatible(format!(
                "pod spec hash differs: checkpoint has {a}, pod has {b}"
            )))
        }
        (None, Some(_)) => {
            return Err(AgentError::Incompatible(
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
        Err(AgentError::Incompatible(
            mismatches
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        ))
    }
}

/// The workload name a checkpoint reference's lineage part gives.
pub fn lineage_of(reference: &str) -> Option<WorkloadName> {
    reference.parse::<CheckpointRef>().ok().map(|r| r.workload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::Source;

    fn manifest(labels: &[(&str, &str)], declared: &[(&str, &str)]) -> Manifest {
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
        matches!(r, Err(AgentError::Incompatible(m)) if m.contains(what))
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

    #[test]
    fn plans_are_found_swept_and_forgotten() {
        let t = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let exec = Executor::new(
            ExecutorConfig {
                runc_root: t.path().join("runc"),
                work_dir: t.path().join("work"),
                images_dir: t.path().join("images"),
                plans_dir: t.path().join("plans"),
                node_name: "n".into(),
                plan_ttl: Duration::from_secs(60),
                tcp_established: true,
                keep_latest: true,
            },
            Arc::new(Store::open(&format!("file://{}", t.path().join("store").display())).unwrap()),
            Arc::new(StaticKey(Key::random())),
            rt.handle().clone(),
            Arc::new(Metrics::default()),
        );
        private_dir(&exec.cfg.plans_dir).unwrap();
        let plan = |expires: u64| PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("live".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: t.path().join("images/live/app"),
                rootfs_method: None,
                checkpoint_ref: "l/1".into(),
                tcp_established: true,
            },
            expires_at_unix_ms: Some(expires),
        };
        let live = planfile::path_for_pod(&exec.cfg.plans_dir, "live", "app").unwrap();
        planfile::write(&live, &plan(now_ms() + 60_000)).unwrap();
        assert_eq!(
            exec.plan_for("cid", "live", "app")
                .map(|p| p.checkpoint_ref),
            Some("l/1".into())
        );
        assert!(exec.plan_for("cid", "live", "other").is_none());
        // Expired plans are not offered.
        planfile::write(&live, &plan(1)).unwrap();
        assert!(exec.plan_for("cid", "live", "app").is_none());
        planfile::write(&live, &plan(now_ms() + 60_000)).unwrap();

        let gone = planfile::path_for_pod(&exec.cfg.plans_dir, "gone", "app").unwrap();
        planfile::write(&gone, &plan(now_ms() + 60_000)).unwrap();
        let consumed = exec.cfg.plans_dir.join("x.json.consumed");
        std::fs::write(&consumed, "{}").unwrap();
        for uid in ["live", "gone"] {
            std::fs::create_dir_all(exec.cfg.images_dir.join(uid).join("app")).unwrap();
        }
        exec.sweep(&HashSet::from(["live".to_owned()]));
        assert!(live.exists() && !gone.exists() && !consumed.exists());
        assert!(exec.cfg.images_dir.join("live/app").exists());
        assert!(!exec.cfg.images_dir.join("gone").exists());

        exec.forget("live", "app");
        assert!(!live.exists());
        assert!(!exec.cfg.images_dir.join("live").exists());
        // Unsafe names never reach the file system.
        exec.forget("../x", "app");
        assert!(!safe_component("../x") && !safe_component(".hidden") && safe_component("a-b_c.1"));
    }
}
