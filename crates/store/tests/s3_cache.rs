//! The node chunk cache and the parallel fetch, through a real S3 server (s3s-fs, built by
//! `scripts/build-platform s3s-fs`): restores read authentic cached chunks first, refetch what
//! fails, keep the cache within its bound, and write the right bytes whatever order the chunks
//! arrive in.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{chunk_rel, draft, image, pseudo_random, S3};
use object_store::path::Path as ObjPath;
use object_store::ObjectStoreExt;
use stasis_core::Manifest;
use stasis_store::{ChunkCache, Key, NoProgress, Store, StoreError, StoreOptions};

/// Every file under `dir`, recursively, with its size.
fn files_under(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                out.push((e.path(), m.len()));
            }
        }
    }
    out
}

fn cached_store(s3: &S3, cache: &Arc<ChunkCache>) -> Store {
    s3.store_with(StoreOptions::default())
        .with_cache(cache.clone())
}

async fn restore(
    store: &Store,
    key: &Key,
    m: &Manifest,
    out: &Path,
) -> Result<Vec<u8>, StoreError> {
    let _ = std::fs::remove_dir_all(out);
    store
        .get_checkpoint(key, &m.reference(), out, &NoProgress)
        .await?;
    Ok(std::fs::read(out.join("pages.img")).unwrap())
}

async fn delete_chunks(s3: &S3, key: &Key, m: &Manifest) {
    for c in &m.files[0].chunks {
        s3.raw
            .delete(&ObjPath::from(chunk_rel(key, &c.id)))
            .await
            .unwrap();
    }
}

