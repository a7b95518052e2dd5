//! `interval: auto`: the heartbeat interval of one pod from what its checkpoints cost and how
//! often pods of its node pool are interrupted (Young/Daly, [`crate::policy::daly`]).
//!
//! - **Cost** `C`: the mean of the freeze plus the upload of the pod's last few succeeded
//!   checkpoints ([`checkpoint_cost`]); [`DEFAULT_COST`] before the first one.
//! - **MTBF** `M`: interruptions per pod-second of its node pool, observed by the controller
//!   ([`EvictionLog`]), with a prior of one interruption per [`prior_mtbf`] of exposure so that
//!   a pool without history (or a controller that just started) gets a finite, cautious value and
//!   a few evictions move it quickly: `M = (exposure + prior) / (interruptions + 1)`.
//! - **Interval** `τ = daly(C, M)`, clamped: at least [`AUTO_MIN`], at least twice the cost (a
//!   checkpoint must end before the next is due), at least `freeze / maxFreezeFraction` (the pod
//!   spends at most that share of its time frozen), at most [`AUTO_MAX`].

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// Shortest automatic interval.
pub const AUTO_MIN: Duration = Duration::from_secs(10);
/// Longest automatic interval.
pub const AUTO_MAX: Duration = Duration::from_secs(6 * 3600);
/// Cost assumed before a pod's first measured checkpoint.
pub const DEFAULT_COST: Duration = Duration::from_secs(5);
/// How many recent checkpoints the cost is averaged over.
pub const COST_SAMPLES: usize = 5;
/// Interruptions older than this no longer count.
pub const WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// At most this many interruptions are remembered (all pools together).
pub const LOG_CAP: usize = 4096;

/// A node pool: the group of nodes whose interruptions a pod shares.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodePool {
    /// The pool's name from the node's labels (Karpenter NodePool, GKE node pool, EKS node
    /// group, AKS agent pool); `default` when none says.
    pub name: String,
    /// Spot / preemptible capacity.
    pub spot: bool,
}

/// Node labels naming a pool, most specific first.
const POOL_LABELS: [&str; 5] = [
    "karpenter.sh/nodepool",
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "kubernetes.azure.com/agentpool",
    "node.kubernetes.io/pool",
];

impl NodePool {
    /// The pool of a node with these labels.
    pub fn of_labels<'a>(labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> NodePool {
        let labels: Vec<(&str, &str)> = labels.into_iter().collect();
        let get = |k: &str| labels.iter().find(|(l, _)| *l == k).map(|(_, v)| *v);
        let name = POOL_LABELS
            .iter()
            .find_map(|k| get(k).filter(|v| !v.is_empty()))
            .unwrap_or("default")
            .to_owned();
        let spot = get("karpenter.sh/capacity-type") == Some("spot")
            || get("eks.amazonaws.com/capacityType") == Some("SPOT")
            || get("cloud.google.com/gke-spot") == Some("true")
            || get("cloud.google.com/gke-preemptible") == Some("true")
            || get("kubernetes.azure.com/scalesetpriority") == Some("spot");
        NodePool { name, spot }
    }

    /// `<name>` or `<name>/spot`: how the policy's status names it.
    pub fn key(&self) -> String {
        if self.spot {
            format!("{}/spot", self.name)
        } else {
            self.name.clone()
        }
    }
}

/// Prior MTBF of a pool without history: a day on demand, six hours on spot capacity (spot
/// pools are reclaimed far more often; the observed rate soon outweighs either).
pub fn prior_mtbf(pool: &NodePool) -> Duration {
    if pool.spot {
        Duration::from_secs(6 * 3600)
    } else {
        Duration::from_secs(24 * 3600)
    }
}

/// One pod's end by interruption.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Interruption {
    pool: NodePool,
    pod_uid: String,
    unix_ms: u64,
}

/// The interruptions the controller saw (pods of a policy that ended on their node while their
/// workload still wanted them: evicted, drained, preempted, deleted, their node lost), since it
/// started watching, and what it needs to attribute them: the pool of each node and the node of
/// each running pod. In memory: a new leader starts with the prior.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionLog {
    since_unix_ms: u64,
    events: VecDeque<Interruption>,
    /// Node name → its pool.
    nodes: BTreeMap<String, NodePool>,
    /// Pod UID → the node it runs on (noted at each heartbeat plan).
    pods: BTreeMap<String, String>,
}

