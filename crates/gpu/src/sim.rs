//! A driver simulator for tests on machines without a GPU: it follows the state machine of
//! [`crate::state`], logs every call, and fails on demand. Nothing here touches a GPU; tests that
//! use it say so.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

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
}

/// A simulated CUDA driver.
#[derive(Debug, Default)]
pub struct SimDriver {
    inner: Mutex<Inner>,
    migration: bool,
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
