//! Typed errors. Every driver failure names the function, the pid and the `CUresult`.

use std::time::Duration;

use crate::result::{CuResult, NvmlReturn};
use crate::state::{Op, ProcessState};

/// What went wrong on the GPU side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// `libcuda.so.1` is absent, is the toolkit's stub, or sees no GPU.
    #[error("no NVIDIA driver: {0}")]
    NoDriver(String),

    /// The driver predates the checkpoint API (r570).
    #[error(
        "the NVIDIA driver (CUDA {cuda_version}) has no checkpoint API (missing {missing}); \
         GPU checkpoints need driver r570 or newer"
    )]
    NoCheckpointApi {
        cuda_version: String,
        missing: String,
    },

    /// A driver call failed.
    #[error("{function} failed{}: {code}{}", pid_suffix(.pid), hint(.code))]
    Call {
        function: &'static str,
        pid: Option<i32>,
        code: CuResult,
    },

    /// `cuCheckpointProcessLock` ran out of its timeout: the process kept running.
    #[error(
        "locking CUDA process {pid} timed out after {} ms (work still in flight on the GPU); \
         the process was left running",
        timeout.as_millis()
    )]
    LockTimeout { pid: i32, timeout: Duration },

    /// The process is in a state where `op` is not allowed.
    #[error("cannot {op} CUDA process {pid}: it is {state}")]
    IllegalState {
        pid: i32,
        op: Op,
        state: ProcessState,
    },

    /// The driver marked the process FAILED; it must be killed and cold-started.
    #[error(
        "CUDA process {pid} is in state FAILED after {op} (an uncorrectable checkpoint/restore \
         error, e.g. managed memory); kill it and cold-start"
    )]
    Failed { pid: i32, op: Op },

    /// A setup the checkpoint API cannot handle (MIG, MPS, NCCL, ...), refused up front.
    #[error("unsupported GPU setup: {0}")]
    Unsupported(String),

    /// An NVML call failed.
    #[error("{function} failed: {code}")]
    Nvml {
        function: &'static str,
        code: NvmlReturn,
    },

    /// Not a GPU UUID.
    #[error("not a GPU UUID: {0:?}")]
    BadUuid(String),

    /// A driver call did not return within its deadline. The call cannot be cancelled: the
    /// thread that made it stays blocked in the driver, and the process's GPU state is unknown.
    #[error(
        "{function}{} did not return within {} s (the driver is hung on it); the process's GPU \
         state is unknown: kill it and cold-start",
        pid_suffix(&Some(*.pid)),
        after.as_secs()
    )]
    Hung {
        function: &'static str,
        pid: i32,
        after: Duration,
    },

    /// Processes that could not be brought back to RUNNING after a checkpoint (their restore or
    /// unlock failed, or the driver marked them FAILED). Left as they are they would block in
    /// their next CUDA call for ever (a failed restore is not retried: NVIDIA cuda-checkpoint #44).
    #[error(
        "CUDA process(es) {pids:?} could not be resumed after the checkpoint ({cause}); {}",
        if *killed {
            "they were killed rather than left blocked in CUDA for ever: cold-start the workload"
        } else {
            "they are blocked in CUDA: kill them and cold-start the workload"
        }
    )]
    NotResumed {
        pids: Vec<i32>,
        cause: Box<GpuError>,
        killed: bool,
    },
}

fn pid_suffix(pid: &Option<i32>) -> String {
    pid.map(|p| format!(" for pid {p}")).unwrap_or_default()
}

/// What a code usually means for the checkpoint calls, from the NVIDIA README's limitations.
fn hint(code: &CuResult) -> &'static str {
    match code.0 {
        801 => {
            " (the driver cannot checkpoint this process: managed/UVM memory, CUDA IPC or \
             cuMemExportToShareableHandle memory, MIG and MPS are not supported)"
        }
        401 => " (the process is not in the state this call needs)",
        805..=810 => " (the process is an MPS client; MPS is not supported)",
        900 => " (a stream is being captured into a CUDA graph)",
        3 => " (the process has no CUDA context, or the driver was not initialised)",
        800 => " (permission denied: the caller must be root or own the process)",
        304 => {
            " (the driver could not reach the process through /proc: the caller needs the \
             host's pid namespace and root or CAP_SYS_PTRACE; a process stopped by a debugger or \
             a frozen cgroup cannot answer either)"
        }
        _ => "",
    }
}

impl GpuError {
    /// The `CUresult` behind the error, when there is one.
    pub fn cu_result(&self) -> Option<CuResult> {
        match self {
            Self::Call { code, .. } => Some(*code),
            Self::NotResumed { cause, .. } => cause.cu_result(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_carry_the_cuda_name_and_pid() {
        let e = GpuError::Call {
            function: "cuCheckpointProcessCheckpoint",
            pid: Some(42),
            code: CuResult::NOT_SUPPORTED,
        };
        let s = e.to_string();
        assert!(
            s.starts_with(
                "cuCheckpointProcessCheckpoint failed for pid 42: CUDA_ERROR_NOT_SUPPORTED (801)"
            ),
            "{s}"
        );
        assert!(s.contains("managed/UVM"), "{s}");
        assert_eq!(e.cu_result(), Some(CuResult::NOT_SUPPORTED));
        let t = GpuError::LockTimeout {
            pid: 7,
            timeout: Duration::from_secs(10),
        };
        assert!(t.to_string().contains("process 7 timed out after 10000 ms"));
        assert!(GpuError::NoDriver("x".into())
            .to_string()
            .starts_with("no NVIDIA driver"));
    }
}
