//! Per-namespace data keys, wrapped by the cluster key (AES-256-GCM through `ring`).
//!
//! - The cluster key: 32 bytes, raw or 64 hex digits (whitespace around them ignored), in a
//!   Secret only stasis-controller reads when its key broker is on (then agents ask the broker for
//!   the data keys of the namespaces they hold pods of); otherwise mounted into every agent.
//! - A namespace's data key: 32 random bytes, the secret of a `stasis_store::Key`; stored
//!   only wrapped, in a Secret in stasis's own namespace (never where workload pods can mount
//!   it): `stasis-key-<namespace>`, data `wrapped` = `v1` ‖ nonce (12) ‖ ciphertext+tag (48).
//! - The wrap is bound to its namespace (associated data `stasis.dev/data-key/v1/<namespace>`):
//!   a wrapped key copied into another namespace's Secret does not unwrap.
//! - `cluster_key_id`: 16 hex digits of SHA-256 of the cluster key, kept in an annotation of the
//!   Secret so a rotated cluster key is reported as such, not as tampering.
//! - Rotation keeps old checkpoints readable: the cluster key's Secret holds the current key
//!   (`cluster.key`) and, after a rotation, the keys it replaced (`retired.keys`, one per line).
//!   New data keys are wrapped with the current key; a data key wrapped with a retired one still
//!   unwraps (AES-GCM authenticates, so trying each key of the ring is safe). The data keys, and
//!   with them every checkpoint, do not change.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

const VERSION: u8 = 1;
pub const WRAPPED_LEN: usize = 1 + NONCE_LEN + 32 + 16;
/// Name prefix of the data key Secrets in stasis's namespace.
pub const SECRET_PREFIX: &str = "stasis-key-";
/// Data field of the wrapped key.
pub const SECRET_FIELD: &str = "wrapped";

/// The cluster key Secret's field with the current key (64 hex digits), and the file it becomes
/// where the chart mounts that Secret.
pub const CLUSTER_KEY_FIELD: &str = "cluster.key";
/// File next to the cluster key holding the keys it replaced, one per line (64 hex digits); the
/// cluster key Secret's field of the same name.
pub const RETIRED_KEYS_FILE: &str = "retired.keys";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("cluster key: expected 32 bytes or 64 hex digits, got {0} bytes")]
    BadClusterKey(usize),
    #[error("retired cluster key on line {line} of {file}: expected 64 hex digits")]
    BadRetiredKey { file: String, line: usize },
    #[error("wrapped key of namespace {namespace}: {why}")]
    Unwrap { namespace: String, why: String },
    #[error("no randomness available")]
    Rng,
    #[error("Secret {secret} has no {field} field")]
    MissingField { secret: String, field: &'static str },
}

/// `field` of Secret `s`, or why there is none (naming the Secret as `namespace/name`).
fn secret_field<'a>(
    s: &'a k8s_openapi::api::core::v1::Secret,
    field: &'static str,
) -> Result<&'a [u8], KeyError> {
    s.data
        .as_ref()
        .and_then(|d| d.get(field))
        .map(|b| b.0.as_slice())
        .ok_or_else(|| KeyError::MissingField {
            secret: format!(
                "{}/{}",
                s.metadata.namespace.as_deref().unwrap_or_default(),
                s.metadata.name.as_deref().unwrap_or_default()
            ),
            field,
        })
}

/// The data key in `namespace`'s Secret `s` (its [`SECRET_FIELD`]), unwrapped with `ring`.
pub fn unwrap_secret(
    ring: &ClusterKey,
    namespace: &str,
    s: &k8s_openapi::api::core::v1::Secret,
) -> Result<[u8; 32], KeyError> {
    ring.unwrap(namespace, secret_field(s, SECRET_FIELD)?)
}

/// One AES-256-GCM cluster key and its id.
struct RingKey {
    key: LessSafeKey,
    id: String,
}

/// The cluster key: the current one, which wraps, and the retired ones, which only unwrap.
pub struct ClusterKey {
    current: RingKey,
    retired: Vec<RingKey>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let retired: Vec<&str> = self.retired.iter().map(|k| k.id.as_str()).collect();
        write!(f, "ClusterKey({}, retired {retired:?})", self.current.id)
    }
}

