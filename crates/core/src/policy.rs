//! Checkpoint policy math: the heartbeat interval, when a pod's next checkpoint is due, the freeze
//! budget against the liveness probe, and the Young/Daly optimal interval (for `interval: auto`,
//! chosen per pod by [`crate::interval`]).

use std::time::Duration;

/// Default share of the liveness budget a freeze may take (see [`freeze_verdict`]).
pub const DEFAULT_MAX_FREEZE_FRACTION: f64 = 0.5;
/// Shortest heartbeat interval accepted: a checkpoint costs at least a freeze and a dump.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Why a policy value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("interval: auto has no fixed duration: it is chosen per pod from the measured checkpoint cost and the node pool's interruptions")]
    Auto,
    #[error("duration {0:?} is invalid: expected numbers with units ms, s, m or h, such as 30s, 5m or 1h30m")]
    InvalidDuration(String),
    #[error("interval {0:?} is too short: at least 1s")]
    TooShort(String),
}

/// Parses a duration: one or more `<digits><unit>` with units `ms`, `s`, `m`, `h` (a subset of
/// Go's `time.ParseDuration`, what Kubernetes users write), numbers of at most 12 digits.
pub fn parse_duration(s: &str) -> Result<Duration, PolicyError> {
    // humantime reads the spans; it also takes what the CRDs' pattern `([0-9]+(ms|s|m|h))+`
    // refuses (spaces, fractions, `d`, `min`, `1hour`), which an annotation must not get past
    // either: with only digits and `h`, `m`, `s` its units are exactly ms, s, m and h.
    let in_grammar = s.bytes().all(|b| b.is_ascii_digit() || b"hms".contains(&b))
        && s.split(|c: char| !c.is_ascii_digit())
            .all(|n| n.len() <= 12);
    in_grammar
        .then(|| humantime::parse_duration(s).ok())
        .flatten()
        .ok_or_else(|| PolicyError::InvalidDuration(s.to_owned()))
}

/// A policy's `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interval {
    /// A duration of at least [`MIN_INTERVAL`].
    Fixed(Duration),
    /// `auto`: per pod, from its checkpoints' cost and its node pool's interruptions
    /// ([`crate::interval::auto_interval`]).
    Auto,
}

/// Parses a policy's `interval`: `auto` or a duration of at least [`MIN_INTERVAL`].
pub fn parse_interval_spec(s: &str) -> Result<Interval, PolicyError> {
    if s == "auto" {
        return Ok(Interval::Auto);
    }
    let d = parse_duration(s)?;
    if d < MIN_INTERVAL {
        return Err(PolicyError::TooShort(s.to_owned()));
    }
    Ok(Interval::Fixed(d))
}

/// A fixed heartbeat interval: a duration of at least [`MIN_INTERVAL`]; `auto`, which has no
/// fixed value, is [`PolicyError::Auto`].
pub fn parse_interval(s: &str) -> Result<Duration, PolicyError> {
    match parse_interval_spec(s)? {
        Interval::Fixed(d) => Ok(d),
        Interval::Auto => Err(PolicyError::Auto),
    }
}

/// When a pod's next heartbeat checkpoint is due, in Unix milliseconds: one interval after the
/// last checkpoint started (or after the pod started, when it has none yet), never in the past.
/// `jitter_ms` (chosen by the caller, e.g. a hash of the pod UID modulo a tenth of the interval)
/// spreads pods that started together so they do not all freeze and upload at once.
pub fn next_checkpoint_at(
    interval: Duration,
    pod_started_unix_ms: u64,
    last_started_unix_ms: Option<u64>,
    jitter_ms: u64,
    now_unix_ms: u64,
) -> u64 {
    let base = last_started_unix_ms.unwrap_or(pod_started_unix_ms);
    let interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
    base.saturating_add(interval_ms)
        .saturating_add(jitter_ms)
        .max(now_unix_ms)
}

/// The liveness probe of a container, with Kubernetes's defaults when a field is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LivenessProbe {
    pub period_seconds: Option<i32>,
    pub failure_threshold: Option<i32>,
    pub timeout_seconds: Option<i32>,
}

impl LivenessProbe {
    /// How long the container can be unresponsive before the kubelet kills it:
    /// `periodSeconds * failureThreshold - timeoutSeconds` (defaults 10, 3, 1), at least zero.
    pub fn budget(&self) -> Duration {
        let period = i64::from(self.period_seconds.unwrap_or(10).max(1));
        let threshold = i64::from(self.failure_threshold.unwrap_or(3).max(1));
        let timeout = i64::from(self.timeout_seconds.unwrap_or(1).max(1));
        Duration::from_secs(u64::try_from((period * threshold - timeout).max(0)).unwrap_or(0))
    }
}

/// How long a pod may stay frozen from a checkpoint's freeze when it is held until its stop
/// (`holdUntilEvicted`): `wanted`, and less than four fifths of its tightest liveness budget,
/// so that the kubelet does not restart a held container for failing its probe.
pub fn hold_limit(wanted: Duration, probes: &[LivenessProbe]) -> Duration {
    probes
        .iter()
        .map(|p| p.budget() * 4 / 5)
        .fold(wanted, Duration::min)
}

