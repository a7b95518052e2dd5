//! The advisor (`stasis advise`, `kubectl stasis advise`): checks of a workload's eviction
//! readiness on spot pools, and the arithmetic of what an eviction costs with and without stasis.
//!
//! Pure: the caller reads pods, nodes, disruption budgets and checkpoint figures from the cluster
//! and hands them in as [`WorkloadFacts`], [`PoolFacts`] and [`CostFacts`]. The checks follow how
//! the platforms mark spot capacity (GKE and AKS taint and label their spot pools; Karpenter labels
//! `karpenter.sh/capacity-type` and taints only what its NodePool says) and what a pod needs to
//! survive a reclaim: a grace period that fits the notice, a toleration *and* an affinity (a
//! toleration alone lets the pod onto spot, it does not draw it there), a disruption budget, and no
//! annotation that blocks the autoscaler's consolidation for a pod that can move at the cost of a
//! restore.

use crate::notice::Provider;
use serde::Serialize;
use std::time::Duration;

/// Node labels that mark spot (or preemptible) capacity, with the value that means spot.
pub const SPOT_NODE_LABELS: &[(&str, &str)] = &[
    ("cloud.google.com/gke-spot", "true"),
    ("cloud.google.com/gke-preemptible", "true"),
    ("cloud.google.com/gke-provisioning", "spot"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
    ("karpenter.sh/capacity-type", "spot"),
    ("eks.amazonaws.com/capacityType", "SPOT"),
];

/// The taints the platforms put on their spot pools themselves (Karpenter puts none).
pub const PLATFORM_SPOT_TAINTS: &[&str] = &[
    "cloud.google.com/gke-spot",
    "kubernetes.azure.com/scalesetpriority",
];

/// The annotation with which Karpenter leaves a pod's node alone.
pub const DO_NOT_DISRUPT: &str = "karpenter.sh/do-not-disrupt";

/// Whether a node's labels mark it as spot capacity.
pub fn is_spot_node<'a>(labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> bool {
    labels
        .into_iter()
        .any(|(k, v)| SPOT_NODE_LABELS.iter().any(|(sk, sv)| *sk == k && *sv == v))
}

/// The notice a provider gives before it reclaims a spot machine: AWS two minutes, GCP and
/// Azure thirty seconds (GKE can extend it to 120 s on recent versions; the default is taken).
pub fn spot_notice(provider: Provider) -> Duration {
    match provider {
        Provider::Aws => Duration::from_secs(120),
        Provider::Gcp | Provider::Azure => Duration::from_secs(30),
    }
}

/// How a pod's node affinity draws it to spot nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SpotAffinity {
    None,
    Preferred,
    Required,
}

/// What an eviction costs when nothing was measured: from a replacement's creation to its
/// restored process running (the local cluster's paths back took 2-4 s; a large state takes its
/// fetch), and from a cold pod's creation to ready (image pull and the workload's own start).
pub const DEFAULT_RESTORE: Duration = Duration::from_secs(10);
/// See [`DEFAULT_RESTORE`].
pub const DEFAULT_COLD_START: Duration = Duration::from_secs(60);
/// The freeze assumed before a workload's first checkpoint: a few hundred MiB of memory (the
/// local cluster froze a 32 MiB counter for 40-55 ms; a large model's process freezes for
/// seconds, and its own figure replaces this at its first checkpoint).
pub const DEFAULT_FREEZE: Duration = Duration::from_secs(1);

/// What the advisor needs to know of one workload (its pod template, as running).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadFacts {
    /// Opted in (`runtimeClassName: stasis`).
    pub opted_in: bool,
    /// A CheckpointPolicy selects its pods.
    pub has_policy: bool,
    pub replicas: u32,
    pub termination_grace: Duration,
    /// Keys of the taints the pod tolerates (an `Exists` toleration without a key tolerates all:
    /// pass `"*"`).
    pub tolerated_taint_keys: Vec<String>,
    /// How its node affinity selects spot nodes.
    pub spot_affinity: SpotAffinity,
    /// A PodDisruptionBudget selects its pods.
    pub has_disruption_budget: bool,
    /// It carries `karpenter.sh/do-not-disrupt: "true"`.
    pub do_not_disrupt: bool,
    /// It has topology spread constraints.
    pub spread: bool,
}

/// What the advisor knows of the node pool a workload runs on.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolFacts {
    pub provider: Option<Provider>,
    /// Any of the workload's nodes is spot capacity.
    pub spot: bool,
    /// Keys of the `NoSchedule`/`NoExecute` taints every spot node of the cluster carries (a
    /// Karpenter NodePool's own taint, say; a GPU taint on some of them is not the spot pool's);
    /// empty when no spot node was seen (or nodes were not readable).
    pub spot_taint_keys: Vec<String>,
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Severity {
    Info,
    Warning,
}

