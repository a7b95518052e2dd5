//! The memory trigger's arithmetic: a container's working set from its memory cgroup's files
//! (cgroup v1 and v2), whether it passed the policy's share of its limit, and the rate limit of
//! the checkpoints it asks for. The agent reads the files (`crates/agent/src/memory.rs`).
//!
//! Working set = usage − inactive file pages, the kubelet's (cAdvisor's) definition: it is what
//! the kubelet's eviction manager compares with its thresholds, and it leaves out the page cache
//! the kernel reclaims before any OOM kill, so a pod that merely read a large file does not look
//! as if it were about to be killed. Active file pages stay in: the kernel reclaims them too,
//! but only after the inactive ones, and counting them errs on the side of an early checkpoint.

use std::time::Duration;

/// A cgroup v1 `memory.limit_in_bytes` at or above this is "no limit" (the kernel writes
/// `PAGE_COUNTER_MAX × page size`, 9223372036854771712 on x86-64 with 4 KiB pages).
const V1_UNLIMITED: u64 = 1 << 62;

/// Shortest time between two memory checkpoints of one pod.
pub const MIN_GAP: Duration = Duration::from_secs(30);
/// A memory checkpoint may cost at most this share of the time between two of them.
pub const MAX_COST_SHARE: u32 = 10;
/// Heartbeat interval assumed for the rate limit when the policy's is `auto`.
pub const AUTO_INTERVAL_FOR_GAP: Duration = Duration::from_secs(600);

/// A memory cgroup file that does not say what it should.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    #[error("{file}: expected a number of bytes, found {found:?}")]
    NotANumber { file: &'static str, found: String },
    #[error("memory.stat has no {0} line")]
    MissingStat(&'static str),
}

/// Which cgroup hierarchy a container's memory is accounted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// `memory.usage_in_bytes`, `memory.limit_in_bytes`, `memory.stat` (`total_inactive_file`).
    V1,
    /// `memory.current`, `memory.max`, `memory.stat` (`inactive_file`).
    V2,
}

impl CgroupVersion {
    /// The files to read, in the order [`Reading::parse`] takes them: usage, limit, stat.
    pub fn files(self) -> [&'static str; 3] {
        match self {
            CgroupVersion::V1 => [
                "memory.usage_in_bytes",
                "memory.limit_in_bytes",
                "memory.stat",
            ],
            CgroupVersion::V2 => ["memory.current", "memory.max", "memory.stat"],
        }
    }
}

/// One container's memory, read from its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Usage less inactive file pages, bytes (never below zero).
    pub working_set_bytes: u64,
    /// The limit the kernel enforces; `None` when there is none.
    pub limit_bytes: Option<u64>,
}

fn number(file: &'static str, text: &str) -> Result<u64, MemoryError> {
    text.trim().parse().map_err(|_| MemoryError::NotANumber {
        file,
        found: text.trim().chars().take(40).collect(),
    })
}

/// The value of a `memory.stat` line (`<key> <bytes>`).
pub fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

impl Reading {
    /// Reads the three files' contents (see [`CgroupVersion::files`]).
    pub fn parse(
        version: CgroupVersion,
        usage: &str,
        limit: &str,
        stat: &str,
    ) -> Result<Reading, MemoryError> {
        let [usage_file, limit_file, _] = version.files();
        let usage = number(usage_file, usage)?;
        let (inactive_file, limit_bytes) = match version {
            CgroupVersion::V1 => {
                // The hierarchical count, as cAdvisor reads it; a leaf cgroup's equals its own.
                let inactive = stat_value(stat, "total_inactive_file")
                    .or_else(|| stat_value(stat, "inactive_file"))
                    .ok_or(MemoryError::MissingStat("total_inactive_file"))?;
                let l = number(limit_file, limit)?;
                (inactive, (l < V1_UNLIMITED).then_some(l))
            }
            CgroupVersion::V2 => {
                let inactive = stat_value(stat, "inactive_file")
                    .ok_or(MemoryError::MissingStat("inactive_file"))?;
                let l = match limit.trim() {
                    "max" => None,
                    other => Some(number(limit_file, other)?),
                };
                (inactive, l)
            }
        };
        Ok(Reading {
            working_set_bytes: usage.saturating_sub(inactive_file),
            limit_bytes,
        })
    }

