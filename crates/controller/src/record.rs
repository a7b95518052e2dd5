//! Lineage records: where the controller keeps lineages, claims and generations (DESIGN §3).
//!
//! One ConfigMap per lineage in stasis's own namespace (never where workload pods can write),
//! named `stasis_api::lineage::record_name(<lineage id>)`, labelled
//! `stasis.dev/lineage-record=true` and `stasis.dev/workload=<16 hex of the workload key>`:
//!
//! - `lineage.json`: the `stasis_core::lineage::Lineage` (generation, holder token, orphaned,
//!   complete checkpoints, restore failures, bad checkpoints, in-flight final checkpoint); the
//!   agents read it to fence before a checkpoint becomes visible;
//! - `holder.json`: the controller's [`Holder`]: who holds the lineage (claim token, and the pod
//!   once seen), since when, and the restore decided for it at admission.
//!
//! Every change is a read-modify-write with the ConfigMap's resourceVersion as precondition
//! (a conflict is [`Error::Conflict`]; the caller re-reads and decides again), so a claim is
//! atomic: two pods can never both take the same orphaned lineage.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use serde::{Deserialize, Serialize};
use stasis_api::lineage::{record_name, RECORD_KEY};
use stasis_api::names;
use stasis_core::lineage::Lineage;
use stasis_core::reference::WorkloadName;

use crate::{Error, Result};

/// Who holds a lineage, as the controller knows it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// The holder token (`Lineage::holder`): the webhook's claim token, or the pod's UID for a
    /// pod the webhook never saw. The pod carries it as label `stasis.dev/claim-token`.
    pub token: String,
    /// When the claim was made (Unix ms): a claim whose pod never appears is released after a
    /// while.
    pub claimed_unix_ms: u64,
    /// The pod's name and UID once seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The checkpoint (`<lineage>/<id>`) the webhook decided to restore into this holder; the
    /// controller turns it into a `PodRestore` once the pod exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<String>,
    /// The pod the lineage was taken over from (the restore's source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pod: Option<String>,
}

/// A lineage record and the resourceVersion it was read at (`None`: not stored yet).
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Namespace of the workload (the pods and their `PodCheckpoint`s).
    pub namespace: String,
    pub lineage: Lineage,
    pub holder: Option<Holder>,
    pub resource_version: Option<String>,
    /// When the lineage was last orphaned or released (Unix ms; ConfigMap annotation
    /// [`names::ORPHANED_SINCE`]): the sweep deletes an empty lineage a while after it.
    pub orphaned_unix_ms: Option<u64>,
}

/// Data key of the holder (who holds the lineage, since when, the restore decided for it) in a
/// lineage record's ConfigMap.
pub const HOLDER_KEY: &str = "holder.json";

/// Label value form of a long key: the first 16 hex digits of its BLAKE3 hash.
pub fn short_hash(s: &str) -> String {
    blake3::hash(s.as_bytes()).to_hex()[..16].to_owned()
}

impl Record {
    /// A record not stored yet.
    pub fn new(namespace: &str, lineage: Lineage, holder: Option<Holder>) -> Self {
        Self {
            namespace: namespace.to_owned(),
            lineage,
            holder,
            resource_version: None,
            orphaned_unix_ms: None,
        }
    }

    /// The ConfigMap's name.
    pub fn name(&self) -> String {
        record_name(self.lineage.id.as_str())
    }

