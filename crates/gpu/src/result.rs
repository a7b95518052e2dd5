//! `CUresult` and `nvmlReturn_t` codes with their names, so every error says which one it was.

use std::fmt;

/// A `CUresult` from the driver. Displays as `CUDA_ERROR_NOT_READY (600)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuResult(pub i32);

impl CuResult {
    pub const SUCCESS: Self = Self(0);
    pub const INVALID_VALUE: Self = Self(1);
    pub const OUT_OF_MEMORY: Self = Self(2);
    pub const NOT_INITIALIZED: Self = Self(3);
    pub const STUB_LIBRARY: Self = Self(34);
    pub const NO_DEVICE: Self = Self(100);
    pub const INVALID_CONTEXT: Self = Self(201);
    pub const ILLEGAL_STATE: Self = Self(401);
    pub const NOT_FOUND: Self = Self(500);
    pub const NOT_READY: Self = Self(600);
    pub const NOT_PERMITTED: Self = Self(800);
    pub const NOT_SUPPORTED: Self = Self(801);
    pub const MPS_CONNECTION_FAILED: Self = Self(805);
    pub const TIMEOUT: Self = Self(909);
    pub const UNKNOWN: Self = Self(999);

    /// The cuda.h name, or `CUDA_ERROR_<code>` for a code this table does not know.
    pub fn name(self) -> String {
        match cu_result_name(self.0) {
            Some(n) => n.to_owned(),
            None => format!("CUDA_ERROR_{}", self.0),
        }
    }

    /// Whether a lock returned because its `timeoutMs` ran out (the driver reports NOT_READY;
    /// TIMEOUT is accepted too).
    pub fn is_timeout(self) -> bool {
        self == Self::NOT_READY || self == Self::TIMEOUT
    }
}

impl fmt::Display for CuResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// cuda.h `cudaError_enum` (CUDA 12.x/13.x driver API). Unknown codes return `None`.
pub fn cu_result_name(code: i32) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        5 => "CUDA_ERROR_PROFILER_DISABLED",
        6 => "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
        7 => "CUDA_ERROR_PROFILER_ALREADY_STARTED",
        8 => "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        102 => "CUDA_ERROR_DEVICE_NOT_LICENSED",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        202 => "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        205 => "CUDA_ERROR_MAP_FAILED",
        206 => "CUDA_ERROR_UNMAP_FAILED",
        207 => "CUDA_ERROR_ARRAY_IS_MAPPED",
        208 => "CUDA_ERROR_ALREADY_MAPPED",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        210 => "CUDA_ERROR_ALREADY_ACQUIRED",
        211 => "CUDA_ERROR_NOT_MAPPED",
        212 => "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
        213 => "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        215 => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        216 => "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        218 => "CUDA_ERROR_INVALID_PTX",
        219 => "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
        220 => "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        223 => "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        224 => "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        225 => "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
        226 => "CUDA_ERROR_CONTAINED",
        300 => "CUDA_ERROR_INVALID_SOURCE",
        301 => "CUDA_ERROR_FILE_NOT_FOUND",
        302 => "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
        303 => "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        402 => "CUDA_ERROR_LOSSY_QUERY",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        703 => "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
        704 => "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        705 => "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        708 => "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        710 => "CUDA_ERROR_ASSERT",
        711 => "CUDA_ERROR_TOO_MANY_PEERS",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
        715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
        717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        718 => "CUDA_ERROR_INVALID_PC",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        721 => "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
        806 => "CUDA_ERROR_MPS_RPC_FAILURE",
        807 => "CUDA_ERROR_MPS_SERVER_NOT_READY",
        808 => "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        809 => "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        810 => "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        811 => "CUDA_ERROR_CDP_NOT_SUPPORTED",
        812 => "CUDA_ERROR_CDP_VERSION_MISMATCH",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        902 => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        903 => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        905 => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        906 => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        907 => "CUDA_ERROR_CAPTURED_EVENT",
        908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        909 => "CUDA_ERROR_TIMEOUT",
        910 => "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        911 => "CUDA_ERROR_EXTERNAL_DEVICE",
        912 => "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        913 => "CUDA_ERROR_FUNCTION_NOT_LOADED",
        914 => "CUDA_ERROR_INVALID_RESOURCE_TYPE",
        915 => "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        916 => "CUDA_ERROR_KEY_ROTATION",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// An `nvmlReturn_t`. Displays as `NVML_ERROR_NOT_SUPPORTED (3)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvmlReturn(pub i32);