    /// The working set as a percentage of the limit; `None` without a limit.
    pub fn percent(&self) -> Option<f64> {
        let limit = self.limit_bytes.filter(|l| *l > 0)?;
        Some(self.working_set_bytes as f64 * 100.0 / limit as f64)
    }

    /// Whether the working set reached `percent` of the limit (never without a limit).
    pub fn over(&self, percent: i32) -> bool {
        self.percent().is_some_and(|p| p >= f64::from(percent))
    }
}

/// At most one memory checkpoint of a pod per this long: at least [`MIN_GAP`], at least
/// [`MAX_COST_SHARE`] times what the pod's last checkpoint took (so memory checkpoints cost at
/// most a tenth of the pod's time), and at least a quarter of the heartbeat interval (a pod
/// that stays above its threshold gets a few extra checkpoints per interval, not one per poll).
pub fn min_gap(heartbeat: Option<Duration>, last_cost: Option<Duration>) -> Duration {
    let interval = heartbeat.unwrap_or(AUTO_INTERVAL_FOR_GAP);
    let by_cost = last_cost.unwrap_or_default() * MAX_COST_SHARE;
    MIN_GAP.max(by_cost).max(interval / 4)
}

/// Why a pod is (not) checkpointed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Create the checkpoint.
    Checkpoint,
    /// A checkpoint of the pod is pending or running.
    InFlight,
    /// The last memory checkpoint is recent: not before this time (Unix ms).
    RateLimited { until_unix_ms: u64 },
}