/// The interval chosen for one pod, and the pool facts it was chosen from.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub auto: AutoInterval,
    pub pool: NodePool,
    /// Interruptions in the pool within [`WINDOW`].
    pub interruptions: u64,
    /// Pod-time observed in the pool.
    pub exposure: Duration,
}

impl EvictionLog {
    /// An empty log, watching from `now_unix_ms`.
    pub fn new(now_unix_ms: u64) -> Self {
        Self {
            since_unix_ms: now_unix_ms,
            events: VecDeque::new(),
            nodes: BTreeMap::new(),
            pods: BTreeMap::new(),
        }
    }

    /// The pool of `node`, once noted.
    pub fn pool_of(&self, node: &str) -> Option<&NodePool> {
        self.nodes.get(node)
    }

    /// Notes the pool of a node (from its labels).
    pub fn note_node(&mut self, node: &str, pool: NodePool) {
        if self.nodes.len() < LOG_CAP || self.nodes.contains_key(node) {
            self.nodes.insert(node.to_owned(), pool);
        }
    }

    /// Notes that pod `pod_uid` runs on `node`.
    pub fn note_pod(&mut self, pod_uid: &str, node: &str) {
        if pod_uid.is_empty() || node.is_empty() {
            return;
        }
        if self.pods.len() >= 8 * LOG_CAP && !self.pods.contains_key(pod_uid) {
            // A bound on what a controller remembers; the oldest UIDs sort first no better
            // than any other, so drop everything but the pods seen from now on.
            self.pods.clear();
        }
        self.pods.insert(pod_uid.to_owned(), node.to_owned());
    }

    /// The pod `pod_uid` ended by interruption at `unix_ms`: recorded in its node's pool when
    /// both are known. Returns whether it was recorded.
    pub fn record_end(&mut self, pod_uid: &str, unix_ms: u64) -> bool {
        let Some(node) = self.pods.remove(pod_uid) else {
            return false;
        };
        let Some(pool) = self.nodes.get(&node).cloned() else {
            return false;
        };
        self.record(pool, pod_uid, unix_ms)
    }

    /// Running pods (noted, not ended) on nodes of `pool`.
    pub fn pods_in(&self, pool: &NodePool) -> u64 {
        self.pods
            .values()
            .filter(|n| self.nodes.get(*n) == Some(pool))
            .count() as u64
    }

    /// The interval of a pod on a node of `pool`, from its checkpoints' measured costs (oldest
    /// first) and its last freeze.
    pub fn choose(
        &self,
        pool: &NodePool,
        measured: &[Measured],
        max_freeze_fraction: f64,
        now_unix_ms: u64,
    ) -> Choice {
        let interruptions = self.count(pool, now_unix_ms);
        let exposure = self.observed(now_unix_ms) * self.pods_in(pool).max(1) as u32;
        let m = mtbf(interruptions, exposure, prior_mtbf(pool));
        let freeze = measured.last().map(|x| Duration::from_millis(x.freeze_ms));
        Choice {
            auto: auto_interval(checkpoint_cost(measured), freeze, m, max_freeze_fraction),
            pool: pool.clone(),
            interruptions,
            exposure,
        }
    }

    /// Records the end of pod `pod_uid` on a node of `pool`; a pod counts once. Returns
    /// whether it was new.
    pub fn record(&mut self, pool: NodePool, pod_uid: &str, unix_ms: u64) -> bool {
        if pod_uid.is_empty() || self.events.iter().any(|e| e.pod_uid == pod_uid) {
            return false;
        }
        if self.events.len() >= LOG_CAP {
            self.events.pop_front();
        }
        self.events.push_back(Interruption {
            pool,
            pod_uid: pod_uid.to_owned(),
            unix_ms,
        });
        true
    }

    /// Interruptions in `pool` within [`WINDOW`] before `now_unix_ms`.
    pub fn count(&self, pool: &NodePool, now_unix_ms: u64) -> u64 {
        let from = now_unix_ms.saturating_sub(window_ms());
        self.events
            .iter()
            .filter(|e| &e.pool == pool && e.unix_ms >= from)
            .count() as u64
    }

    /// How long the log has watched, within [`WINDOW`].
    pub fn observed(&self, now_unix_ms: u64) -> Duration {
        Duration::from_millis(now_unix_ms.saturating_sub(self.since_unix_ms)).min(WINDOW)
    }
}

fn window_ms() -> u64 {
    u64::try_from(WINDOW.as_millis()).unwrap_or(u64::MAX)
}

