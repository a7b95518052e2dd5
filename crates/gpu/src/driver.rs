//! The CUDA driver, loaded at run time, and the checkpoint API over it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::GpuError;
use crate::ffi::{CudaLib, LoadError};
use crate::result::CuResult;
use crate::state::{Op, ProcessState};
use crate::uuid::{GpuPair, GpuUuid};

/// Environment variable naming the libcuda to load instead of the default search.
pub const LIBCUDA_ENV: &str = "STASIS_LIBCUDA";
/// First CUDA driver API version whose restore takes GPU UUID pairs (r580, CUDA 13.0).
pub const MIGRATION_CUDA_VERSION: i32 = 13000;

/// Environment variables that restrict or reorder the GPUs `cuInit` shows the calling process.
pub const DEVICE_MASK_ENV: [&str; 2] = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"];

/// Removes [`DEVICE_MASK_ENV`] from this process's environment and returns what was removed.
///
/// stasis drives other processes' GPUs: its own view must be the kernel driver's whole view, or
/// `cuInit` fails ("no device") or shows a subset and UUID pairs for a restore miss GPUs (NVIDIA's
/// r580 migration demo unsets both before `cuInit`; cuda-python skips its migration tests when
/// they are set). Call it first thing in `main`, before any thread exists: changing the
/// environment races with threads that read it.
pub fn unmask_device_view() -> Vec<(&'static str, String)> {
    let mut removed = Vec::new();
    for name in DEVICE_MASK_ENV {
        if let Some(v) = std::env::var_os(name) {
            removed.push((name, v.to_string_lossy().into_owned()));
            std::env::remove_var(name);
        }
    }
    removed
}

/// Where libcuda is looked for: `$STASIS_LIBCUDA`, else the dynamic linker's search, else GKE's
/// and the GPU operator's install dirs (the operator's driver container keeps the libraries under
/// `/run/nvidia/driver`, out of the host's linker cache).
pub fn libcuda_candidates() -> Vec<String> {
    if let Ok(p) = std::env::var(LIBCUDA_ENV) {
        if !p.is_empty() {
            return vec![p];
        }
    }
    vec![
        "libcuda.so.1".to_owned(),
        "/usr/local/nvidia/lib64/libcuda.so.1".to_owned(),
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_owned(),
        "/run/nvidia/driver/usr/lib64/libcuda.so.1".to_owned(),
    ]
}

/// The checkpoint calls, behind a trait so that the multi-process logic can be tested without a
/// GPU ([`crate::sim::SimDriver`]) and run against the real driver ([`Driver`]).
pub trait CheckpointApi: Send + Sync {
    /// `cuCheckpointProcessGetState`. Fails for a process without a CUDA context.
    fn state(&self, pid: i32) -> Result<ProcessState, GpuError>;
    /// `cuCheckpointProcessLock` with a timeout (`None`: wait for ever). A timeout is
    /// [`GpuError::LockTimeout`] and leaves the process RUNNING.
    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError>;
    /// `cuCheckpointProcessCheckpoint` into host memory.
    fn checkpoint(&self, pid: i32) -> Result<(), GpuError>;
    /// `cuCheckpointProcessRestore`; `pairs` empty: onto the same GPUs.
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError>;
    /// `cuCheckpointProcessUnlock`.
    fn unlock(&self, pid: i32) -> Result<(), GpuError>;
    /// `cuCheckpointProcessGetRestoreThreadId`.
    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError>;
    /// Whether `restore` accepts UUID pairs (r580+).
    fn supports_migration(&self) -> bool;
}

/// The loaded CUDA driver with a working checkpoint API (`cuInit` done).
#[derive(Debug)]
pub struct Driver {
    lib: CudaLib,
    cuda_version: i32,
}

/// `12080` → `12.8`.
pub fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

impl Driver {
    /// Loads libcuda from the default places, checks the checkpoint API and calls `cuInit`.
    pub fn load() -> Result<Self, GpuError> {
        Self::load_from(&libcuda_candidates())
    }

