//! `stasis-gpu-roundtrip`: drives the CUDA checkpoint API on live processes, for
//! `tests/gpu/run.sh` and for debugging on a GPU machine.
//!
//! ```text
//! stasis-gpu-roundtrip --probe [--json]
//! stasis-gpu-roundtrip <PID> [--tree] [--lock-timeout-ms N] [--hold-ms N]
//!     lock → checkpoint (all CUDA processes of the tree with --tree) → hold → restore → unlock,
//!     in place; prints one JSON object with each phase's time and the GPU memory in use before
//!     and while checkpointed.
//! stasis-gpu-roundtrip <PID> --action state|lock|checkpoint|restore|unlock|restore-tid
//!     one call, like NVIDIA's cuda-checkpoint (--lock-timeout-ms applies to lock).
//! stasis-gpu-roundtrip <PID> [--tree] --action suspend|resume
//!     suspend: lock all, then checkpoint all, and leave them CHECKPOINTED (for a CRIU dump
//!     that follows, or to make a live restored process safe to kill: cuda-checkpoint #53);
//!     resume: from whatever state each is in, restore all then unlock all.
//! stasis-gpu-roundtrip --keep-driver
//!     loads the driver (cuInit), prints one JSON line, and holds it until stdin closes or it is
//!     killed: keeps the driver initialised between processes without changing the machine's
//!     settings (no persistence mode), as a restore needs (cuCheckpointProcessRestore: "requires
//!     persistence mode to be enabled or cuInit to have been called").
//! ```
//! Every driver call has a deadline (`STASIS_GPU_CALL_DEADLINE_MS`, default 300 s).
//! Exit status: 0 success, 1 failure (message on stderr), 2 usage, 3 no NVIDIA driver.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stasis_gpu::detect::{process_tree, Procfs};
use stasis_gpu::{probe, suspend_all, CheckpointApi, Driver, GpuError, WithDeadline};

const USAGE: &str = "usage: stasis-gpu-roundtrip --probe [--json]\n       \
    stasis-gpu-roundtrip <PID> [--tree] [--lock-timeout-ms N] [--hold-ms N]\n       \
    stasis-gpu-roundtrip <PID> --action state|lock|checkpoint|restore|unlock|restore-tid \
    [--lock-timeout-ms N]\n       \
    stasis-gpu-roundtrip <PID> [--tree] --action suspend|resume [--lock-timeout-ms N]\n       \
    stasis-gpu-roundtrip --keep-driver";

