//! A restore on a node whose disk is full, with real runc and CRIU: the agent's restore
//! directory and its chunk cache share a small tmpfs (the node's stasis disk), a ballast file
//! takes all but a little of it, and preparing the replacement's restore
//!
//! - succeeds when the chunk cache can give the room back: the cache yields its oldest chunks,
//!   the restore is staged and `stasis-runc create` + `start` restore the counter, which
//!   continues its count with its state intact;
//! - fails before anything is staged when even the emptied cache leaves too little, with an
//!   error naming the sizes (the replacement then starts cold with that reason), never with a
//!   `No space left on device` halfway through.
//!
//! Needs root (it mounts the tmpfs), CRIU >= 4.2, runc, the counter image
//! (`scripts/build-counter-image`) and `stasis-runc` (`cargo build -p stasis-runtime`); run
//! under `tini -s`. Without them the test prints why it did not run (and fails under `CI`).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use stasis_agent::executor::Executor;
use stasis_store::{ChunkCache, Key, Store};

use common::*;

const DISK_MB: u64 = 128;

/// A tmpfs of `DISK_MB` at `dir`, unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: PathBuf) -> SmallDisk {
        std::fs::create_dir_all(&dir).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={DISK_MB}m"), "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "mount a tmpfs at {}", dir.display());
        SmallDisk(dir)
    }

    fn available(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.0).unwrap();
        st.blocks_available() as u64 * st.fragment_size() as u64
    }

    /// Fills the disk with a ballast file until `left` bytes are available.
    fn fill_until(&self, name: &str, left: u64) {
        let f = std::fs::File::create(self.0.join(name)).unwrap();
        let size = self.available().saturating_sub(left);
        nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            nix::fcntl::FallocateFlags::empty(),
            0,
            size as i64,
        )
        .unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A counter of pod `uid-source` run with `env`, checkpointed (stopped) by `exec` and removed:
/// the checkpoint and its last count.
fn counter_checkpointed(
    w: &mut World,
    exec: &Executor,
    env: &[&str],
) -> (stasis_agent::executor::CheckpointOutcome, u64) {
    let b1 = pod_bundle(w, "b1", env, "uid-source", "counter-a");
    let lines = w.run_piped(&b1, "c1");
    wait_counts(&lines, 5);
    let out = checkpoint_stopped(exec, "c1", "counter-a", "uid-source");
    w.runc().delete_force("c1").unwrap();
    (out, last_count(&lines).unwrap())
}

