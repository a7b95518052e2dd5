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

/// Environment variable through which the NVIDIA device plugin and container toolkit give a
/// container its GPUs.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// The GPUs an `NVIDIA_VISIBLE_DEVICES` value names, as UUIDs of `node`'s GPUs: UUIDs as they
/// are, indices in NVML's order. `Ok(None)` when it names no particular GPU (empty, `all`,
/// `none`, `void`); an error when it names one this node does not have (a MIG device, an index
/// out of range, an unknown UUID).
pub fn visible_devices(
    value: &str,
    node: &GpuFingerprint,
) -> Result<Option<Vec<String>>, GpuError> {
    let value = value.trim();
    if matches!(value, "" | "all" | "none" | "void") {
        return Ok(None);
    }
    let mut out = Vec::new();
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let uuid = if let Ok(i) = item.parse::<usize>() {
            node.devices.get(i).map(|d| d.uuid.clone())
        } else {
            node.devices
                .iter()
                .find(|d| d.uuid.eq_ignore_ascii_case(item))
                .map(|d| d.uuid.clone())
        };
        match uuid {
            Some(u) if !out.contains(&u) => out.push(u),
            Some(_) => {}
            None => {
                return Err(GpuError::Unsupported(format!(
                    "{VISIBLE_DEVICES_ENV}={value} names {item}, which is not a GPU of this node \
                     (MIG devices cannot be checkpointed)"
                )))
            }
        }
    }
    Ok(Some(out))
}

