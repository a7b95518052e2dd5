//! The only place in stasis-gpu with `unsafe`: loading `libcuda.so.1` and `libnvidia-ml.so.1` at
//! run time, the C argument structs, and the calls through the loaded function pointers.
//!
//! Everything here returns raw status codes (`CUresult`, `nvmlReturn_t`); the typed errors and the
//! state machine live in safe modules above this one. Nothing here is linked at build time: the
//! crate builds and its tests run on machines without an NVIDIA driver.
//!
//! Soundness rests on three facts, repeated at each block:
//! - every function pointer is resolved from a library that the same struct keeps loaded, with the
//!   C signature NVIDIA documents (cuda.h / nvml.h), so calling it cannot outlive its code;
//! - every pointer argument points at a live, properly sized and aligned local owned by the caller
//!   for the duration of the call (the driver does not keep it);
//! - argument structs are `#[repr(C)]`, 64 bytes, with their reserved fields zeroed, as the
//!   driver requires (layout tests below).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::Library;

/// `CUresult`.
pub type CuResultRaw = c_int;
/// `nvmlReturn_t`.
pub type NvmlReturnRaw = c_int;

const CUDA_SUCCESS: CuResultRaw = 0;
const NVML_SUCCESS: NvmlReturnRaw = 0;

/// `CUuuid`: 16 raw bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUcheckpointGpuPair` (r580+): restore the memory of `old_uuid` onto `new_uuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUcheckpointGpuPair {
    pub old_uuid: CUuuid,
    pub new_uuid: CUuuid,
}

/// `CUcheckpointLockArgs`: `timeoutMs` (0 = wait forever), then reserved, 64 bytes in all.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUcheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`: all reserved (host-memory checkpoint). The 13.4 custom-storage
/// pointer sits at offset 0 and is NULL when zeroed, which asks for host storage.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUcheckpointCheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointRestoreArgs`, r580 (CUDA 13.0) layout: `gpuPairs` at 0, `gpuPairsCount` at 8,
/// reserved to 64 bytes. On 12.8/12.9 the whole struct is reserved, so a zeroed one (no pairs) is
/// valid there too; the 13.4 layout adds a pointer at 16 that is NULL when zeroed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointRestoreArgs {
    pub gpu_pairs: *const CUcheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 44],
    pub reserved1: u64,
}

impl Default for CUcheckpointRestoreArgs {
    fn default() -> Self {
        Self {
            gpu_pairs: std::ptr::null(),
            gpu_pairs_count: 0,
            reserved: [0; 44],
            reserved1: 0,
        }
    }
}

/// `CUcheckpointUnlockArgs`: all reserved.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUcheckpointUnlockArgs {
    pub reserved: [u64; 8],
}

/// `nvmlMemory_t` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

type FnInit = unsafe extern "C" fn(c_uint) -> CuResultRaw;
type FnIntOut = unsafe extern "C" fn(*mut c_int) -> CuResultRaw;
type FnDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResultRaw;
type FnDeviceGetUuid = unsafe extern "C" fn(*mut CUuuid, c_int) -> CuResultRaw;
type FnDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResultRaw;
type FnGetErrorName = unsafe extern "C" fn(CuResultRaw, *mut *const c_char) -> CuResultRaw;
type FnGetState = unsafe extern "C" fn(c_int, *mut c_int) -> CuResultRaw;
type FnLock = unsafe extern "C" fn(c_int, *mut CUcheckpointLockArgs) -> CuResultRaw;
type FnCheckpoint = unsafe extern "C" fn(c_int, *mut CUcheckpointCheckpointArgs) -> CuResultRaw;
type FnRestore = unsafe extern "C" fn(c_int, *mut CUcheckpointRestoreArgs) -> CuResultRaw;
type FnUnlock = unsafe extern "C" fn(c_int, *mut CUcheckpointUnlockArgs) -> CuResultRaw;
type FnGetRestoreTid = unsafe extern "C" fn(c_int, *mut c_int) -> CuResultRaw;