impl NvmlReturn {
    /// The nvml.h name, or `NVML_ERROR_<code>`.
    pub fn name(self) -> String {
        let n = match self.0 {
            0 => "NVML_SUCCESS",
            1 => "NVML_ERROR_UNINITIALIZED",
            2 => "NVML_ERROR_INVALID_ARGUMENT",
            3 => "NVML_ERROR_NOT_SUPPORTED",
            4 => "NVML_ERROR_NO_PERMISSION",
            5 => "NVML_ERROR_ALREADY_INITIALIZED",
            6 => "NVML_ERROR_NOT_FOUND",
            7 => "NVML_ERROR_INSUFFICIENT_SIZE",
            8 => "NVML_ERROR_INSUFFICIENT_POWER",
            9 => "NVML_ERROR_DRIVER_NOT_LOADED",
            10 => "NVML_ERROR_TIMEOUT",
            11 => "NVML_ERROR_IRQ_ISSUE",
            12 => "NVML_ERROR_LIBRARY_NOT_FOUND",
            13 => "NVML_ERROR_FUNCTION_NOT_FOUND",
            14 => "NVML_ERROR_CORRUPTED_INFOROM",
            15 => "NVML_ERROR_GPU_IS_LOST",
            16 => "NVML_ERROR_RESET_REQUIRED",
            17 => "NVML_ERROR_OPERATING_SYSTEM",
            18 => "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
            19 => "NVML_ERROR_IN_USE",
            20 => "NVML_ERROR_MEMORY",
            21 => "NVML_ERROR_NO_DATA",
            22 => "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED",
            23 => "NVML_ERROR_INSUFFICIENT_RESOURCES",
            24 => "NVML_ERROR_FREQ_NOT_SUPPORTED",
            25 => "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
            26 => "NVML_ERROR_DEPRECATED",
            27 => "NVML_ERROR_NOT_READY",
            28 => "NVML_ERROR_GPU_NOT_FOUND",
            29 => "NVML_ERROR_INVALID_STATE",
            999 => "NVML_ERROR_UNKNOWN",
            c => return format!("NVML_ERROR_{c}"),
        };
        n.to_owned()
    }
}

impl fmt::Display for NvmlReturn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_the_codes_the_checkpoint_api_returns() {
        // The codes cuCheckpointProcess* document (reference/gpu.md §1.2).
        for (code, name) in [
            (0, "CUDA_SUCCESS"),
            (1, "CUDA_ERROR_INVALID_VALUE"),
            (3, "CUDA_ERROR_NOT_INITIALIZED"),
            (201, "CUDA_ERROR_INVALID_CONTEXT"),
            (401, "CUDA_ERROR_ILLEGAL_STATE"),
            (600, "CUDA_ERROR_NOT_READY"),
            (801, "CUDA_ERROR_NOT_SUPPORTED"),
            (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
            (34, "CUDA_ERROR_STUB_LIBRARY"),
            (999, "CUDA_ERROR_UNKNOWN"),
        ] {
            assert_eq!(CuResult(code).name(), name);
        }
        assert_eq!(
            CuResult::NOT_READY.to_string(),
            "CUDA_ERROR_NOT_READY (600)"
        );
    }

    #[test]
    fn unknown_codes_still_have_a_name() {
        assert_eq!(cu_result_name(123_456), None);
        assert_eq!(CuResult(123_456).name(), "CUDA_ERROR_123456");
        assert_eq!(NvmlReturn(4242).name(), "NVML_ERROR_4242");
    }

    #[test]
    fn table_has_no_duplicate_names() {
        let mut names: Vec<&str> = (0..1000).filter_map(cu_result_name).collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        assert!(names.iter().all(|n| n.starts_with("CUDA_")));
    }

    #[test]
    fn timeouts() {
        assert!(CuResult::NOT_READY.is_timeout());
        assert!(CuResult::TIMEOUT.is_timeout());
        assert!(!CuResult::ILLEGAL_STATE.is_timeout());
    }

    #[test]
    fn nvml_names() {
        assert_eq!(NvmlReturn(3).name(), "NVML_ERROR_NOT_SUPPORTED");
        assert_eq!(
            NvmlReturn(9).to_string(),
            "NVML_ERROR_DRIVER_NOT_LOADED (9)"
        );
    }
}