/// The UUID pairs to restore a checkpoint onto the GPUs the new pod was given (`assigned`, UUIDs
/// of `node`'s GPUs; empty: no assignment known, as [`plan_remap`]).
///
/// Each GPU the checkpointed workload used (`recorded.workload_gpus`, or every recorded GPU when
/// their number is the number assigned) goes onto the assigned GPU in the same position, of the
/// same model; every other recorded GPU is named too (the driver wants every GPU it sees in the
/// pairs), onto itself where the node has it and else onto a remaining GPU of the same model.
/// `Ok(None)` when every GPU maps onto itself. Refused, naming why, when the numbers or models do
/// not line up, or when GPUs must change and the node's driver is older than r580.
pub fn plan_remap_assigned(
    recorded: &GpuFingerprint,
    node: &GpuFingerprint,
    assigned: &[String],
) -> Result<Option<Vec<GpuPair>>, GpuError> {
    if assigned.is_empty() {
        return plan_remap(recorded, node);
    }
    let refuse = |why: String| Err(GpuError::Unsupported(why));
    let used: Vec<String> = if !recorded.workload_gpus.is_empty() {
        recorded.workload_gpus.clone()
    } else if recorded.devices.len() == assigned.len() {
        recorded.devices.iter().map(|d| d.uuid.clone()).collect()
    } else {
        return refuse(format!(
            "the checkpoint does not say which of its node's {} GPUs the workload used, and the \
             pod was given {}: which GPU's memory goes where is unknown",
            recorded.devices.len(),
            assigned.len()
        ));
    };
    if used.len() != assigned.len() {
        return refuse(format!(
            "the checkpointed workload used {} GPU(s), the new pod was given {}",
            used.len(),
            assigned.len()
        ));
    }
    if recorded.devices.len() != node.devices.len() {
        return refuse(format!(
            "the checkpoint's node had {} GPUs, this node has {}",
            recorded.devices.len(),
            node.devices.len()
        ));
    }
    let model = |g: &GpuFingerprint, uuid: &str| {
        g.devices
            .iter()
            .find(|d| d.uuid == uuid)
            .map(|d| d.name.clone())
    };
    // old UUID (recorded) -> new UUID (node)
    let mut plan: Vec<(String, String)> = Vec::with_capacity(recorded.devices.len());
    for (old, new) in used.iter().zip(assigned) {
        match (model(recorded, old), model(node, new)) {
            (Some(a), Some(b)) if a == b => plan.push((old.clone(), new.clone())),
            (Some(a), Some(b)) => {
                return refuse(format!(
                    "the workload's GPU {old} is a {a}, the pod was given {new}, a {b}"
                ))
            }
            (None, _) => return refuse(format!("the checkpoint records no GPU {old}")),
            (_, None) => return refuse(format!("this node has no GPU {new}")),
        }
    }
    let taken = |plan: &[(String, String)], u: &str| plan.iter().any(|(_, n)| n == u);
    for d in &recorded.devices {
        if plan.iter().any(|(o, _)| *o == d.uuid) {
            continue;
        }
        let onto =
            if model(node, &d.uuid).as_deref() == Some(d.name.as_str()) && !taken(&plan, &d.uuid) {
                Some(d.uuid.clone())
            } else {
                node.devices
                    .iter()
                    .find(|n| n.name == d.name && !taken(&plan, &n.uuid))
                    .map(|n| n.uuid.clone())
            };
        match onto {
            Some(n) => plan.push((d.uuid.clone(), n)),
            None => {
                return refuse(format!(
                    "no free {} on this node to take {}",
                    d.name, d.uuid
                ))
            }
        }
    }
    if plan.iter().all(|(o, n)| o == n) {
        return Ok(None);
    }
    if !node.supports_migration() {
        let moved: Vec<String> = plan
            .iter()
            .filter(|(o, n)| o != n)
            .map(|(o, n)| format!("{o} -> {n}"))
            .collect();
        return refuse(format!(
            "the new pod was given other GPUs than the checkpoint ran on ({}); restoring onto \
             other GPUs needs NVIDIA driver r580 or newer, this node has {}",
            moved.join(", "),
            node.driver_version
        ));
    }
    plan.iter()
        .map(|(o, n)| {
            Ok(GpuPair {
                old: o.parse()?,
                new: n.parse()?,
            })
        })
        .collect::<Result<Vec<_>, GpuError>>()
        .map(Some)
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

    #[test]
    fn visible_devices_by_uuid_or_index() {
        let node = fp("580.65.06", &[("H200", A), ("H200", B)]);
        assert_eq!(visible_devices("all", &node).unwrap(), None);
        assert_eq!(visible_devices("", &node).unwrap(), None);
        assert_eq!(
            visible_devices(&format!("1,{A}"), &node).unwrap(),
            Some(vec![B.to_owned(), A.to_owned()])
        );
        let e = visible_devices("MIG-1234", &node).unwrap_err();
        assert!(e.to_string().contains("names MIG-1234"), "{e}");
        assert!(visible_devices("2", &node).is_err());
    }

    #[test]
    fn the_workload_lands_on_the_gpu_the_pod_was_given() {
        // Same node, two H200s; the workload ran on A and the new pod was given B.
        let mut rec = fp("580.65.06", &[("H200", A), ("H200", B)]);
        rec.workload_gpus = vec![A.into()];
        let node = fp("580.65.06", &[("H200", A), ("H200", B)]);
        let pairs = plan_remap_assigned(&rec, &node, &[B.into()])
            .unwrap()
            .unwrap();
        let a: GpuUuid = A.parse().unwrap();
        let b: GpuUuid = B.parse().unwrap();
        // Every GPU named: A's memory onto B, and B (unused) onto the one left, A.
        assert_eq!(
            pairs,
            [GpuPair { old: a, new: b }, GpuPair { old: b, new: a }]
        );
        // Given the GPU it ran on: nothing to remap (the whole-node plan would say the same).
        assert_eq!(plan_remap_assigned(&rec, &node, &[A.into()]).unwrap(), None);
        // No assignment known: the whole-node plan.
        assert_eq!(plan_remap_assigned(&rec, &node, &[]).unwrap(), None);
    }

    #[test]
    fn another_node_pairs_the_used_gpu_with_the_assigned_one() {
        let mut rec = fp("580.65.06", &[("H200", A), ("H200", B)]);
        rec.workload_gpus = vec![B.into()];
        let node = fp("580.65.06", &[("H200", C), ("H200", D)]);
        let pairs = plan_remap_assigned(&rec, &node, &[D.into()])
            .unwrap()
            .unwrap();
        let u = |s: &str| -> GpuUuid { s.parse().unwrap() };
        assert_eq!(
            pairs,
            [
                GpuPair {
                    old: u(B),
                    new: u(D)
                },
                GpuPair {
                    old: u(A),
                    new: u(C)
                }
            ]
        );
    }

    #[test]
    fn another_gpu_before_r580_is_refused_naming_the_reason() {
        let mut rec = fp("570.172.08", &[("H200", A), ("H200", B)]);
        rec.workload_gpus = vec![A.into()];
        let node = fp("570.172.08", &[("H200", A), ("H200", B)]);
        let e = plan_remap_assigned(&rec, &node, &[B.into()]).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("needs NVIDIA driver r580") && m.contains("570.172.08"),
            "{m}"
        );
        assert!(m.contains(&format!("{A} -> {B}")), "{m}");
        // The GPU it ran on is fine before r580 too.
        assert_eq!(plan_remap_assigned(&rec, &node, &[A.into()]).unwrap(), None);
    }

    #[test]
    fn assignments_that_do_not_line_up_are_refused() {
        let rec = fp("580.65.06", &[("H200", A), ("H200", B)]);
        let node = fp("580.65.06", &[("H200", A), ("H100", C)]);
        // Which of two GPUs the workload used is not recorded and one GPU was given.
        let e = plan_remap_assigned(&rec, &node, &[A.into()]).unwrap_err();
        assert!(e.to_string().contains("does not say which"), "{e}");
        let mut rec1 = rec.clone();
        rec1.workload_gpus = vec![B.into()];
        let e = plan_remap_assigned(&rec1, &node, &[C.into()]).unwrap_err();
        assert!(
            e.to_string().contains("is a H200, the pod was given"),
            "{e}"
        );
        let e = plan_remap_assigned(&rec1, &node, &[A.into(), C.into()]).unwrap_err();
        assert!(
            e.to_string()
                .contains("used 1 GPU(s), the new pod was given 2"),
            "{e}"
        );
    }
}