/// Why a library could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// No candidate could be opened; the loader's message for each candidate tried.
    NotFound(Vec<String>),
    /// The library opened but lacks a symbol every supported driver has.
    MissingSymbol(&'static str),
}

/// Opens the first of `candidates` that loads.
fn open_first(candidates: &[String]) -> Result<(Library, String), LoadError> {
    let mut tried = Vec::new();
    for path in candidates {
        // SAFETY: loading a shared object runs its initialisers. The candidates are NVIDIA's
        // driver libraries (libcuda, libnvidia-ml), whose initialisers only set up the library's
        // own state; they are loaded the same way by every CUDA application.
        match unsafe { Library::new(path) } {
            Ok(lib) => return Ok((lib, path.clone())),
            // dlerror's message names the file already.
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(LoadError::NotFound(tried))
}

/// Copies a function pointer out of `lib`; `None` when the symbol is absent.
///
/// # Safety
/// `T` must be the function-pointer type of the C symbol `name` (NUL-terminated) and the pointer
/// must not be called after `lib` is dropped.
unsafe fn sym<T: Copy>(lib: &Library, name: &[u8]) -> Option<T> {
    // SAFETY: forwarded to the caller (type matches the symbol; lifetime bounded by `lib`).
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

/// Reads a NUL-terminated C string the driver wrote into `buf` (never past its end).
fn c_buf_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `libcuda.so.1`, loaded, with the functions stasis uses.
pub struct CudaLib {
    path: String,
    init: FnInit,
    driver_get_version: FnIntOut,
    device_get_count: FnIntOut,
    device_get: FnDeviceGet,
    device_get_uuid: Option<FnDeviceGetUuid>,
    device_get_name: Option<FnDeviceGetName>,
    get_error_name: Option<FnGetErrorName>,
    get_state: Option<FnGetState>,
    lock: Option<FnLock>,
    checkpoint: Option<FnCheckpoint>,
    restore: Option<FnRestore>,
    unlock: Option<FnUnlock>,
    get_restore_tid: Option<FnGetRestoreTid>,
    // Declared last so the pointers above never outlive the code they point into.
    _lib: Library,
}

impl std::fmt::Debug for CudaLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLib").field("path", &self.path).finish()
    }
}

/// Names of the checkpoint API's symbols (r570+), as `missing_checkpoint_symbols` reports them.
pub const CHECKPOINT_SYMBOLS: [&str; 6] = [
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetRestoreThreadId",
];

impl CudaLib {
    /// Loads the first of `candidates` and resolves its symbols. Does not call `cuInit`.
    pub fn open(candidates: &[String]) -> Result<Self, LoadError> {
        let (lib, path) = open_first(candidates)?;
        // SAFETY (all `sym` calls below): each type alias is the cuda.h prototype of the named
        // symbol (CUdevice is `int`, CUprocessState a 32-bit enum read as `int`), and the pointers
        // are stored next to `lib`, which the struct keeps loaded for as long as they are callable.
        unsafe {
            Ok(Self {
                init: sym::<FnInit>(&lib, b"cuInit\0").ok_or(LoadError::MissingSymbol("cuInit"))?,
                driver_get_version: sym::<FnIntOut>(&lib, b"cuDriverGetVersion\0")
                    .ok_or(LoadError::MissingSymbol("cuDriverGetVersion"))?,
                device_get_count: sym::<FnIntOut>(&lib, b"cuDeviceGetCount\0")
                    .ok_or(LoadError::MissingSymbol("cuDeviceGetCount"))?,
                device_get: sym::<FnDeviceGet>(&lib, b"cuDeviceGet\0")
                    .ok_or(LoadError::MissingSymbol("cuDeviceGet"))?,
                device_get_uuid: sym::<FnDeviceGetUuid>(&lib, b"cuDeviceGetUuid_v2\0")
                    .or_else(|| sym::<FnDeviceGetUuid>(&lib, b"cuDeviceGetUuid\0")),
                device_get_name: sym::<FnDeviceGetName>(&lib, b"cuDeviceGetName\0"),
                get_error_name: sym::<FnGetErrorName>(&lib, b"cuGetErrorName\0"),
                get_state: sym::<FnGetState>(&lib, b"cuCheckpointProcessGetState\0"),
                lock: sym::<FnLock>(&lib, b"cuCheckpointProcessLock\0"),
                checkpoint: sym::<FnCheckpoint>(&lib, b"cuCheckpointProcessCheckpoint\0"),
                restore: sym::<FnRestore>(&lib, b"cuCheckpointProcessRestore\0"),
                unlock: sym::<FnUnlock>(&lib, b"cuCheckpointProcessUnlock\0"),
                get_restore_tid: sym::<FnGetRestoreTid>(
                    &lib,
                    b"cuCheckpointProcessGetRestoreThreadId\0",
                ),
                path,
                _lib: lib,
            })
        }
    }

    /// The file that was loaded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The checkpoint API symbols this driver lacks (empty from r570 on).
    pub fn missing_checkpoint_symbols(&self) -> Vec<&'static str> {
        let present = [
            self.get_state.is_some(),
            self.lock.is_some(),
            self.checkpoint.is_some(),
            self.restore.is_some(),
            self.unlock.is_some(),
            self.get_restore_tid.is_some(),
        ];
        CHECKPOINT_SYMBOLS
            .iter()
            .zip(present)
            .filter(|(_, p)| !p)
            .map(|(n, _)| *n)
            .collect()
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> CuResultRaw {
        // SAFETY: `cuInit` takes a flags word (must be 0) and no pointers; `self` keeps the
        // library loaded.
        unsafe { (self.init)(0) }
    }

    /// `cuDriverGetVersion` (e.g. 12080 for CUDA 12.8). Callable before `cuInit`.
    pub fn driver_version(&self) -> Result<i32, CuResultRaw> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a live, aligned `int` the driver writes once.
        let r = unsafe { (self.driver_get_version)(&mut v) };
        if r == CUDA_SUCCESS {
            Ok(v)
        } else {
            Err(r)
        }
    }

    /// `cuDeviceGetCount` (needs `cuInit`).
    pub fn device_count(&self) -> Result<i32, CuResultRaw> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a live, aligned `int` the driver writes once.
        let r = unsafe { (self.device_get_count)(&mut n) };
        if r == CUDA_SUCCESS {
            Ok(n)
        } else {
            Err(r)
        }
    }

    /// UUID of device `ordinal` (`cuDeviceGet` + `cuDeviceGetUuid[_v2]`).
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16], CuResultRaw> {
        let dev = self.device(ordinal)?;
        let Some(get_uuid) = self.device_get_uuid else {
            return Err(NOT_FOUND);
        };
        let mut uuid = CUuuid::default();
        // SAFETY: `uuid` is a live 16-byte `CUuuid` the driver fills; `dev` came from cuDeviceGet.
        let r = unsafe { get_uuid(&mut uuid, dev) };
        if r == CUDA_SUCCESS {
            Ok(uuid.bytes)
        } else {
            Err(r)
        }
    }

    /// Name of device `ordinal` (`cuDeviceGetName`).
    pub fn device_name(&self, ordinal: i32) -> Result<String, CuResultRaw> {
        let dev = self.device(ordinal)?;
        let Some(get_name) = self.device_get_name else {
            return Err(NOT_FOUND);
        };
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes (NUL included) into `buf`, which is that
        // long and lives across the call.
        let r = unsafe { get_name(buf.as_mut_ptr(), buf.len() as c_int, dev) };
        if r == CUDA_SUCCESS {
            Ok(c_buf_to_string(&buf))
        } else {
            Err(r)
        }
    }

    fn device(&self, ordinal: i32) -> Result<c_int, CuResultRaw> {
        let mut dev: c_int = 0;
        // SAFETY: `dev` is a live, aligned `CUdevice` (`int`) the driver writes once.
        let r = unsafe { (self.device_get)(&mut dev, ordinal) };
        if r == CUDA_SUCCESS {
            Ok(dev)
        } else {
            Err(r)
        }
    }

    /// The driver's own name for a code (`cuGetErrorName`), if it knows it.
    pub fn error_name(&self, code: CuResultRaw) -> Option<String> {
        let f = self.get_error_name?;
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a live out-pointer; on success the driver points it at a static,
        // NUL-terminated string it owns for the life of the library.
        let r = unsafe { f(code, &mut p) };
        if r != CUDA_SUCCESS || p.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated per the cuGetErrorName contract; static storage.
        let s = unsafe { CStr::from_ptr(p) };
        Some(s.to_string_lossy().into_owned())
    }

    /// `cuCheckpointProcessGetState`: the raw `CUprocessState`.
    pub fn checkpoint_get_state(&self, pid: i32) -> Result<u32, CuResultRaw> {
        let f = self.get_state.ok_or(NOT_FOUND)?;
        let mut state: c_int = 0;
        // SAFETY: `state` is a live, aligned 32-bit slot for the `CUprocessState` enum.
        let r = unsafe { f(pid, &mut state) };
        if r == CUDA_SUCCESS {
            Ok(state as u32)
        } else {
            Err(r)
        }
    }

    /// `cuCheckpointProcessLock` with `timeoutMs` (0 = no timeout).
    pub fn checkpoint_lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CuResultRaw> {
        let f = self.lock.ok_or(NOT_FOUND)?;
        let mut args = CUcheckpointLockArgs {
            timeout_ms,
            ..Default::default()
        };
        // SAFETY: `args` is a live, zero-reserved 64-byte CUcheckpointLockArgs; the driver only
        // reads it during the call.
        status(unsafe { f(pid, &mut args) })
    }

    /// `cuCheckpointProcessCheckpoint` to host memory (zeroed args).
    pub fn checkpoint_checkpoint(&self, pid: i32) -> Result<(), CuResultRaw> {
        let f = self.checkpoint.ok_or(NOT_FOUND)?;
        let mut args = CUcheckpointCheckpointArgs::default();
        // SAFETY: `args` is a live, all-zero 64-byte CUcheckpointCheckpointArgs (host storage).
        status(unsafe { f(pid, &mut args) })
    }

    /// `cuCheckpointProcessRestore`, with GPU UUID pairs when `pairs` is non-empty (r580+ only:
    /// older drivers see non-zero reserved fields and refuse).
    pub fn checkpoint_restore(
        &self,
        pid: i32,
        pairs: &[CUcheckpointGpuPair],
    ) -> Result<(), CuResultRaw> {
        let f = self.restore.ok_or(NOT_FOUND)?;
        let mut args = CUcheckpointRestoreArgs::default();
        if !pairs.is_empty() {
            args.gpu_pairs = pairs.as_ptr();
            args.gpu_pairs_count = pairs.len() as c_uint;
        }
        // SAFETY: `args` is a live 64-byte CUcheckpointRestoreArgs with reserved fields zero;
        // `gpu_pairs` is NULL or points at `pairs`, a live slice of `gpu_pairs_count` repr(C)
        // pairs that outlives the call (the driver reads them during the call only).
        status(unsafe { f(pid, &mut args) })
    }

    /// `cuCheckpointProcessUnlock` (zeroed args).
    pub fn checkpoint_unlock(&self, pid: i32) -> Result<(), CuResultRaw> {
        let f = self.unlock.ok_or(NOT_FOUND)?;
        let mut args = CUcheckpointUnlockArgs::default();
        // SAFETY: `args` is a live, all-zero 64-byte CUcheckpointUnlockArgs.
        status(unsafe { f(pid, &mut args) })
    }

    /// `cuCheckpointProcessGetRestoreThreadId`.
    pub fn checkpoint_restore_thread_id(&self, pid: i32) -> Result<i32, CuResultRaw> {
        let f = self.get_restore_tid.ok_or(NOT_FOUND)?;
        let mut tid: c_int = 0;
        // SAFETY: `tid` is a live, aligned `int` the driver writes once.
        let r = unsafe { f(pid, &mut tid) };
        if r == CUDA_SUCCESS {
            Ok(tid)
        } else {
            Err(r)
        }
    }
}