    /// The ConfigMap that stores the record.
    pub fn to_config_map(&self) -> Result<ConfigMap> {
        let mut data = BTreeMap::new();
        data.insert(RECORD_KEY.to_owned(), serde_json::to_string(&self.lineage)?);
        if let Some(h) = &self.holder {
            data.insert(HOLDER_KEY.to_owned(), serde_json::to_string(h)?);
        }
        let workload = self.lineage.workload.as_str();
        let mut labels = BTreeMap::from([
            (names::LINEAGE_RECORD.to_owned(), "true".to_owned()),
            (names::WORKLOAD.to_owned(), short_hash(workload)),
            (
                names::MANAGED_BY.0.to_owned(),
                names::MANAGED_BY.1.to_owned(),
            ),
            // A namespace name is a valid label value (≤ 63, DNS label).
            (names::NAMESPACE.to_owned(), self.namespace.clone()),
        ]);
        // What the agents stamp a pod's checkpoints from: only a registered holder (a UID the
        // controller saw on the pod itself) has one.
        if let Some(uid) = self.holder_uid() {
            labels.insert(names::HOLDER_UID.to_owned(), uid.to_owned());
        }
        Ok(ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.name()),
                resource_version: self.resource_version.clone(),
                labels: Some(labels),
                annotations: Some(
                    [
                        (
                            names::LINEAGE.to_owned(),
                            self.lineage.id.as_str().to_owned(),
                        ),
                        (names::WORKLOAD.to_owned(), workload.to_owned()),
                        (names::NAMESPACE.to_owned(), self.namespace.clone()),
                    ]
                    .into_iter()
                    .chain(
                        self.orphaned_unix_ms
                            .map(|t| (names::ORPHANED_SINCE.to_owned(), t.to_string())),
                    )
                    .collect(),
                ),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        })
    }

    /// Reads a record back from its ConfigMap.
    pub fn from_config_map(cm: &ConfigMap) -> Result<Self> {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let data = cm.data.as_ref();
        let lineage_json = data
            .and_then(|d| d.get(RECORD_KEY))
            .ok_or_else(|| Error::RecordWithoutLineage(name.clone()))?;
        let lineage: Lineage =
            serde_json::from_str(lineage_json).map_err(|source| Error::Record {
                name: name.clone(),
                source,
            })?;
        let holder = match data.and_then(|d| d.get(HOLDER_KEY)) {
            Some(h) => Some(serde_json::from_str(h).map_err(|source| Error::Record {
                name: name.clone(),
                source,
            })?),
            None => None,
        };
        let namespace = cm
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::NAMESPACE))
            .cloned()
            .unwrap_or_else(|| {
                // `<ns>_<kind>_<name>...`: the namespace is the key's first part.
                lineage
                    .workload
                    .as_str()
                    .split('_')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            });
        let orphaned_unix_ms = cm
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(names::ORPHANED_SINCE))
            .and_then(|t| t.parse().ok());
        Ok(Self {
            namespace,
            lineage,
            holder,
            resource_version: cm.metadata.resource_version.clone(),
            orphaned_unix_ms,
        })
    }

    /// The holder token, when the lineage is held.
    pub fn holder_token(&self) -> Option<&str> {
        (!self.lineage.orphaned)
            .then_some(self.lineage.holder.as_deref())
            .flatten()
    }

    /// The UID of the pod registered as holder (held or last held), once the controller saw it.
    pub fn holder_uid(&self) -> Option<&str> {
        self.holder.as_ref().and_then(|h| h.uid.as_deref())
    }

    /// Whether `pod` (by namespace and UID) is this record's holder: the record is of the pod's
    /// namespace and names the pod's UID as holder. A claim not registered yet (no UID) is held
    /// by nobody in particular: see [`Record::registrable_by`].
    pub fn held_by(&self, namespace: &str, uid: &str) -> bool {
        !uid.is_empty() && self.namespace == namespace && self.holder_uid() == Some(uid)
    }

    /// Whether a pod (namespace, UID, claim token) may be registered as this record's holder:
    /// same namespace, the record still held under that token, and no pod registered yet. The
    /// registration itself is a write at the read resourceVersion, so only the first pod seen
    /// with the token becomes the holder; any later one is an impostor.
    pub fn registrable_by(&self, namespace: &str, token: &str) -> bool {
        self.namespace == namespace
            && self.holder_token() == Some(token)
            && self.holder_uid().is_none()
    }
}

/// The lineage records in stasis's namespace.
#[derive(Clone)]
pub struct Records {
    api: Api<ConfigMap>,
    /// At most this many records per workload namespace (`None`: no limit).
    cap: Option<usize>,
}

/// Default of `--max-records-per-namespace`: far above what the workloads of one namespace
/// legitimately keep (one record per replica and per generation of replacements until the sweep
/// collects the empty ones), far below what would strain etcd.
pub const DEFAULT_MAX_RECORDS_PER_NAMESPACE: usize = 1000;

