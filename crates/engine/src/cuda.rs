//! CUDA steps of a checkpoint and a restore (DESIGN §7), around the CRIU dump and restore.
//!
//! # Order of operations
//!
//! Checkpoint (leave-running or stop):
//! 1. [`cuda_processes`] / [`suspend`] find the CUDA processes of the tree;
//! 2. [`suspend`] refuses unsupported setups (MIG, MPS, NCCL shared-memory communicators, a
//!    `/dev/nvidia*` holder without a CUDA context), then **locks all** of them, each with a
//!    timeout (a lock that times out unlocks the ones already locked and fails the checkpoint; the
//!    workload keeps running), then **checkpoints all** (device memory moves into each process's
//!    host memory and the GPU is released, so CRIU sees only ordinary memory);
//! 3. the engine runs the CRIU dump (the GPU memory travels in CRIU's page images);
//! 4. leave-running: [`SuspendedGpu::resume`] **restores all, then unlocks all**; `--stop`:
//!    CRIU killed the processes, [`SuspendedGpu::discard`]. Any other exit (an error, `?`)
//!    drops the [`SuspendedGpu`], which restores and unlocks: a process is never left locked.
//!
//! Record [`SuspendedGpu::pids`] and [`gpu_fingerprint`] with the checkpoint.
//!
//! Restore:
//! 1. the compatibility rule (`stasis_core::gpu::check`) has passed;
//! 2. CRIU restores the tree (detached: its threads run, which the driver needs);
//! 3. [`resume_restored`] **restores all** recorded CUDA pids, with GPU UUID pairs from
//!    [`remap_for`] when the node's GPUs are not the recorded ones (driver r580+), **then unlocks
//!    all**. It finishes from whatever state it finds, so it also works when CRIU's own CUDA
//!    plugin already did part of it. A process whose restore fails must be killed (cold start).
//!
//! Without an NVIDIA driver, or without CUDA processes in the tree, every step is a no-op.
//! Ordering note: stasis locks and checkpoints *before* CRIU freezes the tree, so the driver's
//! restore thread is running and CRIU's CUDA plugin is not needed (if it is installed it sees
//! CHECKPOINTED processes and leaves them alone).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
pub use stasis_core::gpu::GpuFingerprint;
pub use stasis_gpu::detect::Procfs;
use stasis_gpu::{detect, Suspension, WithDeadline};
pub use stasis_gpu::{
    CheckpointApi, Driver, GpuError as CudaError, GpuPair, GpuProbe, GpuUuid, PhaseTimings,
    ProcessState,
};

/// Lock timeout when the caller has none: CRIU's default `--timeout` (10 s), which CRIU's own
/// CUDA plugin uses too.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// Environment variable CRIU reads for its plugin directory (`criu/plugin.c`).
pub const CRIU_LIBS_DIR_ENV: &str = "CRIU_LIBS_DIR";
/// The empty plugin directory stasis gives CRIU when it can create one there.
pub const EMPTY_CRIU_PLUGIN_DIR: &str = "/run/stasis/criu-no-plugins";

/// What a stasis binary does to its own environment first thing in `main`, before any thread
/// exists (changing the environment races with threads that read it); returns what it did, to
/// be logged once logging is set up:
///
/// - removes `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` ([`stasis_gpu::driver::unmask_device_view`]):
///   stasis drives other processes' GPUs and must see every GPU the driver has;
/// - points CRIU, and runc's CRIU, at an empty plugin directory ([`EMPTY_CRIU_PLUGIN_DIR`]) through
///   `CRIU_LIBS_DIR`, unless the operator set one: where a node has CRIU's own CUDA plugin
///   (`/usr/lib/criu/cuda_plugin.so`) it would act on the CUDA processes stasis already drives
///   (restore them without UUID pairs, spawn `cuda-checkpoint` inside the freeze, and mark every
///   image as needing the plugin, which a node without it then cannot restore).
pub fn prepare_process_env() -> Vec<String> {
    let mut did: Vec<String> = stasis_gpu::driver::unmask_device_view()
        .into_iter()
        .map(|(k, v)| format!("removed {k}={v} from stasis's environment (it must see every GPU)"))
        .collect();
    if std::env::var_os(CRIU_LIBS_DIR_ENV).is_some() {
        did.push(format!(
            "{CRIU_LIBS_DIR_ENV} set by the operator: CRIU loads its plugins from there"
        ));
        return did;
    }
    match empty_plugin_dir(std::path::Path::new(EMPTY_CRIU_PLUGIN_DIR)) {
        Ok(()) => std::env::set_var(CRIU_LIBS_DIR_ENV, EMPTY_CRIU_PLUGIN_DIR),
        Err(why) => did.push(format!(
            "CRIU keeps its default plugin directory (a CUDA plugin there would act on CUDA \
             processes too): {why}"
        )),
    }
    did
}

