//! The store at cluster scale: many checkpoints in one S3 bucket (a real S3 server, s3s-fs).
//!
//! ```text
//! cargo run --release -p stasis-store --example store_scale -- \
//!     [--checkpoints 100000] [--workloads 10000] [--keep-last 5] [--concurrency 32]
//! ```
//!
//! Writes `--checkpoints` small checkpoints spread over `--workloads` workloads (10,000 pods
//! with ten checkpoints each, by default) through `Store::put_checkpoint`, then times what the
//! control plane and a restore do with them: `list` of everything (`stasis list`), `list` of one
//! workload and `read_latest_valid` (a restore's manifest lookup), and `gc --keep-last`. Each
//! is compared in the same run with the floor a user would otherwise have: a bare S3 listing
//! of the same prefix (`ListObjectsV2`, what `aws s3 ls --recursive` does) and a bare GET of the
//! newest manifest. Prints times, objects per second and the ratios.
//!
//! Needs s3s-fs (`scripts/build-platform s3s-fs`; `$STASIS_S3S_FS` overrides).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use stasis_core::{CheckpointId, WorkloadName};
use stasis_store::{Key, NoProgress};

#[path = "../tests/common/mod.rs"]
mod s3;

struct Args {
    checkpoints: u64,
    workloads: u64,
    keep_last: usize,
    concurrency: usize,
}

fn args() -> Args {
    let mut a = Args {
        checkpoints: 100_000,
        workloads: 10_000,
        keep_last: 5,
        concurrency: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--checkpoints" => a.checkpoints = v.parse().expect("--checkpoints"),
            "--workloads" => a.workloads = v.parse().expect("--workloads"),
            "--keep-last" => a.keep_last = v.parse().expect("--keep-last"),
            "--concurrency" => a.concurrency = v.parse().expect("--concurrency"),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn workload(i: u64) -> String {
    format!("ns-{}.deploy-w{i:05}", i % 100)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let Some(s3) = s3::S3::start("store_scale") else {
        std::process::exit(2);
    };
    let key = Key::random();
    let tmp = tempfile::tempdir().unwrap();
    // One small image for every checkpoint: its chunk is stored once and then deduplicated,
    // as the unchanged part of a workload's state is between heartbeats.
    let img = s3::image(tmp.path(), &s3::pseudo_random(64 << 10, 1));
    let store = Arc::new(s3.store_with(Default::default()));

    println!(
        "store_scale: {} checkpoints of {} workloads in s3s-fs, {} puts at a time",
        a.checkpoints, a.workloads, a.concurrency
    );
    let t = Instant::now();
    let base = 1_795_000_000_000u64;
    let done = futures::stream::iter(0..a.checkpoints)
        .map(|i| {
            let (store, key, img) = (store.clone(), key.clone(), img.clone());
            async move {
                let w = workload(i % a.workloads);
                // Ids strictly increase within a workload: its n-th checkpoint is n s later.
                let id = CheckpointId::from_parts(base + (i / a.workloads) * 1000, i as u32);
                store
                    .put_checkpoint(&key, s3::draft_with_id(&w, id), &img, &NoProgress)
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(a.concurrency)
        .try_fold(0u64, |n, ()| async move {
            if (n + 1) % 10_000 == 0 {
                eprintln!("  {} written", n + 1);
            }
            Ok(n + 1)
        })
        .await
        .expect("put");
    let put = t.elapsed();
    println!(
        "populate: {done} checkpoints in {} ({:.0} puts/s)",
        secs(put),
        done as f64 / put.as_secs_f64()
    );

    let raw: Arc<dyn ObjectStore> = s3.raw.clone();
    let bare_list = |prefix: String| {
        let raw = raw.clone();
        async move {
            let t = Instant::now();
            let n = raw
                .list(Some(&ObjPath::from(prefix)))
                .try_fold(0u64, |n, _| async move { Ok(n + 1) })
                .await
                .unwrap();
            (n, t.elapsed())
        }
    };

    let mut rows: Vec<(String, Duration, Duration, String)> = Vec::new();
    let (n_raw, t_raw) = bare_list("manifests".into()).await;
    let t = Instant::now();
    let all = store.list(None).await.unwrap();
    let t_list = t.elapsed();
    assert_eq!(all.len() as u64, n_raw);
    rows.push((
        format!("list everything ({} checkpoints)", all.len()),
        t_list,
        t_raw,
        format!(
            "{:.0} checkpoints/s",
            all.len() as f64 / t_list.as_secs_f64()
        ),
    ));

    let w = WorkloadName::new(workload(a.workloads / 2)).unwrap();
    let (n_w, t_raw_w) = bare_list(format!("manifests/{w}")).await;
    let t = Instant::now();
    let mine = store.list(Some(&w)).await.unwrap();
    rows.push((
        format!("list one workload ({} checkpoints)", mine.len()),
        t.elapsed(),
        t_raw_w,
        String::new(),
    ));
    assert_eq!(mine.len() as u64, n_w);

    let newest = mine.last().unwrap().clone();
    let p = ObjPath::from(format!("manifests/{w}/{}.json", newest.id.as_str()));
    let t = Instant::now();
    raw.get(&p).await.unwrap().bytes().await.unwrap();
    let t_get = t.elapsed();
    let t = Instant::now();
    let (m, skipped) = store.read_latest_valid(&key, &w).await.unwrap();
    rows.push((
        "a restore's lookup: newest valid manifest of one workload".into(),
        t.elapsed(),
        t_raw_w + t_get,
        format!("{} (skipped {})", m.id.as_str(), skipped.len()),
    ));

    let t = Instant::now();
    let report = store
        .gc(&key, a.keep_last, Duration::from_secs(0))
        .await
        .unwrap();
    let t_gc = t.elapsed();
    let (n_after, t_raw_after) = bare_list("manifests".into()).await;
    rows.push((
        format!("gc --keep-last {}", a.keep_last),
        t_gc,
        t_raw,
        format!(
            "kept {}, deleted {} manifests, {} chunks; {} left",
            report.manifests_kept,
            report.manifests_deleted.len(),
            report.chunks_deleted,
            n_after
        ),
    ));
    let t = Instant::now();
    let after = store.list(None).await.unwrap();
    rows.push((
        format!("list everything after gc ({} checkpoints)", after.len()),
        t.elapsed(),
        t_raw_after,
        String::new(),
    ));

    println!(
        "{:<58} {:>10} {:>14} {:>8}  notes",
        "operation", "stasis", "bare S3 floor", "ratio"
    );
    for (what, t, floor, note) in rows {
        println!(
            "{what:<58} {:>10} {:>14} {:>8.2}  {note}",
            secs(t),
            secs(floor),
            t.as_secs_f64() / floor.as_secs_f64().max(1e-6)
        );
    }
}
