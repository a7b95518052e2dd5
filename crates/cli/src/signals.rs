//! SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`, systemd, Kubernetes) stop stasis in order.
//!
//! The signals are blocked in every thread and taken by one thread with `sigwait`. While a
//! checkpoint or restore runs ([`Orderly`]), the first signal is recorded: the step in progress
//! (a CRIU dump, which must not be cut in half, or a store transfer, which is cancelled) ends,
//! the command fails with [`Interrupted`], and the usual error paths thaw the workload, drop the
//! store leases and remove the scratch directory with its plaintext images. A second signal, or
//! one that comes outside such a run, removes this process's scratch directories and exits at
//! once. The exit status is 128 + the signal's number either way.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use nix::sys::signal::{SigSet, Signal};

static SIGNAL: AtomicI32 = AtomicI32::new(0);
static ORDERLY: AtomicBool = AtomicBool::new(false);

/// The error of a run stopped by a signal.
#[derive(Debug)]
pub struct Interrupted(pub Signal);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", self.0)
    }
}

impl std::error::Error for Interrupted {}

/// Blocks the signals and starts the thread that takes them. Call before any other thread
/// starts (threads inherit the mask; children get an empty one from `std::process`).
pub fn install() {
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    if set.thread_block().is_err() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("stasis-signals".into())
        .spawn(move || loop {
            let Ok(sig) = set.wait() else {
                return;
            };
            let first = SIGNAL
                .compare_exchange(0, sig as i32, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
            if first && ORDERLY.load(Ordering::SeqCst) {
                eprintln!(
                    "stasis: {sig}: stopping after the current step (the workload is not left frozen, nothing is published); send it again to stop at once"
                );
                continue;
            }
            crate::scratch::remove_all_live();
            std::process::exit(128 + sig as i32);
        });
    if spawned.is_err() {
        let _ = set.thread_unblock();
    }
}

/// While alive, a signal asks for an orderly stop instead of an immediate exit.
pub struct Orderly(());

impl Orderly {
    pub fn enter() -> Self {
        ORDERLY.store(true, Ordering::SeqCst);
        Orderly(())
    }
}

impl Drop for Orderly {
    fn drop(&mut self) {
        ORDERLY.store(false, Ordering::SeqCst);
    }
}

/// The signal received, if any.
pub fn received() -> Option<Signal> {
    Signal::try_from(SIGNAL.load(Ordering::SeqCst)).ok()
}

/// Fails with [`Interrupted`] once a signal was received (between steps).
pub fn check() -> Result<(), Interrupted> {
    received().map_or(Ok(()), |s| Err(Interrupted(s)))
}

/// The error for a step cancelled by [`cancelled`].
pub fn interrupted() -> Interrupted {
    Interrupted(received().unwrap_or(Signal::SIGTERM))
}

/// Completes when a signal has been received (to cancel a store transfer).
pub async fn cancelled() {
    while received().is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