/// Makes `dir` an empty directory only this user can write, or says why it cannot be used. CRIU
/// runs as root and loads every `.so` in its plugin directory, so one that someone else could
/// have written to is refused rather than trusted.
pub fn empty_plugin_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let shown = dir.display();
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {shown}: {e}"))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {shown}: {e}")),
    }
    let md = std::fs::symlink_metadata(dir).map_err(|e| format!("{shown}: {e}"))?;
    if !md.is_dir() {
        return Err(format!("{shown} is not a directory"));
    }
    if md.uid() != nix::unistd::geteuid().as_raw() || md.mode() & 0o022 != 0 {
        return Err(format!(
            "{shown} is not a directory only this user can write (owner {}, mode {:o})",
            md.uid(),
            md.mode() & 0o7777
        ));
    }
    let mut entries = std::fs::read_dir(dir).map_err(|e| format!("{shown}: {e}"))?;
    if let Some(Ok(e)) = entries.next() {
        return Err(format!(
            "{shown} is not empty ({}): stasis will not point CRIU at plugins it did not choose",
            e.file_name().to_string_lossy()
        ));
    }
    Ok(())
}

/// The process-wide CUDA driver; `None` on a machine without one (or without the checkpoint API).
pub fn driver() -> Option<Arc<Driver>> {
    match Driver::shared() {
        Ok(d) => Some(d),
        Err(e) => {
            tracing::debug!(error = %e, "no usable CUDA driver");
            None
        }
    }
}

/// The node's GPUs for its fingerprint (NVML); `None` without an NVIDIA driver.
pub fn gpu_fingerprint() -> Option<GpuFingerprint> {
    stasis_gpu::fingerprint().ok()
}

/// The GPU side of `stasis doctor`: says "no NVIDIA driver" when there is none.
pub fn probe() -> GpuProbe {
    stasis_gpu::probe()
}

/// The pids among `pids` (a process tree) that hold a CUDA context, in the given order: those
/// with a `/dev/nvidia*` fd or libcuda mapped whose `cuCheckpointProcessGetState` succeeds.
/// Empty without a driver.
pub fn cuda_processes(pids: &[i32]) -> Vec<i32> {
    let candidates = Procfs::default().gpu_candidates(pids);
    if candidates.is_empty() {
        return Vec::new();
    }
    match driver() {
        Some(d) => confirm(guarded(d).as_ref(), &candidates),
        None => Vec::new(),
    }
}

fn confirm(api: &dyn CheckpointApi, candidates: &[i32]) -> Vec<i32> {
    candidates
        .iter()
        .copied()
        .filter(|&p| api.state(p).is_ok())
        .collect()
}

/// How stasis's GPU steps of one checkpoint went, for reports: each phase, the bytes the driver
/// moved, and how long the workload's CUDA calls were blocked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GpuCheckpointReport {
    /// CUDA processes checkpointed.
    pub processes: u32,
    /// Loading libcuda and `cuInit` in this process (0 when an earlier call already did).
    pub driver_load_ms: f64,
    /// Lock all, checkpoint all; restore all and unlock all (leave-running only).
    #[serde(flatten)]
    pub phases: PhaseTimings,
    /// GPU memory the checkpoint released, by NVML (in use before the lock minus in use once
    /// checkpointed, over all GPUs): what the driver copied into host memory. More than the
    /// workload's own data (allocator caches, library workspaces, the contexts); `None` when NVML
    /// did not answer.
    pub bytes_moved: Option<u64>,
    /// The workload's CUDA calls were blocked for this long: from the first lock to the last
    /// unlock (leave-running), or to the end of the dump (stop, where the workload ends).
    pub blocked_ms: f64,
}

/// How stasis's GPU steps of one restore went, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GpuRestoreReport {
    /// CUDA processes restored.
    pub processes: u32,
    /// Loading libcuda and `cuInit` in this process (0 when an earlier call already did).
    pub driver_load_ms: f64,
    /// Restore all (host memory → GPU), unlock all.
    #[serde(flatten)]
    pub phases: PhaseTimings,
    /// Whether the processes were restored onto other GPUs than recorded (UUID pairs, r580+).
    pub remapped: bool,
    /// Every GPU step of the restore: driver load, NVML, restore, unlock.
    pub total_ms: f64,
}