/// `CUDA_ERROR_NOT_FOUND`, returned here when a symbol is absent (callers check symbols first).
const NOT_FOUND: CuResultRaw = 500;

fn status(r: CuResultRaw) -> Result<(), CuResultRaw> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

type NvmlDevice = *mut c_void;
type FnNvmlVoid = unsafe extern "C" fn() -> NvmlReturnRaw;
type FnNvmlStr = unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturnRaw;
type FnNvmlIntOut = unsafe extern "C" fn(*mut c_int) -> NvmlReturnRaw;
type FnNvmlUintOut = unsafe extern "C" fn(*mut c_uint) -> NvmlReturnRaw;
type FnNvmlHandle = unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> NvmlReturnRaw;
type FnNvmlDevStr = unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> NvmlReturnRaw;
type FnNvmlDevMem = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> NvmlReturnRaw;
type FnNvmlDevUintOut = unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> NvmlReturnRaw;
type FnNvmlDevMig = unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut c_uint) -> NvmlReturnRaw;

/// `libnvidia-ml.so.1`, loaded and initialised (`nvmlInit_v2`); `nvmlShutdown` on drop.
pub struct NvmlLib {
    shutdown: FnNvmlVoid,
    driver_version: FnNvmlStr,
    cuda_driver_version: Option<FnNvmlIntOut>,
    device_count: FnNvmlUintOut,
    handle_by_index: FnNvmlHandle,
    name: FnNvmlDevStr,
    uuid: FnNvmlDevStr,
    memory: FnNvmlDevMem,
    persistence: Option<FnNvmlDevUintOut>,
    mig_mode: Option<FnNvmlDevMig>,
    _lib: Library,
}