    /// The process-wide driver ([`Driver::load`]). A success is kept for the life of the
    /// process; a failure is not, so a long-running agent picks up a driver installed later.
    pub fn shared() -> Result<Arc<Self>, GpuError> {
        static DRIVER: Mutex<Option<Arc<Driver>>> = Mutex::new(None);
        let mut slot = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let d = Arc::new(Self::load()?);
        *slot = Some(d.clone());
        Ok(d)
    }

    /// As [`Driver::load`], from the given candidate paths.
    pub fn load_from(candidates: &[String]) -> Result<Self, GpuError> {
        for name in DEVICE_MASK_ENV {
            if let Ok(v) = std::env::var(name) {
                tracing::warn!(
                    "{name}={v} in stasis's environment restricts the GPUs the driver shows it; \
                     the binary should have called unmask_device_view"
                );
            }
        }
        let lib = CudaLib::open(candidates).map_err(load_error)?;
        let cuda_version = lib.driver_version().map_err(|c| GpuError::Call {
            function: "cuDriverGetVersion",
            pid: None,
            code: CuResult(c),
        })?;
        let missing = lib.missing_checkpoint_symbols();
        if !missing.is_empty() {
            return Err(GpuError::NoCheckpointApi {
                cuda_version: cuda_version_string(cuda_version),
                missing: missing.join(", "),
            });
        }
        match CuResult(lib.init()) {
            CuResult::SUCCESS => {}
            CuResult::STUB_LIBRARY => {
                return Err(GpuError::NoDriver(format!(
                    "{} is the CUDA toolkit's stub library, not a driver",
                    lib.path()
                )))
            }
            CuResult::NO_DEVICE => {
                return Err(GpuError::NoDriver(format!(
                    "the driver ({}) sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE)",
                    lib.path()
                )))
            }
            code => {
                return Err(GpuError::Call {
                    function: "cuInit",
                    pid: None,
                    code,
                })
            }
        }
        Ok(Self { lib, cuda_version })
    }

    /// `cuDriverGetVersion`, e.g. 12080.
    pub fn cuda_version(&self) -> i32 {
        self.cuda_version
    }

    /// The library file that was loaded.
    pub fn path(&self) -> &str {
        self.lib.path()
    }

    /// UUIDs of the GPUs this process sees, in CUDA order.
    pub fn device_uuids(&self) -> Result<Vec<GpuUuid>, GpuError> {
        let n = self
            .lib
            .device_count()
            .map_err(|c| call("cuDeviceGetCount", None, c))?;
        (0..n)
            .map(|i| {
                self.lib
                    .device_uuid(i)
                    .map(GpuUuid)
                    .map_err(|c| call("cuDeviceGetUuid", None, c))
            })
            .collect()
    }

    /// Names of the GPUs this process sees, in CUDA order.
    pub fn device_names(&self) -> Result<Vec<String>, GpuError> {
        let n = self
            .lib
            .device_count()
            .map_err(|c| call("cuDeviceGetCount", None, c))?;
        (0..n)
            .map(|i| {
                self.lib
                    .device_name(i)
                    .map_err(|c| call("cuDeviceGetName", None, c))
            })
            .collect()
    }

    /// The driver's own name for a code (falls back to stasis's table).
    pub fn error_name(&self, code: CuResult) -> String {
        self.lib.error_name(code.0).unwrap_or_else(|| code.name())
    }

    fn op_error(&self, op: Op, pid: i32, code: i32) -> GpuError {
        let err = call(op.function(), Some(pid), code);
        // A failed checkpoint or restore may leave the process FAILED: say so, it changes what
        // the caller must do (kill, cold start).
        if matches!(op, Op::Checkpoint | Op::Restore)
            && self
                .lib
                .checkpoint_get_state(pid)
                .map(ProcessState::from_raw)
                == Ok(ProcessState::Failed)
        {
            return GpuError::Failed { pid, op };
        }
        err
    }
}

fn call(function: &'static str, pid: Option<i32>, code: i32) -> GpuError {
    GpuError::Call {
        function,
        pid,
        code: CuResult(code),
    }
}

