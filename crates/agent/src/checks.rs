//! The node-ready checks (what `stasis doctor` checks, for a node that restores containers:
//! CRIU >= 4.2, runc, the `stasis` runtime handler registered with containerd) and the node
//! labels the agent publishes (`stasis.dev/ready`, CPU arch, GPU model, driver branch).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use stasis_core::gpu::GpuFingerprint;

use stasis_api::names::node::{
    CPU_ARCH as ARCH_LABEL, GPU_COUNT as GPU_COUNT_LABEL,
    GPU_DRIVER_BRANCH as GPU_DRIVER_BRANCH_LABEL, GPU_MODEL as GPU_MODEL_LABEL,
    READY as READY_LABEL,
};

/// The outcome of each check: `Ok(detail)` or `Err(why)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeChecks {
    pub criu: Result<String, String>,
    pub runc: Result<String, String>,
    pub handler: Result<String, String>,
}

impl NodeChecks {
    pub fn ready(&self) -> bool {
        self.criu.is_ok() && self.runc.is_ok() && self.handler.is_ok()
    }

    /// Why the node is not ready (empty when it is).
    pub fn problems(&self) -> Vec<String> {
        [
            ("criu", &self.criu),
            ("runc", &self.runc),
            ("runtime handler", &self.handler),
        ]
        .into_iter()
        .filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}")))
        .collect()
    }
}

/// Runs the checks (forks `criu --version` and `runc --version`).
pub fn run(containerd_configs: &[PathBuf], runtime_binary: &Path) -> NodeChecks {
    let criu = stasis_engine::tools::criu_checked()
        .map(|(p, v)| format!("{} {v}", p.display()))
        .map_err(|e| e.to_string());
    let runc = match stasis_engine::runc::Runc::new(None) {
        Ok(r) => stasis_engine::tools::runc_version(&r.binary)
            .map(|v| format!("{} {v}", r.binary.display()))
            .ok_or_else(|| format!("{}: no version", r.binary.display())),
        Err(e) => Err(e.to_string()),
    };
    NodeChecks {
        criu,
        runc,
        handler: stasis_engine::containerd::handler_check(containerd_configs, runtime_binary),
    }
}

/// A valid label value from any text: at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric
/// at both ends (others become `_`).
pub fn label_value(s: &str) -> String {
    let v: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(63)
        .collect();
    v.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// The Kubernetes name of a CPU architecture (`x86_64` → `amd64`, `aarch64` → `arm64`).
pub fn kube_arch(arch: &str) -> &str {
    match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        a => a,
    }
}

/// The labels to set (`Some`) or remove (`None`) on the node.
pub fn node_labels(
    ready: bool,
    arch: &str,
    gpu: Option<&GpuFingerprint>,
) -> BTreeMap<String, Option<String>> {
    let mut m = BTreeMap::new();
    m.insert(READY_LABEL.into(), ready.then(|| "true".to_owned()));
    m.insert(ARCH_LABEL.into(), Some(label_value(kube_arch(arch))));
    let gpu = gpu.filter(|g| !g.devices.is_empty());
    m.insert(
        GPU_MODEL_LABEL.into(),
        gpu.map(|g| label_value(&g.devices[0].name)),
    );
    m.insert(
        GPU_COUNT_LABEL.into(),
        gpu.map(|g| g.devices.len().to_string()),
    );
    m.insert(
        GPU_DRIVER_BRANCH_LABEL.into(),
        gpu.map(|g| label_value(g.driver_branch())),
    );
    m
}

/// The merge patch for a node's labels (`null` removes).
pub fn labels_patch(labels: &BTreeMap<String, Option<String>>) -> serde_json::Value {
    serde_json::json!({ "metadata": { "labels": labels } })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::gpu::GpuDevice;

    #[test]
    fn labels_for_cpu_and_gpu_nodes() {
        let l = node_labels(true, "x86_64", None);
        assert_eq!(l[READY_LABEL].as_deref(), Some("true"));
        assert_eq!(l[ARCH_LABEL].as_deref(), Some("amd64"));
        assert_eq!(l[GPU_MODEL_LABEL], None);
        let g = GpuFingerprint {
            driver_version: "580.65.06".into(),
            devices: vec![GpuDevice {
                name: "NVIDIA H200".into(),
                uuid: "GPU-1".into(),
                memory_bytes: 1,
                mig_enabled: None,
            }],
            ..Default::default()
        };
        let l = node_labels(false, "aarch64", Some(&g));
        assert_eq!(l[READY_LABEL], None);
        assert_eq!(l[ARCH_LABEL].as_deref(), Some("arm64"));
        assert_eq!(l[GPU_MODEL_LABEL].as_deref(), Some("NVIDIA_H200"));
        assert_eq!(l[GPU_COUNT_LABEL].as_deref(), Some("1"));
        assert_eq!(l[GPU_DRIVER_BRANCH_LABEL].as_deref(), Some("580"));
        let p = labels_patch(&l);
        assert!(p["metadata"]["labels"][READY_LABEL].is_null());
        assert_eq!(label_value("--a b/c--"), "a_b_c");
        assert_eq!(label_value(&"x".repeat(100)).len(), 63);
        let c = NodeChecks {
            criu: Ok("criu 4.2".into()),
            runc: Err("missing".into()),
            handler: Ok("x".into()),
        };
        assert!(!c.ready());
        assert_eq!(c.problems(), ["runc: missing"]);
    }
}
