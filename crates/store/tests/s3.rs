//! What a writer to the bucket without the keys can do through a real S3 server (s3s-fs, built
//! by `scripts/build-platform s3s-fs`): deny service at most. Oversized objects are refused
//! before they are read; damaged chunks are stored again by the next checkpoint.

mod common;

use std::time::Instant;

use common::{chunk_rel, draft, image, pseudo_random, S3};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};
use stasis_store::{Key, NoProgress, StoreError};

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
