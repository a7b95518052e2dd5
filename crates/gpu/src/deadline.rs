//! A deadline on every driver call.
//!
//! The checkpoint calls can block inside the driver (a restore that never returned,
//! cuda-checkpoint #17; NCCL/NVLS objects, #30 and NCCL #2340; cuda-python runs each of its
//! checkpoint tests in a child process with a timeout for that reason). In `stasisd` or
//! `stasis-runc` one such call would wedge the daemon along with the workload. [`WithDeadline`]
//! makes each call on a worker thread and stops waiting after a deadline: the caller gets
//! [`GpuError::Hung`] and can fail the checkpoint; the worker stays blocked in the driver (a
//! driver call cannot be cancelled), and later calls on that pid are refused at once rather than
//! piling up more blocked threads.

use std::collections::BTreeSet;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::driver::CheckpointApi;
use crate::error::GpuError;
use crate::state::{Op, ProcessState};
use crate::uuid::GpuPair;

/// Environment variable: the deadline of one driver call, in milliseconds.
pub const CALL_DEADLINE_ENV: &str = "STASIS_GPU_CALL_DEADLINE_MS";

/// Deadline of one checkpoint or restore call when [`CALL_DEADLINE_ENV`] is not set. Those calls
/// copy the process's GPU memory over PCIe: 141 GB (an H200) at a pessimistic 2 GB/s takes about
/// 70 s, so 5 minutes leaves room without letting a hung call hold a daemon for ever.
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(300);

/// The deadline for driver calls: `$STASIS_GPU_CALL_DEADLINE_MS`, else [`DEFAULT_CALL_DEADLINE`].
pub fn call_deadline() -> Duration {
    std::env::var(CALL_DEADLINE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map_or(DEFAULT_CALL_DEADLINE, Duration::from_millis)
}

/// A [`CheckpointApi`] whose calls each return within a deadline (see the module doc).
pub struct WithDeadline {
    inner: Arc<dyn CheckpointApi>,
    deadline: Duration,
    /// Pids with a call still blocked in the driver.
    hung: Mutex<BTreeSet<i32>>,
}

impl std::fmt::Debug for WithDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithDeadline")
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl WithDeadline {
    /// `inner`'s calls, each given `deadline` (a lock gets its own timeout on top).
    pub fn new(inner: Arc<dyn CheckpointApi>, deadline: Duration) -> Self {
        Self {
            inner,
            deadline,
            hung: Mutex::new(BTreeSet::new()),
        }
    }

    fn hung(&self) -> std::sync::MutexGuard<'_, BTreeSet<i32>> {
        self.hung.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn call<T: Send + 'static>(
        &self,
        function: &'static str,
        pid: i32,
        deadline: Duration,
        f: impl FnOnce(&dyn CheckpointApi) -> Result<T, GpuError> + Send + 'static,
    ) -> Result<T, GpuError> {
        let hung = GpuError::Hung {
            function,
            pid,
            after: deadline,
        };
        if self.hung().contains(&pid) {
            return Err(hung);
        }
        let api = self.inner.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name(format!("cuda-{pid}"))
            .spawn(move || {
                // The receiver is gone when the deadline passed: nothing to tell anyone.
                let _ = tx.send(f(api.as_ref()));
            });
        if let Err(e) = spawned {
            // Never call without the deadline: a hung call here would wedge the caller.
            return Err(GpuError::Unsupported(format!(
                "could not start a thread for {function} (pid {pid}): {e}"
            )));
        }
        match rx.recv_timeout(deadline) {
            Ok(r) => r,
            Err(_) => {
                tracing::error!(
                    function,
                    pid,
                    deadline_s = deadline.as_secs(),
                    "driver call hung"
                );
                self.hung().insert(pid);
                Err(hung)
            }
        }
    }
}

impl CheckpointApi for WithDeadline {
    fn state(&self, pid: i32) -> Result<ProcessState, GpuError> {
        self.call(
            "cuCheckpointProcessGetState",
            pid,
            self.deadline,
            move |a| a.state(pid),
        )
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError> {
        // The driver enforces the lock's own timeout; the deadline is for a driver that does not.
        let deadline = self.deadline + timeout.unwrap_or(Duration::ZERO);
        self.call(Op::Lock.function(), pid, deadline, move |a| {
            a.lock(pid, timeout)
        })
    }

    fn checkpoint(&self, pid: i32) -> Result<(), GpuError> {
        self.call(Op::Checkpoint.function(), pid, self.deadline, move |a| {
            a.checkpoint(pid)
        })
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError> {
        let pairs = pairs.to_vec();
        self.call(Op::Restore.function(), pid, self.deadline, move |a| {
            a.restore(pid, &pairs)
        })
    }

    fn unlock(&self, pid: i32) -> Result<(), GpuError> {
        self.call(Op::Unlock.function(), pid, self.deadline, move |a| {
            a.unlock(pid)
        })
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError> {
        self.call(
            "cuCheckpointProcessGetRestoreThreadId",
            pid,
            self.deadline,
            move |a| a.restore_thread_id(pid),
        )
    }

    fn supports_migration(&self) -> bool {
        self.inner.supports_migration()
    }
}

#[cfg(test)]
mod tests {
    //! Against [`crate::sim::SimDriver`] (no GPU here), with a call made to hang.
    use std::time::Instant;

    use super::*;
    use crate::sim::SimDriver;

    #[test]
    fn a_hung_call_returns_at_the_deadline_and_its_pid_is_refused_after() {
        let sim = Arc::new(SimDriver::with_processes(&[10, 11]));
        sim.hang(Op::Checkpoint, 10, Duration::from_secs(5));
        let api = WithDeadline::new(sim.clone(), Duration::from_millis(200));
        api.lock(10, Some(Duration::from_secs(1))).unwrap();
        let t = Instant::now();
        let e = api.checkpoint(10).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(
            matches!(
                e,
                GpuError::Hung {
                    function: "cuCheckpointProcessCheckpoint",
                    pid: 10,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("kill it and cold-start"), "{e}");
        // Later calls on the hung pid do not start another blocked thread.
        let t = Instant::now();
        assert!(matches!(
            api.unlock(10),
            Err(GpuError::Hung { pid: 10, .. })
        ));
        assert!(t.elapsed() < Duration::from_millis(100));
        // Other processes are unaffected.
        api.lock(11, None).unwrap();
        api.unlock(11).unwrap();
    }

    #[test]
    fn calls_within_the_deadline_pass_their_result_through() {
        let sim = Arc::new(SimDriver::with_processes(&[10]));
        let api = WithDeadline::new(sim.clone(), Duration::from_secs(5));
        assert_eq!(api.state(10).unwrap(), ProcessState::Running);
        assert!(matches!(
            api.restore(10, &[]),
            Err(GpuError::Call {
                code: crate::CuResult::ILLEGAL_STATE,
                ..
            })
        ));
        assert!(api.state(99).is_err());
    }

    #[test]
    fn the_deadline_comes_from_the_environment_or_the_default() {
        // Read-only: this test does not set the variable (tests share the environment).
        if std::env::var_os(CALL_DEADLINE_ENV).is_none() {
            assert_eq!(call_deadline(), DEFAULT_CALL_DEADLINE);
        }
    }
}