/// Mean time between interruptions of one pod: `(exposure + prior) / (interruptions + 1)`, with
/// `exposure` the pod-time observed in the pool (observed time × pods running there).
pub fn mtbf(interruptions: u64, exposure: Duration, prior: Duration) -> Duration {
    (exposure + prior).div_f64((interruptions + 1) as f64)
}

/// A checkpoint's cost, as measured: freeze and upload in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    pub freeze_ms: u64,
    pub upload_ms: u64,
}

/// The mean freeze + upload of the last [`COST_SAMPLES`] measurements (`samples` newest
/// last); `None` without any.
pub fn checkpoint_cost(samples: &[Measured]) -> Option<Duration> {
    let recent = &samples[samples.len().saturating_sub(COST_SAMPLES)..];
    if recent.is_empty() {
        return None;
    }
    let total: u64 = recent.iter().map(|m| m.freeze_ms + m.upload_ms).sum();
    Some(Duration::from_millis(total / recent.len() as u64))
}

/// What limited the interval, when something did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// [`AUTO_MIN`].
    Min,
    /// Twice the checkpoint's cost.
    Cost,
    /// The freeze budget: `freeze / maxFreezeFraction`.
    FreezeBudget,
    /// [`AUTO_MAX`].
    Max,
}

impl Bound {
    pub fn name(self) -> &'static str {
        match self {
            Bound::Min => "Minimum",
            Bound::Cost => "CheckpointCost",
            Bound::FreezeBudget => "FreezeBudget",
            Bound::Max => "Maximum",
        }
    }
}

/// The interval chosen for a pod, and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoInterval {
    pub interval: Duration,
    /// Daly's optimum before clamping.
    pub optimum: Duration,
    /// The cost used (measured, or [`DEFAULT_COST`]).
    pub cost: Duration,
    /// Whether `cost` was measured.
    pub measured: bool,
    pub mtbf: Duration,
    pub bound: Option<Bound>,
}