pub(crate) fn ms_f64(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// CUDA processes locked and checkpointed for a CRIU dump. Resume or discard it; dropping it
/// resumes (restore + unlock) whatever is still held, and kills a process that cannot be resumed.
#[derive(Debug)]
pub struct SuspendedGpu {
    inner: Suspension,
    gpus: GpuFingerprint,
    driver_load: Duration,
    blocked_since: Instant,
    bytes_moved: Option<u64>,
}

impl SuspendedGpu {
    /// The CUDA processes, in checkpoint order: record them, [`resume_restored`] needs them.
    pub fn pids(&self) -> Vec<i32> {
        self.inner.pids()
    }

    /// The GPUs of this node when they were checkpointed: record them with the checkpoint (a
    /// restore compares them with its node's).
    pub fn fingerprint(&self) -> &GpuFingerprint {
        &self.gpus
    }

    /// Lock and checkpoint times.
    pub fn timings(&self) -> PhaseTimings {
        self.inner.timings()
    }

    fn report(&self, phases: PhaseTimings) -> GpuCheckpointReport {
        GpuCheckpointReport {
            processes: self.inner.pids().len() as u32,
            driver_load_ms: ms_f64(self.driver_load),
            phases,
            bytes_moved: self.bytes_moved,
            blocked_ms: ms_f64(self.blocked_since.elapsed()),
        }
    }

    /// Leave-running path, after the CRIU dump: restore all, then unlock all. A process that
    /// cannot be resumed has been killed when this returns its error
    /// ([`CudaError::NotResumed`]): it would otherwise block in CUDA for ever.
    pub fn resume(self) -> Result<GpuCheckpointReport, CudaError> {
        let mut report = self.report(PhaseTimings::default());
        report.phases = self.inner.resume()?;
        report.blocked_ms = ms_f64(self.blocked_since.elapsed());
        Ok(report)
    }

    /// `--stop` path: CRIU killed the processes after dumping them; nothing to resume.
    pub fn discard(self) -> GpuCheckpointReport {
        let r = self.report(self.inner.timings());
        self.inner.discard();
        r
    }
}

/// Kills a CUDA process that could not be brought back to RUNNING: left CHECKPOINTED or LOCKED
/// it would block in its next CUDA call for ever, and a failed restore cannot be retried
/// (cuda-checkpoint #44). Killing a process whose GPU state is in host memory is safe (unlike a
/// live restored one, cuda-checkpoint #53).
fn kill_stranded(pid: i32) {
    tracing::error!(
        pid,
        "CUDA process could not be resumed after the checkpoint; killing it (cold start)"
    );
    if let Err(e) = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    ) {
        tracing::warn!(pid, error = %e, "could not kill the stranded CUDA process");
    }
}

/// The CUDA driver with a deadline on every call ([`stasis_gpu::WithDeadline`]).
fn guarded(driver: Arc<Driver>) -> Arc<dyn CheckpointApi> {
    Arc::new(WithDeadline::new(
        driver,
        stasis_gpu::deadline::call_deadline(),
    ))
}

/// GPU memory in use over all GPUs (NVML); `None` when NVML does not answer.
fn gpu_memory_used() -> Option<u64> {
    stasis_gpu::nvml::memory_used()
        .ok()
        .and_then(|v| v.into_iter().sum::<Option<u64>>())
}

/// Locks (each with `lock_timeout`) and then checkpoints every CUDA process among `pids`.
///
/// `Ok(None)`: nothing to do (empty list, no process touches the GPU). An error leaves every
/// process running: [`CudaError::LockTimeout`] names the pid and the timeout;
/// [`CudaError::Unsupported`] says which setup was refused; [`CudaError::NoDriver`] when a
/// process has NVIDIA devices open but stasis cannot load the driver library.
pub fn suspend(pids: &[i32], lock_timeout: Duration) -> Result<Option<SuspendedGpu>, CudaError> {
    let procfs = Procfs::default();
    if procfs.gpu_candidates(pids).is_empty() {
        return Ok(None);
    }
    let t = Instant::now();
    let driver = match Driver::shared() {
        Ok(d) => d,
        Err(e) => {
            // Processes that only map libcuda without a device open need nothing; with a device
            // open CRIU would fail on it, so say why now.
            return match pids.iter().find(|&&p| procfs.has_nvidia_fd(p)) {
                Some(p) => Err(CudaError::NoDriver(format!(
                    "process {p} has NVIDIA devices open but the CUDA driver cannot be used: {e}"
                ))),
                None => Ok(None),
            };
        }
    };
    let driver_load = t.elapsed();
    let gpus = stasis_gpu::fingerprint();
    if let Err(e) = &gpus {
        tracing::warn!(error = %e, "NVML does not describe this node's GPUs");
    }
    Ok(suspend_with(
        guarded(driver),
        &procfs,
        gpus.as_ref().ok(),
        &gpu_memory_used,
        pids,
        lock_timeout,
    )?
    .map(|mut s| {
        s.driver_load = driver_load;
        s
    }))
}

