//! Suspending and resuming every CUDA process of a process tree, in the order DESIGN §7 fixes:
//!
//! ```text
//! checkpoint:  lock all ─► checkpoint all ─► (CRIU dump) ─► restore all ─► unlock all
//! restore:     (CRIU restore) ─► restore all (UUID pairs if the GPUs differ) ─► unlock all
//! ```
//!
//! Locking everything before checkpointing anything gives a consistent cut across processes that
//! share work (a lock waits for submitted work; a checkpoint releases the GPU). Restores and
//! unlocks go in checkpoint order, which is what multi-process jobs need (NVIDIA's r610 IPC demo).
//! A failure at any step undoes what was done — a process is never left locked: one that cannot
//! be brought back to RUNNING (its restore failed, the driver marked it FAILED) is handed to the
//! caller's [`StrandedHandler`], which kills it (the engine's), since a process left CHECKPOINTED
//! or LOCKED blocks in its next CUDA call for ever and a failed restore cannot be retried
//! (NVIDIA cuda-checkpoint #44).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::driver::CheckpointApi;
use crate::error::GpuError;
use crate::state::{Op, ProcessState};
use crate::uuid::GpuPair;

/// Time spent in each phase, over all processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PhaseTimings {
    #[serde(rename = "lock_ms", serialize_with = "ms")]
    pub lock: Duration,
    #[serde(rename = "checkpoint_ms", serialize_with = "ms")]
    pub checkpoint: Duration,
    #[serde(rename = "restore_ms", serialize_with = "ms")]
    pub restore: Duration,
    #[serde(rename = "unlock_ms", serialize_with = "ms")]
    pub unlock: Duration,
}

fn ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

/// What to do with a process that could not be brought back to RUNNING after a checkpoint: its
/// pid. The engine's kills it (a cold start is better than a workload blocked for ever).
pub type StrandedHandler = Box<dyn Fn(i32) + Send + Sync>;

/// CUDA processes locked and checkpointed by [`suspend_all`]: their device memory is in their
/// host memory, ready for CRIU. [`Suspension::resume`] puts them back; dropping it does the same
/// (best effort, errors logged), so no exit path leaves a process locked.
pub struct Suspension {
    api: Arc<dyn CheckpointApi>,
    /// Processes in checkpoint order, with the state stasis last put them in.
    procs: Vec<(i32, ProcessState)>,
    timings: PhaseTimings,
    armed: bool,
    on_stranded: Option<StrandedHandler>,
}

impl std::fmt::Debug for Suspension {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Suspension")
            .field("procs", &self.procs)
            .field("timings", &self.timings)
            .finish()
    }
}

/// Locks every pid (each with `lock_timeout`), then checkpoints every pid.
///
/// Processes already LOCKED are checkpointed; already CHECKPOINTED ones are kept as they are;
/// all are brought back to RUNNING on resume. A lock that times out unlocks those already locked
/// and returns [`GpuError::LockTimeout`]; a checkpoint that fails restores and unlocks the others.
pub fn suspend_all(
    api: Arc<dyn CheckpointApi>,
    pids: &[i32],
    lock_timeout: Duration,
) -> Result<Suspension, GpuError> {
    suspend_all_with(api, pids, lock_timeout, None)
}