/// NVML failure: the function, and its `nvmlReturn_t`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlFail {
    Load(LoadError),
    Call(&'static str, NvmlReturnRaw),
}

/// One device's facts as NVML gives them; fields NVML refused are `None`.
#[derive(Debug, Clone, Default)]
pub struct NvmlDeviceInfo {
    pub name: String,
    pub uuid: String,
    pub memory_total: Option<u64>,
    pub memory_used: Option<u64>,
    pub persistence: Option<bool>,
    /// Current MIG mode; `None` where the GPU has no MIG (NVML_ERROR_NOT_SUPPORTED).
    pub mig: Option<bool>,
}

const NVML_BUF: usize = 96;

impl NvmlLib {
    /// Loads the first of `candidates`, resolves its symbols and calls `nvmlInit_v2`.
    pub fn open(candidates: &[String]) -> Result<Self, NvmlFail> {
        let (lib, _) = open_first(candidates).map_err(NvmlFail::Load)?;
        let miss = |n| NvmlFail::Load(LoadError::MissingSymbol(n));
        // SAFETY (all `sym` calls): each alias is the nvml.h prototype of the named symbol
        // (nvmlDevice_t is an opaque pointer, enums are 32-bit), and the pointers live in the
        // same struct as `lib`, which keeps the library loaded.
        let this = unsafe {
            let init = sym::<FnNvmlVoid>(&lib, b"nvmlInit_v2\0").ok_or(miss("nvmlInit_v2"))?;
            let rc = init();
            if rc != NVML_SUCCESS {
                return Err(NvmlFail::Call("nvmlInit_v2", rc));
            }
            Self {
                shutdown: sym(&lib, b"nvmlShutdown\0").ok_or(miss("nvmlShutdown"))?,
                driver_version: sym(&lib, b"nvmlSystemGetDriverVersion\0")
                    .ok_or(miss("nvmlSystemGetDriverVersion"))?,
                cuda_driver_version: sym(&lib, b"nvmlSystemGetCudaDriverVersion_v2\0")
                    .or_else(|| sym(&lib, b"nvmlSystemGetCudaDriverVersion\0")),
                device_count: sym(&lib, b"nvmlDeviceGetCount_v2\0")
                    .ok_or(miss("nvmlDeviceGetCount_v2"))?,
                handle_by_index: sym(&lib, b"nvmlDeviceGetHandleByIndex_v2\0")
                    .ok_or(miss("nvmlDeviceGetHandleByIndex_v2"))?,
                name: sym(&lib, b"nvmlDeviceGetName\0").ok_or(miss("nvmlDeviceGetName"))?,
                uuid: sym(&lib, b"nvmlDeviceGetUUID\0").ok_or(miss("nvmlDeviceGetUUID"))?,
                memory: sym(&lib, b"nvmlDeviceGetMemoryInfo\0")
                    .ok_or(miss("nvmlDeviceGetMemoryInfo"))?,
                persistence: sym(&lib, b"nvmlDeviceGetPersistenceMode\0"),
                mig_mode: sym(&lib, b"nvmlDeviceGetMigMode\0"),
                _lib: lib,
            }
        };
        Ok(this)
    }