impl Severity {
    /// As kubectl prints an Event's type.
    pub fn name(self) -> &'static str {
        match self {
            Severity::Info => "Info",
            Severity::Warning => "Warning",
        }
    }
}

/// One check's finding: a stable code for scripts, and for people what was found, why it
/// matters and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    pub code: &'static str,
    pub what: String,
    pub why: String,
    pub fix: String,
}

fn finding(
    severity: Severity,
    code: &'static str,
    what: impl Into<String>,
    why: impl Into<String>,
    fix: impl Into<String>,
) -> Finding {
    Finding {
        severity,
        code,
        what: what.into(),
        why: why.into(),
        fix: fix.into(),
    }
}

/// The taint a provider puts on its spot pools itself, as a toleration names it.
fn platform_taint(provider: Provider) -> Option<&'static str> {
    match provider {
        Provider::Gcp => Some("cloud.google.com/gke-spot=true:NoSchedule"),
        Provider::Azure => Some("kubernetes.azure.com/scalesetpriority=spot:NoSchedule"),
        Provider::Aws => None,
    }
}

/// The eviction-readiness checks for one workload. `final_checkpoint`: the time its last
/// checkpoint took from the freeze to the upload's end, when known.
pub fn check(
    w: &WorkloadFacts,
    pool: &PoolFacts,
    final_checkpoint: Option<Duration>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let tolerates = |key: &str| w.tolerated_taint_keys.iter().any(|k| k == "*" || k == key);
    if w.opted_in && !w.has_policy {
        out.push(finding(
            Severity::Warning,
            "NoPolicy",
            "no CheckpointPolicy selects its pods",
            "stasis takes no heartbeat of them: an eviction starts the replacement cold",
            "create a CheckpointPolicy in its namespace whose selector matches its pods' labels",
        ));
    }
    if pool.spot {
        if let Some(provider) = pool.provider {
            let notice = spot_notice(provider);
            if w.termination_grace > notice {
                out.push(finding(
                    Severity::Warning,
                    "GraceExceedsNotice",
                    format!(
                        "terminationGracePeriodSeconds is {} s on spot capacity of {}, which reclaims a machine {} s after its notice",
                        w.termination_grace.as_secs(),
                        provider.name(),
                        notice.as_secs()
                    ),
                    "the machine is gone when the notice runs out: the pod never gets the rest of its grace period, and a shutdown sized to it is cut off",
                    format!(
                        "set terminationGracePeriodSeconds to at most {} and size the shutdown (and the final checkpoint) to it",
                        notice.as_secs()
                    ),
                ));
            }
            if let Some(cost) = final_checkpoint {
                let window = notice.min(w.termination_grace);
                if w.opted_in && cost > window {
                    out.push(finding(
                        Severity::Warning,
                        "FinalCheckpointTooSlow",
                        format!(
                            "its last checkpoint took {:.1} s from the freeze to the upload's end; at a reclaim it gets {} s",
                            cost.as_secs_f64(),
                            window.as_secs()
                        ),
                        "the final checkpoint does not finish in time: the replacement resumes from the heartbeat before it",
                        "shorten the interval, or shrink the state the checkpoint carries",
                    ));
                }
            }
        }
        if w.replicas > 1 && !w.spread {
            out.push(finding(
                Severity::Info,
                "NoSpread",
                format!("{} replicas on spot capacity without topologySpreadConstraints", w.replicas),
                "a provider often reclaims one instance type in one zone at once: one reclaim can take every replica",
                "add a topologySpreadConstraint over topology.kubernetes.io/zone",
            ));
        }
    }
    let spot_taint_tolerated = PLATFORM_SPOT_TAINTS
        .iter()
        .copied()
        .chain(pool.spot_taint_keys.iter().map(String::as_str))
        .any(tolerates);
    if spot_taint_tolerated && w.spot_affinity == SpotAffinity::None {
        out.push(finding(
            Severity::Warning,
            "TolerationWithoutAffinity",
            "it tolerates a spot taint but has no node affinity to a spot label",
            "a toleration lets the pod onto spot nodes, it does not draw it there: it may land on on-demand nodes",
            "add a node affinity on the spot label: required, or preferred to fall back to on-demand when spot capacity runs out",
        ));
    }
    if w.spot_affinity != SpotAffinity::None {
        // The taints its spot nodes carry: those seen on the cluster's spot nodes, else the one
        // the provider puts on its spot pools.
        let mut needed: Vec<String> = pool.spot_taint_keys.clone();
        if needed.is_empty() {
            needed.extend(
                pool.provider
                    .and_then(platform_taint)
                    .map(|t| t.split('=').next().unwrap_or(t).to_owned()),
            );
        }
        let missing: Vec<&String> = needed.iter().filter(|k| !tolerates(k)).collect();
        if !missing.is_empty() {
            let names = missing
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            out.push(finding(
                Severity::Warning,
                "AffinityWithoutToleration",
                format!("it asks for spot nodes but does not tolerate their taint ({names})"),
                "the taint keeps it off every spot node: with a required affinity it cannot schedule, with a preferred one it never lands on spot",
                format!("add a toleration for {names} (effect NoSchedule)"),
            ));
        }
    }
    if !w.has_disruption_budget {
        out.push(finding(
            Severity::Info,
            "NoDisruptionBudget",
            "no PodDisruptionBudget selects its pods",
            "a drain may evict every replica at once (the kubelet's own evictions ignore budgets anyway)",
            "add a PodDisruptionBudget (maxUnavailable: 1) whose selector matches its pods",
        ));
    }
    if w.do_not_disrupt && w.opted_in {
        out.push(finding(
            Severity::Warning,
            "DoNotDisruptBlocksConsolidation",
            format!("its pods carry {DO_NOT_DISRUPT}: \"true\""),
            "the annotation keeps the autoscaler from consolidating or expiring its node, yet with stasis the pod moves at the cost of a restore",
            format!("remove the {DO_NOT_DISRUPT} annotation from its pod template"),
        ));
    }
    out
}

