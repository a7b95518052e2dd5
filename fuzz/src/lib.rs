//! What the fuzz targets and the seed generator share: the fixed key and checkpoint a manifest
//! envelope is opened for, so that seeds made by the real store pass the MAC and the fuzzer
//! reaches the manifest parser behind it.

use stasis_core::{CheckpointId, WorkloadName};
use stasis_store::Key;

/// The key seeds are written with and targets open with (a fixed test key, not a secret).
pub fn key() -> Key {
    Key::from_secret(&[7u8; 32])
}

/// The checkpoint the seed manifest describes.
pub fn checkpoint() -> (WorkloadName, CheckpointId) {
    (
        WorkloadName::new("fuzz").expect("valid workload name"),
        CheckpointId::from_parts(1_795_000_000_000, 7),
    )
}

/// Splits an input at the first 0xff byte (never in UTF-8): lets one input carry two fields.
pub fn split2(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}
