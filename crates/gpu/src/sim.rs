//! A driver simulator for tests on machines without a GPU: it follows the state machine of
//! [`crate::state`], logs every call, fails or hangs on demand, and describes the GPU it stands
//! for ([`SimDriver::fingerprint`], what NVML would report), so that a checkpoint taken against it
//! records a GPU like one taken on a GPU node. Nothing here touches a GPU; tests that use it say
//! so. (`tests/gpu/fake/` is the same stand-in for whole binaries: a fake `libcuda.so.1` and
//! `libnvidia-ml.so.1`.)

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use stasis_core::gpu::{GpuDevice, GpuFingerprint};

use crate::driver::CheckpointApi;
use crate::error::GpuError;
use crate::result::CuResult;
use crate::state::{Op, ProcessState};
use crate::uuid::GpuPair;

/// One logged call: `(op, pid)`.
pub type Call = (Op, i32);

#[derive(Debug, Default)]
struct Inner {
    states: BTreeMap<i32, ProcessState>,
    log: Vec<Call>,
    lock_timeouts: Vec<i32>,
    failures: BTreeMap<(Op, i32), (CuResult, bool)>,
    restored_pairs: Vec<(i32, Vec<GpuPair>)>,
    hangs: BTreeMap<(Op, i32), Duration>,
}

/// The model the simulator's GPU reports.
pub const SIM_GPU_MODEL: &str = "NVIDIA H200";
/// The driver version the simulator reports (branch 580: GPU remapping available).
pub const SIM_DRIVER_VERSION: &str = "580.159.04";
/// The simulator's GPU's UUID.
pub const SIM_GPU_UUID: &str = "GPU-5a5a5a5a-0000-4000-8000-000000000001";

/// The fingerprint of the simulator's node: one H200 on driver 580.159.04, as NVML describes it.
pub fn sim_fingerprint() -> GpuFingerprint {
    GpuFingerprint {
        driver_version: SIM_DRIVER_VERSION.into(),
        cuda_driver_version: Some(13000),
        devices: vec![GpuDevice {
            name: SIM_GPU_MODEL.into(),
            uuid: SIM_GPU_UUID.into(),
            memory_bytes: 143_771_566_080,
            mig_enabled: Some(false),
        }],
        persistence_mode: Some(false),
        workload_gpus: Vec::new(),
    }
}

/// A simulated CUDA driver.
#[derive(Debug)]
pub struct SimDriver {
    inner: Mutex<Inner>,
    migration: bool,
    gpus: GpuFingerprint,
}

impl Default for SimDriver {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            migration: false,
            gpus: sim_fingerprint(),
        }
    }
}

impl SimDriver {
    /// A driver where each of `pids` is a RUNNING CUDA process; no GPU migration.
    pub fn with_processes(pids: &[i32]) -> Self {
        let me = Self::default();
        for &p in pids {
            me.set_state(p, ProcessState::Running);
        }
        me
    }

    /// Enables GPU migration (r580+ behaviour).
    pub fn with_migration(mut self) -> Self {
        self.migration = true;
        self
    }

    /// Describes other GPUs (another node, another model, another driver).
    pub fn with_gpus(mut self, gpus: GpuFingerprint) -> Self {
        self.gpus = gpus;
        self
    }

    /// The GPUs this driver stands for, as NVML would describe them: what a checkpoint taken
    /// against it records, and what a restore against it compares with.
    pub fn fingerprint(&self) -> GpuFingerprint {
        self.gpus.clone()
    }

    /// Makes `op` on `pid` take `how_long` before it does anything (a driver call that hangs).
    pub fn hang(&self, op: Op, pid: i32, how_long: Duration) {
        self.inner().hangs.insert((op, pid), how_long);
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts `pid` in `state` (adds it as a CUDA process if new).
    pub fn set_state(&self, pid: i32, state: ProcessState) {
        self.inner().states.insert(pid, state);
    }

    /// The state of `pid`, if it is a CUDA process.
    pub fn state_of(&self, pid: i32) -> Option<ProcessState> {
        self.inner().states.get(&pid).copied()
    }

    /// Makes every lock of `pid` time out.
    pub fn lock_times_out(&self, pid: i32) {
        self.inner().lock_timeouts.push(pid);
    }

    /// Makes `op` on `pid` fail with `code`; `leaves_failed`: the process ends up FAILED.
    pub fn fail(&self, op: Op, pid: i32, code: CuResult, leaves_failed: bool) {
        self.inner()
            .failures
            .insert((op, pid), (code, leaves_failed));
    }

    /// Every state-changing call so far, in order.
    pub fn log(&self) -> Vec<Call> {
        self.inner().log.clone()
    }

    /// The UUID pairs each restore was given.
    pub fn restored_pairs(&self) -> Vec<(i32, Vec<GpuPair>)> {
        self.inner().restored_pairs.clone()
    }

    fn apply(&self, op: Op, pid: i32) -> Result<(), GpuError> {
        let hang = self.inner().hangs.get(&(op, pid)).copied();
        if let Some(d) = hang {
            std::thread::sleep(d);
        }
        let mut g = self.inner();
        g.log.push((op, pid));
        let Some(&state) = g.states.get(&pid) else {
            return Err(GpuError::Call {
                function: op.function(),
                pid: Some(pid),
                code: CuResult::INVALID_VALUE,
            });
        };
        if let Some(&(code, leaves_failed)) = g.failures.get(&(op, pid)) {
            if leaves_failed {
                g.states.insert(pid, ProcessState::Failed);
                return Err(GpuError::Failed { pid, op });
            }
            return Err(GpuError::Call {
                function: op.function(),
                pid: Some(pid),
                code,
            });
        }
        match state.after(op) {
            Some(next) => {
                g.states.insert(pid, next);
                Ok(())
            }
            None => Err(GpuError::Call {
                function: op.function(),
                pid: Some(pid),
                code: CuResult::ILLEGAL_STATE,
            }),
        }
    }
}

impl CheckpointApi for SimDriver {
    fn state(&self, pid: i32) -> Result<ProcessState, GpuError> {
        self.state_of(pid).ok_or(GpuError::Call {
            function: "cuCheckpointProcessGetState",
            pid: Some(pid),
            code: CuResult::INVALID_VALUE,
        })
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError> {
        if let Some(t) = timeout {
            if self.inner().lock_timeouts.contains(&pid) {
                self.inner().log.push((Op::Lock, pid));
                return Err(GpuError::LockTimeout { pid, timeout: t });
            }
        }
        self.apply(Op::Lock, pid)
    }

    fn checkpoint(&self, pid: i32) -> Result<(), GpuError> {
        self.apply(Op::Checkpoint, pid)
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError> {
        if !pairs.is_empty() && !self.migration {
            return Err(GpuError::Unsupported(
                "restoring onto other GPUs needs driver r580 or newer".into(),
            ));
        }
        self.inner().restored_pairs.push((pid, pairs.to_vec()));
        self.apply(Op::Restore, pid)
    }

    fn unlock(&self, pid: i32) -> Result<(), GpuError> {
        self.apply(Op::Unlock, pid)
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError> {
        self.state(pid).map(|_| pid + 1)
    }

    fn supports_migration(&self) -> bool {
        self.migration
    }
}
