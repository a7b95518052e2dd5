//! Where the store's time goes for one large image, against what the S3 server takes from a
//! plain parallel client (bench/large.sh runs it on the CRIU images of a bare `runc checkpoint`).
//!
//! ```text
//! AWS_ENDPOINT_URL=… AWS_ACCESS_KEY_ID=… AWS_SECRET_ACCESS_KEY=… AWS_REGION=… \
//! cargo run --release -p stasis-store --example large_profile -- \
//!     --image-dir /dev/shm/img --store s3://bench/profile --restore-dir /dev/shm/restore \
//!     [--concurrency 12] [--cache-dir /var/tmp/cache]
//! ```
//!
//! 1. stages: chunking, hashing, encoding, decoding, one core, over the image files;
//! 2. plain PUT: the image files cut in 1 MiB objects, `--concurrency` PUTs in flight (no
//!    chunking, no encryption: what the server takes);
//! 3. stasis put (`Store::put_checkpoint`) of the same files;
//! 4. plain GET: every chunk object stasis wrote, `--concurrency` GETs in flight, bodies
//!    dropped (what the server gives);
//! 5. stasis get (`Store::get_checkpoint`) into `--restore-dir`, checked against the images;
//! 6. with `--cache-dir`: a get that fills a node chunk cache, then one served by it.
//!
//! Prints one JSON object (seconds and GB/s, 1 GB = 10^9 bytes).

#[path = "common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use stasis_store::{ChunkCache, Key, NoProgress, Store, StoreOptions};

struct Args {
    image_dir: PathBuf,
    store: String,
    restore_dir: PathBuf,
    concurrency: usize,
    cache_dir: Option<PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        image_dir: PathBuf::new(),
        store: String::new(),
        restore_dir: PathBuf::new(),
        concurrency: StoreOptions::default().concurrency,
        cache_dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--image-dir" => a.image_dir = v.into(),
            "--store" => a.store = v,
            "--restore-dir" => a.restore_dir = v.into(),
            "--concurrency" => a.concurrency = v.parse().expect("--concurrency"),
            "--cache-dir" => a.cache_dir = Some(v.into()),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        !a.store.is_empty() && !a.image_dir.as_os_str().is_empty(),
        "--image-dir and --store are required"
    );
    a
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("image dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// CPU seconds (user + system) this process has used, from /proc/self/stat.
fn cpu_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let f: Vec<f64> = s
        .rsplit_once(')')
        .map(|x| x.1)
        .unwrap_or("")
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // after the command: state(0) ... utime(11) stime(12), in clock ticks (100 per second)
    f.get(11)
        .zip(f.get(12))
        .map_or(0.0, |(u, s)| (u + s) / 100.0)
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    (bytes as f64 / secs / 1e9 * 100.0).round() / 100.0
}

/// The bucket under the store's URL, as a plain client sees it.
fn bucket(url: &str) -> Arc<dyn ObjectStore> {
    let u = url::Url::parse(url).expect("store url");
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(u.host_str().expect("bucket"))
        .with_allow_http(true)
        .build()
        .expect("s3 client");
    let prefix = u.path().trim_matches('/');
    Arc::new(object_store::prefix::PrefixStore::new(s3, prefix))
}

fn same_files(a: &Path, b: &Path) -> bool {
    files(a).iter().all(|f| {
        let other = b.join(f.file_name().expect("name"));
        std::process::Command::new("cmp")
            .arg("-s")
            .arg(f)
            .arg(&other)
            .status()
            .is_ok_and(|s| s.success())
    })
}

