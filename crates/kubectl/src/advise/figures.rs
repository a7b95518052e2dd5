//! The figures of a workload's eviction arithmetic, each with where it came from: recorded by
//! stasis, read from a policy or its status, computed here as the controller would, or assumed.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde::Serialize;
use stasis_api::policy::AutoIntervalStatus;
use stasis_api::CheckpointPolicy;
use stasis_core::advise;
use stasis_core::interval::{self, Measured, NodePool};

/// A number and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    pub value: f64,
    pub source: Source,
    /// Which object, or which assumption.
    pub from: String,
}

/// Where a figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// Recorded by stasis on this workload's checkpoints, restores or pods.
    Measured,
    /// A CheckpointPolicy's spec.
    Policy,
    /// A CheckpointPolicy's status (`interval: auto`: the controller's choice and inputs).
    PolicyStatus,
    /// Computed here from the other figures, as the controller would.
    Estimated,
    /// Assumed: nothing was recorded.
    Default,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Policy => "policy",
            Source::PolicyStatus => "policy status",
            Source::Estimated => "estimated",
            Source::Default => "default",
        }
    }
}

impl Figure {
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.value.max(0.0))
    }
}

fn fig(value: f64, source: Source, from: impl Into<String>) -> Figure {
    Figure {
        value,
        source,
        from: from.into(),
    }
}

fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

fn mean(v: &[u64]) -> Option<u64> {
    (!v.is_empty()).then(|| v.iter().sum::<u64>() / v.len() as u64)
}

/// The last [`interval::COST_SAMPLES`] of `v` (oldest first), as the controller averages.
fn recent<T>(v: &[T]) -> &[T] {
    &v[v.len().saturating_sub(interval::COST_SAMPLES)..]
}

/// `freeze of its last succeeded checkpoint`, `mean freeze of its last 3 succeeded checkpoints`.
fn of_checkpoints(what: &str, n: usize) -> String {
    match n {
        1 => format!("{what} of its last succeeded checkpoint"),
        n => format!("mean {what} of its last {n} succeeded checkpoints"),
    }
}

/// A checkpoint's cost (freeze + upload, `interval: auto`'s C) and its freeze, from the
/// workload's succeeded checkpoints (oldest first).
pub fn cost(measured: &[Measured]) -> (Figure, Figure) {
    let samples = recent(measured);
    match interval::checkpoint_cost(measured) {
        Some(cost) => {
            let freeze = mean(&samples.iter().map(|m| m.freeze_ms).collect::<Vec<_>>());
            (
                fig(
                    cost.as_secs_f64(),
                    Source::Measured,
                    of_checkpoints("freeze + upload", samples.len()),
                ),
                fig(
                    secs(freeze.unwrap_or(0)),
                    Source::Measured,
                    of_checkpoints("freeze", samples.len()),
                ),
            )
        }
        None => (
            fig(
                interval::DEFAULT_COST.as_secs_f64(),
                Source::Default,
                "no succeeded checkpoint of it yet (interval: auto assumes the same)",
            ),
            fig(
                advise::DEFAULT_FREEZE.as_secs_f64(),
                Source::Default,
                "no succeeded checkpoint of it yet",
            ),
        ),
    }
}

/// The restore, from the durations of its restores (oldest first, ms).
pub fn restore(restores: &[u64]) -> Figure {
    let last = recent(restores);
    match mean(last) {
        Some(ms) => fig(
            secs(ms),
            Source::Measured,
            match last.len() {
                1 => "its last restore (the PodRestore's creation to restored)".to_owned(),
                n => format!(
                    "mean of its last {n} restores (each PodRestore's creation to restored)"
                ),
            },
        ),
        None => fig(
            advise::DEFAULT_RESTORE.as_secs_f64(),
            Source::Default,
            "no restore of it recorded",
        ),
    }
}