/// What one workload's checkpoints and starts cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostFacts {
    /// The time the workload is frozen per checkpoint.
    pub freeze: Duration,
    /// One checkpoint from the freeze to the upload's end (`interval: auto`'s cost).
    pub checkpoint: Duration,
    /// The heartbeat interval.
    pub interval: Duration,
    /// From the replacement's creation to its restored process running.
    pub restore: Duration,
    /// From a cold pod's creation to ready (the start stasis saves).
    pub cold_start: Duration,
    /// Work an eviction throws away without stasis beyond the cold start: 0 for a server,
    /// the work since the job's own last checkpoint (or start) for a batch job.
    pub lost_work_without: Duration,
}

/// The arithmetic of evictions for one workload at a pool's eviction rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Goodput {
    /// Expected progress lost per eviction with stasis: half the interval plus the restore.
    #[serde(rename = "lossPerEvictionSeconds")]
    pub loss_per_eviction_s: f64,
    /// Progress lost per eviction without stasis: the cold start plus the lost work.
    #[serde(rename = "lossPerEvictionWithoutSeconds")]
    pub loss_per_eviction_without_s: f64,
    /// Share of wall time doing useful work with stasis (freezes and losses taken off).
    pub with_stasis: f64,
    /// The same without stasis.
    pub without_stasis: f64,
    /// The interval `interval: auto` would choose for this cost and eviction rate (Daly's
    /// optimum within its bounds), when evictions are expected.
    #[serde(rename = "suggestedIntervalSeconds")]
    pub suggested_interval_s: Option<f64>,
}

