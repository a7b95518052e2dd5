//! What the tests of the store on a local `file://` backend share: a store in a temporary
//! directory, strictly increasing checkpoint ids, images written from a file list, and the
//! paths of the objects the store keeps.
#![allow(dead_code)] // each test binary uses its own part

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use stasis_core::{CheckpointId, Manifest};
use stasis_store::{Key, Store};

pub use crate::draft::pseudo_random;

pub static CLOCK: AtomicU64 = AtomicU64::new(0);

/// Strictly increasing checkpoint ids, so "latest" is well defined within a test.
pub fn next_id() -> CheckpointId {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let prev = CLOCK.fetch_max(now, Ordering::SeqCst);
    let ms = if prev >= now {
        CLOCK.fetch_add(1, Ordering::SeqCst) + 1
    } else {
        now
    };
    CheckpointId::from_parts(ms, rand_u32())
}

pub fn rand_u32() -> u32 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    t.wrapping_mul(2_654_435_761)
}

pub fn draft(workload: &str) -> Manifest {
    crate::draft::draft_with_id(workload, next_id())
}

pub fn write(dir: &Path, rel: &str, data: &[u8], mode: u32) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, data).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub struct Env {
    pub _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub store: Store,
    pub key: Key,
}

pub fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("store");
    let store = Store::open(&format!("file://{}", root.display())).unwrap();
    Env {
        root,
        store,
        key: Key::random(),
        _tmp: tmp,
    }
}

pub fn image(base: &Path, name: &str, files: &[(&str, Vec<u8>, u32)]) -> PathBuf {
    let d = base.join(name);
    std::fs::create_dir_all(&d).unwrap();
    for (rel, data, mode) in files {
        write(&d, rel, data, *mode);
    }
    d
}

pub fn assert_same_tree(a: &Path, b: &Path, files: &[(&str, Vec<u8>, u32)]) {
    for (rel, data, mode) in files {
        let got = std::fs::read(b.join(rel)).unwrap();
        assert!(got == *data, "{rel} differs after restore");
        let m = std::fs::metadata(b.join(rel)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(m, *mode, "{rel} mode");
        assert!(a.join(rel).exists());
    }
}

pub fn chunk_object(root: &Path, key: &Key, id: &str) -> PathBuf {
    root.join("chunks").join(key.id()).join(&id[..2]).join(id)
}

pub fn count_files(dir: &Path) -> usize {
    if !dir.exists() {
        return 0;
    }
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            n += count_files(&e.path());
        } else {
            n += 1;
        }
    }
    n
}

/// Unmounts its path when dropped.
pub struct Unmount(pub PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Both local code paths: direct I/O (chunks) and `object_store`'s (what S3 uses).
pub fn stores(root: &Path) -> Vec<(&'static str, Store)> {
    [("direct", true), ("object_store", false)]
        .into_iter()
        .map(|(name, direct_io)| {
            let opts = stasis_store::StoreOptions {
                direct_io,
                ..Default::default()
            };
            (
                name,
                Store::open_with(root.to_str().unwrap(), opts).unwrap(),
            )
        })
        .collect()
}