    /// `nvmlSystemGetDriverVersion` (e.g. `580.65.06`).
    pub fn driver_version(&self) -> Result<String, NvmlFail> {
        let mut buf = [0 as c_char; 80];
        // SAFETY: NVML writes at most `length` bytes, NUL included, into `buf`, which has that
        // length and lives across the call.
        let r = unsafe { (self.driver_version)(buf.as_mut_ptr(), buf.len() as c_uint) };
        if r != NVML_SUCCESS {
            return Err(NvmlFail::Call("nvmlSystemGetDriverVersion", r));
        }
        Ok(c_buf_to_string(&buf))
    }

    /// `nvmlSystemGetCudaDriverVersion[_v2]` (e.g. 12080).
    pub fn cuda_driver_version(&self) -> Option<i32> {
        let f = self.cuda_driver_version?;
        let mut v: c_int = 0;
        // SAFETY: `v` is a live, aligned `int` NVML writes once.
        let r = unsafe { f(&mut v) };
        (r == NVML_SUCCESS).then_some(v)
    }

    /// All devices NVML sees.
    pub fn devices(&self) -> Result<Vec<NvmlDeviceInfo>, NvmlFail> {
        let mut n: c_uint = 0;
        // SAFETY: `n` is a live, aligned `unsigned int` NVML writes once.
        let r = unsafe { (self.device_count)(&mut n) };
        if r != NVML_SUCCESS {
            return Err(NvmlFail::Call("nvmlDeviceGetCount_v2", r));
        }
        (0..n).map(|i| self.device(i)).collect()
    }