/// The interval for a pod whose checkpoints cost `cost` (measured; `None`: not yet), whose
/// last freeze took `freeze`, in a pool with mean time between interruptions `mtbf`.
pub fn auto_interval(
    cost: Option<Duration>,
    freeze: Option<Duration>,
    mtbf: Duration,
    max_freeze_fraction: f64,
) -> AutoInterval {
    let c = cost.unwrap_or(DEFAULT_COST);
    let optimum = crate::policy::daly(c, mtbf);
    let fraction = if max_freeze_fraction.is_finite() && max_freeze_fraction > 0.0 {
        max_freeze_fraction.min(1.0)
    } else {
        crate::policy::DEFAULT_MAX_FREEZE_FRACTION
    };
    let floors = [
        (AUTO_MIN, Bound::Min),
        (c * 2, Bound::Cost),
        (
            freeze.unwrap_or_default().div_f64(fraction),
            Bound::FreezeBudget,
        ),
    ];
    let (floor, floor_bound) = floors
        .into_iter()
        .max_by_key(|(d, _)| *d)
        .expect("three floors");
    let (interval, bound) = if optimum > AUTO_MAX && floor <= AUTO_MAX {
        (AUTO_MAX, Some(Bound::Max))
    } else if optimum < floor {
        (floor, Some(floor_bound))
    } else {
        (optimum, None)
    };
    AutoInterval {
        // Whole milliseconds: what the status and the schedule carry.
        interval: Duration::from_millis(interval.as_millis() as u64),
        optimum,
        cost: c,
        measured: cost.is_some(),
        mtbf,
        bound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn pools_from_node_labels() {
        let karpenter = NodePool::of_labels([
            ("karpenter.sh/nodepool", "gpu"),
            ("karpenter.sh/capacity-type", "spot"),
        ]);
        assert_eq!(karpenter.key(), "gpu/spot");
        let gke = NodePool::of_labels([
            ("cloud.google.com/gke-nodepool", "a100"),
            ("cloud.google.com/gke-spot", "true"),
        ]);
        assert_eq!(gke.key(), "a100/spot");
        let eks = NodePool::of_labels([
            ("eks.amazonaws.com/nodegroup", "ng-1"),
            ("eks.amazonaws.com/capacityType", "ON_DEMAND"),
        ]);
        assert_eq!(eks.key(), "ng-1");
        let aks = NodePool::of_labels([
            ("kubernetes.azure.com/agentpool", "spotpool"),
            ("kubernetes.azure.com/scalesetpriority", "spot"),
        ]);
        assert!(aks.spot);
        let plain = NodePool::of_labels([("kubernetes.io/hostname", "worker-1")]);
        assert_eq!(plain.key(), "default");
        assert!(prior_mtbf(&karpenter) < prior_mtbf(&plain));
    }

    #[test]
    fn the_log_counts_each_pod_once_per_pool_within_the_window() {
        let a = NodePool::of_labels([]);
        let b = NodePool::of_labels([("karpenter.sh/nodepool", "b")]);
        let mut log = EvictionLog::new(0);
        assert!(log.record(a.clone(), "p1", 1_000));
        assert!(!log.record(a.clone(), "p1", 2_000), "the same pod twice");
        assert!(!log.record(a.clone(), "", 2_000), "a pod without a UID");
        assert!(log.record(a.clone(), "p2", 3_000));
        assert!(log.record(b.clone(), "p3", 3_000));
        assert_eq!(log.count(&a, 10_000), 2);
        assert_eq!(log.count(&b, 10_000), 1);
        // A week later the first ones no longer count.
        let later = 1_000 + window_ms() + 1;
        assert_eq!(log.count(&a, later), 1);
        assert_eq!(log.observed(later), WINDOW);
        assert_eq!(log.observed(5_000), Duration::from_secs(5));
    }

    #[test]
    fn the_log_is_bounded() {
        let a = NodePool::of_labels([]);
        let mut log = EvictionLog::new(0);
        for i in 0..(LOG_CAP + 10) {
            log.record(a.clone(), &format!("p{i}"), i as u64);
        }
        assert_eq!(log.count(&a, 100_000), LOG_CAP as u64);
    }

    #[test]
    fn ends_are_attributed_through_the_pods_node_and_the_nodes_pool() {
        let spot = NodePool::of_labels([("karpenter.sh/capacity-type", "spot")]);
        let mut log = EvictionLog::new(0);
        log.note_node("n1", spot.clone());
        log.note_pod("p1", "n1");
        log.note_pod("p2", "n1");
        log.note_pod("p3", "n-unknown");
        assert_eq!(log.pool_of("n1"), Some(&spot));
        assert_eq!(log.pods_in(&spot), 2);
        assert!(log.record_end("p1", 1_000));
        assert!(!log.record_end("p1", 2_000), "once");
        assert!(!log.record_end("p3", 2_000), "a node whose pool is unknown");
        assert!(!log.record_end("never-seen", 2_000));
        assert_eq!(log.count(&spot, 3_000), 1);
        assert_eq!(log.pods_in(&spot), 1);
    }

    #[test]
    fn the_choice_shortens_as_the_pool_loses_pods() {
        let pool = NodePool::of_labels([]);
        let m = |f, u| Measured {
            freeze_ms: f,
            upload_ms: u,
        };
        let costs = [m(200, 400), m(200, 400)];
        let mut log = EvictionLog::new(0);
        log.note_node("n1", pool.clone());
        log.note_pod("steady", "n1");
        let now = 600_000; // ten minutes watched, one pod: 600 pod-seconds
        let before = log.choose(&pool, &costs, 0.5, now);
        assert_eq!(before.interruptions, 0);
        assert_eq!(before.exposure, Duration::from_secs(600));
        assert_eq!(before.auto.mtbf, Duration::from_secs(87_000));
        for i in 0..6 {
            let uid = format!("gone-{i}");
            log.note_pod(&uid, "n1");
            assert!(log.record_end(&uid, now - 1_000));
        }
        let after = log.choose(&pool, &costs, 0.5, now);
        assert_eq!(after.interruptions, 6);
        // The same numbers as more_interruptions_mean_a_shorter_interval: ≈ 323 s → ≈ 122 s.
        assert!(
            (secs(before.auto.interval) - 322.5).abs() < 2.0,
            "{before:?}"
        );
        assert!((secs(after.auto.interval) - 121.9).abs() < 2.0, "{after:?}");
        assert!(after.auto.measured);
    }

    #[test]
    fn mtbf_with_the_prior() {
        let day = Duration::from_secs(86_400);
        // Nothing observed: the prior.
        assert_eq!(mtbf(0, Duration::ZERO, day), day);
        // Ten interruptions in 100 pod-hours: (100 h + 24 h) / 11 = 11.27 h.
        let m = mtbf(10, Duration::from_secs(100 * 3600), day);
        assert!((secs(m) - 124.0 * 3600.0 / 11.0).abs() < 1.0, "{m:?}");
        // Long quiet exposure lengthens it.
        assert!(mtbf(0, day * 30, day) > day * 30);
    }

    #[test]
    fn cost_is_the_mean_of_the_recent_freeze_and_upload() {
        assert_eq!(checkpoint_cost(&[]), None);
        let m = |f, u| Measured {
            freeze_ms: f,
            upload_ms: u,
        };
        assert_eq!(
            checkpoint_cost(&[m(100, 900)]),
            Some(Duration::from_millis(1000))
        );
        // Only the last five count (newest last).
        let v = [
            m(100_000, 0),
            m(200, 800),
            m(300, 700),
            m(100, 900),
            m(500, 500),
            m(0, 2000),
        ];
        assert_eq!(checkpoint_cost(&v), Some(Duration::from_millis(1200)));
    }

    #[test]
    fn the_interval_is_dalys_optimum_when_nothing_binds() {
        // C = 2 s, M = 2 h: sqrt(2·2·7200) = 169.7 s; Daly: r = 2/14400,
        // 169.706·(1 + 0.003928 + 0.0000154) − 2 = 168.38 s.
        let a = auto_interval(
            Some(Duration::from_secs(2)),
            Some(Duration::from_millis(300)),
            Duration::from_secs(7200),
            0.5,
        );
        assert!((secs(a.interval) - 168.38).abs() < 0.05, "{a:?}");
        assert_eq!(a.bound, None);
        assert!(a.measured);
        // Within a few percent of Young's sqrt(2CM).
        let young = (2.0f64 * 2.0 * 7200.0).sqrt();
        assert!((secs(a.interval) - young).abs() / young < 0.02);
    }

    #[test]
    fn more_interruptions_mean_a_shorter_interval() {
        let pool = NodePool::of_labels([]);
        let c = Some(Duration::from_millis(600));
        let quiet = auto_interval(
            c,
            None,
            mtbf(0, Duration::from_secs(600), prior_mtbf(&pool)),
            0.5,
        );
        let busy = auto_interval(
            c,
            None,
            mtbf(6, Duration::from_secs(600), prior_mtbf(&pool)),
            0.5,
        );
        // sqrt(2·0.6·87000) ≈ 323 s; with six interruptions M = 87000/7 ≈ 12429 s → ≈ 122 s.
        assert!((secs(quiet.interval) - 322.5).abs() < 2.0, "{quiet:?}");
        assert!((secs(busy.interval) - 121.9).abs() < 2.0, "{busy:?}");
        // The ratio follows sqrt(M): sqrt(7) ≈ 2.65.
        let ratio = secs(quiet.interval) / secs(busy.interval);
        assert!((ratio - 7f64.sqrt()).abs() < 0.05, "{ratio}");
    }

    #[test]
    fn clamps() {
        // A tiny MTBF: the floor.
        let a = auto_interval(
            Some(Duration::from_millis(100)),
            None,
            Duration::from_secs(60),
            0.5,
        );
        assert_eq!(a.interval, AUTO_MIN);
        assert_eq!(a.bound, Some(Bound::Min));
        // An expensive checkpoint in a busy pool: twice its cost.
        let a = auto_interval(
            Some(Duration::from_secs(60)),
            None,
            Duration::from_secs(100),
            0.5,
        );
        assert_eq!(a.interval, Duration::from_secs(120));
        assert_eq!(a.bound, Some(Bound::Cost));
        // A long freeze with a small budget share: freeze / fraction.
        let a = auto_interval(
            Some(Duration::from_secs(8)),
            Some(Duration::from_secs(8)),
            Duration::from_secs(600),
            0.02,
        );
        assert_eq!(a.interval, Duration::from_secs(400));
        assert_eq!(a.bound, Some(Bound::FreezeBudget));
        // A pool that never loses a node: at most AUTO_MAX.
        let a = auto_interval(
            Some(Duration::from_secs(30)),
            None,
            Duration::from_secs(365 * 86_400),
            0.5,
        );
        assert_eq!(a.interval, AUTO_MAX);
        assert_eq!(a.bound, Some(Bound::Max));
        // No measurement yet: the default cost, said so.
        let a = auto_interval(None, None, Duration::from_secs(86_400), 0.5);
        assert!(!a.measured);
        assert_eq!(a.cost, DEFAULT_COST);
        // A nonsense fraction falls back to the default.
        let a = auto_interval(
            Some(Duration::from_secs(1)),
            Some(Duration::from_secs(100)),
            Duration::from_secs(3600),
            f64::NAN,
        );
        assert_eq!(a.interval, Duration::from_secs(200));
    }
}