/// [`suspend`] against any [`CheckpointApi`] and `/proc` (tests use a simulator and a fake
/// `/proc`); `gpus` is the node's fingerprint (recorded with the checkpoint, and for the MIG
/// check), `memory_used` the GPU memory in use over all GPUs (for the bytes moved).
pub fn suspend_with(
    api: Arc<dyn CheckpointApi>,
    procfs: &Procfs,
    gpus: Option<&GpuFingerprint>,
    memory_used: &dyn Fn() -> Option<u64>,
    pids: &[i32],
    lock_timeout: Duration,
) -> Result<Option<SuspendedGpu>, CudaError> {
    let candidates = procfs.gpu_candidates(pids);
    let mut cuda = Vec::with_capacity(candidates.len());
    for &p in &candidates {
        match api.state(p) {
            Ok(_) => cuda.push(p),
            // A device open without a context the driver can move: CRIU cannot dump it.
            Err(e) if procfs.has_nvidia_fd(p) => {
                return Err(CudaError::Unsupported(format!(
                    "process {p} has /dev/nvidia* open but no CUDA context the driver can \
                     checkpoint ({e}); CRIU cannot dump open NVIDIA device files (an NVML \
                     handle, or a child forked from a CUDA process without exec)"
                )));
            }
            Err(_) => {} // libcuda loaded, CUDA never initialised: plain memory.
        }
    }
    if cuda.is_empty() {
        return Ok(None);
    }
    // A checkpoint that does not say which GPUs it needs could not be restored safely (nor
    // resumed: a restore resumes the GPU state only of checkpoints that recorded GPUs).
    let Some(gpus) = gpus else {
        return Err(CudaError::NoDriver(format!(
            "CUDA processes {cuda:?} run here but NVML does not describe this node's GPUs, \
             which a GPU checkpoint must record"
        )));
    };
    if let Some((i, d)) = gpus
        .devices
        .iter()
        .enumerate()
        .find(|(_, d)| d.mig_enabled == Some(true))
    {
        return Err(CudaError::Unsupported(format!(
            "GPU {i} ({}) is in MIG mode; the CUDA checkpoint API does not support MIG",
            d.uuid
        )));
    }
    procfs.check_supported(&cuda)?;
    let mut recorded = gpus.clone();
    recorded.workload_gpus = workload_gpus(procfs, gpus, &cuda);
    let used_before = memory_used();
    let blocked_since = Instant::now();
    let inner =
        stasis_gpu::suspend_all_with(api, &cuda, lock_timeout, Some(Box::new(kill_stranded)))?;
    let bytes_moved = used_before
        .zip(memory_used())
        .map(|(before, after)| before.saturating_sub(after));
    Ok(Some(SuspendedGpu {
        inner,
        gpus: recorded,
        driver_load: Duration::ZERO,
        blocked_since,
        bytes_moved,
    }))
}