    fn device(&self, index: c_uint) -> Result<NvmlDeviceInfo, NvmlFail> {
        let mut dev: NvmlDevice = std::ptr::null_mut();
        // SAFETY: `dev` is a live out-pointer for the opaque handle; `index` < device count.
        let r = unsafe { (self.handle_by_index)(index, &mut dev) };
        if r != NVML_SUCCESS {
            return Err(NvmlFail::Call("nvmlDeviceGetHandleByIndex_v2", r));
        }
        let string = |f: FnNvmlDevStr, what: &'static str| {
            let mut buf = [0 as c_char; NVML_BUF];
            // SAFETY: `dev` is a handle NVML just returned (valid until nvmlShutdown, which only
            // `drop` calls); NVML writes at most `length` bytes, NUL included, into `buf`.
            let r = unsafe { f(dev, buf.as_mut_ptr(), buf.len() as c_uint) };
            if r == NVML_SUCCESS {
                Ok(c_buf_to_string(&buf))
            } else {
                Err(NvmlFail::Call(what, r))
            }
        };
        let name = string(self.name, "nvmlDeviceGetName")?;
        let uuid = string(self.uuid, "nvmlDeviceGetUUID")?;
        let mut mem = NvmlMemory::default();
        // SAFETY: valid handle as above; `mem` is a live nvmlMemory_t (v1: three u64).
        let mem_ok = unsafe { (self.memory)(dev, &mut mem) } == NVML_SUCCESS;
        let (memory_total, memory_used) = if mem_ok {
            (Some(mem.total), Some(mem.used))
        } else {
            (None, None)
        };
        let persistence = self.persistence.and_then(|f| {
            let mut s: c_uint = 0;
            // SAFETY: valid handle as above; `s` is a live 32-bit nvmlEnableState_t slot.
            (unsafe { f(dev, &mut s) } == NVML_SUCCESS).then_some(s == 1)
        });
        let mig = self.mig_mode.and_then(|f| {
            let (mut cur, mut pending): (c_uint, c_uint) = (0, 0);
            // SAFETY: valid handle as above; both out-pointers are live `unsigned int`s.
            (unsafe { f(dev, &mut cur, &mut pending) } == NVML_SUCCESS).then_some(cur == 1)
        });
        Ok(NvmlDeviceInfo {
            name,
            uuid,
            memory_total,
            memory_used,
            persistence,
            mig,
        })
    }
}

