//! The GPU part of a node's fingerprint and its compatibility rule (DESIGN §5, §7).
//!
//! | field | rule |
//! |---|---|
//! | `gpu.driver` | a checkpoint that recorded GPUs needs an NVIDIA driver on the node |
//! | `gpu.driver_branch` | same branch (`580` of `580.65.06`); the full version is recorded |
//! | `gpu.count` | same number of GPUs |
//! | `gpu.model` | same models (as a multiset: order does not matter) |
//! | `gpu.memory` | each GPU at least as much memory as the one it replaces (sorted pairwise) |
//! | `gpu.mig` | no MIG on the node: the checkpoint API does not support MIG |
//! | `gpu.uuid` | other GPUs than recorded need GPU migration, branch >= 580 |
//!
//! GPUs with other UUIDs are fine from r580 on: the restore passes UUID pairs to the driver.

use serde::{Deserialize, Serialize};

use crate::fingerprint::Mismatch;

/// The first driver branch with the `cuCheckpointProcess*` API.
pub const MIN_CHECKPOINT_BRANCH: u32 = 570;
/// The first driver branch that restores onto other GPUs (`CUcheckpointRestoreArgs.gpuPairs`).
pub const MIN_MIGRATION_BRANCH: u32 = 580;

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GpuDevice {
    /// Model, e.g. `NVIDIA H200`.
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    pub memory_bytes: u64,
    /// Whether MIG mode is on; `None` where the GPU has no MIG or NVML did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_enabled: Option<bool>,
}

/// The node's NVIDIA driver and GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GpuFingerprint {
    /// Full driver version, e.g. `580.65.06`.
    pub driver_version: String,
    /// CUDA driver API version as `cuDriverGetVersion` reports it (e.g. 12080).
    pub cuda_driver_version: Option<u32>,
    pub devices: Vec<GpuDevice>,
    /// Whether persistence mode is on for every GPU; `None` when NVML did not say.
    pub persistence_mode: Option<bool>,
    /// The GPUs the checkpointed workload was given (`NVIDIA_VISIBLE_DEVICES` of its CUDA
    /// processes, as UUIDs of `devices`), when it was given some rather than every GPU of the
    /// node: a restore moves their memory onto the GPUs the new pod is given. Empty in a node's
    /// own fingerprint, and not part of the compatibility rule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workload_gpus: Vec<String>,
}

impl GpuFingerprint {
    /// The driver branch: the major component of the version (`580` of `580.65.06`).
    pub fn driver_branch(&self) -> &str {
        self.driver_version.split('.').next().unwrap_or("")
    }

    /// The driver branch as a number, when the version parses.
    pub fn driver_branch_number(&self) -> Option<u32> {
        self.driver_branch().parse().ok()
    }

    /// Whether the driver has the checkpoint API (branch >= 570).
    pub fn has_checkpoint_api(&self) -> bool {
        self.driver_branch_number()
            .is_some_and(|b| b >= MIN_CHECKPOINT_BRANCH)
    }

    /// Whether the driver restores onto other GPUs (branch >= 580).
    pub fn supports_migration(&self) -> bool {
        self.driver_branch_number()
            .is_some_and(|b| b >= MIN_MIGRATION_BRANCH)
    }

    /// Whether any GPU is in MIG mode.
    pub fn mig_enabled(&self) -> bool {
        self.devices.iter().any(|d| d.mig_enabled == Some(true))
    }

    fn sorted_models(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.devices.iter().map(|d| d.name.as_str()).collect();
        v.sort_unstable();
        v
    }

    fn sorted_uuids(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.devices.iter().map(|d| d.uuid.as_str()).collect();
        v.sort_unstable();
        v
    }
}

