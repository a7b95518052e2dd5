//! The keyless prefetch on a real `file://` store: a node with no key fills its chunk cache
//! from a checkpoint's unauthenticated chunk list, and a restore with the key then reads every
//! chunk there; what a forged manifest can make it fetch is bounded (the cache's bound, the
//! manifest object's size, chunk ids that are ids), and a refused one fetches nothing.
#[path = "common/draft.rs"]
mod draft;
#[path = "common/local.rs"]
mod local;

use std::path::Path;
use std::sync::Arc;

use local::*;
use serde_json::Value;
use stasis_core::Manifest;
use stasis_store::{ChunkCache, Key, NoProgress, Store, StoreError};

/// A checkpoint of `mib` MiB of incompressible data in a local store under `tmp`.
async fn checkpoint(tmp: &Path, key: &Key, mib: usize, seed: u64) -> (Store, Manifest) {
    let store = Store::open(tmp.join("store").to_str().unwrap()).unwrap();
    let files = vec![("pages.img", pseudo_random(mib << 20, seed), 0o600)];
    let img = image(tmp, &format!("img-{seed}"), &files);
    let m = store
        .put_checkpoint(key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    (store, m)
}

/// A store on the same directory with a fresh cache of `max_bytes`, and the cache: a node
/// other than the one that checkpointed, holding no key.
fn node(tmp: &Path, max_bytes: u64) -> (Store, Arc<ChunkCache>) {
    let cache = Arc::new(ChunkCache::open(&tmp.join("cache"), max_bytes).unwrap());
    let store = Store::open(tmp.join("store").to_str().unwrap())
        .unwrap()
        .with_cache(cache.clone());
    (store, cache)
}

fn manifest_file(tmp: &Path, m: &Manifest) -> std::path::PathBuf {
    tmp.join("store/manifests/w").join(format!("{}.json", m.id))
}

/// Edits the stored manifest envelope as a writer to the bucket without the key would.
fn forge(tmp: &Path, m: &Manifest, edit: impl FnOnce(&mut Value)) {
    let p = manifest_file(tmp, m);
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_key_prefetches_and_the_restore_reads_its_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let key = Key::random();
    let (_, m) = checkpoint(tmp.path(), &key, 6, 1).await;
    let (store, cache) = node(tmp.path(), 64 << 20);
    let r = store.prefetch(&m.reference()).await.unwrap();
    assert_eq!((r.chunks, r.cached_already), (m.stats.chunks, 0), "{r:?}");
    assert_eq!(r.fetched, r.chunks);
    assert_eq!(r.fetched_bytes, m.stats.written_bytes);
    assert_eq!(cache.stats().entries, m.stats.chunks);

    // The bucket loses every chunk: the restore (with the key) is served by the cache alone.
    for id in m.chunk_ids() {
        std::fs::remove_file(chunk_object(&tmp.path().join("store"), &key, id)).unwrap();
    }
    let out = tmp.path().join("out");
    store
        .get_checkpoint(&key, &m.reference(), &out, &NoProgress)
        .await
        .unwrap();
    assert!(std::fs::read(out.join("pages.img")).unwrap() == pseudo_random(6 << 20, 1));
    assert_eq!(cache.stats().hits, m.stats.chunks);
    assert_eq!(
        store.prefetch(&m.reference()).await.unwrap().cached_already,
        m.stats.chunks
    );
}

/// The cache's bound: a checkpoint whose chunk objects could exceed it is refused before
/// anything is fetched, whatever its manifest's totals claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_larger_than_the_cache_is_not_fetched() {
    let tmp = tempfile::tempdir().unwrap();
    let key = Key::random();
    let (_, m) = checkpoint(tmp.path(), &key, 6, 2).await;
    let (store, cache) = node(tmp.path(), 4 << 20);
    let e = store.prefetch(&m.reference()).await.unwrap_err();
    let want = m.logical_bytes() + 31 * m.stats.chunks;
    assert!(
        matches!(e, StoreError::ExceedsCache { bytes, limit, .. } if bytes == want && limit == 4 << 20),
        "{e}"
    );
    assert_eq!(cache.stats().inserted, 0, "nothing fetched");
    assert_eq!(count_files(&tmp.path().join("cache")), 0);
}

