//! The node's GPUs through NVML (`libnvidia-ml.so.1`, loaded at run time).

use stasis_core::gpu::{GpuDevice, GpuFingerprint};

use crate::error::GpuError;
use crate::ffi::{NvmlFail, NvmlLib};
use crate::result::NvmlReturn;

/// Environment variable naming the NVML library to load instead of the default search.
pub const LIBNVML_ENV: &str = "STASIS_LIBNVML";

fn candidates() -> Vec<String> {
    if let Ok(p) = std::env::var(LIBNVML_ENV) {
        if !p.is_empty() {
            return vec![p];
        }
    }
    vec![
        "libnvidia-ml.so.1".to_owned(),
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1".to_owned(),
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1".to_owned(),
        "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1".to_owned(),
    ]
}

fn nvml_error(e: NvmlFail) -> GpuError {
    match e {
        NvmlFail::Load(l) => GpuError::NoDriver(match l {
            crate::ffi::LoadError::NotFound(tried) => format!(
                "libnvidia-ml.so.1 could not be loaded ({})",
                tried.join("; ")
            ),
            crate::ffi::LoadError::MissingSymbol(s) => format!("libnvidia-ml.so.1 lacks {s}"),
        }),
        // The library is there but the kernel module is not: no usable driver.
        NvmlFail::Call(f, 9) => GpuError::NoDriver(format!(
            "{f}: {} (the NVIDIA kernel module is not loaded)",
            NvmlReturn(9)
        )),
        NvmlFail::Call(function, code) => GpuError::Nvml {
            function,
            code: NvmlReturn(code),
        },
    }
}

/// The node's GPU fingerprint: driver version (full), CUDA driver version, every GPU's model,
/// UUID, memory and MIG mode, and whether persistence mode is on for all of them.
pub fn fingerprint() -> Result<GpuFingerprint, GpuError> {
    let nvml = NvmlLib::open(&candidates()).map_err(nvml_error)?;
    let driver_version = nvml.driver_version().map_err(nvml_error)?;
    let infos = nvml.devices().map_err(nvml_error)?;
    let persistence_mode = infos
        .iter()
        .map(|d| d.persistence)
        .collect::<Option<Vec<bool>>>()
        .map(|v| v.iter().all(|&p| p));
    Ok(GpuFingerprint {
        driver_version,
        cuda_driver_version: nvml
            .cuda_driver_version()
            .and_then(|v| u32::try_from(v).ok()),
        devices: infos
            .into_iter()
            .map(|d| GpuDevice {
                name: d.name,
                uuid: d.uuid,
                memory_bytes: d.memory_total.unwrap_or(0),
                mig_enabled: d.mig,
            })
            .collect(),
        persistence_mode,
        workload_gpus: Vec::new(),
    })
}

/// GPU memory in use on each GPU (NVML), in NVML order; `None` for a GPU NVML did not answer for.
pub fn memory_used() -> Result<Vec<Option<u64>>, GpuError> {
    let nvml = NvmlLib::open(&candidates()).map_err(nvml_error)?;
    Ok(nvml
        .devices()
        .map_err(nvml_error)?
        .into_iter()
        .map(|d| d.memory_used)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_typed() {
        let e = nvml_error(NvmlFail::Load(crate::ffi::LoadError::NotFound(vec![
            "libnvidia-ml.so.1: not found".into(),
        ])));
        assert!(e
            .to_string()
            .starts_with("no NVIDIA driver: libnvidia-ml.so.1 could not be loaded"));
        let e = nvml_error(NvmlFail::Call("nvmlInit_v2", 9));
        assert!(
            matches!(e, GpuError::NoDriver(ref m) if m.contains("NVML_ERROR_DRIVER_NOT_LOADED"))
        );
        let e = nvml_error(NvmlFail::Call("nvmlDeviceGetCount_v2", 4));
        assert_eq!(
            e.to_string(),
            "nvmlDeviceGetCount_v2 failed: NVML_ERROR_NO_PERMISSION (4)"
        );
    }
}
