//! Integration tests with real runc and CRIU: every container of a pod checkpointed at one
//! instant (`checkpoint::checkpoint_pod`), and a failure in the middle of the capture leaving
//! every container running. Needs root, CRIU >= 4.2, runc and the counter image
//! (`scripts/setup`, `scripts/build-counter-image`); run under `tini -s --` (PID 1 here does not
//! reap). Without them each test prints why it did not run, and fails instead under `CI`.
//!
//! How "one instant" is shown: each counter prints `count=<n>` every 10 ms, and the test notes
//! when each line arrived. A container restored from the checkpoint continues from the count it
//! was captured at, so its first count `r` says the capture happened after the original printed
//! `r - 1` and before it printed `r`: an interval of the original's timeline. Captured at one
//! instant, the two containers' intervals overlap; captured one after the other (the control:
//! two single-container checkpoints), they do not, since a dump takes longer than a tick.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stasis_engine::checkpoint::{
    checkpoint_container, checkpoint_pod, Captured, ContainerCheckpoint, PodCheckpoint, PodMember,
};
use stasis_engine::image::ImageDir;
use stasis_engine::restore::{restore_container, ContainerRestore};
use stasis_testkit::counter::count_of;
use stasis_testkit::{Requirements, World};

const ENV: &[&str] = &["STATE_MB=8", "INTERVAL_MS=10"];

/// Counts a container printed, with when each arrived.
type Timeline = Arc<Mutex<Vec<(Instant, u64)>>>;

/// `runc run -d` of a counter bundle with its stdout on a pipe, read into a [`Timeline`].
fn run_counter(w: &mut World, name: &str) -> Timeline {
    let b = w.bundle(&format!("b-{name}"), ENV);
    w.track(name);
    let mut child = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["run", "-d", "--bundle"])
        .arg(&b)
        .arg(name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run runc");
    let tl: Timeline = Arc::default();
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t = tl.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(n) = count_of(&l) {
                t.lock().unwrap().push((Instant::now(), n));
            }
        }
    });
    std::thread::spawn(move || for _ in BufReader::new(err).lines().map_while(Result::ok) {});
    assert!(child.wait().unwrap().success(), "runc run {name}");
    tl
}

fn last(tl: &Timeline) -> u64 {
    tl.lock().unwrap().last().map_or(0, |(_, n)| *n)
}

