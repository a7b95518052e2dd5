//! Store throughput against the shell baseline a user would script.
//!
//! ```text
//! cargo run --release -p stasis-store --example store_throughput -- \
//!     [--size-mib 2048] [--image-dir /dev/shm/stasis-store-bench/img] \
//!     [--store-dir .stasis-work/store-bench] [--restore-dir /dev/shm/stasis-store-bench/restore]
//! ```
//!
//! One incompressible file of `--size-mib` MiB in `--image-dir` (tmpfs: where CRIU dumps). Then,
//! each after `sync`:
//! - baseline checkpoint: `tar -cf - -C <image-dir> . | zstd -1 -q -o <store-dir>/baseline.tar.zst`
//! - stasis checkpoint: `Store::put_checkpoint` into `file://<store-dir>/stasis` (same disk)
//! - baseline restore: `zstd -d -c <store-dir>/baseline.tar.zst | tar -xf - -C <restore-dir>/baseline`
//! - stasis restore: `Store::get_checkpoint` into `<restore-dir>/stasis`
//! - incremental: a contiguous 5% of the file rewritten, `put_checkpoint` again.
//!
//! Prints times, MB/s, the ratios stasis/baseline (≤ 1.0 means stasis is no slower), the bytes
//! the second checkpoint wrote relative to the first, and the peak RSS of this process during
//! each stasis phase (reset through `/proc/self/clear_refs` before each).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[path = "common/mod.rs"]
mod common;
use common::draft;
use stasis_store::{Key, NoProgress, Store};

struct Args {
    size_mib: u64,
    image_dir: PathBuf,
    store_dir: PathBuf,
    restore_dir: PathBuf,
}