/// A server, a key, a temporary directory and one checkpoint of `size` incompressible bytes
/// (`None` when the server is not built, said by [`S3::start`]).
async fn one_checkpoint(
    test: &str,
    size: usize,
    seed: u64,
) -> Option<(S3, Key, tempfile::TempDir, Vec<u8>, Manifest)> {
    let s3 = S3::start(test)?;
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    let data = pseudo_random(size, seed);
    let img = image(tmp.path(), &data);
    let m = s3
        .store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    Some((s3, key, tmp, data, m))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_cache_serves_a_second_restore_and_holds_no_plaintext() {
    let Some((s3, key, tmp, data, m)) = one_checkpoint(
        "s3_cache_serves_a_second_restore_and_holds_no_plaintext",
        6 << 20,
        11,
    )
    .await
    else {
        return;
    };
    let n = m.files[0].chunks.len() as u64;
    assert!(n >= 3, "{n} chunks");

    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 64 << 20).unwrap());
    let store = cached_store(&s3, &cache);
    let out = tmp.path().join("out");
    assert!(restore(&store, &key, &m, &out).await.unwrap() == data);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.entries), (0, n, n), "{s:?}");

    // Nothing in the cache is plaintext: no 4 KiB block of the image appears in it.
    for (f, _) in files_under(cache.dir()) {
        let cached = std::fs::read(&f).unwrap();
        for block in data.chunks(4096).step_by(97) {
            assert!(
                !cached.windows(block.len()).any(|w| w == block),
                "{} holds plaintext",
                f.display()
            );
        }
    }

    // The store loses every chunk: the restore is served by the cache alone.
    delete_chunks(&s3, &key, &m).await;
    assert!(restore(&store, &key, &m, &out).await.unwrap() == data);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses), (n, n), "{s:?}");

    // Another process opening the same directory finds the entries.
    let again = Arc::new(ChunkCache::open(cache.dir(), 64 << 20).unwrap());
    assert_eq!(again.stats().entries, n);
    assert!(
        restore(&cached_store(&s3, &again), &key, &m, &out)
            .await
            .unwrap()
            == data
    );
    assert_eq!(again.stats().hits, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_cache_corrupt_entry_is_refused_and_refetched() {
    let Some((s3, key, tmp, data, m)) = one_checkpoint(
        "s3_cache_corrupt_entry_is_refused_and_refetched",
        5 << 20,
        12,
    )
    .await
    else {
        return;
    };
    let n = m.files[0].chunks.len() as u64;
    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 64 << 20).unwrap());
    let store = cached_store(&s3, &cache);
    let out = tmp.path().join("out");
    restore(&store, &key, &m, &out).await.unwrap();

    // One cached object gets a flipped byte, another is replaced by another chunk's object.
    let c0 = &m.files[0].chunks[0];
    let c1 = &m.files[0].chunks[1];
    let e0 = cache
        .dir()
        .join(&chunk_rel(&key, &c0.id)["chunks/".len()..]);
    let e1 = cache
        .dir()
        .join(&chunk_rel(&key, &c1.id)["chunks/".len()..]);
    let mut b = std::fs::read(&e0).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 1;
    std::fs::write(&e0, b).unwrap();
    let other = cache
        .dir()
        .join(&chunk_rel(&key, &m.files[0].chunks[2].id)["chunks/".len()..]);
    std::fs::copy(other, &e1).unwrap();

    assert!(restore(&store, &key, &m, &out).await.unwrap() == data);
    let s = cache.stats();
    assert_eq!(s.corrupt, 2, "{s:?}");
    assert_eq!(s.hits, n - 2, "{s:?}");
    assert_eq!(s.misses, n + 2, "{s:?}");
    // Refetched and cached again, authentic this time.
    assert!(restore(&store, &key, &m, &out).await.unwrap() == data);
    let s2 = cache.stats();
    assert_eq!((s2.hits, s2.corrupt), (s.hits + n, 2), "{s2:?}");

    // A corrupt cached chunk the store no longer has: the restore fails, never wrong bytes.
    let mut b = std::fs::read(&e0).unwrap();
    b[mid] ^= 1;
    std::fs::write(&e0, b).unwrap();
    delete_chunks(&s3, &key, &m).await;
    let err = restore(&store, &key, &m, &out).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::ChunkMissing { chunk, .. } if *chunk == c0.id),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_cache_stays_within_its_bound_least_recently_used_first() {
    let Some(s3) = S3::start("s3_cache_stays_within_its_bound_least_recently_used_first") else {
        return;
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    let a = pseudo_random(4 << 20, 13);
    let img_a = image(&tmp.path().join("a"), &a);
    let ma = s3
        .store
        .put_checkpoint(&key, draft("a"), &img_a, &NoProgress)
        .await
        .unwrap();
    let b = pseudo_random(4 << 20, 14);
    let img_b = image(&tmp.path().join("b"), &b);
    let mb = s3
        .store
        .put_checkpoint(&key, draft("b"), &img_b, &NoProgress)
        .await
        .unwrap();
    let size_of = |m: &Manifest| -> u64 { m.stats.written_bytes };
    // Room for one checkpoint's chunks and a half.
    let bound = size_of(&ma) + size_of(&mb) / 2;
    let dir = tmp.path().join("cache");
    let cache = Arc::new(ChunkCache::open(&dir, bound).unwrap());
    let store = cached_store(&s3, &cache);
    let out = tmp.path().join("out");

    assert!(restore(&store, &key, &ma, &out).await.unwrap() == a);
    assert!(restore(&store, &key, &mb, &out).await.unwrap() == b);
    let s = cache.stats();
    let on_disk: u64 = files_under(&dir).iter().map(|(_, n)| n).sum();
    assert!(
        s.bytes <= bound && on_disk <= bound,
        "{s:?}, {on_disk} bytes on disk, bound {bound}"
    );
    assert!(s.evicted > 0, "{s:?}");
    // What was evicted is a's (used least recently): all of b is still cached.
    for c in &mb.files[0].chunks {
        assert!(
            cache.contains(key.id(), &c.id),
            "chunk {} of b evicted",
            c.id
        );
    }
    let a_cached = ma.files[0]
        .chunks
        .iter()
        .filter(|c| cache.contains(key.id(), &c.id))
        .count();
    assert!(a_cached < ma.files[0].chunks.len(), "nothing of a evicted");

    // Reopened with a smaller bound, the cache shrinks to it at once.
    drop(store);
    let small = ChunkCache::open(&dir, bound / 4).unwrap();
    let on_disk: u64 = files_under(&dir).iter().map(|(_, n)| n).sum();
    assert!(
        small.stats().bytes <= bound / 4 && on_disk <= bound / 4,
        "{on_disk}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_parallel_fetch_writes_every_file_right_mixed_with_cache_hits() {
    let Some(s3) = S3::start("s3_parallel_fetch_writes_every_file_right_mixed_with_cache_hits")
    else {
        return;
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    // Three files: incompressible, compressible (stored compressed), and one smaller than a
    // chunk; 64 fetches in flight, far more than the CPUs.
    let img = tmp.path().join("img");
    std::fs::create_dir_all(img.join("sub")).unwrap();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("pages-1.img", pseudo_random(12 << 20, 15)),
        (
            "sub/pages-2.img",
            (0..9u32 << 20).map(|i| (i / 4096 % 7) as u8).collect(),
        ),
        ("small.img", pseudo_random(1000, 16)),
    ];
    for (name, d) in &files {
        std::fs::write(img.join(name), d).unwrap();
    }
    let opts = StoreOptions {
        concurrency: 64,
        ..StoreOptions::default()
    };
    let m = s3
        .store_with(opts.clone())
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    assert!(
        m.stats.written_bytes < m.stats.logical_bytes,
        "{:?}",
        m.stats
    );

    let check = |out: &Path| {
        for (name, d) in &files {
            assert!(
                std::fs::read(out.join(name)).unwrap() == *d,
                "{name} differs"
            );
        }
    };
    let out = tmp.path().join("out");
    let store = s3.store_with(opts.clone());
    store
        .get_checkpoint(&key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    check(&out);

    // Half the chunks in the cache, half from the store.
    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 1 << 30).unwrap());
    let cstore = s3.store_with(opts).with_cache(cache.clone());
    let _ = std::fs::remove_dir_all(&out);
    cstore
        .get_checkpoint(&key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    let all: Vec<_> = files_under(cache.dir());
    for (f, _) in all.iter().step_by(2) {
        std::fs::remove_file(f).unwrap();
    }
    let still_cached = m
        .files
        .iter()
        .flat_map(|f| &f.chunks)
        .filter(|c| {
            let rel = chunk_rel(&key, &c.id);
            cache.dir().join(&rel["chunks/".len()..]).exists()
        })
        .count() as u64;
    assert!(
        still_cached > 0 && still_cached < m.stats.chunks,
        "{still_cached}"
    );
    let _ = std::fs::remove_dir_all(&out);
    cstore
        .get_checkpoint(&key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    check(&out);
    let s = cache.stats();
    assert_eq!(s.hits, still_cached, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_put_with_a_cache_lets_a_restore_on_the_node_skip_the_store() {
    let Some(s3) = S3::start("s3_put_with_a_cache_lets_a_restore_on_the_node_skip_the_store")
    else {
        return;
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    let data = pseudo_random(5 << 20, 17);
    let img = image(tmp.path(), &data);
    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 64 << 20).unwrap());
    let store = cached_store(&s3, &cache);
    let m = store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let n = m.files[0].chunks.len() as u64;
    assert_eq!(cache.stats().entries, n);
    delete_chunks(&s3, &key, &m).await;
    let out = tmp.path().join("out");
    assert!(restore(&store, &key, &m, &out).await.unwrap() == data);
    assert_eq!(cache.stats().hits, n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_prefetch_fills_the_cache_and_a_later_heartbeat_adds_only_its_new_chunks() {
    let name = "s3_prefetch_fills_the_cache_and_a_later_heartbeat_adds_only_its_new_chunks";
    let Some((s3, key, tmp, mut data, m1)) = one_checkpoint(name, 8 << 20, 18).await else {
        return;
    };
    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 64 << 20).unwrap());
    let store = cached_store(&s3, &cache);
    let r1 = store.prefetch(&m1.reference()).await.unwrap();
    assert_eq!(
        (r1.chunks, r1.cached_already),
        (m1.stats.chunks, 0),
        "{r1:?}"
    );
    assert_eq!(r1.fetched, r1.chunks, "{r1:?}");
    assert_eq!(r1.fetched_bytes, m1.stats.written_bytes, "{r1:?}");

    // The next heartbeat: a contiguous 1 MiB rewritten in the middle.
    data[4 << 20..5 << 20].copy_from_slice(&pseudo_random(1 << 20, 19));
    let img = image(tmp.path(), &data);
    let m2 = s3
        .store
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let r2 = store.prefetch(&m2.reference()).await.unwrap();
    assert_eq!(r2.fetched, m2.stats.new_chunks, "{r2:?} {:?}", m2.stats);
    assert!(r2.fetched < r2.chunks / 2, "{r2:?}");

    // Served by the cache alone.
    delete_chunks(&s3, &key, &m2).await;
    let out = tmp.path().join("out");
    assert!(restore(&store, &key, &m2, &out).await.unwrap() == data);
    assert_eq!(store.prefetch(&m2.reference()).await.unwrap().fetched, 0);
    // Without a cache there is nothing to fill.
    assert!(s3.store.prefetch(&m2.reference()).await.is_err());
}