impl ClusterKey {
    /// A ring with only `raw` (32 bytes or 64 hex digits) as its current key.
    pub fn from_bytes(raw: &[u8]) -> Result<Self, KeyError> {
        Ok(ClusterKey {
            current: RingKey::from_bytes(raw)?,
            retired: Vec::new(),
        })
    }

    /// Reads the cluster key file and, when present, the [`RETIRED_KEYS_FILE`] beside it (the
    /// chart mounts the whole Secret as one directory).
    pub fn load(path: &std::path::Path) -> std::io::Result<Result<Self, KeyError>> {
        let raw = std::fs::read(path)?;
        let retired_path = path.with_file_name(RETIRED_KEYS_FILE);
        let retired = match std::fs::read_to_string(&retired_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        Ok(Self::from_parts(
            &raw,
            retired.as_deref(),
            &retired_path.display().to_string(),
        ))
    }

    /// The ring in the cluster key Secret `s`: [`CLUSTER_KEY_FIELD`] and, after rotations,
    /// [`RETIRED_KEYS_FILE`] (what the agents read from the same Secret mounted as files).
    pub fn from_secret(s: &k8s_openapi::api::core::v1::Secret) -> Result<Self, KeyError> {
        let current = secret_field(s, CLUSTER_KEY_FIELD)?;
        let retired = secret_field(s, RETIRED_KEYS_FILE)
            .ok()
            .map(String::from_utf8_lossy);
        let name = format!(
            "Secret {}/{} {RETIRED_KEYS_FILE}",
            s.metadata.namespace.as_deref().unwrap_or_default(),
            s.metadata.name.as_deref().unwrap_or_default()
        );
        Self::from_parts(current, retired.as_deref(), &name)
    }

    /// The current key `raw` and the retired keys in `retired` (one per line, 64 hex digits;
    /// blank lines and `#` comments ignored). `file` names the retired keys in errors.
    pub fn from_parts(raw: &[u8], retired: Option<&str>, file: &str) -> Result<Self, KeyError> {
        let mut ring = Self::from_bytes(raw)?;
        for (i, line) in retired.unwrap_or("").lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || KeyError::BadRetiredKey {
                file: file.to_owned(),
                line: i + 1,
            };
            if line.len() != 64 {
                return Err(bad());
            }
            let k = RingKey::from_bytes(line.as_bytes()).map_err(|_| bad())?;
            if k.id != ring.current.id && !ring.retired.iter().any(|r| r.id == k.id) {
                ring.retired.push(k);
            }
        }
        Ok(ring)
    }

    /// Id of the current key (what new wraps are made with).
    pub fn id(&self) -> &str {
        &self.current.id
    }

    /// Ids of the retired keys, oldest last as listed.
    pub fn retired_ids(&self) -> Vec<&str> {
        self.retired.iter().map(|k| k.id.as_str()).collect()
    }

    /// Wraps a data key for `namespace` with the current key.
    pub fn wrap(&self, namespace: &str, data_key: &[u8; 32]) -> Result<Vec<u8>, KeyError> {
        self.current.wrap(namespace, data_key)
    }

    /// Unwraps a data key of `namespace` with whichever key of the ring wrapped it.
    pub fn unwrap(&self, namespace: &str, wrapped: &[u8]) -> Result<[u8; 32], KeyError> {
        let first = self.current.unwrap(namespace, wrapped);
        if first.is_ok() || self.retired.is_empty() {
            return first;
        }
        for k in &self.retired {
            if let Ok(key) = k.unwrap(namespace, wrapped) {
                tracing::debug!(namespace, retired = %k.id, "data key wrapped with a retired cluster key");
                return Ok(key);
            }
        }
        first
    }
}

impl RingKey {
    fn from_bytes(raw: &[u8]) -> Result<Self, KeyError> {
        let trimmed = std::str::from_utf8(raw).map(str::trim).ok();
        let bytes: Vec<u8> = match trimmed.filter(|s| s.len() == 64) {
            Some(h) => hex::decode(h).map_err(|_| KeyError::BadClusterKey(raw.len()))?,
            None => raw.to_vec(),
        };
        if bytes.len() != 32 {
            return Err(KeyError::BadClusterKey(bytes.len()));
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
        Ok(RingKey {
            key: LessSafeKey::new(
                UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| KeyError::BadClusterKey(32))?,
            ),
            id: hex::encode(&digest.as_ref()[..8]),
        })
    }

