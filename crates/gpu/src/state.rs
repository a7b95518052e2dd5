//! `CUprocessState` and the transitions the checkpoint API allows between its values.
//!
//! ```text
//!            lock                checkpoint
//! RUNNING ----------> LOCKED -----------------> CHECKPOINTED
//!    ^                 |  ^                          |
//!    +-----------------+  +--------------------------+
//!          unlock                   restore
//! ```
//! FAILED is terminal ("uncorrectable error during the checkpoint/restore process"): the process
//! must be killed and cold-started. CHECKPOINTING and RESTORING (CUDA 13.4 custom storage) are
//! transient and not used by stasis.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The driver's view of a CUDA process. Values the driver may add later are kept as `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING` (0).
    Running,
    /// `CU_PROCESS_STATE_LOCKED` (1): CUDA calls block.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED` (2): device memory is in host memory, GPU released.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED` (3): uncorrectable; kill and cold-start.
    Failed,
    /// `CU_PROCESS_STATE_CHECKPOINTING` (4, 13.4+ custom storage).
    Checkpointing,
    /// `CU_PROCESS_STATE_RESTORING` (5, 13.4+ custom storage).
    Restoring,
    /// A value this build does not know.
    Unknown(u32),
}

/// One checkpoint API call that changes a process's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Op {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl Op {
    /// The driver function behind the operation.
    pub fn function(self) -> &'static str {
        match self {
            Op::Lock => "cuCheckpointProcessLock",
            Op::Checkpoint => "cuCheckpointProcessCheckpoint",
            Op::Restore => "cuCheckpointProcessRestore",
            Op::Unlock => "cuCheckpointProcessUnlock",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Lock => "lock",
            Op::Checkpoint => "checkpoint",
            Op::Restore => "restore",
            Op::Unlock => "unlock",
        })
    }
}

impl ProcessState {
    /// From the raw `CUprocessState`.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            4 => Self::Checkpointing,
            5 => Self::Restoring,
            v => Self::Unknown(v),
        }
    }

    /// The raw `CUprocessState`.
    pub fn to_raw(self) -> u32 {
        match self {
            Self::Running => 0,
            Self::Locked => 1,
            Self::Checkpointed => 2,
            Self::Failed => 3,
            Self::Checkpointing => 4,
            Self::Restoring => 5,
            Self::Unknown(v) => v,
        }
    }

    /// The state `op` leads to from `self`, or `None` when the driver does not allow `op` here
    /// (it would answer `CUDA_ERROR_ILLEGAL_STATE`).
    pub fn after(self, op: Op) -> Option<Self> {
        match (self, op) {
            (Self::Running, Op::Lock) => Some(Self::Locked),
            (Self::Locked, Op::Checkpoint) => Some(Self::Checkpointed),
            (Self::Checkpointed, Op::Restore) => Some(Self::Locked),
            (Self::Locked, Op::Unlock) => Some(Self::Running),
            _ => None,
        }
    }

    /// The calls that bring a process from `self` back to RUNNING; `None` when that is impossible
    /// (FAILED, transient or unknown states).
    pub fn path_to_running(self) -> Option<&'static [Op]> {
        match self {
            Self::Running => Some(&[]),
            Self::Locked => Some(&[Op::Unlock]),
            Self::Checkpointed => Some(&[Op::Restore, Op::Unlock]),
            _ => None,
        }
    }

    /// The calls that bring a process from `self` to CHECKPOINTED.
    pub fn path_to_checkpointed(self) -> Option<&'static [Op]> {
        match self {
            Self::Running => Some(&[Op::Lock, Op::Checkpoint]),
            Self::Locked => Some(&[Op::Checkpoint]),
            Self::Checkpointed => Some(&[]),
            _ => None,
        }
    }

    /// Whether CUDA calls in the process block (anything but RUNNING).
    pub fn is_held(self) -> bool {
        !matches!(self, Self::Running)
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running => f.write_str("RUNNING"),
            Self::Locked => f.write_str("LOCKED"),
            Self::Checkpointed => f.write_str("CHECKPOINTED"),
            Self::Failed => f.write_str("FAILED"),
            Self::Checkpointing => f.write_str("CHECKPOINTING"),
            Self::Restoring => f.write_str("RESTORING"),
            Self::Unknown(v) => write!(f, "UNKNOWN({v})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_OPS: [Op; 4] = [Op::Lock, Op::Checkpoint, Op::Restore, Op::Unlock];

    #[test]
    fn raw_values_round_trip() {
        for v in 0..10 {
            assert_eq!(ProcessState::from_raw(v).to_raw(), v);
        }
        assert_eq!(ProcessState::from_raw(2), ProcessState::Checkpointed);
        assert_eq!(ProcessState::from_raw(77), ProcessState::Unknown(77));
        assert_eq!(ProcessState::Unknown(77).to_string(), "UNKNOWN(77)");
    }

    #[test]
    fn legal_transitions() {
        use ProcessState::*;
        assert_eq!(Running.after(Op::Lock), Some(Locked));
        assert_eq!(Locked.after(Op::Checkpoint), Some(Checkpointed));
        assert_eq!(Checkpointed.after(Op::Restore), Some(Locked));
        assert_eq!(Locked.after(Op::Unlock), Some(Running));
    }

    #[test]
    fn everything_else_is_illegal() {
        use ProcessState::*;
        let legal = [
            (Running, Op::Lock),
            (Locked, Op::Checkpoint),
            (Checkpointed, Op::Restore),
            (Locked, Op::Unlock),
        ];
        for s in [
            Running,
            Locked,
            Checkpointed,
            Failed,
            Checkpointing,
            Restoring,
            Unknown(9),
        ] {
            for op in ALL_OPS {
                assert_eq!(
                    s.after(op).is_some(),
                    legal.contains(&(s, op)),
                    "{s} --{op}-->"
                );
            }
        }
        // In particular: no double lock, no unlock of a checkpointed process, nothing from FAILED.
        assert_eq!(Locked.after(Op::Lock), None);
        assert_eq!(Checkpointed.after(Op::Unlock), None);
        assert_eq!(Failed.after(Op::Restore), None);
    }

    #[test]
    fn paths_follow_legal_transitions() {
        use ProcessState::*;
        for s in [Running, Locked, Checkpointed] {
            let end = s
                .path_to_running()
                .unwrap()
                .iter()
                .try_fold(s, |st, &op| st.after(op));
            assert_eq!(end, Some(Running), "from {s}");
            let end = s
                .path_to_checkpointed()
                .unwrap()
                .iter()
                .try_fold(s, |st, &op| st.after(op));
            assert_eq!(end, Some(Checkpointed), "from {s}");
        }
        for s in [Failed, Checkpointing, Restoring, Unknown(6)] {
            assert_eq!(s.path_to_running(), None);
            assert_eq!(s.path_to_checkpointed(), None);
        }
    }
}
