//! Store behaviour against a real `file://` backend in a temporary directory: put and get,
//! deduplication, `latest`, store URLs, and what a full, read-only or interrupted store does.
#[path = "common/draft.rs"]
mod draft;
#[path = "common/local.rs"]
mod local;

use std::time::Duration;

use local::*;
use stasis_core::{CheckpointRef, Selector, WorkloadName};
use stasis_store::{Key, NoProgress, Store, StoreError};

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
    let prefetch = store.prefetch(&r);
    assert_send(&prefetch);
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
