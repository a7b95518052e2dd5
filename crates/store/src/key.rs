//! Store keys.
//!
//! A key is 32 secret bytes. On disk a key file holds them as **64 lower-case hexadecimal
//! characters** followed by a newline (a text file, so it can be pasted into a Kubernetes Secret),
//! and must be readable by its owner only (mode `0600` or `0400`): a key file with any group or
//! other permission bit is refused, the way `ssh` refuses an open private key.
//!
//! From the secret, BLAKE3 `derive_key` derives independent subkeys, each with its own context
//! string:
//!
//! | subkey | context | use |
//! |---|---|---|
//! | chunk address key | `stasis 2026-11 chunk address v1` | keyed BLAKE3 of a chunk's plaintext = its id |
//! | encryption key | `stasis 2026-11 chunk encryption v1` | AES-256-GCM of every chunk |
//! | manifest MAC key | `stasis 2026-11 manifest mac v1` | keyed BLAKE3 over the manifest's bytes |
//! | key id | `stasis 2026-11 key id v1` | first 8 bytes, hex: public, written in manifests and object paths |
//!
//! The key id names a key without revealing anything about it, so a reader can tell "wrong key"
//! from "tampered".
//!
//! ## Default key file
//!
//! [`Key::default_path`]: `$STASIS_KEY_FILE` if set, else `$XDG_CONFIG_HOME/stasis/key`, else
//! `$HOME/.config/stasis/key` (for root that is `/root/.config/stasis/key`), else
//! `/etc/stasis/key` when no home directory is known. [`Key::load_or_create_default`] creates it
//! (directory `0700`, file `0600`) on first use.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::RngCore;
use ring::aead;

use crate::error::{Result, StoreError};

const CTX_ADDRESS: &str = "stasis 2026-11 chunk address v1";
const CTX_ENCRYPTION: &str = "stasis 2026-11 chunk encryption v1";
const CTX_MAC: &str = "stasis 2026-11 manifest mac v1";
const CTX_KEY_ID: &str = "stasis 2026-11 key id v1";

/// A store key: the secret and the subkeys derived from it. Cheap to clone (shared).
/// `Debug` shows the key id only.
#[derive(Clone)]
pub struct Key(Arc<KeyInner>);

struct KeyInner {
    address: [u8; 32],
    mac: [u8; 32],
    aead: aead::LessSafeKey,
    id: String,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key").field("id", &self.0.id).finish()
    }
}

impl Key {
    /// Derives all subkeys from a 32-byte secret.
    pub fn from_secret(secret: &[u8; 32]) -> Self {
        let address = blake3::derive_key(CTX_ADDRESS, secret);
        let enc = blake3::derive_key(CTX_ENCRYPTION, secret);
        let mac = blake3::derive_key(CTX_MAC, secret);
        let id_bytes = blake3::derive_key(CTX_KEY_ID, secret);
        let aead = aead::LessSafeKey::new(
            aead::UnboundKey::new(&aead::AES_256_GCM, &enc)
                .expect("a 32-byte key is valid for AES-256-GCM"),
        );
        Key(Arc::new(KeyInner {
            address,
            mac,
            aead,
            id: hex::encode(&id_bytes[..8]),
        }))
    }

