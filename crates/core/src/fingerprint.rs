//! What a node is, what a checkpoint needs, and the rule that compares the two.
//!
//! A checkpoint records [`Requirements`] taken from the node it was made on. Before a restore the
//! target node's [`NodeFingerprint`] is checked against them with [`Requirements::check`]; every
//! unmet field is reported as a [`Mismatch`] that names the field, so a refusal says exactly why.
//! The rule (see `docs/design.md`, "Compatibility"):
//!
//! | field | rule |
//! |---|---|
//! | `cpu.arch` | equal |
//! | `cpu.features` | every recorded user-space ISA feature is present on the node |
//! | `kernel` | node's major.minor >= recorded major.minor |
//! | `criu` | node's CRIU >= 4.2 and >= recorded major.minor |
//! | `runc` | for container checkpoints: node has runc, major.minor >= recorded |
//! | `image_digest` | equal when both are known; recorded but unknown on the node: refused |
//! | `declared.<key>` | equal (engine/model versions the workload declares) |
//! | `gpu` | see [`crate::gpu`] |

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::gpu::GpuFingerprint;

/// The oldest CRIU stasis accepts: 4.1 cannot dump INET sockets on current kernels (DESIGN §8).
pub const MIN_CRIU: Version = Version {
    major: 4,
    minor: 2,
    patch: 0,
};

/// CPU flags (as `/proc/cpuinfo` names them) that change which instructions user space may run.
/// A process that started on a CPU with one of them may have chosen code paths that use it, so a
/// restore target must have every one the source had. Other flags (mitigations, virtualisation,
/// power management) do not affect a restored process and are ignored.
pub const ISA_FEATURES: &[&str] = &[
    "sse",
    "sse2",
    "pni",
    "ssse3",
    "sse4_1",
    "sse4_2",
    "popcnt",
    "cx16",
    "movbe",
    "aes",
    "pclmulqdq",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi1",
    "bmi2",
    "lzcnt",
    "abm",
    "adx",
    "rdrand",
    "rdseed",
    "sha_ni",
    "xsave",
    "xsaveopt",
    "xsavec",
    "xsaves",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512ifma",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "vaes",
    "vpclmulqdq",
    "gfni",
    "clflushopt",
    "clwb",
    "erms",
    "fsrm",
    "rtm",
    "hle",
    "mpx",
    // arm64 (/proc/cpuinfo "Features")
    "fp",
    "asimd",
    "atomics",
    "crc32",
    "sha1",
    "sha2",
    "sha3",
    "sha512",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
    "lrcpc",
    "dcpop",
    "asimddp",
    "asimdhp",
];

/// A dotted version, compared numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    /// Parses the first `a.b[.c]` found in free text, such as `criu --version` or `uname -r`
    /// output (`Version: 4.2.1`, `6.18.44-fc-v669`, `runc version 1.1.5+ds1`).
    pub fn find_in(text: &str) -> Option<Self> {
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii_digit()
                && (i == 0 || bytes[i - 1] == b'v' || !bytes[i - 1].is_ascii_alphanumeric())
            {
                let rest = &text[i..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .unwrap_or(rest.len());
                let mut parts = rest[..end].split('.').filter(|p| !p.is_empty());
                if let (Some(a), Some(b)) = (parts.next(), parts.next()) {
                    let c = parts.next().unwrap_or("0");
                    if let (Ok(major), Ok(minor), Ok(patch)) = (a.parse(), b.parse(), c.parse()) {
                        return Some(Self {
                            major,
                            minor,
                            patch,
                        });
                    }
                }
                i += end.max(1);
            } else {
                i += 1;
            }
        }
        None
    }

    fn major_minor(self) -> (u32, u32) {
        (self.major, self.minor)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The CPU as far as a restored process can tell.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CpuFingerprint {
    /// `x86_64`, `aarch64`.
    pub arch: String,
    /// Model name, for humans; not compared.
    #[serde(default)]
    pub model: String,
    /// User-space ISA features present (the subset of [`ISA_FEATURES`] the CPU has), sorted.
    pub features: Vec<String>,
}

impl CpuFingerprint {
    /// Keeps only the ISA features of a raw `/proc/cpuinfo` flag list.
    pub fn from_flags<'a>(
        arch: &str,
        model: &str,
        flags: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let mut features: Vec<String> = flags
            .into_iter()
            .filter(|f| ISA_FEATURES.contains(f))
            .map(str::to_owned)
            .collect();
        features.sort();
        features.dedup();
        Self {
            arch: arch.to_owned(),
            model: model.to_owned(),
            features,
        }
    }
}

