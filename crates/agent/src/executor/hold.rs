//! Pods held frozen after their checkpoint until their stop comes (the eviction responder's
//! final checkpoint and a spot notice's, under a policy with `holdUntilEvicted`, docs/design.md
//! §15): a pod that runs on between its capture and its eviction does work that its
//! replacement, restored from the capture, does again.
//!
//! A hold ends when the stop reaches the pod (the runtime's final-checkpoint request, which
//! resumes it before anything else, then is answered with the capture), when the pod leaves the
//! node (the sweep), or the hold's bound after the checkpoint was published ([`HOLD_BOUND`] for
//! an EvictionRequest, the notice's time left for a spot notice): the pod then runs on. If the
//! agent dies while holding, the engine's watchdogs resume the containers at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stasis_engine::checkpoint::Held;
use tracing::{info, warn};

use super::{Executor, HOLD_BOUND};

/// The pods held, by UID, each with the number of its hold (a newer hold replaces an older).
pub(super) struct Holds {
    held: Arc<HeldPods>,
    next: AtomicU64,
    /// The eviction responder's bound: [`HOLD_BOUND`], shorter in tests.
    bound_ms: AtomicU64,
}

impl Default for Holds {
    fn default() -> Self {
        Holds {
            held: Default::default(),
            next: AtomicU64::new(0),
            bound_ms: AtomicU64::new(HOLD_BOUND.as_millis() as u64),
        }
    }
}

type HeldPods = Mutex<HashMap<String, (u64, Held)>>;

/// Takes a pod's hold out of `held`: any, or only hold number `hold`.
fn take(held: &HeldPods, pod_uid: &str, hold: Option<u64>) -> Option<Held> {
    let mut m = held.lock().unwrap_or_else(|e| e.into_inner());
    match m.get(pod_uid) {
        Some((n, _)) if hold.is_none_or(|h| h == *n) => m.remove(pod_uid).map(|(_, h)| h),
        _ => None,
    }
}

fn release(pod_uid: &str, held: Held, why: &str) {
    let ids = held.ids();
    match held.release() {
        Ok(()) => {
            info!(pod_uid, containers = ?ids, "{why}: the pod held since its checkpoint runs again")
        }
        Err(e) => {
            warn!(pod_uid, containers = ?ids, error = %e, "{why}: could not resume the pod held since its checkpoint")
        }
    }
}

impl Executor {
    /// Holds a pod's containers frozen after its published checkpoint, until its stop comes or
    /// `bound` has passed.
    pub(super) fn hold(&self, pod_uid: &str, held: Held, bound: Duration) {
        let n = self.holds.next.fetch_add(1, Ordering::Relaxed);
        info!(pod_uid, containers = ?held.ids(), bound_ms = bound.as_millis() as u64, "the pod stays frozen after its checkpoint until its stop");
        let older = self
            .holds
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pod_uid.to_owned(), (n, held));
        if let Some((_, older)) = older {
            release(pod_uid, older, "a newer checkpoint holds it");
        }
        let (held, uid) = (self.holds.held.clone(), pod_uid.to_owned());
        let timer = std::thread::Builder::new()
            .name("hold".into())
            .spawn(move || {
                std::thread::sleep(bound);
                if let Some(h) = take(&held, &uid, Some(n)) {
                    release(&uid, h, "no stop came within the hold's bound");
                }
            });
        if timer.is_err() {
            if let Some(h) = take(&self.holds.held, pod_uid, Some(n)) {
                release(pod_uid, h, "no thread to bound the hold");
            }
        }
    }

    /// How long the eviction responder's checkpoint holds a pod at most.
    pub fn hold_bound(&self) -> Duration {
        Duration::from_millis(self.holds.bound_ms.load(Ordering::Relaxed))
    }

    /// Sets [`Executor::hold_bound`] ([`HOLD_BOUND`] unless set).
    pub fn set_hold_bound(&self, bound: Duration) {
        self.holds
            .bound_ms
            .store(bound.as_millis() as u64, Ordering::Relaxed);
    }

    /// Ends a pod's hold, if any; whether there was one.
    pub fn release_hold(&self, pod_uid: &str, why: &str) -> bool {
        match take(&self.holds.held, pod_uid, None) {
            Some(h) => {
                release(pod_uid, h, why);
                true
            }
            None => false,
        }
    }

    /// Whether a pod is held frozen after its checkpoint.
    pub fn is_held(&self, pod_uid: &str) -> bool {
        self.holds
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(pod_uid)
    }

    /// Ends the holds of pods no longer on this node.
    pub(super) fn release_holds_gone(&self, live_pod_uids: &std::collections::HashSet<String>) {
        let gone: Vec<String> = self
            .holds
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .filter(|u| !live_pod_uids.contains(*u))
            .cloned()
            .collect();
        for uid in gone {
            self.release_hold(&uid, "its pod is no longer on this node");
        }
    }
}
