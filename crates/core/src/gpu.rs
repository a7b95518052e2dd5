//! The GPU part of a node's fingerprint and its compatibility rule (DESIGN §5, §7).

use serde::{Deserialize, Serialize};

use crate::fingerprint::Mismatch;

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    pub name: String,
    pub uuid: String,
    pub memory_bytes: u64,
}

/// The node's NVIDIA driver and GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuFingerprint {
    /// Full driver version, e.g. `580.65.06`.
    pub driver_version: String,
    /// CUDA driver API version as `cuDriverGetVersion` reports it (e.g. 12080).
    pub cuda_driver_version: Option<u32>,
    pub devices: Vec<GpuDevice>,
    pub persistence_mode: Option<bool>,
}

impl GpuFingerprint {
    /// The driver branch: the major component of the version (`580` of `580.65.06`).
    pub fn driver_branch(&self) -> &str {
        self.driver_version.split('.').next().unwrap_or("")
    }
}

/// GPU requirements: same model and count, same driver branch. No GPU recorded: nothing needed.
pub fn check(recorded: Option<&GpuFingerprint>, node: Option<&GpuFingerprint>) -> Vec<Mismatch> {
    let Some(rec) = recorded else {
        return Vec::new();
    };
    let m = |field: &str, r: String, f: String| Mismatch {
        field: field.to_owned(),
        recorded: r,
        found: f,
    };
    let Some(node) = node else {
        return vec![m(
            "gpu.driver",
            format!("NVIDIA driver {}", rec.driver_version),
            "no NVIDIA driver".to_owned(),
        )];
    };
    let mut out = Vec::new();
    if rec.driver_branch() != node.driver_branch() {
        out.push(m(
            "gpu.driver_branch",
            format!("{} ({})", rec.driver_branch(), rec.driver_version),
            format!("{} ({})", node.driver_branch(), node.driver_version),
        ));
    }
    if rec.devices.len() != node.devices.len() {
        out.push(m(
            "gpu.count",
            rec.devices.len().to_string(),
            node.devices.len().to_string(),
        ));
    }
    let models = |g: &GpuFingerprint| {
        let mut v: Vec<String> = g.devices.iter().map(|d| d.name.clone()).collect();
        v.sort();
        v
    };
    if models(rec) != models(node) {
        out.push(m(
            "gpu.model",
            models(rec).join(","),
            models(node).join(","),
        ));
    }
    out
}
