//! The manifest object: the manifest JSON inside an authenticated envelope.
//!
//! ```json
//! {"format":"stasis-manifest-envelope/1","key_id":"<16 hex>","mac":"<64 hex>","manifest":{...}}
//! ```
//!
//! `mac` is keyed BLAKE3 (the manifest MAC subkey) over the exact bytes of the `manifest` value
//! as stored (compact JSON, field order of the schema). A reader checks, in order: the envelope
//! parses; `key_id` equals its key's id (else [`StoreError::WrongKey`]); the MAC matches (else
//! [`StoreError::ManifestTampered`]); the manifest parses, names the same key id, workload and
//! checkpoint id as its object path (else tampered: a manifest copied to another name); and
//! [`Manifest::validate`] passes (else [`StoreError::ManifestInvalid`]).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use stasis_core::{CheckpointId, Manifest, WorkloadName};

use crate::error::{Result, StoreError};
use crate::key::Key;

pub(crate) const FORMAT: &str = "stasis-manifest-envelope/1";

/// The largest manifest object a reader accepts (and a writer publishes). A chunk reference
/// takes about 90 bytes, so this holds about 370 000 chunks, a checkpoint of about 450 GiB;
/// parsed, such a manifest costs a reader about as much memory again as its bytes.
pub const MAX_MANIFEST_OBJECT: u64 = 32 << 20;

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    format: &'static str,
    key_id: &'a str,
    mac: String,
    manifest: &'a RawValue,
}

#[derive(Deserialize)]
struct EnvelopeIn<'a> {
    format: String,
    key_id: String,
    mac: String,
    #[serde(borrow)]
    manifest: &'a RawValue,
}

/// Serialises and authenticates a manifest (whose `key_id` must be the key's).
pub fn seal(key: &Key, manifest: &Manifest) -> Result<Vec<u8>> {
    let body = serde_json::to_string(manifest)
        .map_err(|e| StoreError::Internal(format!("cannot serialise manifest: {e}")))?;
    let mac = key.mac(body.as_bytes()).to_hex().to_string();
    let raw = RawValue::from_string(body)
        .map_err(|e| StoreError::Internal(format!("cannot embed manifest: {e}")))?;
    let mut out = serde_json::to_vec(&EnvelopeOut {
        format: FORMAT,
        key_id: key.id(),
        mac,
        manifest: &raw,
    })
    .map_err(|e| StoreError::Internal(format!("cannot serialise manifest envelope: {e}")))?;
    out.push(b'\n');
    if out.len() as u64 > MAX_MANIFEST_OBJECT {
        return Err(StoreError::Unsupported {
            path: format!("{}/{}", manifest.workload, manifest.id).into(),
            reason: format!(
                "its manifest ({} chunks) would be {} bytes, more than the {MAX_MANIFEST_OBJECT} bytes readers accept; store fewer or smaller files per checkpoint",
                manifest.chunk_count(),
                out.len()
            ),
        });
    }
    Ok(out)
}

/// The key id an envelope claims, without verifying anything (for listings).
pub(crate) fn peek_key_id(bytes: &[u8]) -> Option<String> {
    serde_json::from_slice::<EnvelopeIn<'_>>(bytes)
        .ok()
        .map(|e| e.key_id)
}

/// Verifies and parses the manifest stored at `path` for `<workload>/<id>`.
pub fn open(
    key: &Key,
    path: &str,
    workload: &WorkloadName,
    id: &CheckpointId,
    bytes: &[u8],
) -> Result<Manifest> {
    let tampered = |reason: &str| StoreError::ManifestTampered {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let env: EnvelopeIn<'_> =
        serde_json::from_slice(bytes).map_err(|_| tampered("not a manifest envelope"))?;
    if env.format != FORMAT {
        return Err(tampered(&format!(
            "unknown envelope format {:?}",
            env.format
        )));
    }
    if env.key_id != key.id() {
        return Err(StoreError::WrongKey {
            reference: format!("{workload}/{id}"),
            manifest_key_id: env.key_id,
            this_key_id: key.id().to_owned(),
        });
    }
    let expected = blake3::Hash::from_hex(&env.mac).map_err(|_| tampered("malformed mac"))?;
    // blake3::Hash equality is constant-time.
    if key.mac(env.manifest.get().as_bytes()) != expected {
        return Err(tampered("mac mismatch"));
    }
    let m: Manifest = serde_json::from_str(env.manifest.get())
        .map_err(|e| tampered(&format!("authentic but unparseable manifest: {e}")))?;
    if m.key_id != env.key_id {
        return Err(tampered(
            "key id inside the manifest differs from the envelope",
        ));
    }
    if &m.workload != workload || &m.id != id {
        return Err(tampered(&format!(
            "manifest describes {}/{}, but is stored as {workload}/{id}",
            m.workload, m.id
        )));
    }
    m.validate().map_err(|source| StoreError::ManifestInvalid {
        path: path.to_owned(),
        source,
    })?;
    Ok(m)
}
