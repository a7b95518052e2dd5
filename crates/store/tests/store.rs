//! Store behaviour against a real `file://` backend in a temporary directory.

#[path = "common/draft.rs"]
mod shared;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shared::pseudo_random;
use stasis_core::{CheckpointId, CheckpointRef, Manifest, Selector, WorkloadName};
use stasis_store::{Key, NoProgress, Store, StoreError};

static CLOCK: AtomicU64 = AtomicU64::new(0);

/// Strictly increasing checkpoint ids, so "latest" is well defined within a test.
fn next_id() -> CheckpointId {
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

fn rand_u32() -> u32 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    t.wrapping_mul(2_654_435_761)
}

fn draft(workload: &str) -> Manifest {
    shared::draft_with_id(workload, next_id())
}

fn write(dir: &Path, rel: &str, data: &[u8], mode: u32) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, data).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
}

struct Env {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    store: Store,
    key: Key,
}

fn env() -> Env {
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

fn image(base: &Path, name: &str, files: &[(&str, Vec<u8>, u32)]) -> PathBuf {
    let d = base.join(name);
    std::fs::create_dir_all(&d).unwrap();
    for (rel, data, mode) in files {
        write(&d, rel, data, *mode);
    }
    d
}

fn assert_same_tree(a: &Path, b: &Path, files: &[(&str, Vec<u8>, u32)]) {
    for (rel, data, mode) in files {
        let got = std::fs::read(b.join(rel)).unwrap();
        assert!(got == *data, "{rel} differs after restore");
        let m = std::fs::metadata(b.join(rel)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(m, *mode, "{rel} mode");
        assert!(a.join(rel).exists());
    }
}

fn chunk_object(root: &Path, key: &Key, id: &str) -> PathBuf {
    root.join("chunks").join(key.id()).join(&id[..2]).join(id)
}

fn count_files(dir: &Path) -> usize {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_of_files_of_all_sizes() {
    let e = env();
    let files = vec![
        ("empty", vec![], 0o600),
        ("tiny.json", b"{\"a\":1}".to_vec(), 0o644),
        ("criu/pages-1.img", pseudo_random(9 << 20, 1), 0o600),
        ("criu/zeros.img", vec![0u8; 5 << 20], 0o400),
        ("deep/er/dir/mid.img", pseudo_random(300_000, 2), 0o755),
    ];
    let img = image(e._tmp.path(), "img", &files);
    let m = e
        .store
        .put_checkpoint(&e.key, draft("web-1"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(m.key_id, e.key.id());
    assert_eq!(m.files.len(), 5);
    assert_eq!(m.stats.logical_bytes, (9 << 20) + (5 << 20) + 300_000 + 7);
    let big = m
        .files
        .iter()
        .find(|f| f.path == "criu/pages-1.img")
        .unwrap();
    assert!(big.chunks.len() >= 3, "{} chunks", big.chunks.len());
    let empty = m.files.iter().find(|f| f.path == "empty").unwrap();
    assert!(empty.chunks.is_empty());
    // zeros compress to almost nothing
    assert!(m.stats.written_bytes < (9 << 20) + 400_000, "{:?}", m.stats);

    let out = e._tmp.path().join("out");
    let got = e
        .store
        .get_checkpoint(&e.key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    assert_eq!(got, m);
    assert_same_tree(&img, &out, &files);

    // a second put of identical content writes nothing new
    let m2 = e
        .store
        .put_checkpoint(&e.key, draft("web-1"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(m2.stats.new_chunks, 0, "{:?}", m2.stats);
    // and another workload with the same content finds the chunks by HEAD
    let m3 = e
        .store
        .put_checkpoint(&e.key, draft("other"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(m3.stats.new_chunks, 0, "{:?}", m3.stats);
    // no leases left behind
    assert_eq!(count_files(&e.root.join("leases")), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_checkpoint_after_5_percent_change_writes_little() {
    let e = env();
    let size = 48usize << 20;
    let mut data = pseudo_random(size, 3);
    let img = image(
        e._tmp.path(),
        "img",
        &[("pages-1.img", data.clone(), 0o600)],
    );
    let m1 = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(m1.stats.new_bytes, size as u64);

    let start = size / 3;
    let len = size / 20;
    let fresh = pseudo_random(len, 99);
    data[start..start + len].copy_from_slice(&fresh);
    write(&img, "pages-1.img", &data, 0o600);
    let m2 = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let ratio = m2.stats.written_bytes as f64 / m1.stats.written_bytes as f64;
    assert!(
        ratio <= 0.15,
        "second checkpoint wrote {:.1}% of the first ({:?})",
        ratio * 100.0,
        m2.stats
    );
    let out = e._tmp.path().join("out");
    e.store
        .get_checkpoint(&e.key, &"w/latest".parse().unwrap(), &out, &NoProgress)
        .await
        .unwrap();
    assert!(std::fs::read(out.join("pages-1.img")).unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_key_is_named() {
    let e = env();
    let img = image(e._tmp.path(), "img", &[("a", b"hello".to_vec(), 0o600)]);
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let other = Key::random();
    let err = e
        .store
        .get_checkpoint(
            &other,
            &m.reference(),
            &e._tmp.path().join("o"),
            &NoProgress,
        )
        .await
        .unwrap_err();
    match &err {
        StoreError::WrongKey {
            manifest_key_id,
            this_key_id,
            ..
        } => {
            assert_eq!(manifest_key_id, e.key.id());
            assert_eq!(this_key_id, other.id());
        }
        other => panic!("expected WrongKey, got {other}"),
    }
    assert!(err.to_string().contains(e.key.id()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_manifest_is_refused() {
    let e = env();
    let img = image(
        e._tmp.path(),
        "img",
        &[("a", pseudo_random(1000, 5), 0o600)],
    );
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let p = e.root.join("manifests/w").join(format!("{}.json", m.id));
    let text = std::fs::read_to_string(&p).unwrap();
    let forged = text.replace("\"leave_running\":true", "\"leave_running\":false");
    assert_ne!(forged, text);
    std::fs::write(&p, forged).unwrap();
    let err = e
        .store
        .read_manifest(&e.key, &m.reference())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ManifestTampered { .. }), "{err}");

    // the newest valid checkpoint skips the tampered one
    let older = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let newest = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let np = e
        .root
        .join("manifests/w")
        .join(format!("{}.json", newest.id));
    let t = std::fs::read_to_string(&np).unwrap();
    std::fs::write(
        &np,
        t.replace("\"leave_running\":true", "\"leave_running\":false"),
    )
    .unwrap();
    let (valid, skipped) = e
        .store
        .read_latest_valid(&e.key, &WorkloadName::new("w").unwrap())
        .await
        .unwrap();
    assert_eq!(valid.id, older.id);
    assert_eq!(skipped.len(), 1);
    assert!(matches!(skipped[0].1, StoreError::ManifestTampered { .. }));
    std::fs::remove_file(&np).unwrap();
    e.store.delete_checkpoint(&older.reference()).await.unwrap();

    // a valid manifest copied under another id is refused too
    std::fs::write(&p, &text).unwrap();
    let other = next_id();
    std::fs::copy(&p, e.root.join("manifests/w").join(format!("{other}.json"))).unwrap();
    let err = e
        .store
        .read_manifest(&e.key, &"w/latest".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::ManifestTampered { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_corrupt_chunks_are_named() {
    let e = env();
    let img = image(
        e._tmp.path(),
        "img",
        &[
            ("small", b"abc".to_vec(), 0o600),
            ("pages.img", pseudo_random(3 << 20, 6), 0o600),
        ],
    );
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let f = m.files.iter().find(|f| f.path == "pages.img").unwrap();
    let victim = f.chunks.last().unwrap().id.clone();
    let obj = chunk_object(&e.root, &e.key, &victim);
    let saved = std::fs::read(&obj).unwrap();

    // corrupt: flip one byte in the ciphertext
    let mut bad = saved.clone();
    let i = bad.len() / 2;
    bad[i] ^= 0x40;
    std::fs::write(&obj, &bad).unwrap();
    let err = e
        .store
        .get_checkpoint(
            &e.key,
            &m.reference(),
            &e._tmp.path().join("o1"),
            &NoProgress,
        )
        .await
        .unwrap_err();
    match &err {
        StoreError::ChunkCorrupt { chunk, file, .. } => {
            assert_eq!(chunk, &victim);
            assert_eq!(file, "pages.img");
        }
        other => panic!("expected ChunkCorrupt, got {other}"),
    }
    assert!(err.to_string().contains(&victim));

    // a chunk swapped for another valid chunk is refused (ids are bound to contents; a larger
    // one is refused by its size already)
    let other = chunk_object(&e.root, &e.key, &f.chunks[0].id);
    std::fs::copy(&other, &obj).unwrap();
    let err = e
        .store
        .get_checkpoint(
            &e.key,
            &m.reference(),
            &e._tmp.path().join("o2"),
            &NoProgress,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::ChunkCorrupt { .. } | StoreError::ObjectTooLarge { .. }
        ),
        "{err}"
    );

    // missing
    std::fs::remove_file(&obj).unwrap();
    let err = e
        .store
        .get_checkpoint(
            &e.key,
            &m.reference(),
            &e._tmp.path().join("o3"),
            &NoProgress,
        )
        .await
        .unwrap_err();
    match &err {
        StoreError::ChunkMissing { chunk, file, .. } => {
            assert_eq!(chunk, &victim);
            assert_eq!(file, "pages.img");
        }
        other => panic!("expected ChunkMissing, got {other}"),
    }
    assert!(err.to_string().contains(&victim) && err.to_string().contains("pages.img"));

    std::fs::write(&obj, &saved).unwrap();
    e.store
        .get_checkpoint(
            &e.key,
            &m.reference(),
            &e._tmp.path().join("o4"),
            &NoProgress,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_of_one_workload_are_both_valid() {
    let e = env();
    let shared = pseudo_random(4 << 20, 7);
    let a = image(
        e._tmp.path(),
        "a",
        &[
            ("p.img", shared.clone(), 0o600),
            ("x", pseudo_random(2 << 20, 8), 0o600),
        ],
    );
    let b = image(
        e._tmp.path(),
        "b",
        &[
            ("p.img", shared, 0o600),
            ("x", pseudo_random(2 << 20, 9), 0o600),
        ],
    );
    let (ra, rb) = tokio::join!(
        e.store.put_checkpoint(&e.key, draft("w"), &a, &NoProgress),
        e.store.put_checkpoint(&e.key, draft("w"), &b, &NoProgress)
    );
    let (ma, mb) = (ra.unwrap(), rb.unwrap());
    assert_ne!(ma.id, mb.id);
    for (m, dir) in [(&ma, &a), (&mb, &b)] {
        let out = e._tmp.path().join(format!("out-{}", m.id));
        e.store
            .get_checkpoint(&e.key, &m.reference(), &out, &NoProgress)
            .await
            .unwrap();
        assert!(std::fs::read(out.join("x")).unwrap() == std::fs::read(dir.join("x")).unwrap());
    }
    assert_eq!(e.store.list(None).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_resolves_to_the_newest() {
    let e = env();
    let img = image(e._tmp.path(), "img", &[("a", b"1".to_vec(), 0o600)]);
    let w = WorkloadName::new("w").unwrap();
    let latest = CheckpointRef {
        workload: w.clone(),
        selector: Selector::Latest,
    };
    assert!(matches!(
        e.store.resolve(&latest).await,
        Err(StoreError::NotFound { .. })
    ));
    let mut ids = vec![];
    for _ in 0..3 {
        let m = e
            .store
            .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
            .await
            .unwrap();
        ids.push(m.id);
    }
    e.store
        .put_checkpoint(&e.key, draft("w2"), &img, &NoProgress)
        .await
        .unwrap();
    assert_eq!(e.store.resolve(&latest).await.unwrap(), ids[2]);
    let listed = e.store.list(Some(&w)).await.unwrap();
    assert_eq!(listed.iter().map(|s| s.id.clone()).collect::<Vec<_>>(), ids);
    assert_eq!(e.store.list(None).await.unwrap().len(), 4);

    let exact = CheckpointRef::exact(w.clone(), ids[1].clone());
    assert_eq!(e.store.resolve(&exact).await.unwrap(), ids[1]);
    assert_eq!(e.store.delete_checkpoint(&latest).await.unwrap(), ids[2]);
    assert_eq!(e.store.resolve(&latest).await.unwrap(), ids[1]);
    let gone = CheckpointRef::exact(w, ids[2].clone());
    assert!(matches!(
        e.store
            .get_checkpoint(&e.key, &gone, &e._tmp.path().join("o"), &NoProgress)
            .await,
        Err(StoreError::ManifestMissing { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_newest_and_sweeps_unreferenced_chunks() {
    let e = env();
    let mut ms = vec![];
    for i in 0..3u64 {
        let img = image(
            e._tmp.path(),
            &format!("img{i}"),
            &[
                ("common", pseudo_random(200_000, 100), 0o600),
                ("own", pseudo_random(200_000, i), 0o600),
            ],
        );
        ms.push(
            e.store
                .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
                .await
                .unwrap(),
        );
    }
    let chunks_dir = e.root.join("chunks").join(e.key.id());
    assert_eq!(count_files(&chunks_dir), 4);

    // young chunks are spared
    let r = e
        .store
        .gc(&e.key, 1, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(r.manifests_deleted.len(), 2);
    assert_eq!(r.chunks_spared_young, 2);
    assert_eq!(r.chunks_deleted, 0);
    assert_eq!(count_files(&chunks_dir), 4);

    let r = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert_eq!(r.manifests_kept, 1);
    assert_eq!(r.chunks_deleted, 2, "{r:?}");
    assert_eq!(r.chunks_kept, 2);
    assert_eq!(count_files(&chunks_dir), 2);
    assert!(!e.root.join("locks/gc.json").exists());
    e.store
        .get_checkpoint(
            &e.key,
            &"w/latest".parse().unwrap(),
            &e._tmp.path().join("o"),
            &NoProgress,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_spares_chunks_while_a_live_lease_exists() {
    let e = env();
    let img = image(
        e._tmp.path(),
        "img",
        &[("a", pseudo_random(100_000, 1), 0o600)],
    );
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    // An unreferenced chunk: as if a writer had uploaded it and not yet published.
    e.store.delete_checkpoint(&m.reference()).await.unwrap();
    let chunks_dir = e.root.join("chunks").join(e.key.id());
    assert_eq!(count_files(&chunks_dir), 1);

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let lease_dir = e.root.join("leases/w");
    std::fs::create_dir_all(&lease_dir).unwrap();
    let live = lease_dir.join(format!("{}.json", next_id()));
    std::fs::write(
        &live,
        format!(r#"{{"holder":"test","purpose":"put","started_unix_ms":{now},"renewed_unix_ms":{now},"ttl_ms":600000}}"#),
    )
    .unwrap();
    let dead = lease_dir.join(format!("{}.json", next_id()));
    std::fs::write(
        &dead,
        r#"{"holder":"dead","purpose":"put","started_unix_ms":1,"renewed_unix_ms":1,"ttl_ms":1000}"#,
    )
    .unwrap();

    let r = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert!(r.sweep_skipped.is_some(), "{r:?}");
    assert_eq!(r.expired_leases_removed, 1);
    assert!(!dead.exists());
    assert_eq!(count_files(&chunks_dir), 1);

    std::fs::remove_file(&live).unwrap();
    let r = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert!(r.sweep_skipped.is_none(), "{r:?}");
    assert_eq!(r.chunks_deleted, 1);
    assert_eq!(count_files(&chunks_dir), 0);

    // a staging file left by a writer killed mid-write is removed once older than the grace
    std::fs::create_dir_all(chunks_dir.join("ab")).unwrap();
    let staging = chunks_dir
        .join("ab")
        .join(format!("ab{}#12345", "0".repeat(62)));
    std::fs::write(&staging, b"partial").unwrap();
    let r = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert_eq!(r.staging_files_removed, 1, "{r:?}");
    assert!(!staging.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gc_is_refused_while_one_holds_the_lock() {
    let e = env();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    std::fs::create_dir_all(e.root.join("locks")).unwrap();
    std::fs::write(
        e.root.join("locks/gc.json"),
        format!(r#"{{"holder":"other","purpose":"gc","started_unix_ms":{now},"renewed_unix_ms":{now},"ttl_ms":600000}}"#),
    )
    .unwrap();
    let err = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap_err();
    assert!(matches!(err, StoreError::GcBusy { .. }), "{err}");
}

/// Unmounts its path when dropped.
struct Unmount(PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// ENOSPC on a real, tiny tmpfs: the put fails with NoSpace, publishes nothing, and the
/// previous checkpoint stays readable. Needs root (mount); skipped with a reason otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_keeps_the_previous_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !mounted {
        eprintln!(
            "SKIPPED disk_full_keeps_the_previous_checkpoint: cannot mount a tmpfs (needs root)"
        );
        return;
    }
    let _guard = Unmount(mnt.clone());

    let store = Store::open(mnt.to_str().unwrap()).unwrap();
    let key = Key::random();
    let small = image(
        tmp.path(),
        "small",
        &[("p.img", pseudo_random(1 << 20, 1), 0o600)],
    );
    let m1 = store
        .put_checkpoint(&key, draft("w"), &small, &NoProgress)
        .await
        .unwrap();
    let big = image(
        tmp.path(),
        "big",
        &[("p.img", pseudo_random(12 << 20, 2), 0o600)],
    );
    let err = store
        .put_checkpoint(&key, draft("w"), &big, &NoProgress)
        .await
        .unwrap_err();
    assert!(err.is_no_space(), "expected out of space, got {err}");
    assert!(matches!(err, StoreError::NoSpace { .. }), "{err}");
    let listed = store.list(None).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        store.resolve(&"w/latest".parse().unwrap()).await.unwrap(),
        m1.id
    );
    let out = tmp.path().join("out");
    store
        .get_checkpoint(&key, &"w/latest".parse().unwrap(), &out, &NoProgress)
        .await
        .unwrap();
    assert!(std::fs::read(out.join("p.img")).unwrap() == pseudo_random(1 << 20, 1));
}

#[test]
fn store_urls() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("a/b");
    Store::open(&format!("file://{}", p.display())).unwrap();
    assert!(p.is_dir());
    Store::open(tmp.path().join("plain").to_str().unwrap()).unwrap();
    assert!(matches!(
        Store::open("ftp://x/y"),
        Err(StoreError::InvalidUrl { .. })
    ));
    assert!(matches!(
        Store::open("s3:///nobucket"),
        Err(StoreError::InvalidUrl { .. })
    ));
}

/// The plain `object_store` code path (what S3 uses): direct I/O off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_the_object_store_path() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("store");
    let store = Store::open_with(
        root.to_str().unwrap(),
        stasis_store::StoreOptions {
            direct_io: false,
            ..Default::default()
        },
    )
    .unwrap();
    let key = Key::random();
    let files = vec![
        ("a", pseudo_random(3 << 20, 1), 0o600),
        ("b", vec![7u8; 2 << 20], 0o644),
        ("c", vec![], 0o600),
    ];
    let img = image(tmp.path(), "img", &files);
    let m = store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let out = tmp.path().join("out");
    store
        .get_checkpoint(&key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    assert_same_tree(&img, &out, &files);
    let victim = &m.files[0].chunks[0].id;
    std::fs::remove_file(chunk_object(&root, &key, victim)).unwrap();
    let err = store
        .get_checkpoint(&key, &m.reference(), &tmp.path().join("o2"), &NoProgress)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::ChunkMissing { ref chunk, .. } if chunk == victim),
        "{err}"
    );
}

/// A put that is abandoned midway (the process killed, the future dropped) publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_put_publishes_nothing() {
    let e = env();
    let img = image(
        e._tmp.path(),
        "img",
        &[("p.img", pseudo_random(64 << 20, 4), 0o600)],
    );
    let r = tokio::time::timeout(
        Duration::from_millis(20),
        e.store
            .put_checkpoint(&e.key, draft("w"), &img, &NoProgress),
    )
    .await;
    assert!(
        r.is_err(),
        "the put finished too fast for this test to mean anything"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(e.store.list(None).await.unwrap().is_empty());
    // its lease stays until it expires, so GC does not sweep what it uploaded
    let rep = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert!(rep.sweep_skipped.is_some(), "{rep:?}");
}

/// The agent spawns store operations on a multi-threaded runtime: their futures must be `Send`.
#[test]
fn store_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path().to_str().unwrap()).unwrap();
    let key = Key::random();
    let r: CheckpointRef = "w/latest".parse().unwrap();
    let put = store.put_checkpoint(&key, draft("w"), tmp.path(), &NoProgress);
    assert_send(&put);
    let get = store.get_checkpoint(&key, &r, tmp.path(), &NoProgress);
    assert_send(&get);
    let gc = store.gc(&key, 1, Duration::ZERO);
    assert_send(&gc);
    let list = store.list(None);
    assert_send(&list);
    let latest = store.read_latest_valid(&key, &r.workload);
    assert_send(&latest);
}

/// Both local code paths: direct I/O (chunks) and `object_store`'s (what S3 uses).
fn stores(root: &Path) -> Vec<(&'static str, Store)> {
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

/// A bucket writer replaces a referenced chunk with a 1 GiB object and a manifest with a
/// 40 MiB one: both are refused from their size, before they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_objects_are_refused_before_they_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("store");
    let key = Key::random();
    for (name, store) in stores(&root) {
        let files = vec![("p.img", pseudo_random(3 << 20, 9), 0o600)];
        let img = image(tmp.path(), &format!("img-{name}"), &files);
        let m = store
            .put_checkpoint(&key, draft("w"), &img, &NoProgress)
            .await
            .unwrap();
        let c = &m.files[0].chunks[0];
        let obj = chunk_object(&root, &key, &c.id);
        let f = std::fs::OpenOptions::new().write(true).open(&obj).unwrap();
        f.set_len(1 << 30).unwrap(); // sparse: costs no disk
        let err = store
            .get_checkpoint(
                &key,
                &m.reference(),
                &tmp.path().join(format!("o-{name}")),
                &NoProgress,
            )
            .await
            .unwrap_err();
        let limit = (15 + c.len + 16) as u64;
        match &err {
            StoreError::ObjectTooLarge {
                path,
                size,
                limit: l,
            } => {
                assert!(path.ends_with(&c.id), "{name}: {err}");
                assert_eq!((*size, *l), (1 << 30, limit), "{name}: {err}");
            }
            other => panic!("{name}: expected ObjectTooLarge, got {other}"),
        }
        assert!(err.is_integrity_failure());
        assert!(err.to_string().contains("1073741824"), "{err}");

        let manifest = root.join("manifests/w").join(format!("{}.json", m.id));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&manifest)
            .unwrap();
        f.set_len(40 << 20).unwrap();
        let err = store.read_manifest(&key, &m.reference()).await.unwrap_err();
        assert!(
            matches!(err, StoreError::ObjectTooLarge { size, limit, .. } if size == 40 << 20 && limit == stasis_store::envelope::MAX_MANIFEST_OBJECT),
            "{name}: {err}"
        );
        // GC does not sweep on a manifest it cannot read
        let rep = store.gc(&key, 5, Duration::ZERO).await.unwrap();
        assert!(rep.sweep_skipped.is_some(), "{rep:?}");
        std::fs::remove_file(&manifest).unwrap();
    }
}

/// A deleted, truncated or grown chunk is not relied on by a later checkpoint of the same
/// data: it is stored again, and that checkpoint restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deduplication_stores_damaged_chunks_again() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("store");
    let key = Key::random();
    for (name, store) in stores(&root) {
        let files = vec![(
            "p.img",
            pseudo_random(6 << 20, 10 + name.len() as u64),
            0o600,
        )];
        let img = image(tmp.path(), &format!("img-{name}"), &files);
        let m1 = store
            .put_checkpoint(&key, draft("w"), &img, &NoProgress)
            .await
            .unwrap();
        let chunks = &m1.files[0].chunks;
        assert!(chunks.len() >= 3, "{name}: {} chunks", chunks.len());
        let objs: Vec<PathBuf> = chunks[..3]
            .iter()
            .map(|c| chunk_object(&root, &key, &c.id))
            .collect();
        std::fs::remove_file(&objs[0]).unwrap();
        // (a size check cannot tell same-size garbage, nor a truncation to a size a compressed
        // chunk could have: restores catch those as corrupt)
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&objs[1])
            .unwrap();
        f.set_len(20).unwrap();
        let mut grown = std::fs::read(&objs[2]).unwrap();
        grown.extend_from_slice(b"extra");
        std::fs::write(&objs[2], grown).unwrap();

        let m2 = store
            .put_checkpoint(&key, draft("w"), &img, &NoProgress)
            .await
            .unwrap();
        assert_eq!(m2.stats.new_chunks, 3, "{name}: {:?}", m2.stats);
        let out = tmp.path().join(format!("out-{name}"));
        store
            .get_checkpoint(&key, &m2.reference(), &out, &NoProgress)
            .await
            .unwrap();
        assert_same_tree(&img, &out, &files);
    }
}

/// A deleted manifest of an exact checkpoint is its own error, not "no checkpoint".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_manifest_is_named_as_missing() {
    let e = env();
    let img = image(e._tmp.path(), "img", &[("a", b"1".to_vec(), 0o600)]);
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    std::fs::remove_file(e.root.join("manifests/w").join(format!("{}.json", m.id))).unwrap();
    for err in [
        e.store
            .read_manifest(&e.key, &m.reference())
            .await
            .unwrap_err(),
        e.store
            .get_checkpoint(
                &e.key,
                &m.reference(),
                &e._tmp.path().join("o"),
                &NoProgress,
            )
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(err, StoreError::ManifestMissing { ref reference, .. } if *reference == m.reference().to_string()),
            "{err}"
        );
        assert!(err.is_integrity_failure());
    }
    let latest: CheckpointRef = "w/latest".parse().unwrap();
    let err = e.store.read_manifest(&e.key, &latest).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
    assert!(!err.is_integrity_failure());
}

/// B3: a kept manifest that is not even an envelope (truncated) blocks the chunk sweep, and the
/// report names it; its chunks stay, so a repaired manifest still restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_does_not_sweep_while_a_manifest_cannot_be_read() {
    let e = env();
    let files = [("pages.img", pseudo_random(300_000, 7), 0o600)];
    let img = image(e._tmp.path(), "img", &files);
    let m = e
        .store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let path = e.root.join("manifests/w").join(format!("{}.json", m.id));
    let whole = std::fs::read(&path).unwrap();
    std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
    let chunks_dir = e.root.join("chunks").join(e.key.id());
    let before = count_files(&chunks_dir);
    assert!(before > 0);

    let r = e.store.gc(&e.key, 1, Duration::ZERO).await.unwrap();
    assert_eq!(r.chunks_deleted, 0, "{r:?}");
    assert_eq!(
        count_files(&chunks_dir),
        before,
        "chunks of a damaged manifest were swept"
    );
    let why = r.sweep_skipped.expect("the sweep was not skipped");
    assert!(why.contains(&format!("w/{}", m.id)), "{why}");

    // Repaired (from a backup), it restores.
    std::fs::write(&path, &whole).unwrap();
    let out = e._tmp.path().join("out");
    e.store
        .get_checkpoint(&e.key, &"w/latest".parse().unwrap(), &out, &NoProgress)
        .await
        .unwrap();
    assert_same_tree(&img, &out, &files);
}

/// B8, B13: `file://` with an empty path (an unset variable) and `/` are refused; a reader's
/// open of a missing local store is "no such store" and creates nothing.
#[test]
fn a_store_is_never_the_host_root_and_a_reader_creates_none() {
    for url in ["file://", "file:///", "file:////", "/"] {
        let r = Store::open(url);
        assert!(
            matches!(r, Err(StoreError::InvalidUrl { .. })),
            "{url} was accepted"
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("typo");
    let opts = stasis_store::StoreOptions {
        create: false,
        ..Default::default()
    };
    let r = Store::open_with(&format!("file://{}", missing.display()), opts.clone());
    assert!(matches!(r, Err(StoreError::NoSuchStore { .. })), "{r:?}");
    let r = Store::open_with(missing.to_str().unwrap(), opts);
    assert!(matches!(r, Err(StoreError::NoSuchStore { .. })), "{r:?}");
    assert!(!missing.exists(), "a reader created the store directory");
}

/// B14, B17: on a read-only mount, `check_writable` fails naming the store, and a checkpoint
/// is still read (without a read lease). Needs root (bind mounts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_store_is_found_before_a_write_and_can_still_be_read() {
    let e = env();
    let files = [("pages.img", pseudo_random(200_000, 9), 0o600)];
    let img = image(e._tmp.path(), "img", &files);
    e.store
        .put_checkpoint(&e.key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let ro = e._tmp.path().join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    let bind = |args: &[&str]| {
        std::process::Command::new("mount")
            .args(args)
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let (root_s, ro_s) = (e.root.to_str().unwrap(), ro.to_str().unwrap());
    if !bind(&["--bind", root_s, ro_s]) {
        assert!(
            std::env::var_os("CI").is_none(),
            "cannot bind-mount in CI (needs root)"
        );
        eprintln!("SKIPPED a_read_only_store_is_found_before_a_write_and_can_still_be_read: cannot bind-mount (needs root)");
        return;
    }
    let _u = Unmount(ro.clone());
    assert!(
        bind(&["-o", "remount,ro,bind", ro_s]),
        "cannot remount read-only"
    );

    let store = Store::open(ro_s).unwrap();
    let err = store.check_writable().await.unwrap_err();
    assert!(err.is_read_only(), "{err}");
    assert!(err.to_string().contains(ro_s), "{err}");
    let out = e._tmp.path().join("out");
    store
        .get_checkpoint(&e.key, &"w/latest".parse().unwrap(), &out, &NoProgress)
        .await
        .unwrap();
    assert_same_tree(&img, &out, &files);
    assert!(e.store.check_writable().await.is_ok());
}
