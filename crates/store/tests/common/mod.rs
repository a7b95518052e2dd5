//! What the S3 tests share: a real S3 server (s3s-fs) with a store on it, manifest drafts,
//! incompressible images.
#![allow(dead_code)] // each test binary uses its own part

pub mod draft;
pub use draft::{draft_with_id, pseudo_random};

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;
use stasis_core::{CheckpointId, Manifest};
use stasis_store::{Key, Store, StoreOptions};

/// The s3s-fs binary: `$STASIS_S3S_FS`, else the platform cache.
pub fn s3s_fs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("STASIS_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let cache = PathBuf::from(std::env::var_os("HOME")?).join(".cache/stasis/platform");
    std::fs::read_dir(cache)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("s3s-fs-"))
        .map(|e| e.path().join("bin/s3s-fs"))
        .find(|p| p.exists())
}

/// A running s3s-fs with bucket `ckpts`, and a store at `s3://ckpts/node-a` on it.
pub struct S3 {
    pub child: Child,
    /// The server's directory: objects are files under `<dir>/ckpts/node-a/`.
    pub dir: tempfile::TempDir,
    /// The bucket, for a writer without keys.
    pub raw: Arc<dyn ObjectStore>,
    pub store: Store,
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3 {
    pub fn start(test: &str) -> Option<S3> {
        let Some(bin) = s3s_fs() else {
            let why = "the s3s-fs server is not built (scripts/build-platform s3s-fs)";
            assert!(
                std::env::var_os("CI").is_none(),
                "{test} cannot run in CI: {why}"
            );
            eprintln!("SKIPPED {test}: {why}");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpts")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", "stasis", "--secret-key", "stasis-secret"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let s3 = AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_allow_http(true)
            .with_bucket_name("ckpts")
            .with_access_key_id("stasis")
            .with_secret_access_key("stasis-secret")
            .with_region("us-east-1")
            .build()
            .unwrap();
        let raw: Arc<dyn ObjectStore> =
            Arc::new(object_store::prefix::PrefixStore::new(s3, "node-a"));
        let store =
            Store::from_object_store(raw.clone(), "s3://ckpts/node-a", StoreOptions::default());
        Some(S3 {
            child,
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