    fn wrap(&self, namespace: &str, data_key: &[u8; 32]) -> Result<Vec<u8>, KeyError> {
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

    fn unwrap(&self, namespace: &str, wrapped: &[u8]) -> Result<[u8; 32], KeyError> {
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

/// Path prefix of the key broker's endpoint: `GET /v1/keys/<namespace>` on stasis-controller's
/// broker port, with `Authorization: Bearer <the agent pod's projected token>`.
pub const BROKER_PATH: &str = "/v1/keys/";
/// The audience of the token an agent presents to the key broker (a projected
/// service-account token for this audience only, so it is good for nothing else, and no
/// token meant for the API server is accepted by the broker).
pub const BROKER_AUDIENCE: &str = "stasis.dev/key-broker";
/// The extra of an authenticated bound service-account token that names the node of the pod it
/// is bound to (Kubernetes ≥ 1.30; `k8s.io/apiserver/pkg/authentication/serviceaccount`'s
/// `NodeNameKey`). The broker takes the agent's node from it and nothing else.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// The key broker's answer: the data key of a namespace (64 hex digits).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyGrant {
    pub namespace: String,
    pub key: String,
}

impl KeyGrant {
    pub fn new(namespace: &str, secret: &[u8; 32]) -> Self {
        Self {
            namespace: namespace.to_owned(),
            key: hex::encode(secret),
        }
    }

    /// The data key's 32 bytes.
    pub fn secret(&self) -> Result<[u8; 32], String> {
        let mut k = [0u8; 32];
        hex::decode_to_slice(self.key.trim(), &mut k)
            .map_err(|e| format!("not 64 hex digits: {e}"))?;
        Ok(k)
    }
}

/// Why a namespace's data key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum DataKeyError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("{0}")]
    Kube(String),
}

/// The data key of `namespace` from its Secret in stasis's namespace `home`, unwrapped with
/// `ring`; created (random, wrapped with the current cluster key) when absent. Create-only,
/// never update: when another component created it first, the create fails with 409 and theirs
/// is used.
#[cfg(feature = "runtime")]
pub async fn load_or_create(
    client: &kube::Client,
    home: &str,
    namespace: &str,
    ring: &ClusterKey,
) -> Result<[u8; 32], DataKeyError> {
    use k8s_openapi::api::core::v1::Secret;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::ByteString;
    use kube::api::{Api, PostParams};
    use std::collections::BTreeMap;

    let api: Api<Secret> = Api::namespaced(client.clone(), home);
    let name = secret_name(namespace);
    let kube_err = |e: kube::Error| DataKeyError::Kube(format!("Secret {home}/{name}: {e}"));
    // A Secret without its field is reported like one that cannot be read, not as a wrong key.
    let unwrap = |s: &Secret| {
        unwrap_secret(ring, namespace, s).map_err(|e| match e {
            KeyError::MissingField { .. } => DataKeyError::Kube(e.to_string()),
            e => DataKeyError::Key(e),
        })
    };
    if let Some(s) = api.get_opt(&name).await.map_err(kube_err)? {
        return unwrap(&s);
    }
    let data_key = new_data_key()?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(home.to_owned()),
            labels: Some(BTreeMap::from([(
                crate::names::NAMESPACE.to_owned(),
                namespace.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([(
                crate::names::CLUSTER_KEY_ID.to_owned(),
                ring.id().to_owned(),
            )])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            SECRET_FIELD.to_owned(),
            ByteString(ring.wrap(namespace, &data_key)?),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(namespace, "created the namespace's data key");
            Ok(data_key)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            unwrap(&api.get(&name).await.map_err(kube_err)?)
        }
        Err(kube::Error::Api(e)) if e.code == 403 => Err(DataKeyError::Kube(format!(
            "the data key Secret {home}/{name} does not exist and may not be created here \
             (`create` on secrets in {home} is needed): {e}"
        ))),
        Err(e) => Err(kube_err(e)),
    }
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

    #[test]
    fn the_secrets_give_the_ring_and_the_data_key_or_name_what_is_missing() {
        use k8s_openapi::api::core::v1::Secret;
        use k8s_openapi::ByteString;
        let secret = |name: &str, fields: &[(&str, &[u8])]| Secret {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                namespace: Some("stasis".into()),
                name: Some(name.into()),
                ..Default::default()
            },
            data: Some(
                fields
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                    .collect(),
            ),
            ..Default::default()
        };
        let (old, new) = (hex::encode([1u8; 32]), hex::encode([2u8; 32]));
        let wrapped_old = ClusterKey::from_bytes(old.as_bytes())
            .unwrap()
            .wrap("team-a", &[7u8; 32])
            .unwrap();
        let ring = ClusterKey::from_secret(&secret(
            "ck",
            &[
                (CLUSTER_KEY_FIELD, new.as_bytes()),
                (RETIRED_KEYS_FILE, old.as_bytes()),
            ],
        ))
        .unwrap();
        assert_eq!(ring.retired_ids().len(), 1);
        let data = secret(&secret_name("team-a"), &[(SECRET_FIELD, &wrapped_old)]);
        assert_eq!(unwrap_secret(&ring, "team-a", &data).unwrap(), [7u8; 32]);
        assert_eq!(
            ClusterKey::from_secret(&secret("ck", &[]))
                .unwrap_err()
                .to_string(),
            "Secret stasis/ck has no cluster.key field"
        );
        assert_eq!(
            unwrap_secret(&ring, "team-a", &secret("stasis-key-team-a", &[]))
                .unwrap_err()
                .to_string(),
            "Secret stasis/stasis-key-team-a has no wrapped field"
        );
        assert!(matches!(
            ClusterKey::from_secret(&secret(
                "ck",
                &[(CLUSTER_KEY_FIELD, new.as_bytes()), (RETIRED_KEYS_FILE, b"zz")]
            )),
            Err(KeyError::BadRetiredKey { file, line: 1 }) if file == "Secret stasis/ck retired.keys"
        ));
    }

    #[test]
    fn a_rotated_ring_unwraps_old_wraps_and_wraps_with_the_new_key() {
        let old = [1u8; 32];
        let new = [2u8; 32];
        let dk = [5u8; 32];
        let wrapped_old = ClusterKey::from_bytes(&old)
            .unwrap()
            .wrap("ns", &dk)
            .unwrap();
        let retired = format!("# rotated 2026-12-01\n\n{}\n", hex::encode(old));
        let ring = ClusterKey::from_parts(&new, Some(&retired), "retired.keys").unwrap();
        assert_eq!(ring.id(), ClusterKey::from_bytes(&new).unwrap().id());
        assert_eq!(ring.retired_ids().len(), 1);
        // Old checkpoints' data keys still unwrap; new wraps are the new key's only.
        assert_eq!(ring.unwrap("ns", &wrapped_old).unwrap(), dk);
        let wrapped_new = ring.wrap("ns", &dk).unwrap();
        assert!(ClusterKey::from_bytes(&old)
            .unwrap()
            .unwrap("ns", &wrapped_new)
            .is_err());
        // Still bound to the namespace, whichever key wrapped it.
        assert!(ring.unwrap("other", &wrapped_old).is_err());
        // Without the retired key the old wrap is refused, naming the cause.
        let err = ClusterKey::from_bytes(&new)
            .unwrap()
            .unwrap("ns", &wrapped_old)
            .unwrap_err();
        assert!(err.to_string().contains("another cluster key"), "{err}");
        // A malformed retired key names its line.
        assert_eq!(
            ClusterKey::from_parts(&new, Some("\nnot-a-key\n"), "f").unwrap_err(),
            KeyError::BadRetiredKey {
                file: "f".into(),
                line: 2
            }
        );
    }

    #[test]
    fn load_reads_the_retired_keys_beside_the_cluster_key() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("cluster.key");
        std::fs::write(&path, hex::encode([2u8; 32])).unwrap();
        assert!(ClusterKey::load(&path)
            .unwrap()
            .unwrap()
            .retired_ids()
            .is_empty());
        std::fs::write(t.path().join(RETIRED_KEYS_FILE), hex::encode([1u8; 32])).unwrap();
        assert_eq!(
            ClusterKey::load(&path)
                .unwrap()
                .unwrap()
                .retired_ids()
                .len(),
            1
        );
        assert!(ClusterKey::load(&t.path().join("missing")).is_err());
    }
}