struct Args {
    probe: bool,
    keep_driver: bool,
    json: bool,
    pid: Option<i32>,
    tree: bool,
    lock_timeout: Duration,
    hold: Duration,
    action: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        probe: false,
        keep_driver: false,
        json: false,
        pid: None,
        tree: false,
        lock_timeout: Duration::from_secs(10),
        hold: Duration::from_millis(0),
        action: None,
    };
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, flag: &str| -> Result<u64, String> {
        v.and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{flag} needs a number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--probe" => a.probe = true,
            "--keep-driver" => a.keep_driver = true,
            "--json" => a.json = true,
            "--tree" => a.tree = true,
            "--lock-timeout-ms" => {
                a.lock_timeout = Duration::from_millis(num(it.next(), "--lock-timeout-ms")?)
            }
            "--hold-ms" => a.hold = Duration::from_millis(num(it.next(), "--hold-ms")?),
            "--action" => a.action = Some(it.next().ok_or("--action needs a value")?),
            "-h" | "--help" => return Err(String::new()),
            p => a.pid = Some(p.parse().map_err(|_| format!("not a pid: {p}"))?),
        }
    }
    if !a.probe && !a.keep_driver && a.pid.is_none() {
        return Err("a PID, --probe or --keep-driver is needed".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    // Before any thread: this tool acts on other processes' GPUs and must see all of them.
    for (name, value) in stasis_gpu::driver::unmask_device_view() {
        eprintln!("stasis-gpu-roundtrip: ignoring {name}={value} (it must see every GPU)");
    }
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("stasis-gpu-roundtrip: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if args.probe {
        let p = probe();
        if args.json {
            println!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
        } else {
            print!("{p}");
            println!();
        }
        return if p.no_driver.is_some() {
            ExitCode::from(3)
        } else {
            ExitCode::SUCCESS
        };
    }
    if args.keep_driver {
        return keep_driver();
    }
    match run(&args) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e @ GpuError::NoDriver(_)) => {
            eprintln!("stasis-gpu-roundtrip: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("stasis-gpu-roundtrip: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--keep-driver`: holds an initialised driver until stdin closes (or a signal ends it).
fn keep_driver() -> ExitCode {
    let t = Instant::now();
    match Driver::load() {
        Ok(d) => {
            println!(
                "{}",
                serde_json::json!({ "keeping": d.path(), "driver_load_ms": ms(t.elapsed()) })
            );
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("stasis-gpu-roundtrip: {e}");
            ExitCode::from(3)
        }
    }
}

fn used_bytes() -> Option<u64> {
    stasis_gpu::nvml::memory_used()
        .ok()
        .map(|v| v.into_iter().flatten().sum())
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// The pids to act on: `pid`, or with `--tree` every process of its tree that the driver knows
/// as a CUDA process (all of the tree, not only those with NVIDIA devices open: after a CRIU
/// restore the checkpointed processes have none).
fn target_pids(a: &Args, driver: &dyn CheckpointApi, check: bool) -> Result<Vec<i32>, GpuError> {
    let pid = a.pid.unwrap_or_default();
    let procfs = Procfs::default();
    let pids = if a.tree {
        process_tree(&procfs, pid)
            .into_iter()
            .filter(|&p| driver.state(p).is_ok())
            .collect()
    } else {
        vec![pid]
    };
    if check {
        procfs.check_supported(&pids)?;
    }
    Ok(pids)
}

fn group_action(
    a: &Args,
    driver: Arc<dyn CheckpointApi>,
    action: &str,
    init_ms: f64,
) -> Result<serde_json::Value, GpuError> {
    let pids = target_pids(a, driver.as_ref(), action == "suspend")?;
    let timings = if action == "suspend" {
        suspend_all(driver.clone(), &pids, a.lock_timeout)?.discard()
    } else {
        stasis_gpu::resume_restored(driver.as_ref(), &pids, &[])?
    };
    let states: Vec<String> = pids
        .iter()
        .map(|&p| {
            driver
                .state(p)
                .map_or_else(|e| e.to_string(), |s| s.to_string())
        })
        .collect();
    Ok(serde_json::json!({
        "action": action,
        "pids": pids,
        "states": states,
        "driver_load_ms": init_ms,
        "lock_ms": ms(timings.lock),
        "checkpoint_ms": ms(timings.checkpoint),
        "restore_ms": ms(timings.restore),
        "unlock_ms": ms(timings.unlock),
    }))
}

fn run(a: &Args) -> Result<serde_json::Value, GpuError> {
    let pid = a.pid.unwrap_or_default();
    let t = Instant::now();
    let loaded = Arc::new(Driver::load()?);
    let init_ms = ms(t.elapsed());
    let cuda_version = loaded.cuda_version();
    let driver: Arc<dyn CheckpointApi> = Arc::new(WithDeadline::new(
        loaded,
        stasis_gpu::deadline::call_deadline(),
    ));
    if let Some(action @ ("suspend" | "resume")) = a.action.as_deref() {
        return group_action(a, driver, action, init_ms);
    }
    if let Some(action) = &a.action {
        let t = Instant::now();
        let state = match action.as_str() {
            "state" => None,
            "lock" => Some(driver.lock(pid, Some(a.lock_timeout))),
            "checkpoint" => Some(driver.checkpoint(pid)),
            "restore" => Some(driver.restore(pid, &[])),
            "unlock" => Some(driver.unlock(pid)),
            "restore-tid" => {
                let tid = driver.restore_thread_id(pid)?;
                return Ok(serde_json::json!({ "pid": pid, "restore_tid": tid }));
            }
            other => return Err(GpuError::Unsupported(format!("unknown action {other}"))),
        };
        if let Some(r) = state {
            r?;
        }
        return Ok(serde_json::json!({
            "pid": pid,
            "action": action,
            "ms": ms(t.elapsed()),
            "state": driver.state(pid)?.to_string(),
        }));
    }
    let pids = target_pids(a, driver.as_ref(), true)?;
    let before = driver.state(pid)?;
    let restore_tid = driver.restore_thread_id(pid).ok();
    let used_before = used_bytes();
    let s = suspend_all(driver.clone(), &pids, a.lock_timeout)?;
    let state_checkpointed = driver.state(pid)?.to_string();
    let used_checkpointed = used_bytes();
    std::thread::sleep(a.hold);
    let timings = s.resume()?;
    let after = driver.state(pid)?;
    Ok(serde_json::json!({
        "pids": pids,
        "cuda_driver_version": cuda_version,
        "driver_load_ms": init_ms,
        "state_before": before.to_string(),
        "state_checkpointed": state_checkpointed,
        "state_after": after.to_string(),
        "restore_tid": restore_tid,
        "gpu_used_before_bytes": used_before,
        "gpu_used_checkpointed_bytes": used_checkpointed,
        "lock_ms": ms(timings.lock),
        "checkpoint_ms": ms(timings.checkpoint),
        "restore_ms": ms(timings.restore),
        "unlock_ms": ms(timings.unlock),
    }))
}