/// Everything about a node that decides whether a checkpoint can be restored on it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeFingerprint {
    pub cpu: CpuFingerprint,
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// CRIU version, if CRIU was found.
    pub criu: Option<Version>,
    /// runc version, if runc was found.
    pub runc: Option<Version>,
    /// GPUs and driver, if an NVIDIA driver was found.
    #[serde(default)]
    pub gpu: Option<GpuFingerprint>,
}

/// What a checkpoint needs from the node that restores it: the source node's fingerprint, plus
/// facts about the workload.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Requirements {
    pub node: NodeFingerprint,
    /// Whether the checkpoint is of a container (then runc must be present) or a process.
    pub needs_runc: bool,
    /// Digest of the image the container's rootfs was made from, when known.
    #[serde(default)]
    pub image_digest: Option<String>,
    /// Engine and model versions the workload declares (`engine=vllm-0.9`, `model=llama-3-8b@rev`).
    #[serde(default)]
    pub declared: BTreeMap<String, String>,
}

/// The restore side of the comparison: the node, plus what the restore target declares.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RestoreTarget {
    pub node: NodeFingerprint,
    pub image_digest: Option<String>,
    pub declared: BTreeMap<String, String>,
}

/// One unmet requirement. `field` names it (`cpu.arch`, `criu`, `declared.engine`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    pub field: String,
    pub recorded: String,
    pub found: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: checkpoint needs {}, this node has {}",
            self.field, self.recorded, self.found
        )
    }
}

fn mismatch(field: &str, recorded: impl fmt::Display, found: impl fmt::Display) -> Mismatch {
    Mismatch {
        field: field.to_owned(),
        recorded: recorded.to_string(),
        found: found.to_string(),
    }
}

fn show(v: Option<Version>) -> String {
    v.map_or_else(|| "none".to_owned(), |v| v.to_string())
}

impl Requirements {
    /// Every requirement the target does not meet; empty means the restore may go ahead.
    pub fn check(&self, target: &RestoreTarget) -> Vec<Mismatch> {
        let mut out = Vec::new();
        let (rec, node) = (&self.node, &target.node);

        if rec.cpu.arch != node.cpu.arch {
            out.push(mismatch("cpu.arch", &rec.cpu.arch, &node.cpu.arch));
        }
        let missing: Vec<&str> = rec
            .cpu
            .features
            .iter()
            .filter(|f| !node.cpu.features.contains(f))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            out.push(mismatch(
                "cpu.features",
                format!("features {}", missing.join(",")),
                "a CPU without them",
            ));
        }

        match (
            Version::find_in(&rec.kernel),
            Version::find_in(&node.kernel),
        ) {
            (Some(r), Some(n)) if n.major_minor() >= r.major_minor() => {}
            (Some(r), found) => out.push(mismatch(
                "kernel",
                format!(">= {}.{}", r.major, r.minor),
                found.map_or_else(
                    || node.kernel.clone(),
                    |v| format!("{}.{}", v.major, v.minor),
                ),
            )),
            (None, _) => {}
        }

        let criu_floor = rec.criu.map_or(MIN_CRIU, |r| r.max(MIN_CRIU));
        match node.criu {
            Some(n) if n.major_minor() >= criu_floor.major_minor() => {}
            found => out.push(mismatch(
                "criu",
                format!(">= {}.{}", criu_floor.major, criu_floor.minor),
                show(found),
            )),
        }

        if self.needs_runc {
            match (rec.runc, node.runc) {
                (_, None) => out.push(mismatch("runc", "runc installed", "none")),
                (Some(r), Some(n)) if n.major_minor() < r.major_minor() => {
                    out.push(mismatch("runc", format!(">= {}.{}", r.major, r.minor), n))
                }
                _ => {}
            }
        }

        match (&self.image_digest, &target.image_digest) {
            (Some(r), Some(t)) if r != t => out.push(mismatch("image_digest", r, t)),
            (Some(r), None) => out.push(mismatch("image_digest", r, "unknown (no digest given)")),
            _ => {}
        }