impl Records {
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            cap: None,
        }
    }

    /// Refuses to create a record in a namespace that has `cap` of them already
    /// ([`Error::RecordCap`]): records are created on behalf of tenants (every new pod of a
    /// workload without an orphaned lineage starts one), and they live in stasis's namespace,
    /// where no quota of theirs applies.
    pub fn with_cap(mut self, cap: usize) -> Self {
        self.cap = Some(cap);
        self
    }

    /// How many records a workload namespace has.
    pub async fn count_in(&self, namespace: &str) -> Result<usize> {
        let lp = ListParams::default().labels(&format!(
            "{}=true,{}={namespace}",
            names::LINEAGE_RECORD,
            names::NAMESPACE
        ));
        Ok(self.api.list_metadata(&lp).await?.items.len())
    }

    /// Deletes a record at the resourceVersion it was read at (a record that changed since is
    /// [`Error::Conflict`] and stays; one already gone is fine).
    pub async fn delete(&self, record: &Record) -> Result<()> {
        let mut dp = kube::api::DeleteParams::default();
        if let Some(rv) = &record.resource_version {
            dp = dp.preconditions(kube::api::Preconditions {
                resource_version: Some(rv.clone()),
                uid: None,
            });
        }
        match self.api.delete(&record.name(), &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Conflict(record.name())),
            Err(e) => Err(e.into()),
        }
    }

    fn parse(list: Vec<ConfigMap>) -> Vec<Record> {
        list.iter()
            .filter_map(|cm| match Record::from_config_map(cm) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(error = %e, "skipping an unreadable lineage record");
                    None
                }
            })
            .collect()
    }

    /// Every lineage record of a workload; `fresh: false` takes them from the API server's
    /// watch cache as it is (`resourceVersion=0`: no wait for the cache to catch up with
    /// etcd), for what only predicts ([`crate::claim::Mode::Predict`]).
    pub async fn of_workload(&self, workload: &WorkloadName, fresh: bool) -> Result<Vec<Record>> {
        let lp = ListParams::default();
        let lp = if fresh { lp } else { lp.match_any() };
        let lp = lp.labels(&format!(
            "{}=true,{}={}",
            names::LINEAGE_RECORD,
            names::WORKLOAD,
            short_hash(workload.as_str())
        ));
        let list = self.api.list(&lp).await?;
        // The label is a hash: keep only this workload's (a collision would be harmless
        // anyway, the lineage carries its workload).
        Ok(Self::parse(list.items)
            .into_iter()
            .filter(|r| &r.lineage.workload == workload)
            .collect())
    }

    /// Every lineage record.
    pub async fn all(&self) -> Result<Vec<Record>> {
        let lp = ListParams::default().labels(&format!("{}=true", names::LINEAGE_RECORD));
        Ok(Self::parse(self.api.list(&lp).await?.items))
    }

    /// One lineage's record.
    pub async fn get(&self, lineage: &str) -> Result<Option<Record>> {
        match self.api.get_opt(&record_name(lineage)).await? {
            Some(cm) => Ok(Some(Record::from_config_map(&cm)?)),
            None => Ok(None),
        }
    }

    /// Stores a record: created when it has no resourceVersion, else replaced at that version.
    /// Another writer in between is [`Error::Conflict`]. Returns the record at its new version.
    pub async fn save(&self, record: &Record) -> Result<Record> {
        let cm = record.to_config_map()?;
        let name = record.name();
        if let (None, Some(cap)) = (&record.resource_version, self.cap) {
            let have = self.count_in(&record.namespace).await?;
            if have >= cap {
                return Err(Error::RecordCap {
                    namespace: record.namespace.clone(),
                    cap,
                });
            }
        }
        let res = match record.resource_version {
            None => self.api.create(&PostParams::default(), &cm).await,
            Some(_) => self.api.replace(&name, &PostParams::default(), &cm).await,
        };
        match res {
            Ok(saved) => Ok(Record {
                resource_version: saved.metadata.resource_version,
                ..record.clone()
            }),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Conflict(name)),
            Err(e) => Err(e.into()),
        }
    }
}

/// What became of the pod holding a lineage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HolderState {
    /// The pod exists and is not stopping.
    Running,
    /// The pod has a deletion timestamp (drain, eviction, delete).
    Terminating {
        /// When the graceful stop began (deletion timestamp minus the grace period), Unix ms.
        started_unix_ms: u64,
        /// How long a final checkpoint may run (the deletion timestamp, plus slack), Unix ms.
        deadline_unix_ms: u64,
        /// A final checkpoint is expected: the pod was running and its policy has
        /// `onTermination`.
        final_expected: bool,
    },
    /// The pod ended (phase `Failed` or `Succeeded`): evicted, its node lost, completed.
    Ended,
    /// No such pod (any more).
    Gone {
        /// A termination `PodCheckpoint` of the pod, or a heartbeat (whose capture may be the
        /// final checkpoint), is still pending or running.
        final_in_flight: bool,
    },
    /// The claim is recent and its pod has not appeared yet.
    Unseen,
}

