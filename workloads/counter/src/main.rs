//! `stasis-counter`: the stateful test workload of stasis.
//!
//! Holds `STATE_MB` MiB of state whose every block follows from its index and the tick that last
//! wrote it. Each tick it rewrites one block, checks a rotating sample, and prints one line:
//!
//!     count=<n> state=ok|CORRUPT
//!
//! (stdout, flushed per line; `CORRUPT` is sticky, details go to stderr). A restored copy continues
//! the count from the checkpoint and still prints `state=ok`.
//!
//! Environment:
//!   STATE_MB=64          MiB of state (incompressible)
//!   BLOCK_KB=64          block size in KiB (must divide STATE_MB*1024)
//!   INTERVAL_MS=100      tick interval
//!   SAMPLE_BLOCKS=16     blocks checked per tick (rotating over all blocks)
//!   DIRTY_PCT=5          percent of the blocks SIGUSR2 rewrites (one contiguous range)
//!   LISTEN_PORT=<port>   TCP (0.0.0.0): each connection gets the current line, then is closed
//!   STREAM_PORT=<port>   TCP (0.0.0.0): each connection stays open and gets every tick's line
//!                        (a long-lived established connection, for `--tcp-established` tests)
//!   OOM_TRIGGER_FILE=<path>  when this file appears, grow memory until the OOM killer acts
//!
//! Signals:
//!   SIGUSR1      check all of the state now (result on stderr: `full-check ... state=ok|CORRUPT`)
//!   SIGUSR2      rewrite a contiguous DIRTY_PCT percent of the blocks (stderr: `dirty ...`)
//!   SIGRTMIN     (34 with glibc: `kill -s RTMIN <pid>`, `runc kill <id> 34`) grow memory until
//!                the OOM killer acts, touching every page, 16 MiB at a time
//!   SIGTERM, SIGINT  print a last line and exit 0 (it runs as PID 1 in containers)
//!
//! Exit codes: 0 on SIGTERM/SIGINT, 2 on bad configuration.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stasis_counter::{status_line, Config, State};

static TERM: AtomicBool = AtomicBool::new(false);
static CHECK: AtomicBool = AtomicBool::new(false);
static DIRTY: AtomicBool = AtomicBool::new(false);
static OOM: AtomicBool = AtomicBool::new(false);

/// What the network threads serve: the latest count and whether the state was ever corrupt.
static COUNT: AtomicU64 = AtomicU64::new(0);
static CORRUPT: AtomicBool = AtomicBool::new(false);

/// `sig` sets `flag` (signal-hook's handler stores to the atomic and nothing else; SA_RESTART,
/// so the sleeps and writes of the main loop are not cut short).
fn install(sig: libc::c_int, flag: &'static AtomicBool) {
    if let Err(e) = signal_hook::flag::register(sig, flag) {
        eprintln!("stasis-counter: cannot handle signal {sig}: {e}");
        std::process::exit(2);
    }
}

fn current_line() -> String {
    status_line(COUNT.load(SeqCst), CORRUPT.load(SeqCst))
}

fn bind(port: u16, what: &str) -> TcpListener {
    match TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("stasis-counter: cannot listen on {what} {port}: {e}");
            std::process::exit(2);
        }
    }
}

/// LISTEN_PORT: each connection gets the current line and is closed.
fn serve_lines(listener: TcpListener) {
    for mut c in listener.incoming().flatten() {
        let _ = c.write_all(format!("{}\n", current_line()).as_bytes());
    }
}

/// STREAM_PORT: connections are kept and get every tick's line (written by the main loop).
fn serve_stream(listener: TcpListener, clients: Arc<Mutex<Vec<TcpStream>>>) {
    for c in listener.incoming().flatten() {
        let _ = c.set_nodelay(true);
        let _ = c.set_write_timeout(Some(Duration::from_millis(50)));
        clients.lock().unwrap_or_else(|e| e.into_inner()).push(c);
    }
}