/// Whether a heartbeat checkpoint may freeze the pod.
#[derive(Debug, Clone, PartialEq)]
pub enum FreezeVerdict {
    Proceed,
    /// Skip this checkpoint; the text goes into the Event.
    Skip(String),
}

/// The freeze budget: a heartbeat whose expected freeze (the last measured freeze of this pod,
/// or an estimate from its memory size) exceeds `max_fraction` of the tightest liveness budget
/// among the pod's containers is skipped, rather than have the kubelet kill the pod for being
/// frozen. Pods without a liveness probe always proceed. A termination checkpoint is not subject
/// to this (the pod is stopping anyway).
pub fn freeze_verdict(
    expected_freeze: Duration,
    probes: &[LivenessProbe],
    max_fraction: f64,
) -> FreezeVerdict {
    let Some(tightest) = probes.iter().map(LivenessProbe::budget).min() else {
        return FreezeVerdict::Proceed;
    };
    let fraction = if max_fraction.is_finite() && max_fraction > 0.0 {
        max_fraction.min(1.0)
    } else {
        DEFAULT_MAX_FREEZE_FRACTION
    };
    let allowed = tightest.mul_f64(fraction);
    if expected_freeze <= allowed {
        FreezeVerdict::Proceed
    } else {
        FreezeVerdict::Skip(format!(
            "expected freeze {:.1}s exceeds {:.0}% of the liveness probe budget {}s ({:.1}s allowed); checkpoint skipped",
            expected_freeze.as_secs_f64(),
            fraction * 100.0,
            tightest.as_secs(),
            allowed.as_secs_f64()
        ))
    }
}

/// How long the restore decision for a replacement waits for the source's in-flight final
/// checkpoint: until the source's grace period ends (deletion timestamp + grace), zero when it
/// has passed.
pub fn final_checkpoint_wait(
    source_deletion_unix_ms: u64,
    grace_period_seconds: u64,
    now_unix_ms: u64,
) -> Duration {
    let deadline =
        source_deletion_unix_ms.saturating_add(grace_period_seconds.saturating_mul(1000));
    Duration::from_millis(deadline.saturating_sub(now_unix_ms))
}

/// Young's optimal checkpoint interval: `sqrt(2 · cost · mtbf)`, with `cost` the time a
/// checkpoint costs the workload and `mtbf` the mean time between interruptions.
pub fn young(cost: Duration, mtbf: Duration) -> Duration {
    Duration::from_secs_f64((2.0 * cost.as_secs_f64() * mtbf.as_secs_f64()).sqrt())
}

