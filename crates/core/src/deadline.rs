//! Checkpoints with a deadline (a grace period, a cloud notice): whether a final checkpoint can
//! finish in the time left, decided before anything is frozen.
//!
//! A final checkpoint that cannot finish in time still freezes the workload and spends the
//! node's bandwidth, then publishes nothing (its upload is cut off at the deadline), and the
//! replacement restores the latest heartbeat anyway. So it is skipped when its estimated cost
//! (the mean freeze + upload of the pod's recent checkpoints, [`interval::checkpoint_cost`], the
//! figure `interval: auto` uses) is more than the time left, and the pod stops at once.
//!
//! - A checkpoint of the pod in progress is waited for first: the final one cannot start before
//!   it ends. Its capture is never cut short (a freeze is not interrupted). A heartbeat whose
//!   capture is done and whose upload is running holds older memory than the final checkpoint
//!   would: its upload is stopped (nothing of it is published) when the final checkpoint is
//!   estimated to fit in the time left ([`new_checkpoint_fits`]), so that a pod whose checkpoints
//!   take most of a grace period still ends on its final state. Otherwise (and when the stop
//!   came during its capture, which then holds the state at the stop) the agent takes that
//!   heartbeat as the final checkpoint: it is the newest state that can be published before
//!   the deadline (`stasis_agent::busy`).
//! - Without a measured cost (the pod's first checkpoint on this node) the final checkpoint is
//!   taken, as is one with nothing published to fall back to: it is the only chance to keep the
//!   pod's state, and a cut-off upload publishes nothing.

use std::time::Duration;

use crate::interval::{self, Measured};

/// The pod's checkpoint state when its final checkpoint is asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Latest {
    /// Nothing published, nothing in progress.
    None,
    /// A checkpoint of the pod is being taken (captured or not).
    InProgress,
    /// The newest published checkpoint, and how old it is.
    Published { reference: String, age: Duration },
}

/// What to do with a final checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Final {
    /// Take it.
    Take,
    /// Wait for the checkpoint in progress to end, then decide again.
    Wait,
    /// Skip it: it cannot finish in time; the replacement restores `fallback`.
    Skip(Skipped),
}

/// Why a final checkpoint was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Estimated freeze + upload.
    pub estimate: Duration,
    /// Time left before the deadline.
    pub left: Duration,
    /// The published checkpoint the replacement restores instead.
    pub fallback: String,
    /// Its age.
    pub fallback_age: Duration,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "final checkpoint skipped: it would take about {} and {} were left; the replacement \
             restores the checkpoint taken {} before ({})",
            seconds(self.estimate),
            seconds(self.left),
            seconds(self.fallback_age),
            self.fallback
        )
    }
}

/// `6 s`, `0.4 s`, `11 s`: one decimal under 10 s.
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 {
        format!("{:.1} s", (s * 10.0).round() / 10.0)
    } else {
        format!("{} s", s.round())
    }
}

/// The decision for a final checkpoint with `left` before its deadline, the pod's measured
/// recent checkpoints (`measured`, newest last) and its latest checkpoint.
pub fn final_checkpoint(left: Duration, measured: &[Measured], latest: &Latest) -> Final {
    let (reference, age) = match latest {
        Latest::InProgress => return Final::Wait,
        Latest::None => return Final::Take,
        Latest::Published { reference, age } => (reference, *age),
    };
    match interval::checkpoint_cost(measured) {
        Some(estimate) if estimate > left => Final::Skip(Skipped {
            estimate,
            left,
            fallback: reference.clone(),
            fallback_age: age,
        }),
        _ => Final::Take,
    }
}

