//! What the store does with damaged objects on a real `file://` backend: a wrong key, a tampered
//! or deleted manifest, missing, corrupt, swapped or oversized chunks.
#[path = "common/draft.rs"]
mod draft;
#[path = "common/local.rs"]
mod local;

use std::path::PathBuf;
use std::time::Duration;

use local::*;
use stasis_core::{CheckpointRef, WorkloadName};
use stasis_store::{Key, NoProgress, StoreError};

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