/// The GPUs the CUDA processes among `pids` were given (`NVIDIA_VISIBLE_DEVICES`, set by the
/// device plugin in a pod's containers), as UUIDs of `node`'s GPUs, in first-seen order; empty
/// when they were given the whole node or it cannot be told (then a restore pairs GPUs by count).
fn workload_gpus(procfs: &Procfs, node: &GpuFingerprint, pids: &[i32]) -> Vec<String> {
    let mut out = Vec::new();
    for &p in pids {
        let Some(v) = procfs.environ_var(p, stasis_gpu::uuid::VISIBLE_DEVICES_ENV) else {
            continue;
        };
        match stasis_gpu::visible_devices(&v, node) {
            Ok(Some(uuids)) => {
                for u in uuids {
                    if !out.contains(&u) {
                        out.push(u);
                    }
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(pid = p, error = %e, "which GPUs the workload uses is unknown")
            }
        }
    }
    out
}

/// The GPUs the device plugin gave the container a bundle describes (`NVIDIA_VISIBLE_DEVICES`
/// in its `process.env`), as UUIDs of `node`'s GPUs; empty when it names none in particular.
pub fn bundle_gpus(
    bundle: &std::path::Path,
    node: &GpuFingerprint,
) -> Result<Vec<String>, CudaError> {
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        process: Option<Process>,
    }
    #[derive(serde::Deserialize)]
    struct Process {
        #[serde(default)]
        env: Vec<String>,
    }
    let path = bundle.join("config.json");
    let cfg: Config = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| {
            CudaError::Unsupported(format!(
                "{} is unreadable: which GPUs the pod was given is unknown",
                path.display()
            ))
        })?;
    let prefix = format!("{}=", stasis_gpu::uuid::VISIBLE_DEVICES_ENV);
    let value = cfg
        .process
        .map(|p| p.env)
        .unwrap_or_default()
        .into_iter()
        .find_map(|kv| kv.strip_prefix(&prefix).map(str::to_owned));
    match value {
        Some(v) => Ok(stasis_gpu::visible_devices(&v, node)?.unwrap_or_default()),
        None => Ok(Vec::new()),
    }
}

/// File in a prepared image directory that says what a restore must do on the GPU: the agent
/// writes it from the checkpoint's manifest, and `stasis-runc`, which restores pods with
/// `runc restore`, reads it.
pub const GPU_RECORD_FILE: &str = "stasis-gpu.json";

/// What a restore needs to know about a checkpoint's GPU state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct GpuRecord {
    /// CUDA processes checkpointed through the driver.
    pub processes: u32,
    /// The GPUs they ran on (and were given).
    pub recorded: GpuFingerprint,
}

/// Writes [`GPU_RECORD_FILE`] into `image_dir` when the checkpoint holds GPU state; removes a
/// stale one otherwise.
pub fn write_gpu_record(
    image_dir: &std::path::Path,
    recorded: Option<&GpuFingerprint>,
    processes: u32,
) -> std::io::Result<()> {
    let path = image_dir.join(GPU_RECORD_FILE);
    match recorded.filter(|_| processes > 0) {
        Some(r) => {
            let record = GpuRecord {
                processes,
                recorded: r.clone(),
            };
            std::fs::write(&path, serde_json::to_vec(&record).unwrap_or_default())
        }
        None => match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
    }
}

/// [`GPU_RECORD_FILE`] of `image_dir`: `None` when the checkpoint holds no GPU state.
pub fn read_gpu_record(image_dir: &std::path::Path) -> Result<Option<GpuRecord>, CudaError> {
    let path = image_dir.join(GPU_RECORD_FILE);
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| CudaError::Unsupported(format!("{} is unreadable: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CudaError::Unsupported(format!(
            "{} is unreadable: {e}",
            path.display()
        ))),
    }
}

/// After CRIU restored a tree rooted at `root` holding `processes` CUDA processes checkpointed on
/// `recorded`: restores their GPU state onto this node's GPUs — those the device plugin gave the
/// new container when `bundle` names them ([`bundle_gpus`], [`remap_onto`]) — and unlocks them
/// (DESIGN §7). An error leaves them CHECKPOINTED: the caller kills them (cold start).
pub fn resume_after_restore(
    root: i32,
    processes: u32,
    recorded: &GpuFingerprint,
    bundle: Option<&std::path::Path>,
) -> Result<GpuRestoreReport, CudaError> {
    let started = Instant::now();
    // Loaded here so that its cost shows on its own line of the report (kept for later calls).
    let _ = driver();
    let driver_load = started.elapsed();
    let node = gpu_fingerprint().ok_or_else(|| {
        CudaError::NoDriver(
            "the checkpoint holds GPU state and this node has no NVIDIA driver".into(),
        )
    })?;
    let assigned = match bundle {
        Some(b) => bundle_gpus(b, &node)?,
        None => Vec::new(),
    };
    let remap = remap_onto(recorded, &node, &assigned)?;
    if remap.is_some() && node.persistence_mode == Some(false) {
        // The documented requirement (persistence mode or cuInit in the caller) is met by the
        // cuInit above, but NVIDIA's own migration demo refuses to run without persistence mode.
        tracing::warn!(
            "restoring onto other GPUs with persistence mode off; if the restore fails, turn \
             persistence mode on (nvidia-smi -pm 1 or nvidia-persistenced) and retry"
        );
    }
    let phases = resume_restored_tree(root, processes as usize, remap.as_deref())?;
    Ok(GpuRestoreReport {
        processes,
        driver_load_ms: ms_f64(driver_load),
        phases,
        remapped: remap.is_some(),
        total_ms: ms_f64(started.elapsed()),
    })
}

