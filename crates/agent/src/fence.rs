//! Stamps and fencing: under which lineage and generation a pod's checkpoint is written, and may
//! it become visible?
//!
//! Both come from the controller's lineage records (ConfigMaps in stasis's namespace, which only
//! the controller writes), never from the pod: a pod's labels and annotations are its user's to
//! set. A pod's stamp is the lineage and generation of the record whose holder-UID label is the
//! pod's UID and whose namespace label is the pod's namespace (the controller registers the
//! holder when it first sees the pod, usually within a second of its creation). A pod no record
//! names is not checkpointed: there is no lineage its checkpoints could safely join. The rule on
//! generations is `stasis_core::lineage::may_publish`.

use k8s_openapi::api::core::v1::ConfigMap;
use stasis_api::lineage::{HOLDER_UID_LABEL, RECORD_KEY, RECORD_NAMESPACE_LABEL};
use stasis_core::lineage::{may_publish, Lineage};
use stasis_core::{CheckpointRef, Manifest, Selector, WorkloadName};

/// The lineage a pod's checkpoints go to, the generation they are written under, and the pod
/// (namespace, UID) that writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub lineage: WorkloadName,
    pub generation: u64,
    pub namespace: String,
    pub pod_uid: String,
}

/// A lineage record as the agent reads it: the lineage, and the namespace and holder UID the
/// controller labelled it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordFacts {
    pub lineage: Lineage,
    pub namespace: Option<String>,
    pub holder_uid: Option<String>,
}

impl RecordFacts {
    /// Reads a lineage record ConfigMap.
    pub fn from_config_map(cm: &ConfigMap) -> Result<Self, String> {
        let name = cm.metadata.name.as_deref().unwrap_or_default();
        let raw = cm
            .data
            .as_ref()
            .and_then(|d| d.get(RECORD_KEY))
            .ok_or_else(|| format!("lineage record {name} has no {RECORD_KEY}"))?;
        let lineage: Lineage =
            serde_json::from_str(raw).map_err(|e| format!("lineage record {name}: {e}"))?;
        let label = |k: &str| cm.metadata.labels.as_ref().and_then(|l| l.get(k)).cloned();
        Ok(Self {
            lineage,
            namespace: label(RECORD_NAMESPACE_LABEL),
            holder_uid: label(HOLDER_UID_LABEL),
        })
    }

    fn held_by(&self, namespace: &str, uid: &str) -> bool {
        !uid.is_empty()
            && self.namespace.as_deref() == Some(namespace)
            && self.holder_uid.as_deref() == Some(uid)
    }
}

/// The stamp of the pod (`namespace`, `uid`) from the lineage records listed by its UID: the
/// record that names it as holder in its namespace (a held one before an orphaned one, then the
/// newest generation). `Err` says why there is none.
pub fn stamp_from_records(
    namespace: &str,
    uid: &str,
    records: &[RecordFacts],
) -> Result<Stamp, String> {
    records
        .iter()
        .filter(|r| r.held_by(namespace, uid))
        .max_by_key(|r| (!r.lineage.orphaned, r.lineage.generation))
        .map(|r| Stamp {
            lineage: r.lineage.id.clone(),
            generation: r.lineage.generation,
            namespace: namespace.to_owned(),
            pod_uid: uid.to_owned(),
        })
        .ok_or_else(|| {
            format!(
                "no lineage record names this pod (UID {uid}) as its holder in namespace {namespace}: the stasis controller registers a pod when it first sees it; until then, or without the controller, the pod is not checkpointed"
            )
        })
}

/// The stamp of a pod without a cluster (the standalone agent): its own lineage
/// `<workload key>.<UID prefix>` at generation 1, which nothing fences.
pub fn standalone_stamp(workload_key: &WorkloadName, namespace: &str, uid: &str) -> Stamp {
    Stamp {
        lineage: Lineage::start(workload_key, uid, &[]).id,
        generation: 1,
        namespace: namespace.to_owned(),
        pod_uid: uid.to_owned(),
    }
}

/// The digest of a checkpoint's manifest that the controller records when it publishes the
/// checkpoint and the restoring agent checks: `sha256:` and the hex SHA-256 of the manifest's
/// canonical JSON (the struct serialised in schema order, as the store seals it; what a reader
/// parses serialises back to the same bytes, so writer and reader agree without the envelope).
/// The envelope's MAC proves only that a holder of the data key wrote the manifest; this ties it
/// to the one the writing node reported through its own `PodCheckpoint`.
pub fn manifest_digest(m: &Manifest) -> String {
    let body = serde_json::to_vec(m).expect("a manifest serialises");
    let d = ring::digest::digest(&ring::digest::SHA256, &body);
    format!("sha256:{}", hex::encode(d.as_ref()))
}

