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
use std::time::Duration;

pub use stasis_core::gpu::GpuFingerprint;
pub use stasis_gpu::detect::Procfs;
use stasis_gpu::{detect, Suspension};
pub use stasis_gpu::{
    CheckpointApi, Driver, GpuError as CudaError, GpuPair, GpuProbe, GpuUuid, PhaseTimings,
    ProcessState,
};

/// Lock timeout when the caller has none: CRIU's default `--timeout` (10 s), which CRIU's own
/// CUDA plugin uses too.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

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
        Some(d) => confirm(d.as_ref(), &candidates),
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

/// CUDA processes locked and checkpointed for a CRIU dump. Resume or discard it; dropping it
/// resumes (restore + unlock) whatever is still held.
#[derive(Debug)]
pub struct SuspendedGpu {
    inner: Suspension,
}

impl SuspendedGpu {
    /// The CUDA processes, in checkpoint order: record them, [`resume_restored`] needs them.
    pub fn pids(&self) -> Vec<i32> {
        self.inner.pids()
    }

    /// Lock and checkpoint times.
    pub fn timings(&self) -> PhaseTimings {
        self.inner.timings()
    }

    /// Leave-running path, after the CRIU dump: restore all, then unlock all.
    pub fn resume(self) -> Result<PhaseTimings, CudaError> {
        self.inner.resume()
    }

    /// `--stop` path: CRIU killed the processes after dumping them; nothing to resume.
    pub fn discard(self) -> PhaseTimings {
        self.inner.discard()
    }
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
    suspend_with(
        driver,
        &procfs,
        gpu_fingerprint().as_ref(),
        pids,
        lock_timeout,
    )
}

