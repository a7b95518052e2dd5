//! The agent's Prometheus metrics, in a `prometheus-client` registry (served as `/metrics` by
//! [`stasis_service::admin`]):
//!
//! - `stasis_agent_checkpoints_total{result}` / `stasis_agent_restores_total{result}`
//! - `stasis_agent_phase_seconds{phase}` histogram: `freeze`, `dump`, `upload`, `fetch`,
//!   `restore`, `checkpoint_total`
//! - `stasis_agent_checkpoint_bytes_total{kind}`: `logical` (captured), `uploaded` (new, stored);
//!   `stasis_agent_fetched_bytes_total`
//! - `stasis_agent_errors_total{kind}` (kinds: `AgentError::kind`)
//! - `stasis_agent_cloud_notices_total{kind}` (the cloud announced the node's end)
//! - `stasis_agent_memory_triggers_total{kind}` (memory checkpoints started: `ContainerLimit`,
//!   `NodePressure`)
//! - `stasis_agent_prestaged_bytes_total`, `stasis_agent_prestaged_checkpoints_total` (other
//!   nodes' checkpoints fetched into this node's chunk cache ahead of their restore);
//!   `stasis_agent_chunk_cache_hits_total` / `_misses_total` (chunks restores read from the cache,
//!   or looked up there and fetched from the store), `stasis_agent_chunk_cache_bytes`
//! - `stasis_agent_up` 1, `stasis_agent_ready` (the node-ready checks)
//!
//! The chart's dashboard and alerts use these names (`scripts/lint chart` checks them against
//! [`EXPOSED`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use stasis_service::admin::Exposition;

/// Histogram buckets of `stasis_agent_phase_seconds`, seconds.
const BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// Every name the exposition holds (the chart's dashboard and alerts are checked against it;
/// the test below checks the exposition holds them).
pub const EXPOSED: &[&str] = &[
    "stasis_agent_up",
    "stasis_agent_ready",
    "stasis_agent_checkpoints_total",
    "stasis_agent_restores_total",
    "stasis_agent_checkpoint_bytes_total",
    "stasis_agent_fetched_bytes_total",
    "stasis_agent_errors_total",
    "stasis_agent_cloud_notices_total",
    "stasis_agent_memory_triggers_total",
    "stasis_agent_prestaged_bytes_total",
    "stasis_agent_prestaged_checkpoints_total",
    "stasis_agent_chunk_cache_hits_total",
    "stasis_agent_chunk_cache_misses_total",
    "stasis_agent_chunk_cache_bytes",
    "stasis_agent_phase_seconds_bucket",
    "stasis_agent_phase_seconds_sum",
    "stasis_agent_phase_seconds_count",
];

// Label values are fixed words of the code (results, `AgentError::kind`, phases, notice and
// memory causes), never input: prometheus-client 0.24 writes them without escaping.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

fn phase_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

type PhaseFamily = Family<PhaseLabel, Histogram, fn() -> Histogram>;

/// The agent's counters, gauges and histogram, and the registry that holds them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    checkpoints: Family<ResultLabel, Counter>,
    restores: Family<ResultLabel, Counter>,
    checkpoint_bytes: Family<KindLabel, Counter>,
    fetched_bytes: Counter,
    errors: Family<KindLabel, Counter>,
    notices: Family<KindLabel, Counter>,
    memory_triggers: Family<KindLabel, Counter>,
    prestaged_bytes: Counter,
    prestaged: Counter,
    cache_hits: Counter,
    cache_misses: Counter,
    cache_bytes: Gauge,
    ready: Gauge,
    phases: PhaseFamily,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let up: Gauge = Gauge::default();
        up.set(1);
        let m = Self {
            registry: Registry::default(),
            checkpoints: Family::default(),
            restores: Family::default(),
            checkpoint_bytes: Family::default(),
            fetched_bytes: Counter::default(),
            errors: Family::default(),
            notices: Family::default(),
            memory_triggers: Family::default(),
            prestaged_bytes: Counter::default(),
            prestaged: Counter::default(),
            cache_hits: Counter::default(),
            cache_misses: Counter::default(),
            cache_bytes: Gauge::default(),
            ready: Gauge::default(),
            phases: Family::new_with_constructor(phase_histogram),
        };
        // Counters are registered without `_total`: the encoder adds it.
        registry.register("stasis_agent_up", "The agent is running.", up);
        registry.register(
            "stasis_agent_ready",
            "The node passes the restore checks (label stasis.dev/ready).",
            m.ready.clone(),
        );
        registry.register(
            "stasis_agent_checkpoints",
            "Checkpoints by result (succeeded, failed, fenced, skipped; final_skipped: a final checkpoint that could not finish before its deadline; superseded: a heartbeat whose upload gave way to its pod's final checkpoint; final_adopted: a final checkpoint that is the heartbeat captured as the stop came).",
            m.checkpoints.clone(),
        );
        registry.register(
            "stasis_agent_restores",
            "Restores by result (prepared, failed, restored, cold_start, damaged).",
            m.restores.clone(),
        );
        registry.register(
            "stasis_agent_checkpoint_bytes",
            "Checkpoint bytes: logical (captured) and uploaded (new chunks, stored).",
            m.checkpoint_bytes.clone(),
        );
        registry.register(
            "stasis_agent_fetched_bytes",
            "Bytes of checkpoints fetched and verified for restores.",
            m.fetched_bytes.clone(),
        );
        registry.register("stasis_agent_errors", "Errors by kind.", m.errors.clone());
        registry.register(
            "stasis_agent_cloud_notices",
            "Notices of the node's end from its cloud, by kind (Reclaim, Maintenance, RebalanceRecommendation).",
            m.notices.clone(),
        );
        registry.register(
            "stasis_agent_memory_triggers",
            "Memory checkpoints started, by cause (ContainerLimit: a container passed the policy's share of its limit; NodePressure: the node reports MemoryPressure).",
            m.memory_triggers.clone(),
        );
        registry.register(
            "stasis_agent_prestaged_bytes",
            "Bytes of other nodes' checkpoints fetched into this node's chunk cache ahead of their restore (new chunks only).",
            m.prestaged_bytes.clone(),
        );
        registry.register(
            "stasis_agent_prestaged_checkpoints",
            "Checkpoints of pods on at-risk nodes pre-staged into this node's chunk cache.",
            m.prestaged.clone(),
        );
        registry.register(
            "stasis_agent_chunk_cache_hits",
            "Chunks read from the node's chunk cache (authenticated) instead of the store.",
            m.cache_hits.clone(),
        );
        registry.register(
            "stasis_agent_chunk_cache_misses",
            "Chunks looked up in the node's chunk cache and fetched from the store.",
            m.cache_misses.clone(),
        );
        registry.register(
            "stasis_agent_chunk_cache_bytes",
            "Bytes held in the node's chunk cache.",
            m.cache_bytes.clone(),
        );
        registry.register(
            "stasis_agent_phase_seconds",
            "Duration of checkpoint and restore phases.",
            m.phases.clone(),
        );
        Self { registry, ..m }
    }
}