fn main() {
    let a = args();
    let paths = files(&a.image_dir);
    let total: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    let key = Key::random();
    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let st = stasis_store::profile::stages(&key, &refs, true).expect("stages");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let raw = bucket(&a.store);
    let c = a.concurrency;

    // Plain PUT of 1 MiB pieces.
    let pieces: Vec<(PathBuf, u64)> = paths
        .iter()
        .flat_map(|p| {
            let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            (0..len.div_ceil(1 << 20)).map(move |i| (p.clone(), i << 20))
        })
        .collect();
    let t = Instant::now();
    rt.block_on(
        futures::stream::iter(pieces.into_iter().enumerate())
            .map(|(i, (p, off))| {
                let raw = raw.clone();
                async move {
                    let body = tokio::task::spawn_blocking(move || {
                        use std::os::unix::fs::FileExt;
                        let f = std::fs::File::open(&p).unwrap();
                        let n = (f.metadata().unwrap().len() - off).min(1 << 20) as usize;
                        let mut b = vec![0u8; n];
                        f.read_exact_at(&mut b, off).unwrap();
                        b
                    })
                    .await
                    .unwrap();
                    raw.put(&ObjPath::from(format!("plain/{i}")), PutPayload::from(body))
                        .await
                        .map(drop)
                }
            })
            .buffer_unordered(c)
            .try_collect::<Vec<_>>(),
    )
    .expect("plain put");
    let plain_put = t.elapsed().as_secs_f64();

    let opts = StoreOptions {
        concurrency: c,
        ..StoreOptions::default()
    };
    let store = Store::open_with(&a.store, opts.clone()).expect("store");
    let t = Instant::now();
    let m = rt
        .block_on(store.put_checkpoint(&key, common::draft(), &a.image_dir, &NoProgress))
        .expect("stasis put");
    let put = t.elapsed().as_secs_f64();

    // Plain GET of every chunk object stasis wrote.
    let prefix = ObjPath::from(format!("chunks/{}", key.id()));
    let objects: Vec<ObjPath> = rt
        .block_on(raw.list(Some(&prefix)).map_ok(|m| m.location).try_collect())
        .expect("list");
    let (t, cpu) = (Instant::now(), cpu_secs());
    let got: u64 = rt
        .block_on(
            futures::stream::iter(objects)
                .map(|p| {
                    let raw = raw.clone();
                    async move {
                        let mut body = raw.get(&p).await?.into_stream();
                        let mut n = 0u64;
                        while let Some(part) = body.next().await {
                            n += part?.len() as u64;
                        }
                        Ok::<_, object_store::Error>(n)
                    }
                })
                .buffer_unordered(c)
                .try_fold(0u64, |acc, n| async move { Ok(acc + n) }),
        )
        .expect("plain get");
    let plain_get = t.elapsed().as_secs_f64();
    let plain_get_cpu = cpu_secs() - cpu;

    let get_into = |store: &Store, dir: &Path| -> f64 {
        let _ = std::fs::remove_dir_all(dir);
        let t = Instant::now();
        rt.block_on(store.get_checkpoint(&key, &m.reference(), dir, &NoProgress))
            .expect("stasis get");
        let s = t.elapsed().as_secs_f64();
        assert!(same_files(&a.image_dir, dir), "restored files differ");
        let _ = std::fs::remove_dir_all(dir);
        s
    };
    let cpu = cpu_secs();
    let get = get_into(&store, &a.restore_dir);
    let get_cpu = cpu_secs() - cpu;

    let mut cached = serde_json::Value::Null;
    if let Some(dir) = &a.cache_dir {
        let _ = std::fs::remove_dir_all(dir);
        let cache = Arc::new(ChunkCache::open(dir, total * 2).expect("cache"));
        let cstore = Store::open_with(&a.store, opts)
            .expect("store")
            .with_cache(cache.clone());
        let fill = get_into(&cstore, &a.restore_dir);
        let hit = get_into(&cstore, &a.restore_dir);
        let s = cache.stats();
        cached = serde_json::json!({
            "get_filling_s": fill, "get_filling_gbs": gbs(total, fill),
            "get_from_cache_s": hit, "get_from_cache_gbs": gbs(total, hit),
            "hits": s.hits, "misses": s.misses, "bytes": s.bytes,
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    let rate = |s: f64| gbs(st.bytes, s);
    let out = serde_json::json!({
        "bytes": total,
        "chunks": st.chunks,
        "concurrency": c,
        "one_core_gbs": {
            "chunk": rate(st.chunk_s), "hash": rate(st.hash_s),
            "encode": rate(st.encode_s), "decode": rate(st.decode_s),
        },
        "plain_put_s": plain_put, "plain_put_gbs": gbs(total, plain_put),
        "stasis_put_s": put, "stasis_put_gbs": gbs(total, put),
        "plain_get_s": plain_get, "plain_get_gbs": gbs(got, plain_get), "plain_get_bytes": got,
        "stasis_get_s": get, "stasis_get_gbs": gbs(total, get),
        "get_vs_plain_get": (plain_get / get * 100.0).round() / 100.0,
        "cpu_s_per_gb": {
            "plain_get": plain_get_cpu / (got as f64 / 1e9),
            "stasis_get": get_cpu / (total as f64 / 1e9),
        },
        "cache": cached,
    });
    println!("{out}");
}
