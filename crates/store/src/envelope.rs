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
//!
//! The envelope authenticates, it does not encrypt: the manifest is plain JSON. A reader
//! without the key can therefore take its key id and chunk list ([`unverified_chunks`]), which
//! is all a prefetch into the node's chunk cache needs (pre-staging on a node that has no data
//! key of the checkpoint's namespace). Nothing read that way is trusted: it only says which
//! objects to fetch as stored, every read from the cache authenticates, and what a forged list
//! can make a node fetch is bounded (ids must be ids, each object by its chunk's length, the
//! whole by the cache's bound, the manifest object by [`MAX_MANIFEST_OBJECT`]).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use stasis_core::{CheckpointId, ChunkRef, Manifest, WorkloadName};

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

/// What a reader without the key takes from a manifest object: NOT authenticated (see the
/// module docs), only checked to be well formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnverifiedChunks {
    /// The key id the envelope and its manifest name (16 lower-case hex digits).
    pub key_id: String,
    /// Each distinct chunk once, in the manifest's order, with the first file that names it
    /// (for messages).
    pub chunks: Vec<(String, ChunkRef)>,
}

impl UnverifiedChunks {
    /// The most bytes fetching every chunk object can cost: each object is read only up to the
    /// size its chunk's length allows.
    pub fn max_object_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|(_, c)| crate::chunk::max_object_len(c.len as usize))
            .sum()
    }
}

