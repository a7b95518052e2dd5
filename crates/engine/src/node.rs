//! This node's fingerprint (DESIGN §5), gathered from /proc and the tools' version output.

use stasis_core::fingerprint::{CpuFingerprint, NodeFingerprint};
use stasis_core::gpu::GpuFingerprint;

use crate::tools;

/// Parses `/proc/cpuinfo`: the first processor's model name and flags (x86 `flags`, arm64
/// `Features`).
pub fn parse_cpuinfo(arch: &str, cpuinfo: &str) -> CpuFingerprint {
    let field = |name: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_owned())
        })
    };
    let model = field("model name")
        .or_else(|| field("CPU part"))
        .unwrap_or_default();
    let flags = field("flags")
        .or_else(|| field("Features"))
        .unwrap_or_default();
    CpuFingerprint::from_flags(arch, &model, flags.split_whitespace())
}

/// The machine's architecture as the kernel names it (`x86_64`, `aarch64`).
pub fn arch() -> String {
    std::env::consts::ARCH.to_owned()
}

/// Kernel release, as `uname -r` prints it.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// This node's fingerprint to restore a checkpoint that recorded `recorded`: with this node's
/// GPUs (NVML) when the checkpoint recorded GPUs, since the compatibility rule compares them;
/// without when it did not (a CPU-only checkpoint never loads NVML). Every restore builds its
/// [`stasis_core::fingerprint::RestoreTarget`] from this, never from [`fingerprint`] alone,
/// which has no GPUs and would refuse every GPU checkpoint with "this node has no NVIDIA driver".
pub fn fingerprint_for_restore(recorded: &NodeFingerprint) -> NodeFingerprint {
    with_gpus_for(fingerprint(), recorded, crate::cuda::gpu_fingerprint)
}

/// [`fingerprint_for_restore`] with the node's fingerprint and its GPU source given (tests pass
/// a simulated driver's).
pub fn with_gpus_for(
    node: NodeFingerprint,
    recorded: &NodeFingerprint,
    gpus: impl FnOnce() -> Option<GpuFingerprint>,
) -> NodeFingerprint {
    NodeFingerprint {
        gpu: if recorded.gpu.is_some() { gpus() } else { None },
        ..node
    }
}

/// This node's fingerprint without its GPUs: a checkpoint adds the GPUs it used
/// ([`crate::cuda::SuspendedGpu::fingerprint`]); a restore uses [`fingerprint_for_restore`].
pub fn fingerprint() -> NodeFingerprint {
    let cpu = parse_cpuinfo(
        &arch(),
        &std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
    );
    let criu = tools::criu_binary()
        .ok()
        .and_then(|c| tools::criu_version(&c).ok());
    let runc = tools::which("runc").and_then(|r| tools::runc_version(&r));
    NodeFingerprint {
        cpu,
        kernel: kernel_release(),
        criu,
        runc,
        gpu: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_x86_and_arm() {
        let x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 hypervisor\n\nprocessor\t: 1\nflags\t: sse2\n";
        let c = parse_cpuinfo("x86_64", x86);
        assert_eq!(c.model, "AMD EPYC");
        assert_eq!(c.features, ["avx2", "sse2"]);
        let arm = "processor\t: 0\nFeatures\t: fp asimd atomics cpuid\nCPU part\t: 0xd4f\n";
        assert_eq!(
            parse_cpuinfo("aarch64", arm).features,
            ["asimd", "atomics", "fp"]
        );
    }

    /// A checkpoint taken against the stand-in driver ([`stasis_gpu::sim::SimDriver`]: no GPU
    /// here) records its GPU; the restore side compares it with what the node's driver reports.
    mod gpu_restore {
        use std::sync::Arc;
        use std::time::Duration;

        use stasis_core::fingerprint::{Mismatch, RestoreTarget};
        use stasis_core::Requirements;
        use stasis_gpu::detect::Procfs;
        use stasis_gpu::sim::SimDriver;

        use super::super::*;
        use crate::cuda::suspend_with;

        /// The GPU fingerprint a checkpoint of a CUDA process records, against `sim`.
        fn checkpoint_records(sim: Arc<SimDriver>) -> Requirements {
            let proc = tempfile::tempdir().unwrap();
            let d = proc.path().join("2");
            std::fs::create_dir_all(d.join("fd")).unwrap();
            std::os::unix::fs::symlink("/dev/nvidia0", d.join("fd/3")).unwrap();
            std::fs::write(d.join("maps"), "").unwrap();
            let gpus = sim.fingerprint();
            let s = suspend_with(
                sim,
                &Procfs::new(proc.path()),
                Some(&gpus),
                &|| None,
                &[2],
                Duration::from_secs(10),
            )
            .unwrap()
            .expect("a CUDA process");
            let recorded = s.fingerprint().clone();
            s.discard();
            Requirements {
                node: NodeFingerprint {
                    gpu: Some(recorded),
                    ..fingerprint()
                },
                needs_runc: false,
                image_digest: None,
                declared: Default::default(),
            }
        }

        fn gpu_mismatches(req: &Requirements, node: NodeFingerprint) -> Vec<Mismatch> {
            req.check(&RestoreTarget {
                node,
                ..Default::default()
            })
            .into_iter()
            .filter(|m| m.field.starts_with("gpu."))
            .collect()
        }

        #[test]
        fn a_restore_on_the_same_node_passes_the_gpu_check() {
            let sim = Arc::new(SimDriver::with_processes(&[2]));
            let req = checkpoint_records(sim.clone());
            assert!(req.node.gpu.is_some(), "the checkpoint records the GPU");
            let node = with_gpus_for(fingerprint(), &req.node, || Some(sim.fingerprint()));
            assert_eq!(gpu_mismatches(&req, node), []);
            // What the restore side used before #15: the node without its GPUs.
            let without = gpu_mismatches(&req, fingerprint());
            assert_eq!(without.len(), 1, "{without:?}");
            assert_eq!(without[0].field, "gpu.driver");
        }

        #[test]
        fn a_restore_on_another_model_or_driver_branch_is_refused_naming_the_field() {
            let sim = Arc::new(SimDriver::with_processes(&[2]));
            let req = checkpoint_records(sim.clone());
            let mut h100 = sim.fingerprint();
            h100.devices[0].name = "NVIDIA H100 80GB HBM3".into();
            let node = with_gpus_for(fingerprint(), &req.node, || Some(h100));
            let m = gpu_mismatches(&req, node);
            assert!(m.iter().any(|m| m.field == "gpu.model"), "{m:?}");
            let mut r570 = sim.fingerprint();
            r570.driver_version = "570.172.08".into();
            let node = with_gpus_for(fingerprint(), &req.node, || Some(r570));
            let m = gpu_mismatches(&req, node);
            assert_eq!(m.len(), 1, "{m:?}");
            assert_eq!(m[0].field, "gpu.driver_branch");
            assert!(m[0].to_string().contains("570"), "{}", m[0]);
        }

        #[test]
        fn a_cpu_checkpoint_does_not_look_at_the_gpus() {
            let cpu_only = fingerprint();
            let node = with_gpus_for(fingerprint(), &cpu_only, || {
                panic!("NVML must not be loaded for a CPU-only checkpoint")
            });
            assert!(node.gpu.is_none());
        }
    }

    #[test]
    fn this_node_has_a_kernel_and_cpu() {
        let f = fingerprint();
        assert!(!f.kernel.is_empty());
        assert_eq!(f.cpu.arch, std::env::consts::ARCH);
    }
}
