//! The synchronous executor: checkpoints (engine + store upload) and restore preparation
//! (store fetch + verification + plan file). It runs on plain threads; the store's async calls
//! go through a tokio [`Handle`] (`block_on` from a non-runtime thread). Nothing here is async,
//! and the engine (which forks runc and CRIU) never runs on a runtime thread.
//!
//! - `checkpoint`: a checkpoint (capture, manifest, upload, fence);
//! - `prepare`: a restore's preparation (checks, fetch, verify, plan file);
//! - `history`: each pod's recent checkpoint costs and newest published one (a final
//!   checkpoint's deadline decision);
//! - `kept`: the reference to the latest checkpoint kept on the node, and the restart in place
//!   prepared from it;
//! - `lazy`: restores whose memory the agent serves after the container runs (lazy pages), and
//!   the choice of a full restore where they cannot apply;
//! - `members`: a pod restore of several containers kept in step when one of them starts cold;
//! - `plans`: the plan files the wrapper reads, and the sweep of stale ones;
//! - `pod`: which containers a pod checkpoint holds and a restore prepares.

mod checkpoint;
mod history;
mod hold;
mod kept;
mod lazy;
mod members;
mod plans;
mod pod;
mod prepare;
pub(crate) mod room;

pub use kept::{KeptLatest, NotInPlace};
pub use lazy::{LazyFailure, LazyRestore};
pub use members::OutOfStep;
pub use pod::PodLayout;
pub use prepare::{check_compatible, verify_digest};

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stasis_core::CheckpointRef;
use stasis_store::{Key, Store};
use tokio::runtime::Handle;

use crate::error::{AgentError, Result};
use crate::fence::{Stamp, Verdict};
use crate::metrics::Metrics;
use crate::resolve;

/// Manifest labels the agent writes (and reads back when preparing a restore).
use stasis_core::names::manifest as label;

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
    /// Keep a reference to each container's latest checkpoint
    /// (`<images>/<pod-uid>/.latest-<container>/.stasis-latest.json`, no images) for a restart
    /// in place after an OOM kill, fetched through the node's chunk cache.
    pub keep_latest: bool,
}

impl ExecutorConfig {
    /// The work dirs of lazy restores (`/run/stasis/lazy`): beside the plans, on the run
    /// directory that the wrapper shares (a tmpfs on a node), not on the images' disk.
    pub fn lazy_dir(&self) -> PathBuf {
        stasis_node_api::planfile::lazy_root(&self.plans_dir)
    }
}

/// What to checkpoint: every container of a pod at one instant (its app containers and native
/// sidecars), unless a container name narrows it to one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The pod of this container (a container outside any pod: that container).
    ContainerId(String),
    /// The pod with this UID (or its one named container).
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
    /// The pod's members by its spec ([`PodLayout::members`]): a pod checkpoint is taken only
    /// when every one runs. Empty: not known.
    pub expected: Vec<String>,
    /// Keep the pod frozen from the capture until its stop comes, at most this long from the
    /// checkpoint's start (a little before its freeze) (the eviction responder's final checkpoint and a spot notice's, when the
    /// pod's policy has `holdUntilEvicted`): it then does no work its replacement does again.
    pub hold: Option<Duration>,
    /// A heartbeat's: told when its capture is done, and its upload stopped (nothing published,
    /// [`AgentError::Superseded`]) when the receiver it gets turns `true`.
    pub upload_stop: Option<Arc<dyn UploadStop>>,
    /// A termination checkpoint taken ahead of the pod's stop (the eviction responder's): the
    /// stop that follows is answered with it only when the pod was held since, or a new
    /// checkpoint does not fit the stop's time left ([`Executor::final_covering`]).
    pub ahead_of_stop: bool,
}

/// How a checkpoint's upload can be stopped for a newer checkpoint of the same pod (the agent's
/// implementation: [`crate::busy::Busy::upload_stop`]).
pub trait UploadStop: Send + Sync + std::fmt::Debug {
    /// The capture is done and the upload of `reference` starts: from now on the upload stops
    /// when the receiver turns `true`.
    fn uploading(&self, reference: &str) -> tokio::sync::watch::Receiver<bool>;
    /// The checkpoint ended (published, stopped, failed), before its caller lets the pod go.
    fn finished(&self, _outcome: &Result<CheckpointOutcome>) {}
}

