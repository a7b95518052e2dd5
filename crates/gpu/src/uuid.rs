//! GPU UUIDs (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`) and the old → new pairs a restore onto
//! other GPUs passes to the driver (r580+).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use stasis_core::gpu::GpuFingerprint;

use crate::error::GpuError;
use crate::ffi::{CUcheckpointGpuPair, CUuuid};

/// A GPU's 16-byte UUID, as `cuDeviceGetUuid` returns it and NVML prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid(pub [u8; 16]);

impl FromStr for GpuUuid {
    type Err = GpuError;

    /// Accepts `GPU-` + 32 hex digits with or without dashes (NVML's form).
    fn from_str(s: &str) -> Result<Self, GpuError> {
        let bad = || GpuError::BadUuid(s.to_owned());
        let hex: String = s
            .strip_prefix("GPU-")
            .ok_or_else(bad)?
            .chars()
            .filter(|&c| c != '-')
            .collect();
        if hex.len() != 32 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl Serialize for GpuUuid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuUuid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Restore the device memory of GPU `old` onto GPU `new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPair {
    pub old: GpuUuid,
    pub new: GpuUuid,
}

impl GpuPair {
    pub(crate) fn to_ffi(self) -> CUcheckpointGpuPair {
        CUcheckpointGpuPair {
            old_uuid: CUuuid { bytes: self.old.0 },
            new_uuid: CUuuid { bytes: self.new.0 },
        }
    }
}

/// The UUID pairs to restore a checkpoint made on `recorded`'s GPUs onto `node`'s.
///
/// `Ok(None)`: the node has the very GPUs that were recorded, no remapping. Otherwise one pair
/// per recorded GPU (the driver wants every checkpointed GPU named): a recorded GPU the node
/// still has maps to itself, the others to the node's remaining GPUs of the same model, in
/// order. Refused when counts or models do not line up (the compatibility rule already refuses
/// those), or when the node's driver is older than r580.
pub fn plan_remap(
    recorded: &GpuFingerprint,
    node: &GpuFingerprint,
) -> Result<Option<Vec<GpuPair>>, GpuError> {
    let parse = |g: &GpuFingerprint| -> Result<Vec<(String, GpuUuid)>, GpuError> {
        g.devices
            .iter()
            .map(|d| Ok((d.name.clone(), d.uuid.parse()?)))
            .collect()
    };
    let (rec, have) = (parse(recorded)?, parse(node)?);
    if rec.iter().all(|(_, u)| have.iter().any(|(_, h)| h == u)) && rec.len() == have.len() {
        return Ok(None);
    }
    if rec.len() != have.len() {
        return Err(GpuError::Unsupported(format!(
            "the checkpoint used {} GPUs, this node has {}",
            rec.len(),
            have.len()
        )));
    }
    if !node.supports_migration() {
        return Err(GpuError::Unsupported(format!(
            "restoring onto other GPUs needs NVIDIA driver r580 or newer (this node has {})",
            node.driver_version
        )));
    }
    let mut free: Vec<bool> = have
        .iter()
        .map(|(_, h)| !rec.iter().any(|(_, r)| r == h))
        .collect();
    let mut pairs = Vec::with_capacity(rec.len());
    for (name, old) in &rec {
        if have.iter().any(|(_, h)| h == old) {
            pairs.push(GpuPair {
                old: *old,
                new: *old,
            });
            continue;
        }
        let Some(i) = (0..have.len()).find(|&i| free[i] && have[i].0 == *name) else {
            return Err(GpuError::Unsupported(format!(
                "no free {name} on this node to take the memory of {old}"
            )));
        };
        free[i] = false;
        pairs.push(GpuPair {
            old: *old,
            new: have[i].1,
        });
    }
    Ok(Some(pairs))
}

#[cfg(test)]
mod tests {
    use stasis_core::gpu::GpuDevice;

    use super::*;

    const A: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
    const B: &str = "GPU-0a1b2c3d-0000-1111-2222-33334444aaaa";
    const C: &str = "GPU-ffffffff-0000-1111-2222-333344445555";
    const D: &str = "GPU-eeeeeeee-0000-1111-2222-333344445555";

    fn fp(driver: &str, devs: &[(&str, &str)]) -> GpuFingerprint {
        GpuFingerprint {
            driver_version: driver.into(),
            devices: devs
                .iter()
                .map(|(n, u)| GpuDevice {
                    name: (*n).into(),
                    uuid: (*u).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn uuid_round_trip() {
        let u: GpuUuid = A.parse().unwrap();
        assert_eq!(u.0[0], 0x0a);
        assert_eq!(u.0[15], 0x55);
        assert_eq!(u.to_string(), A);
        let undashed: GpuUuid = "GPU-0a1b2c3d000011112222333344445555".parse().unwrap();
        assert_eq!(undashed, u);
        for bad in [
            "0a1b2c3d-0000-1111-2222-333344445555",
            "GPU-12",
            "GPU-zz1b2c3d-0000-1111-2222-333344445555",
            "MIG-0a1b2c3d-0000-1111-2222-333344445555",
        ] {
            assert!(
                matches!(bad.parse::<GpuUuid>(), Err(GpuError::BadUuid(_))),
                "{bad}"
            );
        }
        let json = serde_json::to_string(&u).unwrap();
        assert_eq!(json, format!("\"{A}\""));
        assert_eq!(serde_json::from_str::<GpuUuid>(&json).unwrap(), u);
    }

    #[test]
    fn same_gpus_need_no_remap() {
        let g = fp("570.1", &[("H200", A), ("H200", B)]);
        let mut reordered = g.clone();
        reordered.devices.reverse();
        assert_eq!(plan_remap(&g, &reordered).unwrap(), None);
    }

    #[test]
    fn other_gpus_are_paired_by_model_and_every_gpu_is_named() {
        let rec = fp("580.65.06", &[("H200", A), ("H100", B)]);
        let node = fp("580.65.06", &[("H100", C), ("H200", A)]);
        let pairs = plan_remap(&rec, &node).unwrap().unwrap();
        let u = |s: &str| s.parse::<GpuUuid>().unwrap();
        assert_eq!(
            pairs,
            vec![
                GpuPair {
                    old: u(A),
                    new: u(A)
                },
                GpuPair {
                    old: u(B),
                    new: u(C)
                },
            ]
        );
        let ffi = pairs[1].to_ffi();
        assert_eq!(ffi.old_uuid.bytes, u(B).0);
        assert_eq!(ffi.new_uuid.bytes, u(C).0);
    }

    #[test]
    fn remap_is_refused_before_r580_and_on_mismatched_sets() {
        let rec = fp("570.124.06", &[("H200", A)]);
        let node = fp("570.124.06", &[("H200", C)]);
        let e = plan_remap(&rec, &node).unwrap_err().to_string();
        assert!(e.contains("r580"), "{e}");
        let node = fp("580.1", &[("L4", C)]);
        assert!(plan_remap(&rec, &node)
            .unwrap_err()
            .to_string()
            .contains("no free H200"));
        let node = fp("580.1", &[("H200", C), ("H200", D)]);
        assert!(plan_remap(&rec, &node)
            .unwrap_err()
            .to_string()
            .contains("used 1 GPUs"));
    }
}