fn args() -> Args {
    let mut a = Args {
        size_mib: 2048,
        image_dir: "/dev/shm/stasis-store-bench/img".into(),
        store_dir: ".stasis-work/store-bench".into(),
        restore_dir: "/dev/shm/stasis-store-bench/restore".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--size-mib" => a.size_mib = v.parse().expect("--size-mib"),
            "--image-dir" => a.image_dir = v.into(),
            "--store-dir" => a.store_dir = v.into(),
            "--restore-dir" => a.restore_dir = v.into(),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn sh(cmd: &str) {
    if std::env::var_os("STASIS_BENCH_NO_BASELINE").is_some() && !cmd.starts_with("sync") {
        return;
    }
    let st = Command::new("sh").arg("-c").arg(cmd).status().expect("sh");
    assert!(st.success(), "command failed: {cmd}");
}

fn sync() {
    sh("sync");
}

/// (own user+sys, waited-for children's user+sys) CPU seconds, from /proc/self/stat.
fn cpu_secs() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // fields after the command: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
    let tick = 100.0;
    if f.len() < 15 {
        return (0.0, 0.0);
    }
    ((f[11] + f[12]) / tick, (f[13] + f[14]) / tick)
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

/// Writes `size` pseudo-random (incompressible) bytes in 1 MiB pieces, never holding more.
fn fill_random(path: &Path, size: u64, seed: u64, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .expect("open image file");
    let mut x = seed | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < size {
        for w in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let n = (size - done).min(buf.len() as u64) as usize;
        f.write_all_at(&buf[..n], offset + done)
            .expect("write image");
        done += n as u64;
    }
}

fn main() {
    let a = args();
    let size = a.size_mib << 20;
    let mb = size as f64 / 1e6;
    std::fs::create_dir_all(&a.image_dir).unwrap();
    let img = a.image_dir.join("pages-1.img");
    if std::fs::metadata(&img).map(|m| m.len()).unwrap_or(0) != size {
        eprintln!(
            "writing {} MiB of random data to {}",
            a.size_mib,
            img.display()
        );
        let _ = std::fs::remove_file(&img);
        fill_random(&img, size, 0x5eed, 0);
    }
    let _ = std::fs::remove_dir_all(&a.store_dir);
    let _ = std::fs::remove_dir_all(&a.restore_dir);
    std::fs::create_dir_all(&a.store_dir).unwrap();
    std::fs::create_dir_all(a.restore_dir.join("baseline")).unwrap();
    let store_dir = std::fs::canonicalize(&a.store_dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = Store::open(store_dir.join("stasis").to_str().unwrap()).unwrap();
    let key = Key::random();

    // checkpoint
    sync();
    let c0 = cpu_secs();
    let t = Instant::now();
    sh(&format!(
        "tar -cf - -C '{}' . | zstd -1 -q -f -o '{}/baseline.tar.zst'",
        a.image_dir.display(),
        store_dir.display()
    ));
    let base_put = t.elapsed().as_secs_f64();
    let base_put_cpu = cpu_secs().1 - c0.1;
    sync();
    reset_peak_rss();
    let c0 = cpu_secs();
    let t = Instant::now();
    let m1 = rt
        .block_on(store.put_checkpoint(&key, draft(), &a.image_dir, &NoProgress))
        .expect("put");
    let put = t.elapsed().as_secs_f64();
    let put_cpu = cpu_secs().0 - c0.0;
    if std::env::var_os("STASIS_BENCH_PUT_ONLY").is_some() {
        println!("put {put:.2} s, cpu {put_cpu:.2} s, baseline {base_put:.2} s");
        return;
    }
    let put_rss = peak_rss_mib();

    // restore
    sync();
    let c0 = cpu_secs();
    let t = Instant::now();
    sh(&format!(
        "zstd -d -q -c '{}/baseline.tar.zst' | tar -xf - -C '{}'",
        store_dir.display(),
        a.restore_dir.join("baseline").display()
    ));
    let base_get = t.elapsed().as_secs_f64();
    let base_get_cpu = cpu_secs().1 - c0.1;
    let _ = std::fs::remove_dir_all(a.restore_dir.join("baseline"));
    sync();
    reset_peak_rss();
    let c0 = cpu_secs();
    let t = Instant::now();
    rt.block_on(store.get_checkpoint(
        &key,
        &m1.reference(),
        &a.restore_dir.join("stasis"),
        &NoProgress,
    ))
    .expect("get");
    let get = t.elapsed().as_secs_f64();
    let get_cpu = cpu_secs().0 - c0.0;
    let get_rss = peak_rss_mib();
    let same = Command::new("cmp")
        .arg("-s")
        .arg(&img)
        .arg(a.restore_dir.join("stasis/pages-1.img"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(same, "restored image differs from the original");
    let _ = std::fs::remove_dir_all(&a.restore_dir);

    // incremental: a contiguous 5% rewritten (new content every run)
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    fill_random(&img, size / 20, seed, size / 3);
    sync();
    let t = Instant::now();
    let m2 = rt
        .block_on(store.put_checkpoint(&key, draft(), &a.image_dir, &NoProgress))
        .expect("second put");
    let put2 = t.elapsed().as_secs_f64();
    let incr = m2.stats.written_bytes as f64 / m1.stats.written_bytes as f64;

    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "image: {} MiB incompressible, {} chunks",
        a.size_mib, m1.stats.chunks
    );
    let _ = writeln!(
        out,
        "checkpoint  baseline tar|zstd -1: {base_put:6.2} s {:7.0} MB/s   stasis put: {put:6.2} s {:7.0} MB/s   ratio {:.2}   peak RSS {put_rss:.0} MiB   cpu s: baseline {base_put_cpu:.2} stasis {put_cpu:.2}",
        mb / base_put,
        mb / put,
        put / base_put
    );
    let _ = writeln!(
        out,
        "restore     baseline zstd -d|tar -x: {base_get:5.2} s {:7.0} MB/s   stasis get: {get:6.2} s {:7.0} MB/s   ratio {:.2}   peak RSS {get_rss:.0} MiB   cpu s: baseline {base_get_cpu:.2} stasis {get_cpu:.2}",
        mb / base_get,
        mb / get,
        get / base_get
    );
    let _ = writeln!(
        out,
        "incremental 5% contiguous change: second put {put2:.2} s, wrote {} of {} bytes = {:.1}% of the first checkpoint ({} new chunks of {})",
        m2.stats.written_bytes,
        m1.stats.written_bytes,
        incr * 100.0,
        m2.stats.new_chunks,
        m2.stats.chunks
    );
    let _ = writeln!(
        out,
        "{}",
        serde_json::json!({
            "size_mib": a.size_mib,
            "baseline_put_s": base_put, "put_s": put, "baseline_put_cpu_s": base_put_cpu, "put_cpu_s": put_cpu, "baseline_get_cpu_s": base_get_cpu, "get_cpu_s": get_cpu, "put_ratio": put / base_put, "put_peak_rss_mib": put_rss,
            "baseline_get_s": base_get, "get_s": get, "get_ratio": get / base_get, "get_peak_rss_mib": get_rss,
            "incremental_written_ratio": incr, "second_put_s": put2,
        })
    );
    let _ = std::fs::remove_dir_all(&a.store_dir);
}