/// After CRIU restored the tree: restore (onto other GPUs when `uuid_remap` names pairs) and
/// then unlock every pid of `pids` (the [`SuspendedGpu::pids`] recorded at checkpoint time).
/// No pids: nothing to do. Pids but no driver: [`CudaError::NoDriver`].
pub fn resume_restored(
    pids: &[i32],
    uuid_remap: Option<&[GpuPair]>,
) -> Result<PhaseTimings, CudaError> {
    if pids.is_empty() {
        return Ok(PhaseTimings::default());
    }
    let api = guarded(Driver::shared()?);
    resume_restored_with(api.as_ref(), pids, uuid_remap)
}

/// [`resume_restored`] against any [`CheckpointApi`].
pub fn resume_restored_with(
    api: &dyn CheckpointApi,
    pids: &[i32],
    uuid_remap: Option<&[GpuPair]>,
) -> Result<PhaseTimings, CudaError> {
    stasis_gpu::resume_restored(api, pids, uuid_remap.unwrap_or(&[]))
}

/// After CRIU restored a tree rooted at `root`: [`resume_restored`] for every process of the
/// tree the driver knows as a CUDA process. For containers, whose host pids change on restore,
/// and whenever the recorded pids are not at hand. `expected` is the number of CUDA processes the
/// checkpoint had ([`SuspendedGpu::pids`]`.len()`): fewer found, or none because there is no
/// driver, is an error rather than a process left hanging in a CUDA call.
pub fn resume_restored_tree(
    root: i32,
    expected: usize,
    uuid_remap: Option<&[GpuPair]>,
) -> Result<PhaseTimings, CudaError> {
    if expected == 0 {
        return Ok(PhaseTimings::default());
    }
    let api = guarded(Driver::shared()?);
    resume_restored_tree_with(api.as_ref(), &Procfs::default(), root, expected, uuid_remap)
}

/// [`resume_restored_tree`] against any [`CheckpointApi`] and `/proc`.
pub fn resume_restored_tree_with(
    api: &dyn CheckpointApi,
    procfs: &Procfs,
    root: i32,
    expected: usize,
    uuid_remap: Option<&[GpuPair]>,
) -> Result<PhaseTimings, CudaError> {
    let pids: Vec<i32> = detect::process_tree(procfs, root)
        .into_iter()
        .filter(|&p| api.state(p).is_ok())
        .collect();
    let timings = resume_restored_with(api, &pids, uuid_remap)?;
    if pids.len() < expected {
        return Err(CudaError::Unsupported(format!(
            "the checkpoint had {expected} CUDA processes, the restored tree of pid {root} has {}",
            pids.len()
        )));
    }
    Ok(timings)
}

/// UUID pairs to restore a checkpoint recorded on `recorded` onto this node's `node` GPUs:
/// `None` when they are the same GPUs; an error when the node cannot take it (driver < r580).
/// Both fingerprints are whole nodes' (the driver wants every GPU it sees named); for a pod,
/// [`remap_onto`] puts the workload on the GPUs the pod was given.
pub fn remap_for(
    recorded: &GpuFingerprint,
    node: &GpuFingerprint,
) -> Result<Option<Vec<GpuPair>>, CudaError> {
    stasis_gpu::plan_remap(recorded, node)
}

/// [`remap_for`], with the workload's GPUs ([`GpuFingerprint::workload_gpus`]) going onto the GPUs
/// the device plugin gave the new container (`assigned`, from [`bundle_gpus`]; empty: unknown,
/// then as [`remap_for`]). Below r580 a change of GPU is refused, naming the GPUs.
pub fn remap_onto(
    recorded: &GpuFingerprint,
    node: &GpuFingerprint,
    assigned: &[String],
) -> Result<Option<Vec<GpuPair>>, CudaError> {
    stasis_gpu::plan_remap_assigned(recorded, node, assigned)
}

/// The whole process tree under `root` (root first), for [`suspend`].
pub fn process_tree(root: i32) -> Vec<i32> {
    detect::process_tree(&Procfs::default(), root)
}

#[cfg(test)]
mod tests;
