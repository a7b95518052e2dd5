//! Per-namespace data keys, wrapped by the cluster key (AES-256-GCM through `ring`).
//!
//! - The cluster key: 32 bytes, from a file (the chart mounts a Secret into the agent): raw 32
//!   bytes, or 64 hex digits (whitespace around them ignored).
//! - A namespace's data key: 32 random bytes, the secret of a [`stasis_store::Key`]; stored
//!   only wrapped, in a Secret in stasis's own namespace (never where workload pods can mount
//!   it): `stasis-key-<namespace>`, data `wrapped` = `v1` ‖ nonce (12) ‖ ciphertext+tag (48).
//! - The wrap is bound to its namespace (associated data `stasis.dev/data-key/v1/<namespace>`):
//!   a wrapped key copied into another namespace's Secret does not unwrap.
//! - `cluster_key_id`: 16 hex digits of SHA-256 of the cluster key, kept in an annotation of the
//!   Secret so a rotated cluster key is reported as such, not as tampering.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

const VERSION: u8 = 1;
pub const WRAPPED_LEN: usize = 1 + NONCE_LEN + 32 + 16;
/// Name prefix of the data key Secrets in stasis's namespace.
pub const SECRET_PREFIX: &str = "stasis-key-";
/// Data field of the wrapped key.
pub const SECRET_FIELD: &str = "wrapped";
/// Annotation naming the cluster key a data key is wrapped with.
pub const CLUSTER_KEY_ID_ANNOTATION: &str = "stasis.dev/cluster-key-id";
/// Label naming the namespace a data key Secret is for.
pub const NAMESPACE_LABEL: &str = "stasis.dev/namespace";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("cluster key: expected 32 bytes or 64 hex digits, got {0} bytes")]
    BadClusterKey(usize),
    #[error("wrapped key of namespace {namespace}: {why}")]
    Unwrap { namespace: String, why: String },
    #[error("no randomness available")]
    Rng,
}

/// The cluster key.
pub struct ClusterKey {
    key: LessSafeKey,
    id: String,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey({})", self.id)
    }
}

impl ClusterKey {
    pub fn from_bytes(raw: &[u8]) -> Result<Self, KeyError> {
        let trimmed = std::str::from_utf8(raw).map(str::trim).ok();
        let bytes: Vec<u8> = match trimmed.filter(|s| s.len() == 64) {
            Some(h) => hex::decode(h).map_err(|_| KeyError::BadClusterKey(raw.len()))?,
            None => raw.to_vec(),
        };
        if bytes.len() != 32 {
            return Err(KeyError::BadClusterKey(bytes.len()));
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
        Ok(ClusterKey {
            key: LessSafeKey::new(
                UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| KeyError::BadClusterKey(32))?,
            ),
            id: hex::encode(&digest.as_ref()[..8]),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Wraps a data key for `namespace`.
    pub fn wrap(&self, namespace: &str, data_key: &[u8; 32]) -> Result<Vec<u8>, KeyError> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| KeyError::Rng)?;
        let mut buf = data_key.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(namespace)),
                &mut buf,
            )
            .map_err(|_| KeyError::Rng)?;
        let mut out = Vec::with_capacity(WRAPPED_LEN);
        out.push(VERSION);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&buf);
        Ok(out)
    }

    /// Unwraps a data key of `namespace`.
    pub fn unwrap(&self, namespace: &str, wrapped: &[u8]) -> Result<[u8; 32], KeyError> {
        let err = |why: &str| KeyError::Unwrap {
            namespace: namespace.into(),
            why: why.into(),
        };
        if wrapped.len() != WRAPPED_LEN {
            return Err(err(&format!(
                "{} bytes, expected {WRAPPED_LEN}",
                wrapped.len()
            )));
        }
        if wrapped[0] != VERSION {
            return Err(err(&format!("format version {}", wrapped[0])));
        }
        let nonce = Nonce::try_assume_unique_for_key(&wrapped[1..1 + NONCE_LEN])
            .map_err(|_| err("bad nonce"))?;
        let mut buf = wrapped[1 + NONCE_LEN..].to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(aad(namespace)), &mut buf)
            .map_err(|_| {
                err("does not authenticate under this cluster key (another cluster key, another namespace's key, or tampered)")
            })?;
        let mut k = [0u8; 32];
        k.copy_from_slice(plain);
        Ok(k)
    }
}

fn aad(namespace: &str) -> Vec<u8> {
    format!("stasis.dev/data-key/v1/{namespace}").into_bytes()
}

/// A new random data key.
pub fn new_data_key() -> Result<[u8; 32], KeyError> {
    let mut k = [0u8; 32];
    SystemRandom::new()
        .fill(&mut k)
        .map_err(|_| KeyError::Rng)?;
    Ok(k)
}

/// The Secret holding `namespace`'s wrapped data key.
pub fn secret_name(namespace: &str) -> String {
    format!("{SECRET_PREFIX}{namespace}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ck(b: u8) -> ClusterKey {
        ClusterKey::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn wrap_round_trips_and_binds_the_namespace() {
        let k = ck(7);
        let dk = new_data_key().unwrap();
        let w = k.wrap("team-a", &dk).unwrap();
        assert_eq!(w.len(), WRAPPED_LEN);
        assert_eq!(k.unwrap("team-a", &w).unwrap(), dk);
        // Fresh nonce every time.
        assert_ne!(k.wrap("team-a", &dk).unwrap(), w);
        // Another namespace, another cluster key, a flipped bit: refused.
        assert!(matches!(
            k.unwrap("team-b", &w),
            Err(KeyError::Unwrap { .. })
        ));
        assert!(ck(8).unwrap("team-a", &w).is_err());
        let mut bad = w.clone();
        bad[20] ^= 1;
        assert!(k.unwrap("team-a", &bad).is_err());
        assert!(k.unwrap("team-a", &w[..40]).is_err());
        let mut v2 = w;
        v2[0] = 2;
        assert!(k
            .unwrap("team-a", &v2)
            .unwrap_err()
            .to_string()
            .contains("version 2"));
    }

    #[test]
    fn cluster_key_from_raw_or_hex() {
        let raw = [3u8; 32];
        let hexed = format!("{}\n", hex::encode(raw));
        let a = ClusterKey::from_bytes(&raw).unwrap();
        let b = ClusterKey::from_bytes(hexed.as_bytes()).unwrap();
        assert_eq!(a.id(), b.id());
        assert_eq!(a.id().len(), 16);
        let dk = [9u8; 32];
        assert_eq!(b.unwrap("ns", &a.wrap("ns", &dk).unwrap()).unwrap(), dk);
        assert_eq!(
            ClusterKey::from_bytes(b"short").unwrap_err(),
            KeyError::BadClusterKey(5)
        );
        assert_ne!(ck(1).id(), ck(2).id());
        assert_eq!(secret_name("default"), "stasis-key-default");
    }
}