    /// A new random key (not written anywhere).
    pub fn random() -> Self {
        let mut secret = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut secret);
        Self::from_secret(&secret)
    }

    /// The public key id (16 hex digits) written into manifests and chunk paths.
    pub fn id(&self) -> &str {
        &self.0.id
    }

    /// The address of a chunk: keyed BLAKE3 of its plaintext, 64 hex digits.
    pub fn chunk_id(&self, plaintext: &[u8]) -> String {
        self.chunk_hash(plaintext).to_hex().to_string()
    }

    pub(crate) fn chunk_hash(&self, plaintext: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0.address);
        h.update(plaintext);
        h.finalize()
    }

    pub(crate) fn mac(&self, bytes: &[u8]) -> blake3::Hash {
        blake3::keyed_hash(&self.0.mac, bytes)
    }

    pub(crate) fn aead(&self) -> &aead::LessSafeKey {
        &self.0.aead
    }

    /// Writes a new random key to `path` (mode `0600`; the parent directory is created with
    /// mode `0700` if missing). Refuses to overwrite an existing file.
    pub fn generate(path: &Path) -> Result<Key> {
        let mut secret = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut secret);
        write_key_file(path, &secret)?;
        Ok(Key::from_secret(&secret))
    }

    /// Reads a key file, checking that it is a regular file readable by its owner only and holds
    /// 64 hex digits.
    pub fn load(path: &Path) -> Result<Key> {
        let err = |reason: String| StoreError::KeyFile {
            path: path.to_owned(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                err("does not exist (create one with `stasis key generate <FILE>`)".into())
            } else {
                err(format!("cannot be read: {e}"))
            }
        })?;
        if !meta.is_file() {
            return Err(err("is not a regular file".into()));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(err(format!(
                "is accessible by group or others (mode {mode:04o}); run `chmod 600 {}`",
                path.display()
            )));
        }
        if meta.len() > 1024 {
            return Err(err(format!(
                "is {} bytes, too large for a key (expected 64 hex digits)",
                meta.len()
            )));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot be read: {e}")))?;
        let hexpart = text.trim();
        if hexpart.len() != 64 || !hexpart.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(
                "does not hold a key: expected 64 hexadecimal digits (as written by `stasis key generate`)"
                    .into(),
            ));
        }
        let mut secret = [0u8; 32];
        hex::decode_to_slice(hexpart, &mut secret)
            .map_err(|e| err(format!("does not hold a key: {e}")))?;
        Ok(Key::from_secret(&secret))
    }

    /// Loads `path`, or creates a new key there if it does not exist (safe against a concurrent
    /// creator: the file appears atomically, and the loser of a race loads the winner's key).
    pub fn load_or_create(path: &Path) -> Result<Key> {
        match std::fs::symlink_metadata(path) {
            Ok(_) => Key::load(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match Key::generate(path) {
                Ok(k) => {
                    tracing::info!(path = %path.display(), key_id = %k.id(), "created a new store key");
                    Ok(k)
                }
                Err(StoreError::KeyFile { .. }) if path.exists() => Key::load(path),
                Err(e) => Err(e),
            },
            Err(e) => Err(StoreError::KeyFile {
                path: path.to_owned(),
                reason: format!("cannot be read: {e}"),
            }),
        }
    }

    /// The default key file path (see the module docs).
    pub fn default_path() -> Result<PathBuf> {
        if let Some(p) = std::env::var_os("STASIS_KEY_FILE").filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p));
        }
        if let Some(p) = std::env::var_os("XDG_CONFIG_HOME").filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p).join("stasis").join("key"));
        }
        if let Some(p) = std::env::var_os("HOME").filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p).join(".config").join("stasis").join("key"));
        }
        Ok(PathBuf::from("/etc/stasis/key"))
    }

    /// [`Key::load_or_create`] at [`Key::default_path`].
    pub fn load_or_create_default() -> Result<Key> {
        Key::load_or_create(&Key::default_path()?)
    }
}

fn write_key_file(path: &Path, secret: &[u8; 32]) -> Result<()> {
    let err = |reason: String| StoreError::KeyFile {
        path: path.to_owned(),
        reason,
    };
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(err("already exists; refusing to overwrite a key".into()));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    if !parent.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&parent)
            .map_err(|e| err(format!("cannot create directory {}: {e}", parent.display())))?;
    }
    // Write a temporary file, then hard-link it into place: the key appears complete or not
    // at all, and an existing key is never replaced.
    let file_name = path
        .file_name()
        .ok_or_else(|| err("is not a file path".into()))?
        .to_string_lossy()
        .into_owned();
    let tmp = parent.join(format!(
        ".{file_name}.tmp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(format!("{}\n", hex::encode(secret)).as_bytes())?;
        f.sync_all()?;
        std::fs::hard_link(&tmp, path)
    })();
    let _ = std::fs::remove_file(&tmp);
    result.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            err("already exists; refusing to overwrite a key".into())
        } else {
            err(format!("cannot be written: {e}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_load_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/key");
        let k = Key::generate(&p).unwrap();
        assert_eq!(k.id().len(), 16);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let k2 = Key::load(&p).unwrap();
        assert_eq!(k.id(), k2.id());
        assert_eq!(k.chunk_id(b"x"), k2.chunk_id(b"x"));
        assert!(matches!(
            Key::generate(&p),
            Err(StoreError::KeyFile { reason, .. }) if reason.contains("already exists")
        ));
        let k3 = Key::load_or_create(&p).unwrap();
        assert_eq!(k3.id(), k.id());

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Key::load(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");

        let bad = dir.path().join("bad");
        std::fs::write(&bad, "not a key\n").unwrap();
        std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = Key::load(&bad).unwrap_err().to_string();
        assert!(e.contains("64 hexadecimal"), "{e}");

        let e = Key::load(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");

        let created = dir.path().join("new/key");
        let k4 = Key::load_or_create(&created).unwrap();
        assert_eq!(Key::load(&created).unwrap().id(), k4.id());
        assert_ne!(k4.id(), k.id());
    }

    #[test]
    fn subkeys_are_independent() {
        let k = Key::from_secret(&[1u8; 32]);
        assert_ne!(k.0.address, k.0.mac);
        assert_ne!(
            k.chunk_id(b"abc"),
            Key::from_secret(&[2u8; 32]).chunk_id(b"abc")
        );
        assert!(format!("{k:?}").contains(k.id()));
    }
}
