//! Writes the seed corpora of the manifest and chunk_object targets from the real store: a
//! checkpoint of a small image (a compressible file, an incompressible one, an empty one, a
//! nested path) is put into a `file://` store with the fuzz key, and its manifest envelope, the
//! bare manifest and its chunk objects become seeds. Run by `fuzz/run.sh --seeds`; the
//! results are committed, so fuzzing does not depend on running this.

use std::collections::BTreeMap;
use std::path::Path;

use stasis_core::{Manifest, Requirements, Source, StoreStats, Timings, SCHEMA_VERSION};
use stasis_store::{NoProgress, Store};

// The instrumented build needs libFuzzer's coverage callbacks, and the instrumented target
// binaries define this entry point; a no-op here.
libfuzzer_sys::fuzz_target!(|_data: &[u8]| {});

fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn main() {
    let out = std::env::args()
        .nth(1)
        .expect("usage: gen_seeds <fuzz/seeds directory>");
    let out = Path::new(&out);
    let tmp = tempfile::tempdir().expect("tempdir");
    let img = tmp.path().join("img");
    std::fs::create_dir_all(img.join("criu")).expect("mkdir");
    let text: Vec<u8> = (0..700_000u32)
        .flat_map(|i| (i % 251).to_le_bytes())
        .collect();
    std::fs::write(img.join("criu/pages-1.img"), pseudo_random(3_000, 3)).expect("write");
    std::fs::write(img.join("criu/core.img"), &text[..200_000]).expect("write");
    std::fs::write(img.join("rootfs.tar"), b"tiny").expect("write");
    std::fs::write(img.join("empty"), b"").expect("write");

    let (workload, id) = stasis_fuzz::checkpoint();
    let draft = Manifest {
        schema_version: SCHEMA_VERSION,
        workload: workload.clone(),
        created_at: id.created_rfc3339(),
        id: id.clone(),
        key_id: String::new(),
        source: Source::Container {
            container_id: "c1".into(),
        },
        leave_running: true,
        requirements: Requirements::default(),
        processes: vec![],
        rootfs: None,
        timings: Timings::default(),
        stats: StoreStats::default(),
        files: vec![],
        gpu_processes: 0,
        labels: BTreeMap::from([("stasis.dev/lineage".into(), "ns/app".into())]),
    };
    let root = tmp.path().join("store");
    let store = Store::open(root.to_str().expect("utf-8 path")).expect("store");
    let key = stasis_fuzz::key();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let m = rt
        .block_on(store.put_checkpoint(&key, draft, &img, &NoProgress))
        .expect("put");

    let seeds = out.join("manifest");
    std::fs::create_dir_all(&seeds).expect("mkdir");
    let envelope = std::fs::read(root.join(format!("manifests/{workload}/{id}.json")))
        .expect("manifest object");
    std::fs::write(seeds.join("envelope.json"), &envelope).expect("write");
    std::fs::write(
        seeds.join("manifest.json"),
        serde_json::to_vec(&m).expect("json"),
    )
    .expect("write");

    let seeds = out.join("chunk_object");
    std::fs::create_dir_all(&seeds).expect("mkdir");
    for f in &m.files {
        // the first chunk of each file: raw (random), zstd (text) and a tiny one
        let Some(c) = f.chunks.first() else { continue };
        let obj = std::fs::read(root.join(format!("chunks/{}/{}/{}", key.id(), &c.id[..2], c.id)))
            .expect("chunk object");
        let mut seed = hex_decode(&c.id);
        seed.extend_from_slice(&c.len.to_le_bytes());
        seed.extend_from_slice(&obj);
        std::fs::write(
            seeds.join(format!("{}.bin", f.path.replace('/', "_"))),
            seed,
        )
        .expect("write");
    }
    println!("seeds written to {}", out.display());
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}
