//! What the S3 tests share: a real S3 server (s3s-fs) with a store on it, manifest drafts,
//! incompressible images.
#![allow(dead_code)] // each test binary uses its own part

pub mod draft;
pub use draft::{draft_with_id, pseudo_random};

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;
use stasis_core::{CheckpointId, Manifest};
use stasis_store::{Key, Store, StoreOptions};
use stasis_testkit::s3::{self, S3Server};

/// A running s3s-fs with bucket `ckpts`, and a store at `s3://ckpts/node-a` on it.
pub struct S3 {
    pub server: S3Server,
    /// The server's directory: objects are files under `<dir>/ckpts/node-a/`.
    pub dir: tempfile::TempDir,
    /// The bucket, for a writer without keys.
    pub raw: Arc<dyn ObjectStore>,
    pub store: Store,
}

impl S3 {
    pub fn start(test: &str) -> Option<S3> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpts")).unwrap();
        let server = S3Server::start(test, dir.path())?;
        let s3 = AmazonS3Builder::new()
            .with_endpoint(server.endpoint())
            .with_allow_http(true)
            .with_bucket_name("ckpts")
            .with_access_key_id(s3::ACCESS_KEY)
            .with_secret_access_key(s3::SECRET_KEY)
            .with_region(s3::REGION)
            .build()
            .unwrap();
        let raw: Arc<dyn ObjectStore> =
            Arc::new(object_store::prefix::PrefixStore::new(s3, "node-a"));
        let store =
            Store::from_object_store(raw.clone(), "s3://ckpts/node-a", StoreOptions::default());
        Some(S3 {
            server,
            dir,
            raw,
            store,
        })
    }

    /// Another store on the same bucket and prefix, with other options.
    pub fn store_with(&self, opts: StoreOptions) -> Store {
        Store::from_object_store(self.raw.clone(), "s3://ckpts/node-a", opts)
    }

    /// The file s3s-fs keeps an object of the store in.
    pub fn file(&self, rel: &str) -> PathBuf {
        self.dir.path().join("ckpts/node-a").join(rel)
    }
}

pub fn draft(workload: &str) -> Manifest {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    std::thread::sleep(Duration::from_millis(2)); // ids strictly increase
    draft_with_id(workload, CheckpointId::from_parts(ms, 1))
}

pub fn image(dir: &Path, data: &[u8]) -> PathBuf {
    let d = dir.join("img");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("pages.img"), data).unwrap();
    std::fs::set_permissions(d.join("pages.img"), std::fs::Permissions::from_mode(0o600)).unwrap();
    d
}

pub fn chunk_rel(key: &Key, id: &str) -> String {
    format!("chunks/{}/{}/{id}", key.id(), &id[..2])
}
