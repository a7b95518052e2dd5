//! A manifest draft as a caller hands it to a put, and incompressible data: shared by the
//! store's tests and examples.
#![allow(dead_code)] // each user takes its own part

use std::collections::BTreeMap;

use stasis_core::{
    CheckpointId, Manifest, Requirements, Source, StoreStats, Timings, WorkloadName, SCHEMA_VERSION,
};

pub fn draft_with_id(workload: &str, id: CheckpointId) -> Manifest {
    Manifest {
        schema_version: SCHEMA_VERSION,
        workload: WorkloadName::new(workload).unwrap(),
        created_at: id.created_rfc3339(),
        id,
        key_id: String::new(),
        source: Source::Process { pid: 42 },
        leave_running: true,
        requirements: Requirements::default(),
        processes: vec![],
        rootfs: None,
        timings: Timings::default(),
        stats: StoreStats::default(),
        files: vec![],
        gpu_processes: 0,
        labels: BTreeMap::new(),
    }
}

pub fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}