impl Drop for NvmlLib {
    fn drop(&mut self) {
        // SAFETY: pairs the successful nvmlInit_v2 in `open`; no device handle outlives `self`.
        unsafe {
            (self.shutdown)();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn argument_structs_are_64_bytes() {
        assert_eq!(size_of::<CUcheckpointLockArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointCheckpointArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointRestoreArgs>(), 64);
        assert_eq!(size_of::<CUcheckpointUnlockArgs>(), 64);
        assert_eq!(size_of::<CUuuid>(), 16);
        assert_eq!(size_of::<CUcheckpointGpuPair>(), 32);
    }

    #[test]
    fn field_offsets_match_cuda_h() {
        assert_eq!(offset_of!(CUcheckpointLockArgs, timeout_ms), 0);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved0), 4);
        assert_eq!(offset_of!(CUcheckpointLockArgs, reserved1), 8);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpu_pairs), 0);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, gpu_pairs_count), 8);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved), 12);
        assert_eq!(offset_of!(CUcheckpointRestoreArgs, reserved1), 56);
        assert_eq!(offset_of!(CUcheckpointGpuPair, old_uuid), 0);
        assert_eq!(offset_of!(CUcheckpointGpuPair, new_uuid), 16);
    }

    /// The bytes of a value, to check that reserved fields are zero.
    fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
        let n = size_of::<T>();
        // SAFETY: `v` is a live `T` of `n` bytes; every type checked here is repr(C) without
        // padding, so all `n` bytes are initialised.
        unsafe { std::slice::from_raw_parts(v as *const T as *const u8, n).to_vec() }
    }

    #[test]
    fn default_arguments_are_all_zero() {
        assert!(bytes_of(&CUcheckpointLockArgs::default())
            .iter()
            .all(|&b| b == 0));
        assert!(bytes_of(&CUcheckpointCheckpointArgs::default())
            .iter()
            .all(|&b| b == 0));
        assert!(bytes_of(&CUcheckpointRestoreArgs::default())
            .iter()
            .all(|&b| b == 0));
        assert!(bytes_of(&CUcheckpointUnlockArgs::default())
            .iter()
            .all(|&b| b == 0));
        let lock = CUcheckpointLockArgs {
            timeout_ms: 0x0102_0304,
            ..Default::default()
        };
        let b = bytes_of(&lock);
        assert_eq!(&b[..4], &0x0102_0304u32.to_ne_bytes());
        assert!(b[4..].iter().all(|&x| x == 0), "reserved must stay zero");
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let e = CudaLib::open(&["libstasis-no-such-cuda.so.1".to_owned()]).unwrap_err();
        match e {
            LoadError::NotFound(tried) => {
                assert_eq!(tried.len(), 1);
                assert!(
                    tried[0].contains("libstasis-no-such-cuda.so.1"),
                    "{tried:?}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            NvmlLib::open(&["libstasis-no-such-nvml.so.1".to_owned()]),
            Err(NvmlFail::Load(LoadError::NotFound(_)))
        ));
    }

    #[test]
    fn c_strings_stop_at_nul_and_buffer_end() {
        let buf: Vec<c_char> = b"580.65.06\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_buf_to_string(&buf), "580.65.06");
        let unterminated: Vec<c_char> = b"abc".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_buf_to_string(&unterminated), "abc");
    }
}