/// [`suspend_all`], with what to do with a process that cannot be brought back to RUNNING, on
/// every path: a failed checkpoint, a drop, a failed [`Suspension::resume`].
pub fn suspend_all_with(
    api: Arc<dyn CheckpointApi>,
    pids: &[i32],
    lock_timeout: Duration,
    on_stranded: Option<StrandedHandler>,
) -> Result<Suspension, GpuError> {
    let mut s = Suspension {
        api,
        procs: Vec::with_capacity(pids.len()),
        timings: PhaseTimings::default(),
        armed: true,
        on_stranded,
    };
    // Look first: refuse states nothing can be done with before touching anything.
    let mut initial = Vec::with_capacity(pids.len());
    for &pid in pids {
        let st = s.api.state(pid)?;
        if st.path_to_checkpointed().is_none() {
            return Err(match st {
                ProcessState::Failed => GpuError::Failed { pid, op: Op::Lock },
                state => GpuError::IllegalState {
                    pid,
                    op: Op::Lock,
                    state,
                },
            });
        }
        initial.push((pid, st));
    }
    // Pass 1: lock all.
    let t = Instant::now();
    for &(pid, st) in &initial {
        if st == ProcessState::Running {
            // On error `s` drops here and unlocks what it locked.
            s.api.lock(pid, Some(lock_timeout))?;
        }
        s.procs.push((pid, st.after(Op::Lock).unwrap_or(st)));
    }
    s.timings.lock = t.elapsed();
    // Pass 2: checkpoint all.
    let t = Instant::now();
    for i in 0..s.procs.len() {
        let (pid, st) = s.procs[i];
        if st == ProcessState::Locked {
            match s.api.checkpoint(pid) {
                Ok(()) => s.procs[i].1 = ProcessState::Checkpointed,
                Err(e) => {
                    // The failed one may be FAILED (nothing to undo) or still LOCKED.
                    if let Ok(now) = s.api.state(pid) {
                        s.procs[i].1 = now;
                    }
                    return Err(e);
                }
            }
        }
    }
    s.timings.checkpoint = t.elapsed();
    Ok(s)
}

impl Suspension {
    /// The suspended processes, in checkpoint order.
    pub fn pids(&self) -> Vec<i32> {
        self.procs.iter().map(|(p, _)| *p).collect()
    }

    /// Lock and checkpoint times so far.
    pub fn timings(&self) -> PhaseTimings {
        self.timings
    }

    /// Restores and unlocks every process (the leave-running path). All are attempted even if
    /// one fails; then [`GpuError::NotResumed`] names those not RUNNING, with the first error,
    /// and says whether the stranded handler took care of them.
    pub fn resume(mut self) -> Result<PhaseTimings, GpuError> {
        self.armed = false;
        let r = self.bring_back(&[]);
        r.map(|()| self.timings)
    }

    /// Forgets the processes without touching them: only for when CRIU has killed them after the
    /// dump (`--stop`), so that there is nothing left to resume.
    pub fn discard(mut self) -> PhaseTimings {
        self.armed = false;
        self.timings
    }

