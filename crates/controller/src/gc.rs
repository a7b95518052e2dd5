//! In-cluster chunk garbage collection (docs/design.md §13.5a): while this replica leads, every
//! `--gc-interval-seconds` the store's mark-and-sweep ([`Store::gc`]) runs once per namespace
//! data key, so the chunks of checkpoints that retention dropped leave the bucket.
//!
//! Retention stays the reconcilers' (lineage records, policies, pinned restores): the store's
//! own retention is not used here (`keep_last` unbounded), so this only sweeps chunks that no
//! remaining manifest of the key names. Everything that makes a sweep safe is the store's:
//! the GC lock in the bucket (one sweep at a time, whatever runs it: another controller, a
//! `stasis gc` by hand), writers' and readers' leases (a live one skips the sweep), chunks
//! younger than the grace period spared, and no sweep while a kept manifest of the key cannot be
//! read.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use stasis_api::keys::{self, ClusterKey};
use stasis_service::shutdown::Shutdown;
use stasis_store::{Key, Store, StoreError};

use crate::metrics::Metrics;

/// Where and how often the collector runs.
pub struct GcSetup {
    pub client: kube::Client,
    /// stasis's namespace (the cluster key and data key Secrets).
    pub namespace: String,
    /// The cluster key Secret (re-read at each run, so a rotated ring is used at once).
    pub cluster_key_secret: String,
    pub store: Store,
    pub interval: Duration,
    /// Unreferenced chunks younger than this are left (the store's grace period).
    pub grace: Duration,
}

/// How one run ended (the `result` label of `stasis_controller_gc_runs_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Outcome {
    /// Every namespace's key was swept.
    #[default]
    Swept,
    /// At least one key's sweep did not run (a live lease, an unreadable kept manifest, a data
    /// key that did not unwrap); the next run tries again.
    Skipped,
    /// Another collector held the store's GC lock.
    Busy,
    /// The API server or the store failed.
    Failed,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Swept => "swept",
            Outcome::Skipped => "skipped",
            Outcome::Busy => "busy",
            Outcome::Failed => "failed",
        }
    }
}

/// What one run did, summed over the namespaces.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    pub outcome: Outcome,
    /// Namespaces whose key was collected.
    pub namespaces: u64,
    pub chunks_swept: u64,
    pub bytes_swept: u64,
    pub chunks_kept: u64,
    pub chunks_spared_young: u64,
    pub expired_leases_removed: u64,
    /// Per namespace, why its sweep did not run (or why the run stopped).
    pub skipped: BTreeMap<String, String>,
}

/// The namespace data keys stasis holds: every `stasis-key-<namespace>` Secret of `home`,
/// unwrapped with the cluster key ring. A Secret that does not unwrap is returned as an error
/// for its namespace: its chunks are left alone (nothing can tell which of them are garbage).
pub async fn data_keys(
    client: &kube::Client,
    home: &str,
    ring: &ClusterKey,
) -> Result<Vec<(String, Result<Key, String>)>, kube::Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), home);
    let list = api
        .list(&ListParams::default().labels(stasis_api::names::NAMESPACE))
        .await?;
    let mut out = Vec::new();
    for s in list.items {
        let Some(ns) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(stasis_api::names::NAMESPACE))
            .cloned()
        else {
            continue;
        };
        // Only the Secret stasis names for the namespace: another object carrying the label is
        // not a data key.
        if s.metadata.name.as_deref() != Some(keys::secret_name(&ns).as_str()) {
            continue;
        }
        let key = keys::unwrap_secret(ring, &ns, &s)
            .map(|k| Key::from_secret(&k))
            .map_err(|e| e.to_string());
        out.push((ns, key));
    }
    Ok(out)
}

/// One collection: the ring, the data keys, then the store's GC for each key in turn.
pub async fn run_once(setup: &GcSetup) -> Report {
    let mut report = Report::default();
    let ring =
        match crate::broker::load_ring(&setup.client, &setup.namespace, &setup.cluster_key_secret)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                report.outcome = Outcome::Failed;
                report.skipped.insert(
                    String::new(),
                    format!("the cluster key could not be read: {e}"),
                );
                return report;
            }
        };
    let keys = match data_keys(&setup.client, &setup.namespace, &ring).await {
        Ok(k) => k,
        Err(e) => {
            report.outcome = Outcome::Failed;
            report.skipped.insert(
                String::new(),
                format!("the data key Secrets could not be listed: {e}"),
            );
            return report;
        }
    };
    for (ns, key) in keys {
        let key = match key {
            Ok(k) => k,
            Err(why) => {
                report.outcome = Outcome::Skipped;
                report.skipped.insert(
                    ns.clone(),
                    format!("its data key does not unwrap with the cluster key ({why}); its chunks are left"),
                );
                continue;
            }
        };
        match setup.store.gc(&key, usize::MAX, setup.grace).await {
            Ok(r) => {
                report.namespaces += 1;
                report.chunks_swept += r.chunks_deleted;
                report.bytes_swept += r.bytes_deleted;
                report.chunks_kept += r.chunks_kept;
                report.chunks_spared_young += r.chunks_spared_young;
                report.expired_leases_removed += r.expired_leases_removed;
                if let Some(why) = r.sweep_skipped {
                    report.outcome = Outcome::Skipped;
                    report.skipped.insert(ns, why);
                }
            }
            Err(e @ StoreError::GcBusy { .. }) => {
                report.outcome = Outcome::Busy;
                report.skipped.insert(ns, e.to_string());
                return report;
            }
            Err(e) => {
                report.outcome = Outcome::Failed;
                report.skipped.insert(ns, e.to_string());
                return report;
            }
        }
    }
    report
}

/// How long a new leader waits before its first collection, at most: not at once (a controller
/// in a restart loop does not collect at each start), not a whole interval (one restarted more
/// often than the interval would never collect).
pub const FIRST_RUN_AFTER: Duration = Duration::from_secs(600);

/// Runs [`run_once`] every `setup.interval` (the first after `interval`, at most
/// [`FIRST_RUN_AFTER`]) until `shutdown`.
pub async fn run(setup: GcSetup, metrics: Metrics, shutdown: Shutdown) {
    tracing::info!(
        interval_s = setup.interval.as_secs(),
        grace_s = setup.grace.as_secs(),
        store = %setup.store.url(),
        "chunk garbage collection on"
    );
    let mut wait = setup.interval.min(FIRST_RUN_AFTER);
    loop {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.wait() => return,
        }
        wait = setup.interval;
        let started = Instant::now();
        let report = run_once(&setup).await;
        metrics.gc_ran(&report);
        let skipped: Vec<String> = report
            .skipped
            .iter()
            .map(|(ns, why)| {
                if ns.is_empty() {
                    why.clone()
                } else {
                    format!("{ns}: {why}")
                }
            })
            .collect();
        // One structured line per run, whatever its result; the reasons again as a warning when
        // something was left.
        tracing::info!(
            result = report.outcome.label(),
            namespaces = report.namespaces,
            chunks_swept = report.chunks_swept,
            bytes_swept = report.bytes_swept,
            chunks_kept = report.chunks_kept,
            chunks_spared_young = report.chunks_spared_young,
            expired_leases_removed = report.expired_leases_removed,
            duration_ms = started.elapsed().as_millis() as u64,
            skipped = ?skipped,
            "chunk garbage collection"
        );
        if matches!(report.outcome, Outcome::Skipped | Outcome::Failed) {
            tracing::warn!(result = report.outcome.label(), reasons = ?skipped, "chunk garbage collection left chunks in the store; the next run tries again");
        }
    }
}