/// The cold start, from its cold-started pods (name, creation to Ready in ms).
pub fn cold_start(colds: &[(String, u64)]) -> Figure {
    match mean(&colds.iter().map(|(_, ms)| *ms).collect::<Vec<_>>()) {
        Some(ms) => {
            let names: Vec<&str> = colds.iter().map(|(n, _)| n.as_str()).collect();
            fig(
                secs(ms),
                Source::Measured,
                format!(
                    "creation to Ready of its cold-started pods ({})",
                    names.join(", ")
                ),
            )
        }
        None => fig(
            advise::DEFAULT_COLD_START.as_secs_f64(),
            Source::Default,
            "no cold start of it seen",
        ),
    }
}

/// The work an eviction throws away without stasis beyond the cold start: a Job's since its pod
/// started, a server's none.
pub fn lost_work(job: bool, pod: &Pod, now_ms: i64) -> Figure {
    if !job {
        return fig(
            0.0,
            Source::Default,
            "a server: nothing beyond the cold start",
        );
    }
    let started = pod
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .map(crate::view::ms);
    let age = started.map_or(0, |s| u64::try_from(now_ms - s).unwrap_or(0));
    fig(
        secs(age),
        Source::Measured,
        format!("a Job: the work of pod {} since its start", pod.name_any()),
    )
}

/// Evictions per hour of a pod of its pool: `3600 / M` from a policy's status, else the
/// controller's prior for the pool (`pool`: none when no node of it is known; `spot`: whether it
/// is, or asks for, spot capacity).
pub fn evictions(
    status: Option<&(&CheckpointPolicy, &AutoIntervalStatus)>,
    pool: Option<&NodePool>,
    spot: bool,
) -> Figure {
    if let Some((p, a)) = status.filter(|(_, a)| a.mtbf_seconds > 0) {
        return fig(
            3600.0 / a.mtbf_seconds as f64,
            Source::PolicyStatus,
            format!(
                "policy {}'s status: pool {}, MTBF {} s, {} interruptions seen",
                p.name_any(),
                a.node_pool,
                a.mtbf_seconds,
                a.interruptions
            ),
        );
    }
    let prior = "the controller's prior (one a day on demand, four a day on spot)";
    let (p, from) = match pool {
        Some(p) => (
            p.clone(),
            format!("no policy status for pool {}: {prior}", p.key()),
        ),
        None => {
            let p = NodePool {
                name: "default".into(),
                spot,
            };
            let what = if spot { "spot" } else { "on-demand" };
            (
                p,
                format!("none of its pods is on a known node: {prior}, for {what} capacity"),
            )
        }
    };
    fig(
        3600.0 / interval::prior_mtbf(&p).as_secs_f64(),
        Source::Default,
        from,
    )
}

/// The heartbeat interval of `policy`: its spec's, or with `auto` its status entry for one of
/// the workload's pods, else what the controller would choose from the other figures. `None`
/// for an invalid interval (the policy's own status says why).
pub fn heartbeat(
    policy: &CheckpointPolicy,
    own_status: Option<&(&CheckpointPolicy, &AutoIntervalStatus)>,
    evictions_per_hour: &Figure,
    checkpoint: &Figure,
    freeze: &Figure,
) -> Option<Figure> {
    let name = policy.name_any();
    Some(match policy.spec.interval().ok()? {
        stasis_core::policy::Interval::Fixed(d) => {
            fig(d.as_secs_f64(), Source::Policy, format!("policy {name}"))
        }
        stasis_core::policy::Interval::Auto => match own_status {
            Some((sp, a)) if sp.name_any() == name => fig(
                a.interval_millis as f64 / 1000.0,
                Source::PolicyStatus,
                format!("policy {name} (auto), its status for pod {}", a.pod),
            ),
            _ => {
                let mtbf = Duration::from_secs_f64(3600.0 / evictions_per_hour.value.max(1e-9));
                let cost = (checkpoint.source == Source::Measured).then(|| checkpoint.duration());
                let a = interval::auto_interval(
                    cost,
                    Some(freeze.duration()),
                    mtbf,
                    policy.spec.freeze_fraction(),
                );
                fig(
                    a.interval.as_secs_f64(),
                    Source::Estimated,
                    format!(
                        "policy {name} (auto) lists none of its pods yet: chosen here as the controller would"
                    ),
                )
            }
        },
    })
}
