//! Prometheus metrics (`/metrics`), prefix `stasis_controller_`.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabel {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: String,
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

/// One opted-in pod.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub decision: String,
    pub reason: String,
}

/// Every metric of the controller and the webhook.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Arc<Registry>,
    /// Reconciles run, per controller (`pods`, `checkpoints`, `policies`, `restores`).
    pub reconciles: Family<ControllerLabel, Counter>,
    /// Reconcile errors, per controller and error label.
    pub errors: Family<ErrorLabels, Counter>,
    /// Heartbeat `PodCheckpoint`s created.
    pub checkpoints_scheduled: Counter,
    /// Heartbeats skipped, by reason (`FreezeBudgetExceeded`).
    pub checkpoints_skipped: Family<ReasonLabel, Counter>,
    /// Checkpoints refused because a newer claim fenced their generation off.
    pub checkpoints_fenced: Counter,
    /// Checkpoints deleted by retention.
    pub checkpoints_deleted: Counter,
    /// Admission decisions, by decision (`Restore`, `ColdStart`, `Skipped`) and reason.
    pub admissions: Family<DecisionLabels, Counter>,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
    /// Objects refused because they named a lineage they do not hold, by reason
    /// (`ClaimTokenCopied`, `OtherNamespace`, `NotHolder`, `LineageMismatch`).
    pub refused: Family<ReasonLabel, Counter>,
    /// Lineage records deleted by the sweep (workload gone, no checkpoints).
    pub records_collected: Counter,
    /// Restores that found their checkpoint gone or damaged in the store (an alarm: the
    /// lineage cold-starts instead of restoring older memory).
    pub checkpoints_damaged: Counter,
    /// Per pod the controller checkpoints (running, under a policy; leader only): when its
    /// newest succeeded checkpoint froze it, Unix seconds, or when the pod started while it has
    /// none. `time() - this > 2 * checkpoint_interval_seconds` is a checkpoint older than twice
    /// its interval (the chart's `StasisCheckpointTooOld` alert).
    pub last_checkpoint: Family<PodLabels, Gauge<f64, AtomicU64>>,
    /// Per pod the controller checkpoints: its policy's heartbeat interval, seconds.
    pub checkpoint_interval: Family<PodLabels, Gauge<f64, AtomicU64>>,
    /// The pods of the two families above, so pods that are gone lose their series.
    pods: Arc<Mutex<HashSet<PodLabels>>>,
    /// Chunk garbage collections (`crate::gc`), by result (`swept`, `skipped`, `busy`,
    /// `failed`).
    pub gc_runs: Family<ResultLabel, Counter>,
    /// Chunks and stored bytes the collections deleted.
    pub gc_swept_chunks: Counter,
    pub gc_swept_bytes: Counter,
    /// When the last collection ended, Unix seconds.
    pub gc_last_run: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("stasis_controller");
        let m = Self {
            registry: Arc::new(Registry::default()),
            reconciles: Family::default(),
            errors: Family::default(),
            checkpoints_scheduled: Counter::default(),
            checkpoints_skipped: Family::default(),
            checkpoints_fenced: Counter::default(),
            checkpoints_deleted: Counter::default(),
            admissions: Family::default(),
            leader: Gauge::default(),
            refused: Family::default(),
            records_collected: Counter::default(),
            checkpoints_damaged: Counter::default(),
            last_checkpoint: Family::default(),
            checkpoint_interval: Family::default(),
            pods: Arc::default(),
            gc_runs: Family::default(),
            gc_swept_chunks: Counter::default(),
            gc_swept_bytes: Counter::default(),
            gc_last_run: Gauge::default(),
        };
        registry.register("reconciles", "Reconciles run", m.reconciles.clone());
        registry.register("reconcile_errors", "Reconcile errors", m.errors.clone());
        registry.register(
            "checkpoints_scheduled",
            "Heartbeat PodCheckpoints created",
            m.checkpoints_scheduled.clone(),
        );
        registry.register(
            "checkpoints_skipped",
            "Heartbeat checkpoints skipped",
            m.checkpoints_skipped.clone(),
        );
        registry.register(
            "checkpoints_fenced",
            "Checkpoints refused: their lineage generation was fenced off",
            m.checkpoints_fenced.clone(),
        );
        registry.register(
            "checkpoints_deleted",
            "Checkpoints deleted by retention",
            m.checkpoints_deleted.clone(),
        );
        registry.register(
            "admissions",
            "Restore decisions at admission",
            m.admissions.clone(),
        );
        registry.register("leader", "1 while this replica leads", m.leader.clone());
        registry.register(
            "refused",
            "Pods, checkpoints and restores refused for naming a lineage they do not hold",
            m.refused.clone(),
        );
        registry.register(
            "records_collected",
            "Lineage records deleted by the sweep",
            m.records_collected.clone(),
        );
        registry.register(
            "checkpoints_damaged",
            "Restores that found their checkpoint gone or damaged in the store",
            m.checkpoints_damaged.clone(),
        );
        registry.register(
            "last_checkpoint_timestamp_seconds",
            "Per checkpointed pod: when its newest succeeded checkpoint froze it (Unix s), or when it started while it has none",
            m.last_checkpoint.clone(),
        );
        registry.register(
            "checkpoint_interval_seconds",
            "Per checkpointed pod: its policy's heartbeat interval",
            m.checkpoint_interval.clone(),
        );
        registry.register(
            "gc_runs",
            "Chunk garbage collections, by result (swept, skipped, busy, failed)",
            m.gc_runs.clone(),
        );
        registry.register(
            "gc_swept_chunks",
            "Unreferenced chunks deleted by garbage collection",
            m.gc_swept_chunks.clone(),
        );
        registry.register(
            "gc_swept_bytes",
            "Stored bytes of the chunks deleted by garbage collection",
            m.gc_swept_bytes.clone(),
        );
        registry.register(
            "gc_last_run_timestamp_seconds",
            "When the last chunk garbage collection ended (Unix s)",
            m.gc_last_run.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..m
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, controller: &str) {
        self.reconciles
            .get_or_create(&ControllerLabel {
                controller: controller.to_owned(),
            })
            .inc();
    }

    pub fn failed(&self, controller: &str, error: &crate::Error) {
        self.errors
            .get_or_create(&ErrorLabels {
                controller: controller.to_owned(),
                error: error.metric_label().to_owned(),
            })
            .inc();
    }

    pub fn admitted(&self, decision: &str, reason: &str) {
        self.admissions
            .get_or_create(&DecisionLabels {
                decision: decision.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn refused(&self, reason: &str) {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Records a checkpointed pod's newest checkpoint (or start, `last_unix_ms`) and interval.
    pub fn checkpoint_freshness(
        &self,
        namespace: &str,
        pod: &str,
        last_unix_ms: u64,
        interval: Duration,
    ) {
        let l = PodLabels {
            namespace: namespace.to_owned(),
            pod: pod.to_owned(),
        };
        self.last_checkpoint
            .get_or_create(&l)
            .set(last_unix_ms as f64 / 1000.0);
        self.checkpoint_interval
            .get_or_create(&l)
            .set(interval.as_secs_f64());
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(l);
    }

    /// Drops the freshness series of pods `keep(namespace, pod)` refuses (gone, stopped, no
    /// longer under a policy): a stale series would raise the age alert for a pod that no
    /// longer exists.
    pub fn retain_pods(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        pods.retain(|l| {
            let kept = keep(&l.namespace, &l.pod);
            if !kept {
                self.last_checkpoint.remove(l);
                self.checkpoint_interval.remove(l);
            }
            kept
        });
    }

    /// Counts one chunk garbage collection.
    pub fn gc_ran(&self, r: &crate::gc::Report) {
        self.gc_runs
            .get_or_create(&ResultLabel {
                result: r.outcome.label().to_owned(),
            })
            .inc();
        self.gc_swept_chunks.inc_by(r.chunks_swept);
        self.gc_swept_bytes.inc_by(r.bytes_swept);
        self.gc_last_run.set(crate::now_ms() as f64 / 1000.0);
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names() {
        let m = Metrics::default();
        m.reconciled("pods");
        m.checkpoints_scheduled.inc();
        m.failed("pods", &crate::Error::Invariant("x"));
        m.admitted("ColdStart", "NoPolicy");
        m.gc_ran(&crate::gc::Report {
            chunks_swept: 3,
            bytes_swept: 300,
            ..crate::gc::Report::default()
        });
        let text = m.encode();
        for name in [
            "stasis_controller_reconciles_total{controller=\"pods\"} 1",
            "stasis_controller_checkpoints_scheduled_total 1",
            "stasis_controller_reconcile_errors_total{controller=\"pods\",error=\"invariant\"} 1",
            "stasis_controller_admissions_total{decision=\"ColdStart\",reason=\"NoPolicy\"} 1",
            "stasis_controller_gc_runs_total{result=\"swept\"} 1",
            "stasis_controller_gc_swept_chunks_total 3",
            "stasis_controller_gc_swept_bytes_total 300",
            "# TYPE stasis_controller_gc_last_run_timestamp_seconds gauge",
        ] {
            assert!(text.contains(name), "{name} in\n{text}");
        }
    }

    #[test]
    fn checkpoint_freshness_per_pod_until_the_pod_is_gone() {
        let m = Metrics::default();
        m.checkpoint_freshness("prod", "a", 1_700_000_000_500, Duration::from_secs(30));
        m.checkpoint_freshness("prod", "b", 1_700_000_100_000, Duration::from_millis(1500));
        // A newer checkpoint replaces the value, it adds no series.
        m.checkpoint_freshness("prod", "a", 1_700_000_030_000, Duration::from_secs(30));
        let text = m.encode();
        for line in [
            "# TYPE stasis_controller_last_checkpoint_timestamp_seconds gauge",
            "stasis_controller_last_checkpoint_timestamp_seconds{namespace=\"prod\",pod=\"a\"} 1700000030.0",
            "stasis_controller_checkpoint_interval_seconds{namespace=\"prod\",pod=\"a\"} 30.0",
            "stasis_controller_checkpoint_interval_seconds{namespace=\"prod\",pod=\"b\"} 1.5",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("1700000000.5"), "{text}");
        m.retain_pods(|ns, pod| ns == "prod" && pod == "b");
        let text = m.encode();
        assert!(!text.contains("pod=\"a\""), "{text}");
        assert!(text.contains("pod=\"b\"} 1.5"), "{text}");
    }
}