/// Brings a record up to date with its holder's state; true when it changed:
///
/// - a held lineage whose pod is stopping, ended or gone is orphaned (claimable); a graceful
///   stop with a final checkpoint expected also records the in-flight final checkpoint
///   (`begin_final`), unless a checkpoint newer than the stop's start is already published;
/// - a claim whose pod never appeared within `phantom_after_ms` is released;
/// - an in-flight final checkpoint ends when the pod is gone with no termination checkpoint
///   pending, or at its deadline.
pub fn refresh(r: &mut Record, state: &HolderState, now_ms: u64, phantom_after_ms: u64) -> bool {
    let before = (r.lineage.clone(), r.holder.clone());
    if !r.lineage.orphaned {
        match state {
            HolderState::Running => {}
            HolderState::Terminating {
                started_unix_ms,
                deadline_unix_ms,
                final_expected,
            } => {
                r.lineage.orphan();
                let published_since = r
                    .lineage
                    .latest()
                    .is_some_and(|c| c.created_unix_ms >= *started_unix_ms);
                if *final_expected && !published_since && *deadline_unix_ms > now_ms {
                    r.lineage.begin_final(*deadline_unix_ms, *started_unix_ms);
                }
            }
            HolderState::Ended | HolderState::Gone { .. } => r.lineage.orphan(),
            HolderState::Unseen => {
                let claimed = r.holder.as_ref().map_or(0, |h| h.claimed_unix_ms);
                if now_ms.saturating_sub(claimed) > phantom_after_ms {
                    r.lineage.release();
                }
            }
        }
    }
    if let Some(deadline) = r.lineage.final_deadline_unix_ms {
        // An ended pod (e.g. after a graceful node shutdown) still waits: its termination
        // checkpoint publishes or fails, or the deadline passes.
        let pod_gone_quietly = matches!(
            state,
            HolderState::Gone {
                final_in_flight: false
            }
        );
        if deadline <= now_ms || (r.lineage.orphaned && pod_gone_quietly) {
            r.lineage.end_final();
        }
    }
    if r.lineage.orphaned && !before.0.orphaned {
        r.orphaned_unix_ms = Some(now_ms);
    }
    (r.lineage.clone(), r.holder.clone()) != before
}