        for (key, want) in &self.declared {
            match target.declared.get(key) {
                Some(have) if have == want => {}
                have => out.push(mismatch(
                    &format!("declared.{key}"),
                    want,
                    have.map_or("nothing declared", String::as_str),
                )),
            }
        }
        for key in target.declared.keys() {
            if !self.declared.contains_key(key) {
                out.push(mismatch(
                    &format!("declared.{key}"),
                    "nothing declared",
                    &target.declared[key],
                ));
            }
        }

        out.extend(crate::gpu::check(rec.gpu.as_ref(), node.gpu.as_ref()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeFingerprint {
        NodeFingerprint {
            cpu: CpuFingerprint::from_flags(
                "x86_64",
                "test",
                ["sse2", "avx2", "hypervisor", "aes"],
            ),
            kernel: "6.18.44-fc".into(),
            criu: Some(Version {
                major: 4,
                minor: 2,
                patch: 1,
            }),
            runc: Version::find_in("runc version 1.1.5+ds1"),
            gpu: None,
        }
    }

    fn reqs() -> Requirements {
        Requirements {
            node: node(),
            needs_runc: true,
            image_digest: Some("sha256:aa".into()),
            declared: [("engine".to_owned(), "v1".to_owned())].into(),
        }
    }

    fn target() -> RestoreTarget {
        RestoreTarget {
            node: node(),
            image_digest: Some("sha256:aa".into()),
            declared: [("engine".to_owned(), "v1".to_owned())].into(),
        }
    }

    fn fields(m: Vec<Mismatch>) -> Vec<String> {
        m.into_iter().map(|m| m.field).collect()
    }

    #[test]
    fn same_node_is_compatible() {
        assert!(reqs().check(&target()).is_empty());
    }

    #[test]
    fn versions_are_found_in_tool_output() {
        assert_eq!(
            Version::find_in("Version: 4.2.1\nGitID: x")
                .unwrap()
                .to_string(),
            "4.2.1"
        );
        assert_eq!(
            Version::find_in("6.18.44-fc-v669").unwrap().to_string(),
            "6.18.44"
        );
        assert_eq!(
            Version::find_in("runc version 1.1.5+ds1\ncommit")
                .unwrap()
                .to_string(),
            "1.1.5"
        );
        assert_eq!(Version::find_in("v3.17").unwrap().to_string(), "3.17.0");
        assert!(Version::find_in("no digits").is_none());
    }

    #[test]
    fn each_field_is_named_when_unmet() {
        let mut t = target();
        t.node.cpu.arch = "aarch64".into();
        t.node.cpu.features.retain(|f| f != "avx2");
        t.node.kernel = "6.1.0".into();
        t.node.criu = Version::find_in("4.1.1");
        t.node.runc = None;
        t.image_digest = Some("sha256:bb".into());
        t.declared.insert("engine".into(), "v2".into());
        assert_eq!(
            fields(reqs().check(&t)),
            [
                "cpu.arch",
                "cpu.features",
                "kernel",
                "criu",
                "runc",
                "image_digest",
                "declared.engine"
            ]
        );
    }

    #[test]
    fn newer_node_is_fine_older_is_not() {
        let mut t = target();
        t.node.kernel = "6.19.1".into();
        t.node.criu = Version::find_in("4.3");
        assert!(reqs().check(&t).is_empty());
        let mut r = reqs();
        r.node.criu = Version::find_in("4.3.0");
        assert_eq!(fields(r.check(&target())), ["criu"]);
    }

    #[test]
    fn declared_keys_must_match_both_ways() {
        let mut t = target();
        t.declared.insert("model".into(), "m1".into());
        let m = reqs().check(&t);
        assert_eq!(fields(m.clone()), ["declared.model"]);
        assert!(m[0].to_string().contains("nothing declared"));
    }

    #[test]
    fn unknown_image_digest_on_target_is_refused() {
        let mut t = target();
        t.image_digest = None;
        assert_eq!(fields(reqs().check(&t)), ["image_digest"]);
    }

    #[test]
    fn non_isa_flags_are_ignored() {
        let cpu = CpuFingerprint::from_flags("x86_64", "", ["hypervisor", "avx2", "avx2", "aes"]);
        assert_eq!(cpu.features, ["aes", "avx2"]);
    }
}