/// Grows memory until the OOM killer acts (touching every page so it is really used).
fn grow_until_oom() {
    const CHUNK: usize = 16 << 20;
    let mut hog: Vec<Vec<u8>> = Vec::new();
    loop {
        hog.push(vec![0xa5u8; CHUNK]);
        let mib = hog.len() * (CHUNK >> 20);
        if mib % 256 == 0 {
            eprintln!("stasis-counter: oom: grown by {mib} MiB");
        }
    }
}

fn main() {
    let cfg = match Config::from_lookup(|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("stasis-counter: {e}");
            std::process::exit(2);
        }
    };

    install(libc::SIGTERM, &TERM);
    install(libc::SIGINT, &TERM);
    install(libc::SIGUSR1, &CHECK);
    install(libc::SIGUSR2, &DIRTY);
    install(libc::SIGRTMIN(), &OOM);

    let started = Instant::now();
    let mut state = State::new(cfg.state_mb, cfg.block_kb);
    eprintln!(
        "stasis-counter: pid {} state {} MiB in {} blocks of {} KiB, filled in {} ms; interval {} ms",
        std::process::id(),
        cfg.state_mb,
        state.blocks(),
        cfg.block_kb,
        started.elapsed().as_millis(),
        cfg.interval_ms
    );
    CHECK.store(true, SeqCst); // check all of the state once after starting

    if let Some(port) = cfg.listen_port {
        let l = bind(port, "LISTEN_PORT");
        std::thread::spawn(move || serve_lines(l));
    }
    let clients: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    if let Some(port) = cfg.stream_port {
        let l = bind(port, "STREAM_PORT");
        let c = clients.clone();
        std::thread::spawn(move || serve_stream(l, c));
    }

    let stdout = std::io::stdout();
    let interval = Duration::from_millis(cfg.interval_ms);
    let mut oom_started = false;
    loop {
        let t0 = Instant::now();
        if TERM.load(SeqCst) {
            break;
        }
        if CHECK.swap(false, SeqCst) {
            let t = Instant::now();
            let r = state.verify_all();
            if let Err(c) = &r {
                CORRUPT.store(true, SeqCst);
                eprintln!("stasis-counter: CORRUPT: {c}");
            }
            eprintln!(
                "stasis-counter: full-check count={} blocks={} ms={} state={}",
                state.count,
                state.blocks(),
                t.elapsed().as_millis(),
                if r.is_ok() { "ok" } else { "CORRUPT" }
            );
        }
        if DIRTY.swap(false, SeqCst) {
            let r = state.dirty(cfg.dirty_pct);
            eprintln!(
                "stasis-counter: dirty count={} blocks={}..{} ({} blocks, {} KiB, {}%)",
                state.count,
                r.start,
                r.end,
                r.len(),
                r.len() * state.block_bytes() / 1024,
                cfg.dirty_pct
            );
        }
        if !oom_started
            && (OOM.load(SeqCst)
                || cfg
                    .oom_trigger_file
                    .as_deref()
                    .is_some_and(|f| std::path::Path::new(f).exists()))
        {
            oom_started = true;
            eprintln!("stasis-counter: oom: growing memory until the OOM killer acts");
            std::thread::spawn(grow_until_oom);
        }

        if let Err(c) = state.tick(cfg.sample_blocks) {
            if !CORRUPT.swap(true, SeqCst) {
                eprintln!("stasis-counter: CORRUPT: {c}");
            }
        }
        COUNT.store(state.count, SeqCst);
        let line = current_line();
        {
            let mut out = stdout.lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
        if cfg.stream_port.is_some() {
            let mut cl = clients.lock().unwrap_or_else(|e| e.into_inner());
            let msg = format!("{line}\n");
            cl.retain_mut(|c| c.write_all(msg.as_bytes()).is_ok());
        }

        // Sleep the rest of the interval. Never plan against an absolute monotonic deadline:
        // a restored copy may run on a machine whose monotonic clock is far behind or ahead.
        // Sleep in slices so SIGTERM is answered promptly even with long intervals.
        let until = t0 + interval;
        while !TERM.load(SeqCst) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || left > interval {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }

    let line = current_line();
    let mut out = stdout.lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
    eprintln!(
        "stasis-counter: exiting on SIGTERM at count={}",
        state.count
    );
    std::process::exit(0);
}