/// The manifest object's size cap: a manifest grown past it is refused from its size, before
/// it is read, and nothing is fetched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_manifest_is_refused_before_it_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let key = Key::random();
    let (_, m) = checkpoint(tmp.path(), &key, 1, 3).await;
    let (store, cache) = node(tmp.path(), 64 << 20);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(manifest_file(tmp.path(), &m))
        .unwrap();
    f.set_len(40 << 20).unwrap(); // sparse: costs no disk
    let e = store.prefetch(&m.reference()).await.unwrap_err();
    assert!(
        matches!(e, StoreError::ObjectTooLarge { size, limit, .. } if size == 40 << 20 && limit == stasis_store::envelope::MAX_MANIFEST_OBJECT),
        "{e}"
    );
    assert_eq!(cache.stats().inserted, 0, "nothing fetched");
}

/// A forged chunk list: ids that are not ids are refused (nothing fetched); ids of objects
/// that are not the chunks (here: another checkpoint's) are fetched as stored, within the
/// bounds, and cost only those fetches: the restore with the key refuses the forged manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_chunk_list_costs_only_bounded_fetches() {
    let tmp = tempfile::tempdir().unwrap();
    let key = Key::random();
    let (_, m) = checkpoint(tmp.path(), &key, 2, 4).await;
    let (_, other) = checkpoint(tmp.path(), &key, 2, 5).await;
    let (store, cache) = node(tmp.path(), 64 << 20);

    let id = m.files[0].chunks[0].id.clone();
    forge(tmp.path(), &m, |v| {
        v["manifest"]["files"][0]["chunks"][0]["id"] = Value::from("../../../locks/gc.json");
    });
    let e = store.prefetch(&m.reference()).await.unwrap_err();
    assert!(matches!(e, StoreError::ManifestInvalid { .. }), "{e}");
    assert!(e.to_string().contains("is not 64 lower-case hex"), "{e}");
    assert_eq!(cache.stats().inserted, 0, "nothing fetched");

    // The other checkpoint's chunk list (lengths and totals kept consistent, key id kept).
    forge(tmp.path(), &m, |v| {
        v["manifest"]["files"] = serde_json::to_value(&other.files).unwrap();
        v["manifest"]["stats"] = serde_json::to_value(other.stats).unwrap();
    });
    let r = store.prefetch(&m.reference()).await.unwrap();
    assert_eq!(r.fetched, other.stats.chunks, "{r:?}");
    assert!(!cache.contains(key.id(), &id));
    let e = store
        .get_checkpoint(&key, &m.reference(), &tmp.path().join("out"), &NoProgress)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::ManifestTampered { .. }), "{e}");
}

/// A restore and a prefetch of one checkpoint at once on a node (two stores sharing its cache,
/// as the agent's do), over a store whose every GET takes 200 ms: each chunk is fetched once,
/// the other waits for it and reads the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_and_a_prefetch_at_once_fetch_each_chunk_once() {
    use object_store::throttle::{ThrottleConfig, ThrottledStore};
    use object_store::ObjectStore;
    let tmp = tempfile::tempdir().unwrap();
    let key = Key::random();
    // (in memory: the throttle does not wrap a local file's reads)
    let bucket: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let files = vec![("pages.img", pseudo_random(6 << 20, 6), 0o600)];
    let img = image(tmp.path(), "img", &files);
    let m = Store::from_object_store(bucket.clone(), "mem", Default::default())
        .put_checkpoint(&key, draft("w"), &img, &NoProgress)
        .await
        .unwrap();
    let cache = Arc::new(ChunkCache::open(&tmp.path().join("cache"), 64 << 20).unwrap());
    let slow = || {
        let config = ThrottleConfig {
            wait_get_per_call: std::time::Duration::from_millis(200),
            ..Default::default()
        };
        Store::from_object_store(
            Arc::new(ThrottledStore::new(bucket.clone(), config)),
            "mem",
            Default::default(),
        )
        .with_cache(cache.clone())
    };
    let (restore, prefetch) = (slow(), slow());
    let (out, reference) = (tmp.path().join("out"), m.reference());
    let (got, pre) = tokio::join!(
        restore.get_checkpoint(&key, &reference, &out, &NoProgress),
        prefetch.prefetch(&reference)
    );
    got.unwrap();
    let pre = pre.unwrap();
    assert!(std::fs::read(out.join("pages.img")).unwrap() == files[0].1);
    let s = cache.stats();
    assert_eq!(
        s.inserted, m.stats.chunks,
        "each chunk cached once: {s:?} {pre:?}"
    );
    assert_eq!(pre.fetched + pre.cached_already, m.stats.chunks, "{pre:?}");
}