/// [`suspend`] against any [`CheckpointApi`] and `/proc` (tests use a simulator and a fake
/// `/proc`); `gpus` is the node's fingerprint, for the MIG check.
pub fn suspend_with(
    api: Arc<dyn CheckpointApi>,
    procfs: &Procfs,
    gpus: Option<&GpuFingerprint>,
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
    if let Some(fp) = gpus {
        if let Some((i, d)) = fp
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
    }
    procfs.check_supported(&cuda)?;
    let inner = stasis_gpu::suspend_all(api, &cuda, lock_timeout)?;
    Ok(Some(SuspendedGpu { inner }))
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
    let driver = Driver::shared()?;
    resume_restored_with(driver.as_ref(), pids, uuid_remap)
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
    let driver = Driver::shared()?;
    resume_restored_tree_with(
        driver.as_ref(),
        &Procfs::default(),
        root,
        expected,
        uuid_remap,
    )
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
/// For a pod, give both fingerprints with the pod's allocated GPUs only, not the whole node's.
pub fn remap_for(
    recorded: &GpuFingerprint,
    node: &GpuFingerprint,
) -> Result<Option<Vec<GpuPair>>, CudaError> {
    stasis_gpu::plan_remap(recorded, node)
}

/// The whole process tree under `root` (root first), for [`suspend`].
pub fn process_tree(root: i32) -> Vec<i32> {
    detect::process_tree(&Procfs::default(), root)
}

#[cfg(test)]
mod tests {
    //! No GPU here: the driver is [`stasis_gpu::sim::SimDriver`] (it follows the driver's state
    //! machine) and `/proc` is a temporary directory; the real-driver paths are checked to be
    //! no-ops on this driverless machine.
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    use stasis_core::gpu::GpuDevice;
    use stasis_gpu::sim::SimDriver;
    use stasis_gpu::Op;

    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn fake_proc(procs: &[(i32, &[&str], &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for (pid, fds, maps) in procs {
            let d = t.path().join(pid.to_string());
            fs::create_dir_all(d.join("fd")).unwrap();
            for (i, f) in fds.iter().enumerate() {
                symlink(f, d.join("fd").join(i.to_string())).unwrap();
            }
            fs::write(d.join("maps"), maps).unwrap();
            fs::write(d.join("comm"), "python3\n").unwrap();
        }
        t
    }

    fn proc_at(p: &Path) -> Procfs {
        Procfs::new(p)
    }

    #[test]
    fn empty_list_or_no_gpu_process_is_none_without_a_driver() {
        // This machine has no NVIDIA driver: nothing to do, and no error.
        assert!(suspend(&[], T).unwrap().is_none());
        let me = std::process::id() as i32;
        assert!(suspend(&[me], T).unwrap().is_none());
        assert!(cuda_processes(&[me]).is_empty());
        assert_eq!(resume_restored(&[], None).unwrap(), PhaseTimings::default());
    }

    #[test]
    fn restoring_gpu_pids_without_a_driver_is_a_clear_error() {
        if Path::new("/proc/driver/nvidia").exists() {
            return; // a GPU machine
        }
        let e = resume_restored(&[12345], None).unwrap_err();
        assert!(e.to_string().starts_with("no NVIDIA driver"), "{e}");
    }

    #[test]
    fn doctor_says_no_nvidia_driver_here() {
        if Path::new("/proc/driver/nvidia").exists() {
            return;
        }
        assert_eq!(probe().summary(), "no NVIDIA driver");
        assert!(gpu_fingerprint().is_none());
    }

    #[test]
    fn suspends_only_the_cuda_processes_of_the_tree() {
        let t = fake_proc(&[
            (1, &["/dev/null"], ""),
            (2, &["/dev/nvidiactl", "/dev/nvidia0"], ""),
            (3, &[], "7f-80 r-xp 0 0:0 1 /usr/lib/libcuda.so.1\n"), // libcuda, no context
            (4, &["/dev/nvidia-uvm"], ""),
        ]);
        let sim = Arc::new(SimDriver::with_processes(&[2, 4]));
        let s = suspend_with(sim.clone(), &proc_at(t.path()), None, &[1, 2, 3, 4], T)
            .unwrap()
            .unwrap();
        assert_eq!(s.pids(), [2, 4]);
        assert_eq!(sim.state_of(2), Some(ProcessState::Checkpointed));
        s.resume().unwrap();
        assert_eq!(sim.state_of(2), Some(ProcessState::Running));
        assert_eq!(sim.state_of(4), Some(ProcessState::Running));
    }

    #[test]
    fn no_cuda_context_in_the_tree_is_none() {
        let t = fake_proc(&[(3, &[], "/usr/lib/libcuda.so.1\n")]);
        let sim = Arc::new(SimDriver::default());
        assert!(suspend_with(sim, &proc_at(t.path()), None, &[3], T)
            .unwrap()
            .is_none());
    }

    #[test]
    fn device_holder_without_context_is_refused() {
        let t = fake_proc(&[(2, &["/dev/nvidia0"], ""), (5, &["/dev/nvidiactl"], "")]);
        let sim = Arc::new(SimDriver::with_processes(&[2]));
        let e = suspend_with(sim.clone(), &proc_at(t.path()), None, &[2, 5], T).unwrap_err();
        assert!(
            e.to_string().contains("process 5 has /dev/nvidia* open"),
            "{e}"
        );
        assert!(sim.log().is_empty(), "nothing locked");
    }

    #[test]
    fn mig_is_refused_before_locking() {
        let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
        let sim = Arc::new(SimDriver::with_processes(&[2]));
        let fp = GpuFingerprint {
            driver_version: "580.65.06".into(),
            devices: vec![GpuDevice {
                name: "NVIDIA H200".into(),
                uuid: "GPU-x".into(),
                memory_bytes: 1,
                mig_enabled: Some(true),
            }],
            ..Default::default()
        };
        let e = suspend_with(sim.clone(), &proc_at(t.path()), Some(&fp), &[2], T).unwrap_err();
        assert!(e.to_string().contains("MIG"), "{e}");
        assert!(sim.log().is_empty());
    }

    #[test]
    fn lock_timeout_fails_the_checkpoint_and_leaves_all_running() {
        let t = fake_proc(&[(2, &["/dev/nvidia0"], ""), (3, &["/dev/nvidia0"], "")]);
        let sim = Arc::new(SimDriver::with_processes(&[2, 3]));
        sim.lock_times_out(3);
        let e = suspend_with(sim.clone(), &proc_at(t.path()), None, &[2, 3], T).unwrap_err();
        assert_eq!(e, CudaError::LockTimeout { pid: 3, timeout: T });
        assert_eq!(sim.log(), [(Op::Lock, 2), (Op::Lock, 3), (Op::Unlock, 2)]);
        assert_eq!(sim.state_of(2), Some(ProcessState::Running));
    }

    #[test]
    fn an_error_between_suspend_and_resume_still_unlocks() {
        let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
        let sim = Arc::new(SimDriver::with_processes(&[2]));
        let dump = || -> Result<(), String> {
            let _gpu = suspend_with(sim.clone(), &proc_at(t.path()), None, &[2], T)
                .map_err(|e| e.to_string())?;
            Err("criu dump failed".into())
        };
        assert!(dump().is_err());
        assert_eq!(sim.state_of(2), Some(ProcessState::Running));
    }

    #[test]
    fn restore_of_a_tree_finds_its_cuda_processes_and_counts_them() {
        let t = tempfile::tempdir().unwrap();
        for (pid, kids) in [(1, "5 6"), (5, ""), (6, "")] {
            let d = t.path().join(format!("{pid}/task/{pid}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("children"), kids).unwrap();
        }
        let sim = SimDriver::with_processes(&[5]);
        sim.set_state(5, ProcessState::Checkpointed);
        let p = proc_at(t.path());
        resume_restored_tree_with(&sim, &p, 1, 1, None).unwrap();
        assert_eq!(sim.state_of(5), Some(ProcessState::Running));
        let e = resume_restored_tree_with(&sim, &p, 1, 2, None).unwrap_err();
        assert!(e.to_string().contains("had 2 CUDA processes"), "{e}");
        assert_eq!(
            resume_restored_tree(1, 0, None).unwrap(),
            PhaseTimings::default()
        );
    }

    #[test]
    fn restore_side_with_and_without_remap() {
        let sim = SimDriver::with_processes(&[2]).with_migration();
        sim.set_state(2, ProcessState::Checkpointed);
        let pair = GpuPair {
            old: GpuUuid([1; 16]),
            new: GpuUuid([2; 16]),
        };
        resume_restored_with(&sim, &[2], Some(&[pair])).unwrap();
        assert_eq!(sim.state_of(2), Some(ProcessState::Running));
        assert_eq!(sim.restored_pairs(), [(2, vec![pair])]);
        let rec = GpuFingerprint {
            driver_version: "580.1".into(),
            devices: vec![GpuDevice {
                name: "H200".into(),
                uuid: GpuUuid([1; 16]).to_string(),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(remap_for(&rec, &rec).unwrap(), None);
        let mut node = rec.clone();
        node.devices[0].uuid = GpuUuid([2; 16]).to_string();
        assert_eq!(remap_for(&rec, &node).unwrap(), Some(vec![pair]));
    }
}