/// Waits until the timeline moves `more` counts past where it is now.
fn advances(tl: &Timeline, more: u64, what: &str) {
    let from = last(tl);
    let until = Instant::now() + Duration::from_secs(20);
    while last(tl) < from + more {
        assert!(
            Instant::now() < until,
            "{what}: the counter stays at {} (from {from})",
            last(tl)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Restores `cap` from `img` into a new container `new_id` and returns the first count it
/// prints (the count it was captured at, plus one).
fn first_restored_count(w: &mut World, img: &ImageDir, cap: &Captured, new_id: &str) -> u64 {
    let b = w.bundle(&format!("b-{new_id}"), ENV);
    let log = w.path(&format!("{new_id}.log"));
    w.track(new_id);
    restore_container(&ContainerRestore {
        runc: &w.runc(),
        new_id,
        bundle: &b,
        image: img,
        rootfs_method: cap.rootfs.as_ref().map(|r| r.method),
        tcp_established: true,
        stdio_log: Some(&log),
        gpu: None,
        lazy_pages: false,
    })
    .unwrap_or_else(|e| panic!("restore {new_id}: {e}"));
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(n) = text.lines().find_map(count_of) {
            return n;
        }
        assert!(Instant::now() < until, "{new_id} prints nothing: {text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// When the original printed `first - 1` and `first`: the capture lies in between.
fn capture_interval(tl: &Timeline, first: u64, what: &str) -> (Instant, Instant) {
    let v = tl.lock().unwrap();
    let at = |n: u64| {
        v.iter()
            .find(|(_, c)| *c == n)
            .map(|(t, _)| *t)
            .unwrap_or_else(|| panic!("{what}: the original never printed count {n}"))
    };
    (at(first - 1), at(first))
}

fn overlap(a: (Instant, Instant), b: (Instant, Instant)) -> bool {
    a.0.max(b.0) < a.1.min(b.1)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Two counters with runc ids `ids` (nothing shared but the test; ids unique across the tests,
/// which run at once: runc names a container's cgroup after its id) counting, and the image
/// dirs of a pod checkpoint of both under `dir` (`a` and `b`).
fn two_counters(
    w: &mut World,
    ids: [&str; 2],
    dir: &str,
) -> (Timeline, Timeline, ImageDir, ImageDir) {
    let [ida, idb] = ids;
    let a = run_counter(w, ida);
    let b = run_counter(w, idb);
    advances(&a, 20, ida);
    advances(&b, 20, idb);
    let ia = ImageDir::new(w.path(&format!("{dir}/a")));
    let ib = ImageDir::new(w.path(&format!("{dir}/b")));
    (a, b, ia, ib)
}

/// [`checkpoint_pod`] of containers `ids`, leave-running.
fn pod_checkpoint(
    w: &World,
    ids: [&str; 2],
    ia: &ImageDir,
    ib: &ImageDir,
) -> Result<Vec<Captured>, stasis_engine::EngineError> {
    checkpoint_pod(&PodCheckpoint {
        runc: &w.runc(),
        members: &[
            PodMember {
                id: ids[0],
                image: ia,
            },
            PodMember {
                id: ids[1],
                image: ib,
            },
        ],
        leave_running: true,
        tcp_established: true,
    })
}

#[test]
fn pod_containers_are_captured_at_one_instant() {
    if !Requirements::containers("pod_containers_are_captured_at_one_instant").met() {
        return;
    }
    let mut w = World::new("pod-instant");
    let (a, b, ia, ib) = two_counters(&mut w, ["a", "b"], "pod");
    // The pod checkpoint: both paused, both captured, both resumed.
    let caps = pod_checkpoint(&w, ["a", "b"], &ia, &ib).expect("pod checkpoint");
    assert_eq!(caps.len(), 2);
    // One freeze window for both.
    assert_eq!(caps[0].timings.frozen_ms, caps[1].timings.frozen_ms);
    advances(&a, 10, "a after the pod checkpoint");
    advances(&b, 10, "b after the pod checkpoint");
    let ra = first_restored_count(&mut w, &ia, &caps[0], "ra");
    let rb = first_restored_count(&mut w, &ib, &caps[1], "rb");
    let (xa, xb) = (capture_interval(&a, ra, "a"), capture_interval(&b, rb, "b"));
    println!(
        "pod checkpoint: frozen {} ms (dumps {} + {} ms); a captured at count {}, b at {}; their capture intervals overlap by {:.1} ms",
        caps[0].timings.frozen_ms,
        caps[0].timings.dump_ms,
        caps[1].timings.dump_ms,
        ra - 1,
        rb - 1,
        ms(xa.1.min(xb.1).saturating_duration_since(xa.0.max(xb.0)))
    );
    assert!(
        overlap(xa, xb),
        "the two containers were not captured at one instant: a between {:?} and {:?} after b's start",
        xa.0.saturating_duration_since(xb.0),
        xa.1.saturating_duration_since(xb.0)
    );
    for id in ["ra", "rb"] {
        assert_eq!(w.runc().state(id).unwrap().status, "running", "{id}");
    }

    // The control: one container after the other. The same measurement tells them apart, so
    // the overlap above is the pod checkpoint's doing, not the measurement's slack.
    let (sa, sb) = (
        ImageDir::new(w.path("seq/a")),
        ImageDir::new(w.path("seq/b")),
    );
    let one = |id: &str, image: &ImageDir| {
        checkpoint_container(&ContainerCheckpoint {
            runc: &w.runc(),
            id,
            image,
            leave_running: true,
            tcp_established: true,
        })
        .expect("single checkpoint")
    };
    let ca = one("a", &sa);
    // A pause shorter than any dump (150+ ms here): a checkpoint of one container after the
    // other can be no closer than that.
    std::thread::sleep(Duration::from_millis(50));
    let cb = one("b", &sb);
    advances(&a, 10, "a after the control");
    advances(&b, 10, "b after the control");
    let sra = first_restored_count(&mut w, &sa, &ca, "sra");
    let srb = first_restored_count(&mut w, &sb, &cb, "srb");
    let (ya, yb) = (
        capture_interval(&a, sra, "a"),
        capture_interval(&b, srb, "b"),
    );
    println!(
        "control, one after the other: a frozen {} ms, b frozen {} ms; b captured {:.1} ms after a was resumed",
        ca.timings.frozen_ms,
        cb.timings.frozen_ms,
        ms(yb.0.saturating_duration_since(ya.1))
    );
    assert!(
        !overlap(ya, yb),
        "two checkpoints one after the other look simultaneous: the measurement cannot tell"
    );
}

/// A read-only bind mount of `dir` onto itself, undone on drop: whatever is written there
/// fails with EROFS, also for root.
struct ReadOnly(PathBuf);

impl ReadOnly {
    fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        for args in [
            vec!["--bind", dir.to_str().unwrap(), dir.to_str().unwrap()],
            vec!["-o", "remount,bind,ro", dir.to_str().unwrap()],
        ] {
            assert!(Command::new("mount")
                .args(&args)
                .status()
                .unwrap()
                .success());
        }
        Self(dir.to_path_buf())
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_failure_mid_capture_leaves_every_container_running() {
    if !Requirements::containers("a_failure_mid_capture_leaves_every_container_running").met() {
        return;
    }
    let mut w = World::new("pod-fail");
    const IDS: [&str; 2] = ["fail-a", "fail-b"];
    let (a, b, ia, ib) = two_counters(&mut w, IDS, "img");
    // a is captured first and fine; b's CRIU images cannot be written, so its capture fails
    // while both are frozen (a already dumped, which leaves it paused).
    let ro = ReadOnly::new(&ib.criu());
    let t = Instant::now();
    let err = pod_checkpoint(&w, IDS, &ia, &ib).expect_err("b's capture cannot succeed");
    drop(ro);
    println!("failed after {:.0} ms: {err}", ms(t.elapsed()));
    assert!(err.to_string().contains("img/b"), "{err}");
    // a was really dumped before b failed (the failure is in the middle of the capture).
    assert!(
        ia.criu().join("inventory.img").is_file(),
        "a was not dumped"
    );
    for (id, tl) in [(IDS[0], &a), (IDS[1], &b)] {
        assert_eq!(w.runc().state(id).unwrap().status, "running", "{id}");
        advances(tl, 10, &format!("{id} after the failed pod checkpoint"));
    }
}