/// Daly's refinement of Young's interval (Daly 2006, first-order): with δ the cost and M the
/// MTBF, for δ < 2M:
/// `τ = sqrt(2δM) · (1 + ⅓·sqrt(δ/(2M)) + ⅑·δ/(2M)) − δ`; otherwise `τ = M`.
pub fn daly(cost: Duration, mtbf: Duration) -> Duration {
    let d = cost.as_secs_f64();
    let m = mtbf.as_secs_f64();
    if m <= 0.0 {
        return Duration::ZERO;
    }
    if d >= 2.0 * m {
        return mtbf;
    }
    let r = d / (2.0 * m);
    let tau = (2.0 * d * m).sqrt() * (1.0 + r.sqrt() / 3.0 + r / 9.0) - d;
    Duration::from_secs_f64(tau.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(
            parse_duration("1m30s250ms"),
            Ok(Duration::from_millis(90_250))
        );
        for bad in [
            "",
            "30",
            "s",
            "1d",
            "-1s",
            "1.5s",
            "30 s",
            " 30s",
            "1m s",
            "99999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// Go's forms the API server writes (`?timeout=1m0s`) are read; what humantime alone would
    /// also take, and the CRDs' pattern refuses, is refused.
    #[test]
    fn durations_stay_within_the_crd_pattern() {
        assert_eq!(parse_duration("1m0s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("2h0m0s"), Ok(Duration::from_secs(7200)));
        assert_eq!(
            parse_duration("1s1s"),
            Ok(Duration::from_secs(2)),
            "spans add up"
        );
        assert_eq!(
            parse_duration("999999999999h"),
            Ok(Duration::from_secs(999_999_999_999 * 3600))
        );
        for bad in [
            "1.5h", "1h 30m", "1hour", "1min", "2mins", "1sec", "1hr", "1w", "1M", "1y", "1us",
            "1ns", "1msec", "1sm", "1hh", "1m5", "PT1H", "1µs", "1H",
        ] {
            assert_eq!(
                parse_duration(bad),
                Err(PolicyError::InvalidDuration(bad.to_owned())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn intervals_auto_or_a_duration_of_at_least_a_second() {
        assert_eq!(parse_interval_spec("auto"), Ok(Interval::Auto));
        assert_eq!(
            parse_interval_spec("90s"),
            Ok(Interval::Fixed(Duration::from_secs(90)))
        );
        assert!(parse_interval_spec(" auto").is_err());
        assert!(parse_interval_spec("Auto").is_err());
        let err = parse_interval("auto").unwrap_err();
        assert_eq!(err, PolicyError::Auto);
        assert!(err.to_string().contains("per pod"), "{err}");
        assert!(matches!(
            parse_interval("500ms"),
            Err(PolicyError::TooShort(_))
        ));
        assert_eq!(parse_interval("10s"), Ok(Duration::from_secs(10)));
        assert!(parse_interval("ten")
            .unwrap_err()
            .to_string()
            .contains("30s"));
    }

    #[test]
    fn next_checkpoint_schedule() {
        let i = Duration::from_secs(10);
        // First heartbeat: one interval after the pod started.
        assert_eq!(next_checkpoint_at(i, 1_000, None, 0, 2_000), 11_000);
        // Then one interval after the last start, plus jitter.
        assert_eq!(
            next_checkpoint_at(i, 1_000, Some(20_000), 500, 21_000),
            30_500
        );
        // Overdue (controller was down): due now, not in the past.
        assert_eq!(
            next_checkpoint_at(i, 1_000, Some(20_000), 0, 99_000),
            99_000
        );
    }

    #[test]
    fn a_hold_stays_within_the_liveness_budget() {
        let probe = |period, threshold| LivenessProbe {
            period_seconds: Some(period),
            failure_threshold: Some(threshold),
            timeout_seconds: Some(1),
        };
        let minute = Duration::from_secs(60);
        assert_eq!(hold_limit(minute, &[]), minute);
        // 10 s × 3 − 1 s = 29 s of budget: held at most 23.2 s.
        assert_eq!(
            hold_limit(minute, &[probe(10, 3), probe(60, 5)]),
            Duration::from_millis(23_200)
        );
        assert_eq!(
            hold_limit(Duration::from_secs(5), &[probe(10, 3)]),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn liveness_budget_defaults_and_freeze_verdict() {
        let default = LivenessProbe::default();
        assert_eq!(default.budget(), Duration::from_secs(29)); // 10*3-1
        let tight = LivenessProbe {
            period_seconds: Some(2),
            failure_threshold: Some(2),
            timeout_seconds: Some(1),
        };
        assert_eq!(tight.budget(), Duration::from_secs(3));
        assert_eq!(
            freeze_verdict(Duration::from_secs(60), &[], 0.5),
            FreezeVerdict::Proceed
        );
        assert_eq!(
            freeze_verdict(Duration::from_secs(10), &[default], 0.5),
            FreezeVerdict::Proceed
        );
        // The tightest container's probe decides.
        match freeze_verdict(Duration::from_secs(2), &[default, tight], 0.5) {
            FreezeVerdict::Skip(why) => {
                assert!(why.contains("liveness probe budget 3s"), "{why}");
                assert!(why.contains("50%"), "{why}");
            }
            v => panic!("expected skip, got {v:?}"),
        }
        // A nonsense fraction falls back to the default.
        assert_eq!(
            freeze_verdict(Duration::from_millis(1_400), &[tight], f64::NAN),
            FreezeVerdict::Proceed
        );
        // A probe whose budget is zero (timeout ≥ period·threshold) skips any real freeze.
        let zero = LivenessProbe {
            period_seconds: Some(1),
            failure_threshold: Some(1),
            timeout_seconds: Some(5),
        };
        assert_eq!(zero.budget(), Duration::ZERO);
        assert!(matches!(
            freeze_verdict(Duration::from_millis(1), &[zero], 0.5),
            FreezeVerdict::Skip(_)
        ));
    }

    #[test]
    fn final_wait_is_bounded_by_grace() {
        assert_eq!(
            final_checkpoint_wait(10_000, 30, 25_000),
            Duration::from_secs(15)
        );
        assert_eq!(final_checkpoint_wait(10_000, 30, 50_000), Duration::ZERO);
    }

    #[test]
    fn young_and_daly() {
        // cost 10 s, MTBF 2 h: sqrt(2·10·7200) = 379.47 s.
        let y = young(Duration::from_secs(10), Duration::from_secs(7200));
        assert!((y.as_secs_f64() - 379.473).abs() < 0.01, "{y:?}");
        let d = daly(Duration::from_secs(10), Duration::from_secs(7200));
        // r = 10/14400; τ = 379.473·(1 + 0.008784 + 0.0000772) − 10 ≈ 372.835
        assert!((d.as_secs_f64() - 372.83).abs() < 0.05, "{d:?}");
        // Daly is close to Young when the cost is small against the MTBF.
        assert!((d.as_secs_f64() - y.as_secs_f64()).abs() / y.as_secs_f64() < 0.05);
        // Cost beyond twice the MTBF: checkpoint once per MTBF.
        assert_eq!(
            daly(Duration::from_secs(100), Duration::from_secs(40)),
            Duration::from_secs(40)
        );
        assert_eq!(daly(Duration::from_secs(1), Duration::ZERO), Duration::ZERO);
    }
}
