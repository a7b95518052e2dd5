//! This node's fingerprint (DESIGN §5), gathered from /proc and the tools' version output.

use stasis_core::fingerprint::{CpuFingerprint, NodeFingerprint};

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

/// This node's fingerprint (without the GPU part, which [`crate::cuda`] adds).
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

    #[test]
    fn this_node_has_a_kernel_and_cpu() {
        let f = fingerprint();
        assert!(!f.kernel.is_empty());
        assert_eq!(f.cpu.arch, std::env::consts::ARCH);
    }
}
