//! What a writer to the bucket without the keys can do through a real S3 server (s3s-fs, built
//! by `scripts/build-platform s3s-fs`): deny service at most. Oversized objects are refused
//! before they are read; damaged chunks are stored again by the next checkpoint.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use stasis_core::{
    CheckpointId, Manifest, Requirements, Source, StoreStats, Timings, WorkloadName, SCHEMA_VERSION,
};
use stasis_store::{Key, NoProgress, Store, StoreError, StoreOptions};

/// The s3s-fs binary: `$STASIS_S3S_FS`, else the platform cache.
fn s3s_fs() -> Option<PathBuf> {
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
struct S3 {
    child: Child,
    /// The server's directory: objects are files under `<dir>/ckpts/node-a/`.
    dir: tempfile::TempDir,
    /// The bucket, for a writer without keys.
    raw: Arc<dyn ObjectStore>,
    store: Store,
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3 {
    fn start(test: &str) -> Option<S3> {
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

    /// The file s3s-fs keeps an object of the store in.
    fn file(&self, rel: &str) -> PathBuf {
        self.dir.path().join("ckpts/node-a").join(rel)
    }
}

fn draft(workload: &str) -> Manifest {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    std::thread::sleep(Duration::from_millis(2)); // ids strictly increase
    let id = CheckpointId::from_parts(ms, 1);
    Manifest {
        schema_version: SCHEMA_VERSION,
        workload: WorkloadName::new(workload).unwrap(),
        created_at: id.created_rfc3339(),
        id,
        key_id: String::new(),
        source: Source::Process { pid: 42 },
        leave_running: true,
        requirements: Requirements::default(),
        processes: vec![],
        rootfs: None,
        timings: Timings::default(),
        stats: StoreStats::default(),
        files: vec![],
        gpu_processes: 0,
        labels: BTreeMap::new(),
    }
}

fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

fn image(dir: &Path, data: &[u8]) -> PathBuf {
    let d = dir.join("img");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("pages.img"), data).unwrap();
    std::fs::set_permissions(d.join("pages.img"), std::fs::Permissions::from_mode(0o600)).unwrap();
    d
}

fn chunk_rel(key: &Key, id: &str) -> String {
    format!("chunks/{}/{}/{id}", key.id(), &id[..2])
}

/// Peak resident memory of this process since the last [`reset_peak_rss`], in bytes.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

fn reset_peak_rss() {
    // "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_oversized_objects_are_refused_before_they_are_read() {
    let Some(s3) = S3::start("s3_oversized_objects_are_refused_before_they_are_read") else {
        return;
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    let img = image(tmp.path(), &pseudo_random(3 << 20, 1));
    let m = s3
        .store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();

    // A referenced chunk becomes a 1 GiB object (a sparse file on the server's disk: the
    // server announces and would send 1 GiB).
    let c = &m.files[0].chunks[0];
    let rel = chunk_rel(&key, &c.id);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(s3.file(&rel))
        .unwrap();
    f.set_len(1 << 30).unwrap();
    drop(f);
    let head = s3.raw.head(&ObjPath::from(rel.as_str())).await.unwrap();
    assert_eq!(
        head.size,
        1 << 30,
        "the server does not serve the sparse object"
    );

    reset_peak_rss();
    let before = peak_rss();
    let t = Instant::now();
    let err = s3
        .store
        .get_checkpoint(&key, &m.reference(), &tmp.path().join("out"), &NoProgress)
        .await
        .unwrap_err();
    let peak = peak_rss();
    match &err {
        StoreError::ObjectTooLarge { path, size, limit } => {
            assert!(path.ends_with(&rel), "{err}");
            assert_eq!(*size, 1 << 30, "{err}");
            assert_eq!(*limit, u64::from(c.len) + 31, "{err}");
        }
        other => panic!("expected ObjectTooLarge, got {other}"),
    }
    assert!(err.is_integrity_failure());
    eprintln!(
        "1 GiB chunk refused in {:?}; peak RSS {} MiB (was {} MiB)",
        t.elapsed(),
        peak >> 20,
        before >> 20
    );
    assert!(
        peak < before + (64 << 20),
        "restoring grew the peak RSS from {before} to {peak} bytes"
    );

    // An oversized manifest, written through S3.
    let mp = ObjPath::from(format!("manifests/w/{}.json", m.id));
    s3.raw
        .put(&mp, PutPayload::from(vec![b' '; 40 << 20]))
        .await
        .unwrap();
    reset_peak_rss();
    let before = peak_rss();
    let err = s3
        .store
        .read_manifest(&key, &m.reference())
        .await
        .unwrap_err();
    let peak = peak_rss();
    assert!(
        matches!(err, StoreError::ObjectTooLarge { size, limit, .. }
            if size == 40 << 20 && limit == stasis_store::envelope::MAX_MANIFEST_OBJECT),
        "{err}"
    );
    assert!(
        peak < before + (16 << 20),
        "reading the manifest grew the peak RSS from {before} to {peak} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_damaged_chunks_are_stored_again_by_the_next_checkpoint() {
    let Some(s3) = S3::start("s3_damaged_chunks_are_stored_again_by_the_next_checkpoint") else {
        return;
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    let data = pseudo_random(6 << 20, 2);
    let img = image(tmp.path(), &data);
    let m1 = s3
        .store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let chunks = &m1.files[0].chunks;
    assert!(chunks.len() >= 3, "{} chunks", chunks.len());
    let rels: Vec<ObjPath> = chunks[..3]
        .iter()
        .map(|c| ObjPath::from(chunk_rel(&key, &c.id)))
        .collect();
    // deleted, replaced by a stub, replaced by something larger
    s3.raw.delete(&rels[0]).await.unwrap();
    s3.raw
        .put(&rels[1], PutPayload::from(b"not a chunk".to_vec()))
        .await
        .unwrap();
    s3.raw
        .put(&rels[2], PutPayload::from(vec![7u8; 5 << 20]))
        .await
        .unwrap();

    let m2 = s3
        .store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(m2.stats.new_chunks, 3, "{:?}", m2.stats);
    assert_eq!(m2.stats.chunks, m1.stats.chunks);
    let out = tmp.path().join("out");
    s3.store
        .get_checkpoint(&key, &m2.reference(), &out, &NoProgress)
        .await
        .unwrap();
    assert!(std::fs::read(out.join("pages.img")).unwrap() == data);
}
