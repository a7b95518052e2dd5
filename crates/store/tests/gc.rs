//! Garbage collection on a real `file://` backend: retention, the chunk sweep, leases, the GC
//! lock, and a sweep that stops at a manifest it cannot read.
#[path = "common/draft.rs"]
mod draft;
#[path = "common/local.rs"]
mod local;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use local::*;
use stasis_store::{NoProgress, StoreError};

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