/// GPU requirements (table above). No GPU recorded: nothing needed.
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
    let (rec_models, node_models) = (rec.sorted_models(), node.sorted_models());
    if rec_models != node_models {
        out.push(m("gpu.model", rec_models.join(","), node_models.join(",")));
    } else {
        // Same models: compare memory pairwise, smallest with smallest (0 = unknown).
        let mem = |g: &GpuFingerprint| {
            let mut v: Vec<(String, u64)> = g
                .devices
                .iter()
                .map(|d| (d.name.clone(), d.memory_bytes))
                .collect();
            v.sort();
            v
        };
        let short: Vec<String> = mem(rec)
            .into_iter()
            .zip(mem(node))
            .filter(|((_, r), (_, n))| *r > 0 && *n > 0 && n < r)
            .map(|((name, r), (_, n))| format!("{name} with {n} bytes, recorded {r}"))
            .collect();
        if !short.is_empty() {
            out.push(m(
                "gpu.memory",
                "at least the recorded memory per GPU".to_owned(),
                short.join("; "),
            ));
        }
    }
    if node.mig_enabled() && !rec.mig_enabled() {
        out.push(m(
            "gpu.mig",
            "MIG disabled".to_owned(),
            "MIG enabled (the CUDA checkpoint API does not support MIG)".to_owned(),
        ));
    }
    if rec.sorted_uuids() != node.sorted_uuids() && !node.supports_migration() {
        out.push(m(
            "gpu.uuid",
            format!(
                "the same GPUs ({}), or driver >= {MIN_MIGRATION_BRANCH} to restore onto others",
                rec.sorted_uuids().join(",")
            ),
            format!(
                "other GPUs ({}) with driver {}",
                node.sorted_uuids().join(","),
                node.driver_version
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn dev(name: &str, uuid: &str, mem: u64) -> GpuDevice {
        GpuDevice {
            name: name.into(),
            uuid: uuid.into(),
            memory_bytes: mem,
            mig_enabled: Some(false),
        }
    }

    fn h200(driver: &str, uuids: &[&str]) -> GpuFingerprint {
        GpuFingerprint {
            driver_version: driver.into(),
            cuda_driver_version: Some(13000),
            devices: uuids
                .iter()
                .map(|u| dev("NVIDIA H200", u, 141 * GIB))
                .collect(),
            persistence_mode: Some(true),
            workload_gpus: Vec::new(),
        }
    }

    fn fields(v: Vec<Mismatch>) -> Vec<String> {
        v.into_iter().map(|m| m.field).collect()
    }

    #[test]
    fn branch_parsing() {
        let g = h200("580.65.06", &["GPU-a"]);
        assert_eq!(g.driver_branch(), "580");
        assert_eq!(g.driver_branch_number(), Some(580));
        assert!(g.has_checkpoint_api() && g.supports_migration());
        let old = h200("565.57.01", &["GPU-a"]);
        assert!(!old.has_checkpoint_api());
        let r570 = h200("570.124.06", &["GPU-a"]);
        assert!(r570.has_checkpoint_api() && !r570.supports_migration());
        assert_eq!(h200("", &[]).driver_branch_number(), None);
    }

    #[test]
    fn no_gpu_recorded_needs_nothing() {
        assert!(check(None, None).is_empty());
        assert!(check(None, Some(&h200("580.65.06", &["GPU-a"]))).is_empty());
    }

    #[test]
    fn same_node_is_compatible() {
        let g = h200("580.65.06", &["GPU-a", "GPU-b"]);
        assert!(check(Some(&g), Some(&g)).is_empty());
    }

    #[test]
    fn other_patch_release_of_the_branch_is_compatible() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let node = h200("580.95.05", &["GPU-a"]);
        assert!(check(Some(&rec), Some(&node)).is_empty());
    }

    #[test]
    fn no_driver_on_target() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let out = check(Some(&rec), None);
        assert_eq!(fields(out.clone()), ["gpu.driver"]);
        assert_eq!(out[0].found, "no NVIDIA driver");
        assert!(out[0].recorded.contains("580.65.06"));
    }

    #[test]
    fn branch_mismatch_names_both_full_versions() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let node = h200("575.51.03", &["GPU-a"]);
        let out = check(Some(&rec), Some(&node));
        assert_eq!(fields(out.clone()), ["gpu.driver_branch"]);
        assert_eq!(out[0].recorded, "580 (580.65.06)");
        assert_eq!(out[0].found, "575 (575.51.03)");
    }

    #[test]
    fn count_mismatch() {
        let rec = h200("580.65.06", &["GPU-a", "GPU-b"]);
        let node = h200("580.65.06", &["GPU-a"]);
        let f = fields(check(Some(&rec), Some(&node)));
        assert!(f.contains(&"gpu.count".to_owned()), "{f:?}");
        assert!(f.contains(&"gpu.model".to_owned()), "{f:?}");
    }

    #[test]
    fn model_mismatch_ignores_order() {
        let mut rec = h200("580.65.06", &["GPU-a", "GPU-b"]);
        rec.devices[1].name = "NVIDIA H100 80GB HBM3".into();
        let mut node = rec.clone();
        node.devices.reverse();
        assert!(check(Some(&rec), Some(&node)).is_empty());
        node.devices[0].name = "NVIDIA L4".into();
        let out = check(Some(&rec), Some(&node));
        assert_eq!(fields(out.clone()), ["gpu.model"]);
        assert!(out[0].found.contains("NVIDIA L4"));
    }

    #[test]
    fn less_memory_is_refused_more_is_fine() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let mut node = rec.clone();
        node.devices[0].memory_bytes = 140 * GIB;
        assert_eq!(fields(check(Some(&rec), Some(&node))), ["gpu.memory"]);
        node.devices[0].memory_bytes = 200 * GIB;
        assert!(check(Some(&rec), Some(&node)).is_empty());
        node.devices[0].memory_bytes = 0; // unknown
        assert!(check(Some(&rec), Some(&node)).is_empty());
    }

    #[test]
    fn mig_on_the_node_is_refused() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let mut node = rec.clone();
        node.devices[0].mig_enabled = Some(true);
        assert_eq!(fields(check(Some(&rec), Some(&node))), ["gpu.mig"]);
    }

    #[test]
    fn other_gpus_need_r580() {
        let rec = h200("580.65.06", &["GPU-a"]);
        let node = h200("580.65.06", &["GPU-z"]);
        assert!(check(Some(&rec), Some(&node)).is_empty(), "r580 remaps");
        let rec = h200("570.124.06", &["GPU-a"]);
        let node = h200("570.124.06", &["GPU-z"]);
        let out = check(Some(&rec), Some(&node));
        assert_eq!(fields(out.clone()), ["gpu.uuid"]);
        assert!(out[0].recorded.contains("GPU-a"));
        assert!(out[0].found.contains("GPU-z"));
    }

    #[test]
    fn old_fingerprints_without_mig_field_still_parse() {
        let json = r#"{"driver_version":"570.1","cuda_driver_version":12080,
            "devices":[{"name":"NVIDIA L4","uuid":"GPU-a","memory_bytes":1}],
            "persistence_mode":null}"#;
        let g: GpuFingerprint = serde_json::from_str(json).unwrap();
        assert_eq!(g.devices[0].mig_enabled, None);
        assert!(!g.mig_enabled());
    }
}
