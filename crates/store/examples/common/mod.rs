//! What the store examples share.

use std::time::{SystemTime, UNIX_EPOCH};

use stasis_core::{CheckpointId, Manifest};

#[path = "../../tests/common/draft.rs"]
mod shared;

/// A manifest draft of workload `bench` with a fresh id, as a caller hands it to a put.
pub fn draft() -> Manifest {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    shared::draft_with_id("bench", CheckpointId::from_parts(now, rand::random()))
}