/// Whether the sweep deletes a record now: its lineage is orphaned (or released) since at least
/// `grace_ms`, holds no checkpoint, waits for no final checkpoint, and no pod of its namespace is
/// (or claims to be) its holder any more. Nothing is lost: a lineage without checkpoints has
/// nothing to restore, and with its record gone no agent stamps a checkpoint into it.
pub fn collectable(r: &Record, holder_pod_exists: bool, now_ms: u64, grace_ms: u64) -> bool {
    r.lineage.orphaned
        && r.lineage.checkpoints.is_empty()
        && r.lineage.final_deadline_unix_ms.is_none()
        && !holder_pod_exists
        && r.orphaned_unix_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= grace_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::lineage::LineageCheckpoint;
    use stasis_core::reference::CheckpointId;

    fn record(token: &str, claimed: u64) -> Record {
        let w = WorkloadName::new("prod_deploy_counter").unwrap();
        let l = Lineage::start(&w, token, &[]);
        Record::new(
            "prod",
            l,
            Some(Holder {
                token: token.into(),
                claimed_unix_ms: claimed,
                ..Default::default()
            }),
        )
    }

    #[test]
    fn config_map_round_trip() {
        let mut r = record("3f2a9c10aa", 5);
        r.holder.as_mut().unwrap().restore = Some("x/y".into());
        let cm = r.to_config_map().unwrap();
        assert_eq!(
            cm.metadata.name.as_deref(),
            Some(&*record_name("prod_deploy_counter.3f2a9c10"))
        );
        let labels = cm.metadata.labels.clone().unwrap();
        assert_eq!(labels[names::LINEAGE_RECORD], "true");
        assert_eq!(labels[names::WORKLOAD].len(), 16);
        // The agents read lineage.json as a plain Lineage.
        let l: Lineage = serde_json::from_str(&cm.data.as_ref().unwrap()[RECORD_KEY]).unwrap();
        assert_eq!(l, r.lineage);
        assert_eq!(Record::from_config_map(&cm).unwrap(), r);
    }

    #[test]
    fn terminating_holder_orphans_and_records_the_final_checkpoint() {
        let mut r = record("aaaaaaaa", 0);
        let t = HolderState::Terminating {
            started_unix_ms: 10_000,
            deadline_unix_ms: 40_000,
            final_expected: true,
        };
        assert!(refresh(&mut r, &t, 11_000, 60_000));
        assert!(r.lineage.orphaned);
        assert_eq!(r.lineage.final_deadline_unix_ms, Some(40_000));
        // When it was orphaned is kept (the sweep collects empty lineages a while after).
        assert_eq!(r.orphaned_unix_ms, Some(11_000));
        let cm = r.to_config_map().unwrap();
        assert_eq!(
            Record::from_config_map(&cm).unwrap().orphaned_unix_ms,
            Some(11_000)
        );
        assert!(
            !collectable(&r, false, 11_000 + 600_000, 600_000),
            "final in flight"
        );
        // Idempotent.
        assert!(!refresh(&mut r, &t, 12_000, 60_000));
        // The pod is gone and no termination checkpoint is pending: the wait ends.
        assert!(refresh(
            &mut r,
            &HolderState::Gone {
                final_in_flight: false
            },
            13_000,
            60_000
        ));
        assert_eq!(r.lineage.final_deadline_unix_ms, None);
        assert!(!collectable(&r, false, 11_000 + 599_999, 600_000));
        assert!(!collectable(&r, true, 11_000 + 600_000, 600_000));
        assert!(collectable(&r, false, 11_000 + 600_000, 600_000));
    }

    #[test]
    fn holder_labels_and_checks() {
        let mut r = record("aaaaaaaa", 0);
        assert!(r.registrable_by("prod", "aaaaaaaa"));
        assert!(!r.registrable_by("dev", "aaaaaaaa"));
        assert!(!r.registrable_by("prod", "bbbbbbbb"));
        let cm = r.to_config_map().unwrap();
        let labels = cm.metadata.labels.unwrap();
        assert_eq!(labels[names::NAMESPACE], "prod");
        assert!(!labels.contains_key(names::HOLDER_UID));
        r.holder.as_mut().unwrap().uid = Some("u-1".into());
        assert!(!r.registrable_by("prod", "aaaaaaaa"));
        assert!(r.held_by("prod", "u-1"));
        assert!(!r.held_by("dev", "u-1"));
        assert!(!r.held_by("prod", "u-2"));
        assert!(!r.held_by("prod", ""));
        let labels = r.to_config_map().unwrap().metadata.labels.unwrap();
        assert_eq!(labels[names::HOLDER_UID], "u-1");
    }

    #[test]
    fn final_already_published_or_not_expected_means_no_wait() {
        let mut r = record("aaaaaaaa", 0);
        r.lineage
            .publish(LineageCheckpoint {
                id: CheckpointId::from_parts(10_500, 1),
                generation: 1,
                created_unix_ms: 10_500,
                manifest_digest: None,
            })
            .unwrap();
        let t = HolderState::Terminating {
            started_unix_ms: 10_000,
            deadline_unix_ms: 40_000,
            final_expected: true,
        };
        refresh(&mut r, &t, 11_000, 60_000);
        assert!(r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none());
        let mut r = record("bbbbbbbb", 0);
        let t = HolderState::Terminating {
            started_unix_ms: 10_000,
            deadline_unix_ms: 40_000,
            final_expected: false,
        };
        refresh(&mut r, &t, 11_000, 60_000);
        assert!(r.lineage.orphaned && r.lineage.final_deadline_unix_ms.is_none());
        // Past the deadline the wait ends by itself.
        let mut r = record("cccccccc", 0);
        r.lineage.orphan();
        r.lineage.begin_final(20_000, 0);
        assert!(refresh(&mut r, &HolderState::Running, 20_000, 60_000));
        assert!(r.lineage.final_deadline_unix_ms.is_none());
    }

    #[test]
    fn phantom_claims_are_released_after_a_while_and_ended_pods_orphan() {
        let mut r = record("aaaaaaaa", 1_000);
        assert!(!refresh(&mut r, &HolderState::Unseen, 30_000, 60_000));
        assert!(!r.lineage.orphaned);
        assert!(refresh(&mut r, &HolderState::Unseen, 62_000, 60_000));
        assert!(r.lineage.orphaned);
        let mut r = record("bbbbbbbb", 1_000);
        assert!(refresh(&mut r, &HolderState::Ended, 2_000, 60_000));
        assert!(r.lineage.orphaned && r.holder_token().is_none());
        // An ended holder with a final checkpoint in flight keeps the wait until its deadline.
        let mut r = record("dddddddd", 1_000);
        r.lineage.begin_final(10_000, 0);
        assert!(refresh(&mut r, &HolderState::Ended, 2_000, 60_000));
        assert_eq!(r.lineage.final_deadline_unix_ms, Some(10_000));
        assert!(refresh(&mut r, &HolderState::Ended, 10_000, 60_000));
        assert_eq!(r.lineage.final_deadline_unix_ms, None);
        let mut r = record("cccccccc", 1_000);
        assert!(!refresh(&mut r, &HolderState::Running, 99_000, 60_000));
        assert_eq!(r.holder_token(), Some("cccccccc"));
    }
}
