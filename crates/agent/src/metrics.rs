//! The agent's Prometheus metrics, hand-written (no registry crate): counters and histograms
//! behind one mutex, rendered in the text exposition format.
//!
//! - `stasis_agent_checkpoints_total{result}` / `stasis_agent_restores_total{result}`
//! - `stasis_agent_phase_seconds{phase}` histogram: `freeze`, `dump`, `upload`, `fetch`,
//!   `checkpoint_total`
//! - `stasis_agent_checkpoint_bytes_total{kind}`: `logical` (captured), `uploaded` (new, stored);
//!   `stasis_agent_fetched_bytes_total`
//! - `stasis_agent_errors_total{kind}` (kinds: `AgentError::kind`)
//! - `stasis_agent_cloud_notices_total{kind}` (the cloud announced the node's end)
//! - `stasis_agent_memory_triggers_total{kind}` (memory checkpoints started: `ContainerLimit`,
//!   `NodePressure`)
//! - `stasis_agent_up` 1, `stasis_agent_ready` (the node-ready checks)

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

const BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    counters: BTreeMap<(&'static str, String), u64>,
    hist: BTreeMap<String, Histogram>,
    ready: bool,
}

#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

const HELP: &[(&str, &str, &str)] = &[
    (
        "stasis_agent_checkpoints_total",
        "counter",
        "Checkpoints by result (succeeded, failed, fenced, skipped).",
    ),
    (
        "stasis_agent_restores_total",
        "counter",
        "Restores by result (prepared, failed, restored, cold_start).",
    ),
    (
        "stasis_agent_checkpoint_bytes_total",
        "counter",
        "Checkpoint bytes: logical (captured) and uploaded (new chunks, stored).",
    ),
    (
        "stasis_agent_fetched_bytes_total",
        "counter",
        "Bytes of checkpoints fetched and verified for restores.",
    ),
    ("stasis_agent_errors_total", "counter", "Errors by kind."),
    (
        "stasis_agent_cloud_notices_total",
        "counter",
        "Notices of the node's end from its cloud, by kind (Reclaim, Maintenance, RebalanceRecommendation).",
    ),
    (
        "stasis_agent_memory_triggers_total",
        "counter",
        "Memory checkpoints started, by cause (ContainerLimit: a container passed the policy's share of its limit; NodePressure: the node reports MemoryPressure).",
    ),
];

impl Metrics {
    fn inc(&self, name: &'static str, label: &str, by: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *g.counters.entry((name, label.to_owned())).or_default() += by;
    }

    pub fn checkpoint(&self, result: &str) {
        self.inc("stasis_agent_checkpoints_total", result, 1);
    }
    pub fn restore(&self, result: &str) {
        self.inc("stasis_agent_restores_total", result, 1);
    }
    pub fn error(&self, kind: &str) {
        self.inc("stasis_agent_errors_total", kind, 1);
    }
    pub fn notice(&self, kind: &str) {
        self.inc("stasis_agent_cloud_notices_total", kind, 1);
    }
    pub fn memory_trigger(&self, kind: &str) {
        self.inc("stasis_agent_memory_triggers_total", kind, 1);
    }
    pub fn checkpoint_bytes(&self, logical: u64, uploaded: u64) {
        self.inc("stasis_agent_checkpoint_bytes_total", "logical", logical);
        self.inc("stasis_agent_checkpoint_bytes_total", "uploaded", uploaded);
    }
    pub fn fetched_bytes(&self, n: u64) {
        self.inc("stasis_agent_fetched_bytes_total", "", n);
    }
    pub fn set_ready(&self, ready: bool) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).ready = ready;
    }

    /// Observes a phase duration in milliseconds.
    pub fn phase_ms(&self, phase: &str, ms: u64) {
        let secs = ms as f64 / 1000.0;
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let h = g.hist.entry(phase.to_owned()).or_insert_with(|| Histogram {
            counts: vec![0; BUCKETS.len()],
            ..Default::default()
        });
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = String::new();
        s.push_str("# HELP stasis_agent_up The agent is running.\n# TYPE stasis_agent_up gauge\nstasis_agent_up 1\n");
        let _ = writeln!(
            s,
            "# HELP stasis_agent_ready The node passes the restore checks (label stasis.dev/ready).\n# TYPE stasis_agent_ready gauge\nstasis_agent_ready {}",
            u8::from(g.ready)
        );
        for (name, kind, help) in HELP {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            let label = match *name {
                "stasis_agent_checkpoints_total" | "stasis_agent_restores_total" => "result",
                _ => "kind",
            };
            for ((n, l), v) in g.counters.iter().filter(|((n, _), _)| n == name) {
                if l.is_empty() {
                    let _ = writeln!(s, "{n} {v}");
                } else {
                    let _ = writeln!(s, "{n}{{{label}=\"{}\"}} {v}", escape(l));
                }
            }
        }
        s.push_str("# HELP stasis_agent_phase_seconds Duration of checkpoint and restore phases.\n# TYPE stasis_agent_phase_seconds histogram\n");
        for (phase, h) in &g.hist {
            let p = escape(phase);
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "stasis_agent_phase_seconds_bucket{{phase=\"{p}\",le=\"{b}\"}} {}",
                    h.counts[i]
                );
            }
            let _ = writeln!(
                s,
                "stasis_agent_phase_seconds_bucket{{phase=\"{p}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                s,
                "stasis_agent_phase_seconds_sum{{phase=\"{p}\"}} {}",
                h.sum
            );
            let _ = writeln!(
                s,
                "stasis_agent_phase_seconds_count{{phase=\"{p}\"}} {}",
                h.count
            );
        }
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.checkpoint("succeeded");
        m.checkpoint("succeeded");
        m.checkpoint("fenced");
        m.error("store");
        m.memory_trigger("ContainerLimit");
        m.checkpoint_bytes(100, 10);
        m.fetched_bytes(7);
        m.phase_ms("freeze", 200);
        m.phase_ms("freeze", 3000);
        m.set_ready(true);
        let t = m.render();
        for want in [
            "stasis_agent_up 1",
            "stasis_agent_ready 1",
            "stasis_agent_checkpoints_total{result=\"succeeded\"} 2",
            "stasis_agent_checkpoints_total{result=\"fenced\"} 1",
            "stasis_agent_errors_total{kind=\"store\"} 1",
            "stasis_agent_memory_triggers_total{kind=\"ContainerLimit\"} 1",
            "stasis_agent_checkpoint_bytes_total{kind=\"uploaded\"} 10",
            "stasis_agent_fetched_bytes_total 7",
            "stasis_agent_phase_seconds_bucket{phase=\"freeze\",le=\"0.25\"} 1",
            "stasis_agent_phase_seconds_bucket{phase=\"freeze\",le=\"5\"} 2",
            "stasis_agent_phase_seconds_bucket{phase=\"freeze\",le=\"+Inf\"} 2",
            "stasis_agent_phase_seconds_sum{phase=\"freeze\"} 3.2",
            "# TYPE stasis_agent_phase_seconds histogram",
        ] {
            assert!(t.contains(want), "missing {want} in\n{t}");
        }
        assert_eq!(escape("a\"b"), "a\\\"b");
    }
}