/// Whether a new checkpoint of the pod is worth taking in place of an older state that will be
/// published anyway: only when the pod's measured cost ([`interval::checkpoint_cost`]) fits in
/// `left`. Two older states use it: a heartbeat's upload in progress (stopped for the final
/// checkpoint) and a capture taken ahead of the stop (the eviction responder's, which the
/// pod has run past since). Without a measurement nothing says the new checkpoint can finish,
/// and the older state is the one closest to the stop that is likely to be published.
pub fn new_checkpoint_fits(left: Duration, measured: &[Measured]) -> bool {
    interval::checkpoint_cost(measured).is_some_and(|estimate| estimate <= left)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 6 GiB pod of docs/benchmarks.md: ≈ 21.7 s a checkpoint; with 28 s left the final
    /// checkpoint replaces the heartbeat uploading, with 20 s left the heartbeat is let finish,
    /// and with nothing measured it is too.
    #[test]
    fn a_heartbeat_upload_is_stopped_only_for_a_final_checkpoint_that_fits() {
        let six_gib = [ms(6_300, 15_400)];
        assert!(new_checkpoint_fits(Duration::from_secs(28), &six_gib));
        assert!(new_checkpoint_fits(Duration::from_millis(21_700), &six_gib));
        assert!(!new_checkpoint_fits(Duration::from_secs(20), &six_gib));
        assert!(!new_checkpoint_fits(Duration::from_secs(600), &[]));
    }

    fn ms(freeze_ms: u64, upload_ms: u64) -> Measured {
        Measured {
            freeze_ms,
            upload_ms,
        }
    }

    fn published() -> Latest {
        Latest::Published {
            reference: "default_pod_counter.abc/01J".into(),
            age: Duration::from_millis(7_300),
        }
    }

    /// The 2 GiB eviction of docs/benchmarks.md: freeze ≈ 4.2 s, upload ≈ 7 s, 6 s left: the
    /// checkpoint cannot finish (its upload was cut off after 6 s); skipped before the freeze.
    #[test]
    fn a_2_gib_pod_with_6_s_left_is_skipped() {
        let d = final_checkpoint(Duration::from_secs(6), &[ms(4_200, 7_000)], &published());
        let Final::Skip(s) = d else { panic!("{d:?}") };
        assert_eq!(s.estimate, Duration::from_millis(11_200));
        assert_eq!(s.left, Duration::from_secs(6));
        assert_eq!(s.fallback, "default_pod_counter.abc/01J");
        assert_eq!(
            s.to_string(),
            "final checkpoint skipped: it would take about 11 s and 6.0 s were left; the \
             replacement restores the checkpoint taken 7.3 s before (default_pod_counter.abc/01J)"
        );
    }

    /// A 64 MiB pod: 0.2 s + 0.3 s fits 6 s easily.
    #[test]
    fn a_small_pod_with_6_s_left_is_taken() {
        let d = final_checkpoint(Duration::from_secs(6), &[ms(200, 300)], &published());
        assert_eq!(d, Final::Take);
    }

    /// The estimate is the mean of the last few (`interval: auto`'s cost), and only a cost
    /// above the time left skips.
    #[test]
    fn the_estimate_is_the_recent_mean() {
        let left = Duration::from_millis(5_000);
        // Mean 5.0 s: fits exactly.
        let d = final_checkpoint(left, &[ms(2_000, 2_000), ms(3_000, 3_000)], &published());
        assert_eq!(d, Final::Take);
        // One old, slow first upload is averaged out of the last five.
        let mut v = vec![ms(9_000, 60_000)];
        v.extend([ms(1_000, 1_000); 5]);
        assert_eq!(final_checkpoint(left, &v, &published()), Final::Take);
        let d = final_checkpoint(left, &[ms(2_000, 3_001)], &published());
        assert!(matches!(d, Final::Skip(_)), "{d:?}");
    }

    /// No measured cost (the first checkpoint): taken, as before.
    #[test]
    fn without_a_measured_cost_it_is_taken() {
        assert_eq!(
            final_checkpoint(Duration::from_millis(100), &[], &published()),
            Final::Take
        );
    }

    /// Nothing to fall back to: taken, whatever the estimate (the only chance to keep the state).
    #[test]
    fn with_nothing_published_it_is_taken() {
        let d = final_checkpoint(Duration::from_secs(1), &[ms(4_200, 7_000)], &Latest::None);
        assert_eq!(d, Final::Take);
    }

    /// A checkpoint in progress is waited for (never cancelled), whatever the time left.
    #[test]
    fn a_checkpoint_in_progress_is_waited_for() {
        for left in [Duration::ZERO, Duration::from_secs(60)] {
            let d = final_checkpoint(left, &[ms(4_200, 7_000)], &Latest::InProgress);
            assert_eq!(d, Final::Wait);
        }
    }
}