/// Goodput with and without stasis at `evictions_per_hour`: each hour loses
/// `rate · loss` to evictions, and with stasis also `freeze / interval` to its freezes.
pub fn goodput(cost: &CostFacts, evictions_per_hour: f64) -> Goodput {
    let rate_per_s = evictions_per_hour.max(0.0) / 3600.0;
    let interval = cost.interval.as_secs_f64().max(f64::EPSILON);
    let loss_with = interval / 2.0 + cost.restore.as_secs_f64();
    let loss_without = cost.cold_start.as_secs_f64() + cost.lost_work_without.as_secs_f64();
    let freeze_share = (cost.freeze.as_secs_f64() / interval).min(1.0);
    let with = ((1.0 - freeze_share) * (1.0 - rate_per_s * loss_with)).clamp(0.0, 1.0);
    let without = (1.0 - rate_per_s * loss_without).clamp(0.0, 1.0);
    let suggested = (rate_per_s > 0.0).then(|| {
        let mtbf = Duration::from_secs_f64((1.0 / rate_per_s).min(1e12));
        crate::interval::auto_interval(
            Some(cost.checkpoint),
            Some(cost.freeze),
            mtbf,
            crate::policy::DEFAULT_MAX_FREEZE_FRACTION,
        )
        .interval
        .as_secs_f64()
    });
    Goodput {
        loss_per_eviction_s: loss_with,
        loss_per_eviction_without_s: loss_without,
        with_stasis: with,
        without_stasis: without,
        suggested_interval_s: suggested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> WorkloadFacts {
        WorkloadFacts {
            opted_in: true,
            has_policy: true,
            replicas: 1,
            termination_grace: Duration::from_secs(30),
            tolerated_taint_keys: vec![],
            spot_affinity: SpotAffinity::None,
            has_disruption_budget: true,
            do_not_disrupt: false,
            spread: false,
        }
    }

    fn gke_spot() -> PoolFacts {
        PoolFacts {
            provider: Some(Provider::Gcp),
            spot: true,
            spot_taint_keys: vec![],
        }
    }

    fn codes(f: &[Finding]) -> Vec<&'static str> {
        f.iter().map(|f| f.code).collect()
    }

    #[test]
    fn spot_nodes_are_recognised_by_each_platforms_label() {
        assert!(is_spot_node([("cloud.google.com/gke-spot", "true")]));
        assert!(is_spot_node([(
            "kubernetes.azure.com/scalesetpriority",
            "spot"
        )]));
        assert!(is_spot_node([("karpenter.sh/capacity-type", "spot")]));
        assert!(!is_spot_node([("karpenter.sh/capacity-type", "on-demand")]));
        assert!(!is_spot_node([("kubernetes.io/hostname", "spot")]));
    }

    #[test]
    fn a_well_set_up_spot_workload_has_no_warning() {
        let w = WorkloadFacts {
            tolerated_taint_keys: vec!["cloud.google.com/gke-spot".into()],
            spot_affinity: SpotAffinity::Required,
            ..server()
        };
        let f = check(&w, &gke_spot(), Some(Duration::from_secs(5)));
        assert!(f.iter().all(|f| f.severity == Severity::Info), "{f:?}");
        assert!(f.is_empty(), "{f:?}");
    }

    #[test]
    fn a_grace_longer_than_the_notice_is_flagged_with_the_providers_window() {
        let w = WorkloadFacts {
            termination_grace: Duration::from_secs(120),
            ..server()
        };
        let f = check(&w, &gke_spot(), None);
        let grace = f.iter().find(|f| f.code == "GraceExceedsNotice").unwrap();
        assert!(grace.what.contains("120 s"), "{}", grace.what);
        assert!(grace.what.contains("30 s"), "{}", grace.what);
        assert!(grace.fix.contains("at most 30"), "{}", grace.fix);
        // On AWS two minutes fit.
        let aws = PoolFacts {
            provider: Some(Provider::Aws),
            ..gke_spot()
        };
        assert!(!codes(&check(&w, &aws, None)).contains(&"GraceExceedsNotice"));
        // Off spot, the grace is the user's choice.
        let on_demand = PoolFacts {
            spot: false,
            ..gke_spot()
        };
        assert!(check(&w, &on_demand, None).is_empty());
    }

    #[test]
    fn a_final_checkpoint_that_does_not_fit_the_notice_is_flagged() {
        let f = check(&server(), &gke_spot(), Some(Duration::from_secs(45)));
        assert!(codes(&f).contains(&"FinalCheckpointTooSlow"), "{f:?}");
        let f = check(&server(), &gke_spot(), Some(Duration::from_secs(10)));
        assert!(!codes(&f).contains(&"FinalCheckpointTooSlow"), "{f:?}");
    }

    #[test]
    fn toleration_and_affinity_go_together() {
        let only_toleration = WorkloadFacts {
            tolerated_taint_keys: vec!["*".into()],
            ..server()
        };
        assert!(codes(&check(&only_toleration, &gke_spot(), None))
            .contains(&"TolerationWithoutAffinity"));
        let only_affinity = WorkloadFacts {
            spot_affinity: SpotAffinity::Preferred,
            ..server()
        };
        assert!(
            codes(&check(&only_affinity, &gke_spot(), None)).contains(&"AffinityWithoutToleration")
        );
        // Karpenter taints nothing by itself: an affinity alone is fine on AWS...
        let aws = PoolFacts {
            provider: Some(Provider::Aws),
            ..gke_spot()
        };
        assert!(!codes(&check(&only_affinity, &aws, None)).contains(&"AffinityWithoutToleration"));
        // ...unless its NodePool taints its nodes: the taints seen on spot nodes count, named.
        let tainted = PoolFacts {
            spot_taint_keys: vec!["workload-class".into()],
            ..aws
        };
        let f = check(&only_affinity, &tainted, None);
        let missing = f
            .iter()
            .find(|f| f.code == "AffinityWithoutToleration")
            .unwrap();
        assert!(missing.fix.contains("workload-class"), "{}", missing.fix);
        // A toleration of that taint without an affinity is the other half missing.
        let custom = WorkloadFacts {
            tolerated_taint_keys: vec!["workload-class".into()],
            ..server()
        };
        assert!(codes(&check(&custom, &tainted, None)).contains(&"TolerationWithoutAffinity"));
        let both = WorkloadFacts {
            spot_affinity: SpotAffinity::Required,
            ..custom
        };
        assert!(check(&both, &tainted, None).is_empty());
    }

    #[test]
    fn an_opted_in_workload_without_a_policy_is_flagged() {
        let w = WorkloadFacts {
            has_policy: false,
            ..server()
        };
        assert_eq!(codes(&check(&w, &gke_spot(), None)), ["NoPolicy"]);
        let plain = WorkloadFacts {
            opted_in: false,
            ..w
        };
        assert!(check(&plain, &gke_spot(), None).is_empty());
    }

    #[test]
    fn budgets_spread_and_do_not_disrupt() {
        let w = WorkloadFacts {
            replicas: 3,
            has_disruption_budget: false,
            do_not_disrupt: true,
            ..server()
        };
        let c = codes(&check(&w, &gke_spot(), None));
        for code in [
            "NoSpread",
            "NoDisruptionBudget",
            "DoNotDisruptBlocksConsolidation",
        ] {
            assert!(c.contains(&code), "{code} missing from {c:?}");
        }
        // A workload that is not opted in may need the annotation: it cannot move.
        let plain = WorkloadFacts {
            opted_in: false,
            ..w
        };
        assert!(
            !codes(&check(&plain, &gke_spot(), None)).contains(&"DoNotDisruptBlocksConsolidation")
        );
    }

    #[test]
    fn goodput_follows_the_formula() {
        let cost = CostFacts {
            freeze: Duration::from_secs(2),
            checkpoint: Duration::from_secs(2),
            interval: Duration::from_secs(60),
            restore: Duration::from_secs(10),
            cold_start: Duration::from_secs(600),
            lost_work_without: Duration::ZERO,
        };
        let g = goodput(&cost, 2.0);
        assert_eq!(g.loss_per_eviction_s, 40.0);
        assert_eq!(g.loss_per_eviction_without_s, 600.0);
        // 2 evictions/h: with = (1 - 2/60)(1 - 80/3600); without = 1 - 1200/3600.
        assert!((g.with_stasis - (58.0 / 60.0) * (1.0 - 80.0 / 3600.0)).abs() < 1e-12);
        assert!((g.without_stasis - (1.0 - 1200.0 / 3600.0)).abs() < 1e-12);
        // What interval: auto chooses: Daly's optimum for 2 s and an MTBF of 1800 s (above its
        // floors), within 2 % of Young's sqrt(2 · 2 s · 1800 s) ≈ 84.9 s.
        let s = g.suggested_interval_s.unwrap();
        let daly = crate::policy::daly(Duration::from_secs(2), Duration::from_secs(1800));
        assert!((s - daly.as_secs_f64()).abs() < 1e-3, "{s} vs {daly:?}");
        assert!(
            (s / (2.0f64 * 2.0 * 1800.0).sqrt() - 1.0).abs() < 0.02,
            "{s}"
        );
    }

    #[test]
    fn without_evictions_only_the_freezes_cost_and_no_interval_is_suggested() {
        let cost = CostFacts {
            freeze: Duration::from_secs(1),
            checkpoint: Duration::from_secs(1),
            interval: Duration::from_secs(100),
            restore: Duration::from_secs(5),
            cold_start: Duration::from_secs(60),
            lost_work_without: Duration::ZERO,
        };
        let g = goodput(&cost, 0.0);
        assert!((g.with_stasis - 0.99).abs() < 1e-12);
        assert_eq!(g.without_stasis, 1.0);
        assert_eq!(g.suggested_interval_s, None);
    }

    #[test]
    fn losses_larger_than_the_hour_give_zero_not_negative() {
        let cost = CostFacts {
            freeze: Duration::from_secs(1),
            checkpoint: Duration::from_secs(3),
            interval: Duration::from_secs(60),
            restore: Duration::from_secs(5),
            cold_start: Duration::from_secs(1800),
            lost_work_without: Duration::from_secs(3600),
        };
        let g = goodput(&cost, 10.0);
        assert_eq!(g.without_stasis, 0.0);
        assert!(g.with_stasis > 0.8, "{}", g.with_stasis);
    }
}