    fn bring_back(&mut self, pairs: &[GpuPair]) -> Result<(), GpuError> {
        let mut first = None;
        let t = Instant::now();
        for (pid, st) in self.procs.iter_mut() {
            if *st == ProcessState::Checkpointed {
                match self.api.restore(*pid, pairs) {
                    Ok(()) => *st = ProcessState::Locked,
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
        }
        self.timings.restore = t.elapsed();
        let t = Instant::now();
        for (pid, st) in self.procs.iter_mut() {
            if *st == ProcessState::Locked {
                match self.api.unlock(*pid) {
                    Ok(()) => *st = ProcessState::Running,
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
        }
        self.timings.unlock = t.elapsed();
        let stranded: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, st)| *st != ProcessState::Running)
            .map(|(p, _)| *p)
            .collect();
        if stranded.is_empty() {
            return Ok(());
        }
        if let Some(h) = &self.on_stranded {
            for &pid in &stranded {
                h(pid);
            }
        }
        let cause = first.unwrap_or(GpuError::Unsupported(
            "the driver left them in a state stasis cannot resume".into(),
        ));
        Err(GpuError::NotResumed {
            pids: stranded,
            cause: Box::new(cause),
            killed: self.on_stranded.is_some(),
        })
    }
}

impl Drop for Suspension {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Err(e) = self.bring_back(&[]) {
            tracing::error!(error = %e, "could not resume every CUDA process after a failed checkpoint");
        }
    }
}

/// After a CRIU restore: restores (with `pairs` when the GPUs differ) and unlocks every pid.
///
/// State-driven, so it also finishes what someone else started (CRIU's own CUDA plugin may
/// already have restored a process): RUNNING is left alone, LOCKED is unlocked, CHECKPOINTED is
/// restored and unlocked. All processes are attempted; the first error is returned. A process
/// whose restore failed stays CHECKPOINTED and must be killed (cold start).
pub fn resume_restored(
    api: &dyn CheckpointApi,
    pids: &[i32],
    pairs: &[GpuPair],
) -> Result<PhaseTimings, GpuError> {
    if !pairs.is_empty() && !api.supports_migration() {
        return Err(GpuError::Unsupported(
            "restoring onto other GPUs needs NVIDIA driver r580 or newer".into(),
        ));
    }
    let mut timings = PhaseTimings::default();
    let mut first = None;
    let mut states = Vec::with_capacity(pids.len());
    for &pid in pids {
        match api.state(pid) {
            Ok(st) if st.path_to_running().is_some() => states.push((pid, st)),
            Ok(state) => {
                first.get_or_insert(match state {
                    ProcessState::Failed => GpuError::Failed {
                        pid,
                        op: Op::Restore,
                    },
                    state => GpuError::IllegalState {
                        pid,
                        op: Op::Restore,
                        state,
                    },
                });
            }
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    let t = Instant::now();
    for (pid, st) in states.iter_mut() {
        if *st == ProcessState::Checkpointed {
            match api.restore(*pid, pairs) {
                Ok(()) => *st = ProcessState::Locked,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
    }
    timings.restore = t.elapsed();
    let t = Instant::now();
    for (pid, st) in states.iter_mut() {
        if *st == ProcessState::Locked {
            match api.unlock(*pid) {
                Ok(()) => *st = ProcessState::Running,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
    }
    timings.unlock = t.elapsed();
    first.map_or(Ok(timings), Err)
}

#[cfg(test)]
mod tests {
    //! Against [`SimDriver`]: no GPU here; the simulator follows the driver's state machine.
    use super::*;
    use crate::result::CuResult;
    use crate::sim::SimDriver;
    use crate::uuid::GpuUuid;
    use Op::*;
    use ProcessState::*;

    const T: Duration = Duration::from_secs(10);

    fn sim(pids: &[i32]) -> Arc<SimDriver> {
        Arc::new(SimDriver::with_processes(pids))
    }

    #[test]
    fn locks_all_then_checkpoints_all_then_restores_all_then_unlocks_all() {
        let d = sim(&[10, 11, 12]);
        let s = suspend_all(d.clone(), &[10, 11, 12], T).unwrap();
        assert_eq!(s.pids(), [10, 11, 12]);
        for p in [10, 11, 12] {
            assert_eq!(d.state_of(p), Some(Checkpointed));
        }
        s.resume().unwrap();
        assert_eq!(
            d.log(),
            [
                (Lock, 10),
                (Lock, 11),
                (Lock, 12),
                (Checkpoint, 10),
                (Checkpoint, 11),
                (Checkpoint, 12),
                (Restore, 10),
                (Restore, 11),
                (Restore, 12),
                (Unlock, 10),
                (Unlock, 11),
                (Unlock, 12),
            ]
        );
        for p in [10, 11, 12] {
            assert_eq!(d.state_of(p), Some(Running));
        }
    }

    #[test]
    fn lock_timeout_unlocks_those_already_locked_and_names_the_pid() {
        let d = sim(&[10, 11, 12]);
        d.lock_times_out(11);
        let e = suspend_all(d.clone(), &[10, 11, 12], T).unwrap_err();
        assert_eq!(
            e,
            GpuError::LockTimeout {
                pid: 11,
                timeout: T
            }
        );
        assert!(e.to_string().contains("11") && e.to_string().contains("10000 ms"));
        assert_eq!(d.log(), [(Lock, 10), (Lock, 11), (Unlock, 10)]);
        for p in [10, 11, 12] {
            assert_eq!(d.state_of(p), Some(Running), "pid {p}");
        }
    }

    #[test]
    fn failed_checkpoint_restores_and_unlocks_the_others() {
        let d = sim(&[10, 11, 12]);
        d.fail(Checkpoint, 11, CuResult::NOT_SUPPORTED, false);
        let e = suspend_all(d.clone(), &[10, 11, 12], T).unwrap_err();
        assert_eq!(e.cu_result(), Some(CuResult::NOT_SUPPORTED));
        assert_eq!(d.state_of(10), Some(Running));
        assert_eq!(d.state_of(11), Some(Running));
        assert_eq!(d.state_of(12), Some(Running));
        let log = d.log();
        assert!(
            log.ends_with(&[(Restore, 10), (Unlock, 10), (Unlock, 11), (Unlock, 12)]),
            "{log:?}"
        );
    }

    #[test]
    fn a_process_the_driver_marked_failed_is_reported_and_left_alone() {
        let d = sim(&[10, 11]);
        d.fail(Checkpoint, 11, CuResult::NOT_SUPPORTED, true);
        let e = suspend_all(d.clone(), &[10, 11], T).unwrap_err();
        assert_eq!(
            e,
            GpuError::Failed {
                pid: 11,
                op: Checkpoint
            }
        );
        assert_eq!(d.state_of(10), Some(Running));
        assert_eq!(d.state_of(11), Some(Failed));
        assert!(!d.log().contains(&(Unlock, 11)));
    }

    #[test]
    fn drop_without_resume_never_leaves_a_process_locked() {
        let d = sim(&[10, 11]);
        {
            let _s = suspend_all(d.clone(), &[10, 11], T).unwrap();
            // e.g. the CRIU dump failed and the caller returned early with `?`.
        }
        assert_eq!(d.state_of(10), Some(Running));
        assert_eq!(d.state_of(11), Some(Running));
    }

    #[test]
    fn discard_leaves_killed_processes_alone() {
        let d = sim(&[10]);
        let s = suspend_all(d.clone(), &[10], T).unwrap();
        let n = d.log().len();
        s.discard();
        assert_eq!(d.log().len(), n);
    }

    #[test]
    fn already_locked_or_checkpointed_processes_are_taken_as_they_are() {
        let d = sim(&[10, 11]);
        d.set_state(10, Locked);
        d.set_state(11, Checkpointed);
        let s = suspend_all(d.clone(), &[10, 11], T).unwrap();
        assert_eq!(d.log(), [(Checkpoint, 10)]);
        s.resume().unwrap();
        assert_eq!(d.state_of(10), Some(Running));
        assert_eq!(d.state_of(11), Some(Running));
    }

    #[test]
    fn failed_or_unknown_states_are_refused_before_any_call() {
        let d = sim(&[10, 11]);
        d.set_state(11, Failed);
        assert_eq!(
            suspend_all(d.clone(), &[10, 11], T).unwrap_err(),
            GpuError::Failed { pid: 11, op: Lock }
        );
        d.set_state(11, Unknown(9));
        assert!(matches!(
            suspend_all(d.clone(), &[10, 11], T).unwrap_err(),
            GpuError::IllegalState { pid: 11, .. }
        ));
        assert!(d.log().is_empty());
    }

    #[test]
    fn a_pid_without_cuda_fails_the_lookup() {
        let d = sim(&[10]);
        let e = suspend_all(d.clone(), &[10, 99], T).unwrap_err();
        assert!(e.to_string().contains("pid 99"), "{e}");
        assert!(d.log().is_empty());
    }

    #[test]
    fn empty_list_is_a_no_op() {
        let d = sim(&[]);
        let s = suspend_all(d.clone(), &[], T).unwrap();
        assert!(s.pids().is_empty());
        s.resume().unwrap();
        assert!(d.log().is_empty());
    }

    #[test]
    fn restore_after_criu_finishes_whatever_state_it_finds() {
        let d = sim(&[10, 11, 12]);
        d.set_state(10, Checkpointed);
        d.set_state(11, Locked); // e.g. CRIU's plugin restored but had not unlocked yet
                                 // 12 RUNNING: already done.
        resume_restored(d.as_ref(), &[10, 11, 12], &[]).unwrap();
        assert_eq!(d.log(), [(Restore, 10), (Unlock, 10), (Unlock, 11)]);
        for p in [10, 11, 12] {
            assert_eq!(d.state_of(p), Some(Running));
        }
    }

    #[test]
    fn restore_with_uuid_pairs_needs_migration_support() {
        let pair = GpuPair {
            old: GpuUuid([1; 16]),
            new: GpuUuid([2; 16]),
        };
        let d = sim(&[10]);
        d.set_state(10, Checkpointed);
        let e = resume_restored(d.as_ref(), &[10], &[pair]).unwrap_err();
        assert!(matches!(e, GpuError::Unsupported(ref m) if m.contains("r580")));
        assert!(d.log().is_empty());
        let d = Arc::new(SimDriver::with_processes(&[10]).with_migration());
        d.set_state(10, Checkpointed);
        resume_restored(d.as_ref(), &[10], &[pair]).unwrap();
        assert_eq!(d.restored_pairs(), [(10, vec![pair])]);
    }

    /// A stranded handler that notes the pids it is given.
    fn collecting() -> (Arc<std::sync::Mutex<Vec<i32>>>, StrandedHandler) {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let noted = seen.clone();
        (seen, Box::new(move |p| noted.lock().unwrap().push(p)))
    }

    #[test]
    fn a_failed_restore_after_a_leave_running_dump_hands_the_process_to_the_handler() {
        // cuda-checkpoint #44: after a failed restore every later restore fails, so the process
        // would stay CHECKPOINTED (every CUDA call blocked) for ever; it must not be left so.
        let d = sim(&[10, 11]);
        d.fail(Restore, 11, CuResult::OUT_OF_MEMORY, false);
        let (stranded, handler) = collecting();
        let s = suspend_all_with(d.clone(), &[10, 11], T, Some(handler)).unwrap();
        let e = s.resume().unwrap_err();
        assert_eq!(*stranded.lock().unwrap(), [11]);
        assert!(
            matches!(&e, GpuError::NotResumed { pids, killed: true, .. } if pids == &[11]),
            "{e:?}"
        );
        assert_eq!(e.cu_result(), Some(CuResult::OUT_OF_MEMORY));
        assert!(e.to_string().contains("were killed"), "{e}");
        assert_eq!(d.state_of(10), Some(Running));
    }

    #[test]
    fn a_process_failed_by_the_checkpoint_is_handed_to_the_handler_too() {
        let d = sim(&[10, 11]);
        d.fail(Checkpoint, 11, CuResult::NOT_SUPPORTED, true);
        let (stranded, handler) = collecting();
        let e = suspend_all_with(d.clone(), &[10, 11], T, Some(handler)).unwrap_err();
        assert_eq!(
            e,
            GpuError::Failed {
                pid: 11,
                op: Checkpoint
            }
        );
        assert_eq!(*stranded.lock().unwrap(), [11]);
        assert_eq!(d.state_of(10), Some(Running));
    }

    #[test]
    fn without_a_handler_the_error_says_the_processes_are_blocked() {
        let d = sim(&[10]);
        d.fail(Unlock, 10, CuResult::ILLEGAL_STATE, false);
        let e = suspend_all(d.clone(), &[10], T)
            .unwrap()
            .resume()
            .unwrap_err();
        assert!(
            matches!(&e, GpuError::NotResumed { pids, killed: false, .. } if pids == &[10]),
            "{e:?}"
        );
        assert!(e.to_string().contains("kill them and cold-start"), "{e}");
    }

    #[test]
    fn restore_continues_past_a_failure_and_reports_it() {
        let d = sim(&[10, 11]);
        d.set_state(10, Checkpointed);
        d.set_state(11, Checkpointed);
        d.fail(Restore, 10, CuResult::OUT_OF_MEMORY, false);
        let e = resume_restored(d.as_ref(), &[10, 11], &[]).unwrap_err();
        assert_eq!(e.cu_result(), Some(CuResult::OUT_OF_MEMORY));
        assert_eq!(d.state_of(10), Some(Checkpointed));
        assert_eq!(d.state_of(11), Some(Running));
    }
}