/// The manifest digest the controller recorded for the checkpoint `reference` of a restore in
/// `namespace`, from the lineage's record (`None` inside `Ok`: published before digests were
/// recorded). A restore of a checkpoint the record does not list, of a lineage without a record
/// or of another namespace's lineage is refused (`Err` says why): only published checkpoints
/// are restored.
pub fn published_digest(
    record: Option<&RecordFacts>,
    namespace: &str,
    reference: &CheckpointRef,
) -> Result<Option<String>, String> {
    let lineage = &reference.workload;
    let Some(r) = record else {
        return Err(format!(
            "lineage {lineage} has no record: {reference} was never published"
        ));
    };
    if r.lineage.id != *lineage || r.namespace.as_deref() != Some(namespace) {
        return Err(format!(
            "lineage {lineage} is not a lineage of namespace {namespace}"
        ));
    }
    let Selector::Id(id) = &reference.selector else {
        return Err(format!("{reference} names no exact checkpoint"));
    };
    r.lineage
        .checkpoints
        .iter()
        .find(|c| &c.id == id)
        .map(|c| c.manifest_digest.clone())
        .ok_or_else(|| {
            format!("{reference} is not a published checkpoint of lineage {lineage} (its record does not list it)")
        })
}

/// What the fence says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The record exists, names the writer as holder, and the generation is current.
    Current,
    /// No cluster, no records (the standalone agent): nothing can fence.
    NoRecord,
    /// The checkpoint must not become visible; why.
    Fenced(String),
}

impl Verdict {
    pub fn allows(&self) -> bool {
        !matches!(self, Verdict::Fenced(_))
    }
}