/// Whether a pod that passed its threshold (or whose node reports memory pressure) is
/// checkpointed now: never while one of its checkpoints is in flight, and at most once per
/// `gap` (from [`min_gap`]) after its last memory checkpoint started.
pub fn verdict(
    in_flight: bool,
    last_memory_checkpoint_unix_ms: Option<u64>,
    gap: Duration,
    now_unix_ms: u64,
) -> Verdict {
    if in_flight {
        return Verdict::InFlight;
    }
    let gap_ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX);
    match last_memory_checkpoint_unix_ms.map(|t| t.saturating_add(gap_ms)) {
        Some(until) if until > now_unix_ms => Verdict::RateLimited {
            until_unix_ms: until,
        },
        _ => Verdict::Checkpoint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A cgroup v1 memory.stat as the kernel writes it (excerpt of a container's, local and
    /// hierarchical counters).
    const V1_STAT: &str = "cache 10485760\nrss 209715200\nrss_huge 0\nshmem 0\nmapped_file 0\n\
        inactive_anon 0\nactive_anon 209715200\ninactive_file 8388608\nactive_file 2097152\n\
        unevictable 0\nhierarchical_memory_limit 268435456\ntotal_cache 10485760\n\
        total_rss 209715200\ntotal_inactive_anon 0\ntotal_active_anon 209715200\n\
        total_inactive_file 8388608\ntotal_active_file 2097152\ntotal_unevictable 0\n";

    /// A cgroup v2 memory.stat (excerpt).
    const V2_STAT: &str = "anon 209715200\nfile 10485760\nkernel 1048576\nshmem 0\n\
        file_mapped 0\nfile_dirty 0\ninactive_anon 0\nactive_anon 209715200\n\
        inactive_file 8388608\nactive_file 2097152\nunevictable 0\n";

    #[test]
    fn v1_working_set_is_usage_less_inactive_file() {
        let r = Reading::parse(CgroupVersion::V1, "220200960\n", "268435456\n", V1_STAT).unwrap();
        assert_eq!(r.working_set_bytes, 220_200_960 - 8 * MIB);
        assert_eq!(r.limit_bytes, Some(256 * MIB));
        // 202 MiB of 256 MiB: 78.9 %.
        let p = r.percent().unwrap();
        assert!((p - 78.906).abs() < 0.01, "{p}");
        assert!(!r.over(80));
        assert!(r.over(78));
    }

    #[test]
    fn v1_without_a_limit_never_triggers() {
        let r = Reading::parse(
            CgroupVersion::V1,
            "220200960",
            "9223372036854771712",
            V1_STAT,
        )
        .unwrap();
        assert_eq!(r.limit_bytes, None);
        assert_eq!(r.percent(), None);
        assert!(!r.over(1));
    }

    #[test]
    fn v2_working_set_and_limit() {
        let r = Reading::parse(CgroupVersion::V2, "230686720\n", "268435456\n", V2_STAT).unwrap();
        assert_eq!(r.working_set_bytes, 230_686_720 - 8 * MIB);
        assert!(r.over(80), "{:?}", r.percent());
        let unlimited = Reading::parse(CgroupVersion::V2, "230686720", "max\n", V2_STAT).unwrap();
        assert_eq!(unlimited.limit_bytes, None);
        assert!(!unlimited.over(80));
    }

    #[test]
    fn inactive_file_above_usage_is_a_zero_working_set() {
        let r = Reading::parse(CgroupVersion::V2, "4096", "8192", "inactive_file 65536\n").unwrap();
        assert_eq!(r.working_set_bytes, 0);
        assert!(!r.over(1));
    }

    #[test]
    fn malformed_files_name_the_file() {
        let e = Reading::parse(CgroupVersion::V1, "lots", "1", V1_STAT).unwrap_err();
        assert!(e.to_string().contains("memory.usage_in_bytes"), "{e}");
        let e = Reading::parse(CgroupVersion::V2, "1", "1", "anon 1\n").unwrap_err();
        assert_eq!(e, MemoryError::MissingStat("inactive_file"));
        let e = Reading::parse(CgroupVersion::V2, "1", "unlimited", V2_STAT).unwrap_err();
        assert!(e.to_string().contains("memory.max"), "{e}");
        // A v1 stat of a kernel without hierarchical counters still reads.
        let r = Reading::parse(CgroupVersion::V1, "100", "200", "inactive_file 10\n").unwrap();
        assert_eq!(r.working_set_bytes, 90);
    }

    #[test]
    fn thresholds_at_the_edge() {
        let r = Reading {
            working_set_bytes: 80,
            limit_bytes: Some(100),
        };
        assert!(r.over(80));
        assert!(!r.over(81));
        assert!(r.over(1));
        let zero = Reading {
            working_set_bytes: 80,
            limit_bytes: Some(0),
        };
        assert!(!zero.over(1));
    }

    #[test]
    fn rate_limit_gap() {
        // Short heartbeats, cheap checkpoints: the floor.
        assert_eq!(
            min_gap(Some(Duration::from_secs(10)), Some(Duration::from_secs(1))),
            MIN_GAP
        );
        // An expensive checkpoint: ten times its cost.
        assert_eq!(
            min_gap(Some(Duration::from_secs(60)), Some(Duration::from_secs(9))),
            Duration::from_secs(90)
        );
        // A long heartbeat: a quarter of it.
        assert_eq!(
            min_gap(
                Some(Duration::from_secs(3600)),
                Some(Duration::from_secs(1))
            ),
            Duration::from_secs(900)
        );
        // `auto`, never checkpointed: a quarter of the assumed interval.
        assert_eq!(min_gap(None, None), Duration::from_secs(150));
    }

    #[test]
    fn verdicts() {
        let gap = Duration::from_secs(30);
        assert_eq!(verdict(false, None, gap, 1_000), Verdict::Checkpoint);
        assert_eq!(verdict(true, None, gap, 1_000), Verdict::InFlight);
        assert_eq!(
            verdict(false, Some(10_000), gap, 20_000),
            Verdict::RateLimited {
                until_unix_ms: 40_000
            }
        );
        assert_eq!(
            verdict(false, Some(10_000), gap, 40_000),
            Verdict::Checkpoint
        );
        // In flight wins over everything.
        assert_eq!(verdict(true, Some(0), gap, 99_000_000), Verdict::InFlight);
    }
}
