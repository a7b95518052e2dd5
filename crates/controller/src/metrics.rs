//! Prometheus metrics (`/metrics`), prefix `stasis_controller_`.

use std::sync::Arc;

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
        m.failed("pods", &crate::Error::Missing("x"));
        m.admitted("ColdStart", "NoPolicy");
        let text = m.encode();
        for name in [
            "stasis_controller_reconciles_total{controller=\"pods\"} 1",
            "stasis_controller_checkpoints_scheduled_total 1",
            "stasis_controller_reconcile_errors_total{controller=\"pods\",error=\"missing\"} 1",
            "stasis_controller_admissions_total{decision=\"ColdStart\",reason=\"NoPolicy\"} 1",
        ] {
            assert!(text.contains(name), "{name} in\n{text}");
        }
    }
}
