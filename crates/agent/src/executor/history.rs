//! What the agent remembers of each pod's checkpoints on this node: the measured cost of the
//! recent ones and the newest published, which decide whether a final checkpoint can finish
//! before its deadline ([`stasis_core::deadline`]). In memory: after a restart of the agent a
//! pod's first final checkpoint is taken, as before any measurement.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use stasis_core::deadline::{self, Final, Latest};
use stasis_core::interval::{Measured, COST_SAMPLES};
use stasis_core::time::parse_rfc3339_nanos;
use stasis_core::{CheckpointRef, Selector};

use super::{now_ms, Executor};

/// One pod's recent checkpoints.
#[derive(Debug, Default)]
pub(super) struct PodHistory {
    /// Newest last, at most [`COST_SAMPLES`].
    measured: VecDeque<Measured>,
    /// The newest published checkpoint and when it was taken (Unix ms).
    published: Option<(String, u64)>,
    updated: Option<Instant>,
}

/// Pods remembered before the ones not heard of for [`FORGET_AFTER`] are dropped.
const MAX_PODS: usize = 1024;
const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

impl Executor {
    fn with_history<T>(&self, pod_uid: &str, f: impl FnOnce(&mut PodHistory) -> T) -> T {
        let mut m = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_PODS && !m.contains_key(pod_uid) {
            m.retain(|_, h| h.updated.is_some_and(|t| t.elapsed() < FORGET_AFTER));
            if m.len() >= MAX_PODS {
                m.clear();
            }
        }
        let h = m.entry(pod_uid.to_owned()).or_default();
        h.updated = Some(Instant::now());
        f(h)
    }

    /// Notes the measured cost of one of the pod's checkpoints (the executor notes its own; a
    /// caller may add what it knows from elsewhere, such as the pod's earlier checkpoints).
    pub fn note_measured(&self, pod_uid: &str, m: Measured) {
        if pod_uid.is_empty() {
            return;
        }
        self.with_history(pod_uid, |h| {
            if h.measured.len() == COST_SAMPLES {
                h.measured.pop_front();
            }
            h.measured.push_back(m);
        });
    }

    /// Notes a published checkpoint of the pod and what it cost.
    pub(super) fn note_published(&self, pod_uid: &str, reference: &str, m: Measured) {
        self.note_measured(pod_uid, m);
        if !pod_uid.is_empty() {
            self.with_history(pod_uid, |h| {
                h.published = Some((reference.to_owned(), taken_ms(reference)))
            });
        }
    }

    /// Whether the pod's final checkpoint, with `left` before its deadline, is taken, waits
    /// for the checkpoint `in_progress`, or is skipped.
    pub fn final_decision(&self, pod_uid: &str, left: Duration, in_progress: bool) -> Final {
        let m = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let h = m.get(pod_uid);
        let measured = measured(h);
        let latest = match h.and_then(|h| h.published.as_ref()) {
            _ if in_progress => Latest::InProgress,
            None => Latest::None,
            Some((reference, taken)) => Latest::Published {
                reference: reference.clone(),
                age: Duration::from_millis(now_ms().saturating_sub(*taken)),
            },
        };
        deadline::final_checkpoint(left, &measured, &latest)
    }

    /// Whether a new checkpoint of the pod, with `left` before its deadline, replaces an older
    /// state that would be published instead ([`deadline::new_checkpoint_fits`]): a heartbeat's
    /// upload in progress, or a capture taken ahead of the stop.
    pub fn new_checkpoint_fits(&self, pod_uid: &str, left: Duration) -> bool {
        let m = self.history.lock().unwrap_or_else(|e| e.into_inner());
        deadline::new_checkpoint_fits(left, &measured(m.get(pod_uid)))
    }
}

/// A pod's measured recent checkpoints, oldest first (none when it has no history).
fn measured(h: Option<&PodHistory>) -> Vec<Measured> {
    h.map(|h| h.measured.iter().copied().collect())
        .unwrap_or_default()
}

/// When a checkpoint was taken, from its id (its capture's instant: what the replacement's
/// state is as of); now when the reference has none.
fn taken_ms(reference: &str) -> u64 {
    let id = match reference.parse::<CheckpointRef>().map(|r| r.selector) {
        Ok(Selector::Id(id)) => id,
        _ => return now_ms(),
    };
    parse_rfc3339_nanos(&id.created_rfc3339())
        .and_then(|n| u64::try_from(n / 1_000_000).ok())
        .unwrap_or_else(now_ms)
}

pub(super) type Histories = std::sync::Mutex<HashMap<String, PodHistory>>;

#[cfg(test)]
mod tests {
    use super::super::{test_executor, test_runtime};
    use super::*;

    fn m(freeze_ms: u64, upload_ms: u64) -> Measured {
        Measured {
            freeze_ms,
            upload_ms,
        }
    }

    #[test]
    fn a_pods_history_decides_its_final_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let rt = test_runtime();
        let exec = test_executor(dir.path(), &rt, None, stasis_store::Key::random());
        let six = Duration::from_secs(6);
        // Nothing known: taken.
        assert_eq!(exec.final_decision("u1", six, false), Final::Take);
        // In progress: waited for.
        assert_eq!(exec.final_decision("u1", six, true), Final::Wait);
        // A 2 GiB pod's heartbeat published: 11.2 s does not fit 6 s.
        exec.note_published("u1", "l/a", m(4_200, 7_000));
        let Final::Skip(s) = exec.final_decision("u1", six, false) else {
            panic!("not skipped")
        };
        assert_eq!(s.fallback, "l/a");
        assert_eq!(s.estimate, Duration::from_millis(11_200));
        // Another pod's history is its own.
        exec.note_published("u2", "l/b", m(200, 300));
        assert_eq!(exec.final_decision("u2", six, false), Final::Take);
        // Only the last few count: five cheap checkpoints outweigh the slow one.
        for _ in 0..COST_SAMPLES {
            exec.note_measured("u1", m(200, 300));
        }
        assert_eq!(exec.final_decision("u1", six, false), Final::Take);
    }

    #[test]
    fn a_checkpoint_is_as_old_as_its_id() {
        let id = stasis_core::CheckpointId::from_parts(1_700_000_000_123, 7);
        assert_eq!(taken_ms(&format!("ns_pod_a.l/{id}")), 1_700_000_000_123);
        let t = now_ms();
        assert!(taken_ms("not a reference") >= t);
    }
}
