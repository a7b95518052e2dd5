//! Fencing decisions: may a checkpoint written under a generation become visible?
//!
//! The writer's lineage and generation come from the pod (annotations the webhook writes at
//! admission, `stasis_api::lineage`); the lineage's current generation from the controller's
//! lineage record. The rule itself is `stasis_core::lineage::may_publish`.

use std::collections::BTreeMap;

use stasis_core::lineage::{may_publish, Lineage};
use stasis_core::WorkloadName;

/// The lineage a pod's checkpoints go to, and the generation they are written under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub lineage: WorkloadName,
    pub generation: u64,
    /// True when the lineage came from the webhook's claim; false for the agent's fallback
    /// (a pod admitted without the webhook: its own lineage `<workload key>.<uid prefix>`,
    /// generation 1, which no record fences until the controller creates one).
    pub claimed: bool,
}

/// The stamp of a pod: its claim annotations, else the fallback lineage.
pub fn stamp_for_pod(
    annotations: &BTreeMap<String, String>,
    workload_key: &WorkloadName,
    pod_uid: &str,
) -> Stamp {
    if let Some((l, g)) = stasis_api::lineage::pod_lineage(annotations) {
        if let Ok(l) = WorkloadName::new(l) {
            return Stamp {
                lineage: l,
                generation: g,
                claimed: true,
            };
        }
    }
    Stamp {
        lineage: Lineage::start(workload_key, pod_uid, &[]).id,
        generation: 1,
        claimed: false,
    }
}

/// What the fence says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The record exists and the generation is current.
    Current,
    /// No record yet (nobody claimed the lineage since it started): nothing can fence it.
    NoRecord,
    /// A newer claim exists: the checkpoint must not become visible.
    Fenced(String),
}

impl Verdict {
    pub fn allows(&self) -> bool {
        !matches!(self, Verdict::Fenced(_))
    }
}

/// The fencing decision for a checkpoint of `stamp`, given the lineage record (if any).
pub fn decide(record: Option<&Lineage>, stamp: &Stamp) -> Verdict {
    match record {
        None => Verdict::NoRecord,
        Some(r) if r.id != stamp.lineage => Verdict::Fenced(format!(
            "lineage record is for {}, not {}",
            r.id, stamp.lineage
        )),
        Some(r) if may_publish(r, stamp.generation) => Verdict::Current,
        Some(r) => Verdict::Fenced(format!(
            "lineage {} is at generation {}; this checkpoint was written under generation {} (a newer pod claimed the lineage)",
            r.id, r.generation, stamp.generation
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> WorkloadName {
        WorkloadName::new("default_deployment_counter").unwrap()
    }

    #[test]
    fn stamp_from_annotations_or_fallback() {
        let mut a = BTreeMap::new();
        let s = stamp_for_pod(&a, &key(), "0b5c7e1a-1111");
        assert_eq!(s.lineage.as_str(), "default_deployment_counter.0b5c7e1a");
        assert_eq!((s.generation, s.claimed), (1, false));
        a.insert(
            "stasis.dev/lineage".into(),
            "default_deployment_counter.aa".into(),
        );
        a.insert("stasis.dev/generation".into(), "4".into());
        let s = stamp_for_pod(&a, &key(), "u");
        assert_eq!(s.lineage.as_str(), "default_deployment_counter.aa");
        assert_eq!((s.generation, s.claimed), (4, true));
        // An invalid lineage name falls back.
        a.insert("stasis.dev/lineage".into(), "Bad Name".into());
        assert!(!stamp_for_pod(&a, &key(), "u").claimed);
    }

    #[test]
    fn only_the_current_generation_publishes() {
        let mut l = Lineage::start(&key(), "holder-1", &[]);
        let stamp = Stamp {
            lineage: l.id.clone(),
            generation: l.generation,
            claimed: true,
        };
        assert_eq!(decide(None, &stamp), Verdict::NoRecord);
        assert!(decide(None, &stamp).allows());
        assert_eq!(decide(Some(&l), &stamp), Verdict::Current);
        // Orphaning does not fence (a final checkpoint still publishes)...
        l.orphan();
        assert_eq!(decide(Some(&l), &stamp), Verdict::Current);
        // ...a newer claim does.
        let mut ls = vec![l];
        let c = stasis_core::lineage::claim(&mut ls, &key(), "holder-2").unwrap();
        assert_eq!(c.generation, stamp.generation + 1);
        let v = decide(Some(&ls[0]), &stamp);
        assert!(!v.allows());
        assert!(
            matches!(&v, Verdict::Fenced(m) if m.contains("newer pod")),
            "{v:?}"
        );
        // A record of another lineage never vouches for this one.
        let other = Lineage::start(&key(), "zzzz", &ls);
        assert!(!decide(Some(&other), &stamp).allows());
    }
}