/// The fencing decision for a checkpoint of `stamp`, given the lineage's record as read now.
/// Fails closed: no record (deleted, or never there) fences.
pub fn decide(record: Option<&RecordFacts>, stamp: &Stamp) -> Verdict {
    let Some(r) = record else {
        return Verdict::Fenced(format!("lineage {} has no record", stamp.lineage));
    };
    let l = &r.lineage;
    if l.id != stamp.lineage {
        return Verdict::Fenced(format!(
            "lineage record is for {}, not {}",
            l.id, stamp.lineage
        ));
    }
    if r.namespace.as_deref() != Some(stamp.namespace.as_str()) {
        return Verdict::Fenced(format!(
            "lineage {} belongs to another namespace than {}",
            l.id, stamp.namespace
        ));
    }
    if !may_publish(l, stamp.generation) {
        return Verdict::Fenced(format!(
            "lineage {} is at generation {}; this checkpoint was written under generation {} (a newer pod claimed the lineage)",
            l.id, l.generation, stamp.generation
        ));
    }
    if r.holder_uid.as_deref() != Some(stamp.pod_uid.as_str()) {
        return Verdict::Fenced(format!(
            "lineage {} is not held by this pod (UID {})",
            l.id, stamp.pod_uid
        ));
    }
    Verdict::Current
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn key() -> WorkloadName {
        WorkloadName::new("default_deployment_counter").unwrap()
    }

    fn facts(l: &Lineage, ns: &str, uid: Option<&str>) -> RecordFacts {
        RecordFacts {
            lineage: l.clone(),
            namespace: Some(ns.into()),
            holder_uid: uid.map(Into::into),
        }
    }

    #[test]
    fn a_restore_takes_the_digest_its_record_published() {
        use stasis_core::lineage::LineageCheckpoint;
        use stasis_core::CheckpointId;
        let mut l = Lineage::start(&key(), "aaaaaaaa", &[]);
        let (old, new, never) = (
            CheckpointId::from_parts(1_700_000_000_000, 1),
            CheckpointId::from_parts(1_700_000_010_000, 2),
            CheckpointId::from_parts(1_700_000_020_000, 3),
        );
        for (id, d) in [(&old, None), (&new, Some("sha256:ab"))] {
            l.publish(LineageCheckpoint {
                id: id.clone(),
                generation: 1,
                created_unix_ms: 1,
                manifest_digest: d.map(str::to_owned),
            })
            .unwrap();
        }
        let r = facts(&l, "default", Some("u-1"));
        let at = |id: &CheckpointId| -> CheckpointRef { format!("{}/{id}", l.id).parse().unwrap() };
        assert_eq!(
            published_digest(Some(&r), "default", &at(&new)),
            Ok(Some("sha256:ab".to_owned()))
        );
        // Published before digests were recorded: restorable, unchecked.
        assert_eq!(published_digest(Some(&r), "default", &at(&old)), Ok(None));
        for (rec, ns, reference, why) in [
            (
                Some(&r),
                "default",
                at(&never),
                "not a published checkpoint",
            ),
            (None, "default", at(&new), "has no record"),
            (
                Some(&r),
                "other",
                at(&new),
                "not a lineage of namespace other",
            ),
            (
                Some(&r),
                "default",
                format!("{}/latest", l.id).parse().unwrap(),
                "no exact checkpoint",
            ),
        ] {
            let e = published_digest(rec, ns, &reference).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn the_stamp_comes_from_the_record_naming_the_pod() {
        let mut held = Lineage::start(&key(), "aaaaaaaa", &[]);
        held.generation = 4;
        let mut old = Lineage::start(&key(), "bbbbbbbb", &[]);
        old.generation = 9;
        old.orphan();
        let records = [
            facts(&old, "default", Some("u-1")),
            facts(&held, "default", Some("u-1")),
            // Another namespace's record naming the same UID, another pod's record.
            facts(
                &Lineage::start(&key(), "cccccccc", &[]),
                "other",
                Some("u-1"),
            ),
            facts(
                &Lineage::start(&key(), "dddddddd", &[]),
                "default",
                Some("u-2"),
            ),
        ];
        let s = stamp_from_records("default", "u-1", &records).unwrap();
        assert_eq!((s.lineage.clone(), s.generation), (held.id.clone(), 4));
        assert_eq!(
            (s.namespace.as_str(), s.pod_uid.as_str()),
            ("default", "u-1")
        );
        // A pod nobody registered (whatever its annotations say) gets no stamp.
        let e = stamp_from_records("default", "u-3", &records).unwrap_err();
        assert!(
            e.contains("no lineage record names this pod (UID u-3)"),
            "{e}"
        );
        assert!(stamp_from_records("default", "", &[facts(&held, "default", None)]).is_err());
    }

    #[test]
    fn record_facts_from_the_config_map_labels() {
        let l = Lineage::start(&key(), "aaaaaaaa", &[]);
        let cm = ConfigMap {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("lineage-x".into()),
                labels: Some(BTreeMap::from([
                    (HOLDER_UID_LABEL.to_owned(), "u-1".to_owned()),
                    (RECORD_NAMESPACE_LABEL.to_owned(), "default".to_owned()),
                ])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                RECORD_KEY.to_owned(),
                serde_json::to_string(&l).unwrap(),
            )])),
            ..Default::default()
        };
        assert_eq!(
            RecordFacts::from_config_map(&cm).unwrap(),
            facts(&l, "default", Some("u-1"))
        );
        let empty = ConfigMap::default();
        assert!(RecordFacts::from_config_map(&empty).is_err());
    }

    #[test]
    fn only_the_holder_at_the_current_generation_in_its_namespace_publishes() {
        let mut l = Lineage::start(&key(), "holder-1", &[]);
        let stamp = Stamp {
            lineage: l.id.clone(),
            generation: l.generation,
            namespace: "default".into(),
            pod_uid: "u-1".into(),
        };
        assert!(!decide(None, &stamp).allows(), "no record: fail closed");
        assert_eq!(
            decide(Some(&facts(&l, "default", Some("u-1"))), &stamp),
            Verdict::Current
        );
        // Review H3: a record of another namespace, or held by another pod, never vouches.
        let v = decide(Some(&facts(&l, "other", Some("u-1"))), &stamp);
        assert!(
            matches!(&v, Verdict::Fenced(m) if m.contains("another namespace")),
            "{v:?}"
        );
        let v = decide(Some(&facts(&l, "default", Some("u-2"))), &stamp);
        assert!(
            matches!(&v, Verdict::Fenced(m) if m.contains("not held by this pod")),
            "{v:?}"
        );
        // Orphaning does not fence (a final checkpoint still publishes)...
        l.orphan();
        assert_eq!(
            decide(Some(&facts(&l, "default", Some("u-1"))), &stamp),
            Verdict::Current
        );
        // ...a newer claim does.
        let mut ls = vec![l];
        let c = stasis_core::lineage::claim(&mut ls, &key(), "holder-2").unwrap();
        assert_eq!(c.generation, stamp.generation + 1);
        let v = decide(Some(&facts(&ls[0], "default", Some("u-1"))), &stamp);
        assert!(
            matches!(&v, Verdict::Fenced(m) if m.contains("newer pod")),
            "{v:?}"
        );
        // A record of another lineage never vouches for this one.
        let other = Lineage::start(&key(), "zzzz", &ls);
        assert!(!decide(Some(&facts(&other, "default", Some("u-1"))), &stamp).allows());
    }
}