/// A key id as [`Key::id`] writes it (so it is safe in an object path).
fn is_key_id(s: &str) -> bool {
    s.len() == 16
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The key id and chunk list of the manifest stored at `path` for `<workload>/<id>`, read
/// WITHOUT the key and without authenticating anything. Refused as
/// [`StoreError::ManifestUnreadable`]: not an envelope of this format, a key id that is not
/// one, a manifest that does not parse, names another key id than its envelope or another
/// checkpoint than its path; as [`StoreError::ManifestInvalid`]: what [`Manifest::validate`]
/// refuses (chunk ids that are not 64 lower-case hex digits, chunk lengths outside
/// `1..=MAX_CHUNK_LEN`, unsafe paths, totals that do not add up). The caller bounds the object
/// it reads by [`MAX_MANIFEST_OBJECT`].
pub fn unverified_chunks(
    path: &str,
    workload: &WorkloadName,
    id: &CheckpointId,
    bytes: &[u8],
) -> Result<UnverifiedChunks> {
    let unreadable = |reason: String| StoreError::ManifestUnreadable {
        path: path.to_owned(),
        reason,
    };
    let m = parse(path, workload, id, bytes, unreadable, |env| {
        if is_key_id(&env.key_id) {
            Ok(())
        } else {
            Err(unreadable(format!(
                "key id {:?} is not 16 lower-case hex digits",
                env.key_id
            )))
        }
    })?;
    let mut seen = std::collections::HashSet::new();
    let mut chunks = Vec::new();
    for f in m.files {
        for c in f.chunks {
            if seen.insert(c.id.clone()) {
                chunks.push((f.path.clone(), c));
            }
        }
    }
    Ok(UnverifiedChunks {
        key_id: m.key_id,
        chunks,
    })
}

/// The checks every reader of a manifest object makes, in order: the envelope parses and is of
/// this format; `check` (the key id, and the MAC for a reader with the key); the manifest
/// parses, names its envelope's key id and the checkpoint of its object path; and it validates.
/// What fails is `bad(reason)`, but validation, which is [`StoreError::ManifestInvalid`].
fn parse(
    path: &str,
    workload: &WorkloadName,
    id: &CheckpointId,
    bytes: &[u8],
    bad: impl Fn(String) -> StoreError,
    check: impl FnOnce(&EnvelopeIn<'_>) -> Result<()>,
) -> Result<Manifest> {
    let env: EnvelopeIn<'_> =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not a manifest envelope: {e}")))?;
    if env.format != FORMAT {
        return Err(bad(format!("unknown envelope format {:?}", env.format)));
    }
    check(&env)?;
    let m: Manifest = serde_json::from_str(env.manifest.get())
        .map_err(|e| bad(format!("the manifest does not parse: {e}")))?;
    if m.key_id != env.key_id {
        return Err(bad(format!(
            "the manifest names key id {:?}, its envelope {:?}",
            m.key_id, env.key_id
        )));
    }
    if &m.workload != workload || &m.id != id {
        return Err(bad(format!(
            "the manifest describes {}/{}, but is stored as {workload}/{id}",
            m.workload, m.id
        )));
    }
    m.validate().map_err(|source| StoreError::ManifestInvalid {
        path: path.to_owned(),
        source,
    })?;
    Ok(m)
}

/// Verifies and parses the manifest stored at `path` for `<workload>/<id>`.
pub fn open(
    key: &Key,
    path: &str,
    workload: &WorkloadName,
    id: &CheckpointId,
    bytes: &[u8],
) -> Result<Manifest> {
    let tampered = |reason: String| StoreError::ManifestTampered {
        path: path.to_owned(),
        reason,
    };
    parse(path, workload, id, bytes, tampered, |env| {
        if env.key_id != key.id() {
            return Err(StoreError::WrongKey {
                reference: format!("{workload}/{id}"),
                manifest_key_id: env.key_id.clone(),
                this_key_id: key.id().to_owned(),
            });
        }
        let expected =
            blake3::Hash::from_hex(&env.mac).map_err(|_| tampered("malformed mac".into()))?;
        // blake3::Hash equality is constant-time.
        if key.mac(env.manifest.get().as_bytes()) != expected {
            return Err(tampered("mac mismatch".into()));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use stasis_core::manifest::MAX_CHUNK_LEN;
    use stasis_core::FileEntry;

    use crate::test_draft as draft;

    fn id(c: char) -> String {
        c.to_string().repeat(64)
    }

    /// Two files naming three distinct chunks, one of them twice.
    fn manifest(key: &Key) -> Manifest {
        let file = |path: &str, chunks: &[(String, u32)]| FileEntry {
            path: path.into(),
            mode: 0o600,
            size: chunks.iter().map(|c| u64::from(c.1)).sum(),
            chunks: chunks
                .iter()
                .map(|(id, len)| ChunkRef {
                    id: id.clone(),
                    len: *len,
                })
                .collect(),
        };
        let mut m = draft::draft_with_id("w", CheckpointId::from_parts(1_795_000_000_000, 7));
        m.key_id = key.id().into();
        m.files = vec![
            file("criu/pages-1.img", &[(id('a'), 100), (id('b'), 200)]),
            file("criu/core-1.img", &[(id('b'), 200), (id('c'), 100)]),
        ];
        m.stats.logical_bytes = 600;
        m.stats.chunks = 4;
        m
    }

    /// What a writer to the bucket without the key can make of a sealed manifest: its envelope
    /// edited as JSON (the MAC left as it was).
    fn forged(sealed: &[u8], edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        let mut v: Value = serde_json::from_slice(sealed).unwrap();
        edit(&mut v);
        serde_json::to_vec(&v).unwrap()
    }

    fn read(m: &Manifest, bytes: &[u8]) -> Result<UnverifiedChunks> {
        unverified_chunks("manifests/w/x.json", &m.workload, &m.id, bytes)
    }

    #[test]
    fn the_key_id_and_chunk_list_are_read_without_the_key() {
        let key = Key::random();
        let m = manifest(&key);
        let list = read(&m, &seal(&key, &m).unwrap()).unwrap();
        assert_eq!(list.key_id, key.id());
        let got: Vec<(&str, &str, u32)> = list
            .chunks
            .iter()
            .map(|(f, c)| (f.as_str(), c.id.as_str(), c.len))
            .collect();
        assert_eq!(
            got,
            [
                ("criu/pages-1.img", id('a').as_str(), 100),
                ("criu/pages-1.img", id('b').as_str(), 200),
                ("criu/core-1.img", id('c').as_str(), 100),
            ],
            "each distinct chunk once, in order, with the first file naming it"
        );
        // Each object is read only up to its raw size: 15 + len + 16.
        assert_eq!(list.max_object_bytes(), 400 + 3 * 31);
    }

    #[test]
    fn a_forged_list_is_read_as_it_is_and_a_reader_with_the_key_refuses_it() {
        let key = Key::random();
        let m = manifest(&key);
        let bytes = forged(&seal(&key, &m).unwrap(), |v| {
            v["manifest"]["files"][0]["chunks"][0]["id"] = json!(id('d'));
        });
        // Unauthenticated by design: a prefetch fetches what it names, as stored...
        assert_eq!(read(&m, &bytes).unwrap().chunks[0].1.id, id('d'));
        // ...and every reader with the key, the restore of it included, refuses it.
        let e = open(&key, "p", &m.workload, &m.id, &bytes).unwrap_err();
        assert!(matches!(e, StoreError::ManifestTampered { .. }), "{e}");
    }

    #[test]
    fn chunk_ids_must_be_ids() {
        let key = Key::random();
        let m = manifest(&key);
        let sealed = seal(&key, &m).unwrap();
        // A path out of the key's chunks, a short id, upper case, one digit too many.
        for bad in [
            format!("../../../locks/{}", "a".repeat(49)),
            "ab".into(),
            "A".repeat(64),
            "a".repeat(65),
        ] {
            let bytes = forged(&sealed, |v| {
                v["manifest"]["files"][1]["chunks"][1]["id"] = json!(bad);
            });
            let e = read(&m, &bytes).unwrap_err();
            assert!(
                matches!(&e, StoreError::ManifestInvalid { source: stasis_core::ManifestError::BadChunkId(b), .. } if *b == bad),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn key_ids_must_be_ids_and_agree() {
        let key = Key::random();
        let m = manifest(&key);
        let sealed = seal(&key, &m).unwrap();
        for bad in ["../../manifests", "ABCDEF0123456789", "0123456789abcde", ""] {
            let bytes = forged(&sealed, |v| {
                v["key_id"] = json!(bad);
                v["manifest"]["key_id"] = json!(bad);
            });
            let e = read(&m, &bytes).unwrap_err();
            assert!(
                matches!(&e, StoreError::ManifestUnreadable { reason, .. } if reason.contains("not 16 lower-case hex")),
                "{bad:?}: {e}"
            );
        }
        let bytes = forged(&sealed, |v| v["manifest"]["key_id"] = json!("0".repeat(16)));
        let e = read(&m, &bytes).unwrap_err();
        assert!(
            matches!(&e, StoreError::ManifestUnreadable { reason, .. } if reason.contains("its envelope")),
            "{e}"
        );
        assert!(e.is_integrity_failure());
    }

    #[test]
    fn chunk_lengths_bound_each_object() {
        let key = Key::random();
        let m = manifest(&key);
        let bytes = forged(&seal(&key, &m).unwrap(), |v| {
            v["manifest"]["files"][0]["chunks"][0]["len"] = json!(MAX_CHUNK_LEN + 1);
        });
        let e = read(&m, &bytes).unwrap_err();
        assert!(
            matches!(
                &e,
                StoreError::ManifestInvalid {
                    source: stasis_core::ManifestError::ChunkLength { .. },
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn what_is_not_this_checkpoints_manifest_is_unreadable() {
        let key = Key::random();
        let m = manifest(&key);
        let sealed = seal(&key, &m).unwrap();
        let cases: [(&str, Vec<u8>); 4] = [
            ("not a manifest envelope", b"{\"chunks\": []}".to_vec()),
            (
                "unknown envelope format",
                forged(&sealed, |v| v["format"] = json!("other/1")),
            ),
            (
                "does not parse",
                forged(&sealed, |v| v["manifest"]["files"] = json!("x")),
            ),
            (
                "stored as w/",
                forged(&sealed, |v| v["manifest"]["workload"] = json!("other")),
            ),
        ];
        for (why, bytes) in cases {
            let e = read(&m, &bytes).unwrap_err();
            assert!(
                matches!(&e, StoreError::ManifestUnreadable { reason, .. } if reason.contains(why)),
                "{why}: {e}"
            );
        }
    }
}