fn label<L>(f: impl FnOnce(String) -> L, v: &str) -> L {
    f(v.to_owned())
}

impl Metrics {
    pub fn checkpoint(&self, result: &str) {
        self.checkpoints
            .get_or_create(&label(|result| ResultLabel { result }, result))
            .inc();
    }
    pub fn restore(&self, result: &str) {
        self.restores
            .get_or_create(&label(|result| ResultLabel { result }, result))
            .inc();
    }
    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&label(|kind| KindLabel { kind }, kind))
            .inc();
    }
    pub fn notice(&self, kind: &str) {
        self.notices
            .get_or_create(&label(|kind| KindLabel { kind }, kind))
            .inc();
    }
    pub fn memory_trigger(&self, kind: &str) {
        self.memory_triggers
            .get_or_create(&label(|kind| KindLabel { kind }, kind))
            .inc();
    }
    pub fn checkpoint_bytes(&self, logical: u64, uploaded: u64) {
        for (kind, n) in [("logical", logical), ("uploaded", uploaded)] {
            self.checkpoint_bytes
                .get_or_create(&label(|kind| KindLabel { kind }, kind))
                .inc_by(n);
        }
    }
    pub fn fetched_bytes(&self, n: u64) {
        self.fetched_bytes.inc_by(n);
    }
    /// A checkpoint pre-staged; `bytes` fetched for it.
    pub fn prestaged(&self, bytes: u64) {
        self.prestaged.inc();
        self.prestaged_bytes.inc_by(bytes);
    }
    /// The chunk cache's counts since it was opened (counters follow them up).
    pub fn chunk_cache(&self, s: stasis_store::CacheStats) {
        for (c, n) in [(&self.cache_hits, s.hits), (&self.cache_misses, s.misses)] {
            c.inc_by(n.saturating_sub(c.get()));
        }
        self.cache_bytes.set(s.bytes as i64);
    }
    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// Observes a phase duration in milliseconds.
    pub fn phase_ms(&self, phase: &str, ms: u64) {
        self.phases
            .get_or_create(&label(|phase| PhaseLabel { phase }, phase))
            .observe(ms as f64 / 1000.0);
    }

    /// The text exposition (OpenMetrics).
    pub fn render(&self) -> String {
        self.registry.encode()
    }
}

impl Exposition for Metrics {
    fn encode(&self) -> String {
        self.render()
    }
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
        m.notice("Reclaim");
        m.memory_trigger("ContainerLimit");
        m.restore("prepared");
        m.checkpoint_bytes(100, 10);
        m.fetched_bytes(7);
        m.prestaged(4096);
        m.chunk_cache(stasis_store::CacheStats {
            hits: 5,
            misses: 2,
            bytes: 9,
            ..Default::default()
        });
        m.chunk_cache(stasis_store::CacheStats {
            hits: 7,
            misses: 2,
            bytes: 3,
            ..Default::default()
        });
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
            "stasis_agent_prestaged_bytes_total 4096",
            "stasis_agent_prestaged_checkpoints_total 1",
            "stasis_agent_chunk_cache_hits_total 7",
            "stasis_agent_chunk_cache_misses_total 2",
            "stasis_agent_chunk_cache_bytes 3",
            "stasis_agent_phase_seconds_bucket{le=\"0.25\",phase=\"freeze\"} 1",
            "stasis_agent_phase_seconds_bucket{le=\"5.0\",phase=\"freeze\"} 2",
            "stasis_agent_phase_seconds_bucket{le=\"+Inf\",phase=\"freeze\"} 2",
            "stasis_agent_phase_seconds_sum{phase=\"freeze\"} 3.2",
            "# TYPE stasis_agent_phase_seconds histogram",
        ] {
            assert!(t.contains(want), "missing {want} in\n{t}");
        }
        for name in EXPOSED {
            assert!(
                t.lines()
                    .any(|l| l.starts_with(&format!("{name} "))
                        || l.starts_with(&format!("{name}{{"))),
                "{name} is not exposed:\n{t}"
            );
        }
    }
}