/// How long the eviction responder's checkpoint holds a pod frozen from the checkpoint's start,
/// waiting for its stop ([`CheckpointJob::hold`]); then it runs on.
pub const HOLD_BOUND: Duration = Duration::from_secs(60);

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
    /// The one container to restore (a restart in place); `None`: the pod's containers, or the
    /// manifest's label for a one-container checkpoint.
    pub container_name: Option<String>,
    /// The target pod's containers: the restore prepares every member (they must be the
    /// checkpoint's) and skip notes for its init containers. `None`: not known.
    pub layout: Option<PodLayout>,
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
    /// The latest termination capture of each pod: its reference and container ids (see
    /// [`Executor::final_covering`]).
    finals: std::sync::Mutex<std::collections::HashMap<String, FinalCapture>>,
    /// Each pod's recent checkpoints ([`Executor::final_decision`]).
    history: history::Histories,
    /// The lazy restores this agent serves (off until [`Executor::set_lazy_restore`]).
    lazy: lazy::LazyRestores,
    /// The pod restores of several containers not yet all restored ([`Executor::member_cold`]).
    in_step: members::PodRestores,
    /// Pods held frozen after their checkpoint until their stop ([`CheckpointJob::hold`]).
    holds: hold::Holds,
}

/// A termination checkpoint's capture of a pod.
#[derive(Debug, Clone)]
struct FinalCapture {
    cover: FinalCover,
    container_ids: Vec<String>,
    at: Instant,
}

/// The termination capture that holds a stopping container ([`Executor::final_covering`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalCover {
    pub reference: String,
    /// Taken ahead of the stop ([`CheckpointJob::ahead_of_stop`]): the pod may have run since.
    pub ahead_of_stop: bool,
}

/// How long a pod's termination capture stands for its other containers' stops.
const FINAL_COVERS: Duration = Duration::from_secs(120);

/// The wall clock, Unix milliseconds: the project's one clock.
pub(crate) use stasis_core::time::now_ms;

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
            finals: Default::default(),
            history: Default::default(),
            lazy: Default::default(),
            in_step: Default::default(),
            holds: Default::default(),
        }
    }

    /// The reference of a termination checkpoint, taken in the last two minutes, that captured
    /// container `container_id` of pod `pod_uid`: the kubelet stops a pod's containers one by
    /// one (sidecars after the app containers), and the first stop's checkpoint holds them all
    /// at one instant; a second one would find its peers gone. A container restarted since has
    /// another id and is not covered. A capture taken ahead of the stop (the eviction
    /// responder's) is said to be one: the stop decides whether a new checkpoint is worth it.
    pub fn final_covering(&self, pod_uid: &str, container_id: &str) -> Option<FinalCover> {
        let mut m = self.finals.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, f| f.at.elapsed() < FINAL_COVERS);
        m.get(pod_uid)
            .filter(|f| f.container_ids.iter().any(|c| c == container_id))
            .map(|f| f.cover.clone())
    }

    fn record_final(&self, pod_uid: &str, cover: FinalCover, container_ids: Vec<String>) {
        let mut m = self.finals.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(
            pod_uid.to_owned(),
            FinalCapture {
                cover,
                container_ids,
                at: Instant::now(),
            },
        );
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// A container by id (not a pod sandbox).
    pub fn resolve(&self, id: &str) -> Result<resolve::RuncContainer> {
        resolve::by_id(&self.cfg.runc_root, id)
            .filter(|c| c.kind() != resolve::Kind::Sandbox)
            .ok_or_else(|| AgentError::UnknownContainer(id.to_owned()))
    }

    /// The containers a target names, to be checkpointed together.
    pub fn resolve_members(&self, target: &Target) -> Result<Vec<resolve::RuncContainer>> {
        let (uid, name) = match target {
            Target::ContainerId(id) => {
                let c = self.resolve(id)?;
                match c.pod() {
                    Some(p) if !p.pod_uid.is_empty() => (p.pod_uid, None),
                    _ => return Ok(vec![c]),
                }
            }
            Target::Pod {
                uid,
                container_name,
            } => (uid.clone(), container_name.clone()),
        };
        resolve::members(
            &resolve::list(&self.cfg.runc_root),
            &self.cfg.runc_root,
            &uid,
            name.as_deref(),
        )
    }
}

/// An executor on a `file://` store under `dir` (with `store` when given), for unit tests: no
/// runc root, no cluster.
#[cfg(test)]
pub(crate) fn test_executor(
    dir: &Path,
    rt: &tokio::runtime::Runtime,
    store: Option<Store>,
    key: Key,
) -> Executor {
    let store = store.unwrap_or_else(|| {
        Store::open(&format!("file://{}", dir.join("store").display())).unwrap()
    });
    Executor::new(
        ExecutorConfig {
            runc_root: dir.join("runc"),
            work_dir: dir.join("work"),
            images_dir: dir.join("images"),
            plans_dir: dir.join("plans"),
            node_name: "n".into(),
            plan_ttl: Duration::from_secs(60),
            tcp_established: true,
            keep_latest: true,
        },
        Arc::new(store),
        Arc::new(StaticKey(key)),
        rt.handle().clone(),
        Arc::new(Metrics::default()),
    )
}

/// A current-thread runtime for [`test_executor`].
#[cfg(test)]
pub(crate) fn test_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