pub(crate) fn load_error(e: LoadError) -> GpuError {
    match e {
        LoadError::NotFound(tried) => GpuError::NoDriver(format!(
            "libcuda.so.1 could not be loaded ({})",
            tried.join("; ")
        )),
        LoadError::MissingSymbol(s) => GpuError::NoDriver(format!(
            "libcuda.so.1 lacks {s}: not an NVIDIA driver library"
        )),
    }
}

/// Milliseconds for `CUcheckpointLockArgs.timeoutMs`: at least 1 (0 would mean "no timeout"),
/// saturating at `u32::MAX`.
pub fn lock_timeout_ms(timeout: Option<Duration>) -> u32 {
    match timeout {
        None => 0,
        Some(t) => u32::try_from(t.as_millis()).unwrap_or(u32::MAX).max(1),
    }
}

impl CheckpointApi for Driver {
    fn state(&self, pid: i32) -> Result<ProcessState, GpuError> {
        self.lib
            .checkpoint_get_state(pid)
            .map(ProcessState::from_raw)
            .map_err(|c| call("cuCheckpointProcessGetState", Some(pid), c))
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<(), GpuError> {
        self.lib
            .checkpoint_lock(pid, lock_timeout_ms(timeout))
            .map_err(|c| match (timeout, CuResult(c).is_timeout()) {
                (Some(timeout), true) => GpuError::LockTimeout { pid, timeout },
                _ => call(Op::Lock.function(), Some(pid), c),
            })
    }

    fn checkpoint(&self, pid: i32) -> Result<(), GpuError> {
        self.lib
            .checkpoint_checkpoint(pid)
            .map_err(|c| self.op_error(Op::Checkpoint, pid, c))
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), GpuError> {
        if !pairs.is_empty() && !self.supports_migration() {
            return Err(GpuError::Unsupported(format!(
                "restoring onto other GPUs needs driver r580 (CUDA 13.0) or newer; this one is \
                 CUDA {}",
                cuda_version_string(self.cuda_version)
            )));
        }
        let ffi: Vec<_> = pairs.iter().map(|p| p.to_ffi()).collect();
        self.lib
            .checkpoint_restore(pid, &ffi)
            .map_err(|c| self.op_error(Op::Restore, pid, c))
    }

    fn unlock(&self, pid: i32) -> Result<(), GpuError> {
        self.lib
            .checkpoint_unlock(pid)
            .map_err(|c| call(Op::Unlock.function(), Some(pid), c))
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32, GpuError> {
        self.lib
            .checkpoint_restore_thread_id(pid)
            .map_err(|c| call("cuCheckpointProcessGetRestoreThreadId", Some(pid), c))
    }

    fn supports_migration(&self) -> bool {
        self.cuda_version >= MIGRATION_CUDA_VERSION
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_libcuda_is_a_typed_no_driver_error() {
        let e = Driver::load_from(&["/nonexistent/libcuda.so.1".to_owned()]).unwrap_err();
        match &e {
            GpuError::NoDriver(why) => assert!(why.contains("/nonexistent/libcuda.so.1"), "{why}"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(e
            .to_string()
            .starts_with("no NVIDIA driver: libcuda.so.1 could not be loaded"));
    }

    #[test]
    fn a_library_that_is_not_libcuda_is_refused() {
        // libc is on every machine and has none of the CUDA symbols.
        let e = Driver::load_from(&["libc.so.6".to_owned()]).unwrap_err();
        assert!(
            matches!(&e, GpuError::NoDriver(why) if why.contains("lacks cuInit")),
            "{e:?}"
        );
    }

    #[test]
    fn lock_timeouts_in_milliseconds() {
        assert_eq!(lock_timeout_ms(None), 0);
        assert_eq!(lock_timeout_ms(Some(Duration::from_secs(10))), 10_000);
        assert_eq!(lock_timeout_ms(Some(Duration::from_micros(10))), 1);
        assert_eq!(
            lock_timeout_ms(Some(Duration::from_secs(u64::MAX))),
            u32::MAX
        );
    }

    #[test]
    fn cuda_versions() {
        assert_eq!(cuda_version_string(12080), "12.8");
        assert_eq!(cuda_version_string(13000), "13.0");
    }
}