#[test]
fn a_full_disk_is_made_room_on_by_the_chunk_cache_or_refused_with_the_sizes() {
    if !ready("a_full_disk_is_made_room_on_by_the_chunk_cache_or_refused_with_the_sizes") {
        return;
    }
    let mut w = World::new("room");
    let disk = SmallDisk::mount(w.path("disk"));
    let rt = runtime();
    let store = Store::open(&format!("file://{}", w.path("store").display())).unwrap();
    let cache = Arc::new(ChunkCache::open(&disk.0.join("cache"), 64 << 20).unwrap());
    store.set_cache(cache.clone());
    let exec = executor_with_images(&w, &rt, store, Key::random(), disk.0.join("images"));
    let env = ["STATE_MB=24", "INTERVAL_MS=100"];

    // A counter checkpointed (stopped): its chunks go into the cache as they upload.
    let (out, before) = counter_checkpointed(&mut w, &exec, &env);
    let cached = cache.stats().bytes;
    let logical = out.logical_bytes;
    eprintln!(
        "checkpoint {} ({logical} bytes), {cached} bytes cached",
        out.reference
    );
    assert!(
        cached > 16 << 20,
        "the checkpoint's chunks were cached: {cached}"
    );

    // The disk full but for 20 MiB: less than the restore needs (its files and a 16 MiB
    // margin), more than it needs once the cache has given its chunks back.
    disk.fill_until("ballast-1", 20 << 20);
    let b2 = pod_bundle(&w, "b2", &env, "uid-full-1", "counter-b");
    exec.prepare(&prepare_job(&out.reference, "uid-full-1", &b2))
        .expect("prepare on a full disk with a cache to give room back");
    let stats = cache.stats();
    eprintln!(
        "prepared with {} bytes free after the cache evicted {} entries ({} bytes left cached)",
        disk.available(),
        stats.evicted,
        stats.bytes
    );
    assert!(
        stats.evicted > 0 && stats.bytes < cached,
        "the cache gave room back"
    );
    // ... and did not take it again with the chunks the restore fetched (it keeps
    // KEEP_FREE_BYTES free on its filesystem): before, the restore then failed now and then
    // writing its last files, "No space left on device".
    assert!(
        stats.skipped_full > 0,
        "the cache stored the restore's chunks on a full disk: {stats:?}"
    );
    let rx = wrapper_create_start(&mut w, &b2, "c2");
    let first = first_count(&rx);
    assert!(
        first > before && first <= before + 2,
        "first={first}, before={before}"
    );
    assert_full_check(&w, "c2");
    w.runc().delete_force("c2").unwrap();

    // Now nothing left to give: the cache emptied, the disk full but for 8 MiB.
    cache.yield_space(u64::MAX);
    disk.fill_until("ballast-2", 8 << 20);
    let b3 = pod_bundle(&w, "b3", &env, "uid-full-2", "counter-c");
    let Err(err) = exec.prepare(&prepare_job(&out.reference, "uid-full-2", &b3)) else {
        panic!("a restore with no room is refused");
    };
    let msg = err.to_string();
    eprintln!("refused: {msg}");
    assert!(
        msg.contains("no room on the node's disk") && msg.contains("bytes needed"),
        "{msg}"
    );
    assert!(
        !disk.0.join("images/uid-full-2").exists()
            || std::fs::read_dir(disk.0.join("images/uid-full-2"))
                .unwrap()
                .next()
                .is_none(),
        "nothing staged"
    );
}

/// Soak finding: the disk filled after the room check, while the restore ran. A lazy restore's
/// files are staged and allocated whole before its plan is written; what is written after (the
/// daemon's socket and log, the restore's log, the note naming the container to the agent) is
/// on the run directory, so a disk with no byte left still restores, and the pages still
/// arrive (into the allocated page images).
#[test]
fn a_disk_filled_after_a_lazy_staging_does_not_stop_the_restore() {
    if !ready("a_disk_filled_after_a_lazy_staging_does_not_stop_the_restore") {
        return;
    }
    let mut w = World::new("room-lazy");
    let disk = SmallDisk::mount(w.path("disk"));
    let rt = runtime();
    let store = Store::open(&format!("file://{}", w.path("store").display())).unwrap();
    let exec = executor_with_images(&w, &rt, store, Key::random(), disk.0.join("images"));
    exec.set_lazy_restore(stasis_agent::executor::LazyRestore::Auto);
    let env = ["STATE_MB=48", "INTERVAL_MS=100"];

    let (out, before) = counter_checkpointed(&mut w, &exec, &env);

    let b2 = pod_bundle(&w, "b2", &env, "uid-lazy-full", "counter-b");
    let prepared = exec
        .prepare(&prepare_job(&out.reference, "uid-lazy-full", &b2))
        .expect("prepare");
    let plan = stasis_node_api::planfile::read(&prepared.plan_path)
        .unwrap()
        .unwrap()
        .plan;
    assert!(plan.lazy, "the restore is not lazy: {plan:?}");
    // Not a byte left on the node's disk.
    disk.fill_until("ballast", 0);
    eprintln!("disk full: {} bytes available", disk.available());
    assert!(disk.available() < 64 << 10);

    let rx = wrapper_create_start(&mut w, &b2, "c2");
    let first = first_count(&rx);
    assert!(
        first > before && first <= before + 2,
        "first={first}, before={before}; log: {}",
        std::fs::read_to_string(w.path("log.json")).unwrap_or_default()
    );
    wait_for("residency on a full disk", 120, || {
        exec.metrics
            .render()
            .contains("stasis_agent_restores_total{result=\"lazy_resident\"} 1")
    });
    assert_full_check(&w, "c2");
}
