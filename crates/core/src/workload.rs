//! Workload identity: which workload a Kubernetes pod belongs to (DESIGN §3).
//!
//! A replacement pod continues the history of the pod it replaces only if both belong to the same
//! workload, so the identity must survive exactly what a replacement changes (pod name, UID, node,
//! the ReplicaSet's template hash after a rollout) and nothing else:
//!
//! | controller owner           | workload                                   | member            |
//! |----------------------------|--------------------------------------------|-------------------|
//! | ReplicaSet `X-<hash>` with label `pod-template-hash=<hash>` | Deployment `X` | —      |
//! | ReplicaSet without that shape | ReplicaSet (its own name)               | —                 |
//! | StatefulSet `S`            | StatefulSet `S`                            | ordinal           |
//! | Job `J`                    | Job `J`                                    | completion index  |
//! | none                       | the bare pod's own name                    | —                 |
//! | any other kind `K`         | `K` and its name (DaemonSet, operators)    | —                 |
//!
//! Replicas of one workload without a member (Deployment replicas, non-indexed Job pods) share
//! the workload but never a lineage: each running pod holds its own (see [`crate::lineage`]).
//!
//! The key is `<namespace>_<kind>_<name>[_<member>]`. Kubernetes names and namespaces never
//! contain `_` (DNS-1123), so the key is unambiguous; it is a valid [`WorkloadName`], and a key
//! longer than 128 characters is cut and suffixed with a digest of the whole key so that two long
//! names never collide.

use std::collections::BTreeMap;
use std::fmt;

use crate::reference::WorkloadName;

/// Label the ReplicaSet controller puts on pods and appends to the ReplicaSet's name.
pub const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";
/// StatefulSet pod ordinal label (Kubernetes ≥ 1.28).
pub const POD_INDEX_LABEL: &str = "apps.kubernetes.io/pod-index";
/// Indexed Job completion index (annotation always; label since Kubernetes 1.28).
pub const JOB_COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// The facts about a pod that identity needs: the k8s-facing adapter (stasis-api) fills this in,
/// so this crate stays free of Kubernetes types.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    /// The owner reference with `controller: true`, if any.
    pub controller: Option<OwnerFacts>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// A controlling owner reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerFacts {
    pub kind: String,
    pub name: String,
}

/// Kind of workload a pod belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkloadKind {
    Deployment,
    ReplicaSet,
    StatefulSet,
    Job,
    /// A pod without a controlling owner.
    Pod,
    /// Any other controller kind (DaemonSet, an operator's custom resource), lower-cased.
    Other(String),
}

impl WorkloadKind {
    /// The short form used in keys.
    pub fn short(&self) -> &str {
        match self {
            Self::Deployment => "deploy",
            Self::ReplicaSet => "rs",
            Self::StatefulSet => "sts",
            Self::Job => "job",
            Self::Pod => "pod",
            Self::Other(k) => k,
        }
    }
}

/// Why a pod's identity could not be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("pod has no namespace, or is a bare pod without a name")]
    Unnamed,
    #[error("pod {pod:?} of StatefulSet {set:?} has no ordinal: neither label {POD_INDEX_LABEL} nor a name <set>-<n>")]
    NoOrdinal { pod: String, set: String },
}

/// The workload a pod belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkloadIdentity {
    pub namespace: String,
    pub kind: WorkloadKind,
    pub name: String,
    /// StatefulSet ordinal or Job completion index: a replacement continues the same member.
    pub member: Option<String>,
}

impl WorkloadIdentity {
    /// Derives the identity of a pod (the table in the module documentation).
    pub fn of(pod: &PodFacts) -> Result<Self, IdentityError> {
        // At admission a `generateName` pod has no name yet; only identities built from the
        // pod's own name need one.
        if pod.namespace.is_empty() || (pod.controller.is_none() && pod.name.is_empty()) {
            return Err(IdentityError::Unnamed);
        }
        let (kind, name, member) = match &pod.controller {
            None => (WorkloadKind::Pod, pod.name.clone(), None),
            Some(owner) => match owner.kind.as_str() {
                "ReplicaSet" => match deployment_of(&owner.name, &pod.labels) {
                    Some(deploy) => (WorkloadKind::Deployment, deploy.to_owned(), None),
                    None => (WorkloadKind::ReplicaSet, owner.name.clone(), None),
                },
                "StatefulSet" => {
                    let ordinal = statefulset_ordinal(&owner.name, pod).ok_or_else(|| {
                        IdentityError::NoOrdinal {
                            pod: pod.name.clone(),
                            set: owner.name.clone(),
                        }
                    })?;
                    (WorkloadKind::StatefulSet, owner.name.clone(), Some(ordinal))
                }
                "Job" => {
                    let index = pod
                        .annotations
                        .get(JOB_COMPLETION_INDEX)
                        .or_else(|| pod.labels.get(JOB_COMPLETION_INDEX))
                        .filter(|i| is_number(i))
                        .cloned();
                    (WorkloadKind::Job, owner.name.clone(), index)
                }
                other => (
                    WorkloadKind::Other(other.to_ascii_lowercase()),
                    owner.name.clone(),
                    None,
                ),
            },
        };
        Ok(Self {
            namespace: pod.namespace.clone(),
            kind,
            name,
            member,
        })
    }

    /// The key under which the workload's lineages live: `<ns>_<kind>_<name>[_<member>]`, a
    /// valid [`WorkloadName`] (see the module documentation for long names).
    pub fn key(&self) -> WorkloadName {
        let mut key = format!("{}_{}_{}", self.namespace, self.kind.short(), self.name);
        if let Some(m) = &self.member {
            key.push('_');
            key.push_str(m);
        }
        bounded_name(&key)
    }
}

impl fmt::Display for WorkloadIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} {}", self.namespace, self.kind.short(), self.name)?;
        if let Some(m) = &self.member {
            write!(f, " #{m}")?;
        }
        Ok(())
    }
}

/// `X` when the ReplicaSet is named `X-<hash>` and the pod carries `pod-template-hash=<hash>`:
/// the shape the Deployment controller gives the ReplicaSets it owns.
fn deployment_of<'a>(replicaset: &'a str, labels: &BTreeMap<String, String>) -> Option<&'a str> {
    let hash = labels.get(POD_TEMPLATE_HASH_LABEL)?;
    let prefix = replicaset.strip_suffix(hash.as_str())?.strip_suffix('-')?;
    (!hash.is_empty() && !prefix.is_empty()).then_some(prefix)
}

fn statefulset_ordinal(set: &str, pod: &PodFacts) -> Option<String> {
    if let Some(i) = pod.labels.get(POD_INDEX_LABEL).filter(|i| is_number(i)) {
        return Some(i.clone());
    }
    pod.name
        .strip_prefix(set)?
        .strip_prefix('-')
        .filter(|n| is_number(n))
        .map(str::to_owned)
}

fn is_number(s: &str) -> bool {
    !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit())
}

/// `raw` as a [`WorkloadName`]: unchanged when valid and short enough; otherwise sanitised, cut
/// to 111 characters and suffixed with `-` and 16 hex digits of the BLAKE3 hash of `raw`, so
/// distinct long keys stay distinct.
pub fn bounded_name(raw: &str) -> WorkloadName {
    if let Ok(name) = WorkloadName::new(raw) {
        return name;
    }
    let digest = blake3::hash(raw.as_bytes()).to_hex();
    let sanitized = WorkloadName::sanitize(raw);
    let head: String = sanitized.as_str().chars().take(111).collect();
    WorkloadName::sanitize(&format!("{head}-{}", &digest[..16]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, owner: Option<(&str, &str)>, labels: &[(&str, &str)]) -> PodFacts {
        PodFacts {
            namespace: ns.into(),
            name: name.into(),
            controller: owner.map(|(k, n)| OwnerFacts {
                kind: k.into(),
                name: n.into(),
            }),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn deployment_through_replicaset_strips_template_hash() {
        let a = pod(
            "prod",
            "counter-7d9f8b6c5-abcde",
            Some(("ReplicaSet", "counter-7d9f8b6c5")),
            &[(POD_TEMPLATE_HASH_LABEL, "7d9f8b6c5")],
        );
        let id = WorkloadIdentity::of(&a).unwrap();
        assert_eq!(id.kind, WorkloadKind::Deployment);
        assert_eq!(id.name, "counter");
        assert_eq!(id.key().as_str(), "prod_deploy_counter");
        // After a rollout (new template hash) the workload is the same.
        let b = pod(
            "prod",
            "counter-55c4d9f-zzzzz",
            Some(("ReplicaSet", "counter-55c4d9f")),
            &[(POD_TEMPLATE_HASH_LABEL, "55c4d9f")],
        );
        assert_eq!(WorkloadIdentity::of(&b).unwrap().key(), id.key());
    }

    #[test]
    fn bare_replicaset_keeps_its_name() {
        let p = pod("ns", "web-x1", Some(("ReplicaSet", "web")), &[]);
        let id = WorkloadIdentity::of(&p).unwrap();
        assert_eq!(id.kind, WorkloadKind::ReplicaSet);
        assert_eq!(id.key().as_str(), "ns_rs_web");
        // A hash label that is not the name's suffix is not a Deployment's.
        let q = pod(
            "ns",
            "web-x1",
            Some(("ReplicaSet", "web")),
            &[(POD_TEMPLATE_HASH_LABEL, "abc")],
        );
        assert_eq!(
            WorkloadIdentity::of(&q).unwrap().kind,
            WorkloadKind::ReplicaSet
        );
    }

    #[test]
    fn statefulset_ordinal_from_label_or_name() {
        let a = pod(
            "db",
            "pg-2",
            Some(("StatefulSet", "pg")),
            &[(POD_INDEX_LABEL, "2")],
        );
        assert_eq!(
            WorkloadIdentity::of(&a).unwrap().key().as_str(),
            "db_sts_pg_2"
        );
        let b = pod("db", "pg-10", Some(("StatefulSet", "pg")), &[]);
        let id = WorkloadIdentity::of(&b).unwrap();
        assert_eq!(id.member.as_deref(), Some("10"));
        assert_eq!(id.key().as_str(), "db_sts_pg_10");
        // Distinct ordinals are distinct workloads.
        assert_ne!(WorkloadIdentity::of(&a).unwrap().key(), id.key());
        let c = pod("db", "weird", Some(("StatefulSet", "pg")), &[]);
        assert!(matches!(
            WorkloadIdentity::of(&c),
            Err(IdentityError::NoOrdinal { .. })
        ));
    }

    #[test]
    fn job_completion_index() {
        let mut p = pod("ml", "train-3-xyz", Some(("Job", "train")), &[]);
        p.annotations
            .insert(JOB_COMPLETION_INDEX.into(), "3".into());
        assert_eq!(
            WorkloadIdentity::of(&p).unwrap().key().as_str(),
            "ml_job_train_3"
        );
        let q = pod(
            "ml",
            "train-4-xyz",
            Some(("Job", "train")),
            &[(JOB_COMPLETION_INDEX, "4")],
        );
        assert_eq!(
            WorkloadIdentity::of(&q).unwrap().key().as_str(),
            "ml_job_train_4"
        );
        // Non-indexed jobs: one workload, replicas told apart by lineage.
        let r = pod("ml", "train-abcde", Some(("Job", "train")), &[]);
        assert_eq!(
            WorkloadIdentity::of(&r).unwrap().key().as_str(),
            "ml_job_train"
        );
    }

    #[test]
    fn bare_pod_and_other_kinds() {
        let p = pod("default", "scratch", None, &[]);
        assert_eq!(
            WorkloadIdentity::of(&p).unwrap().key().as_str(),
            "default_pod_scratch"
        );
        let d = pod("kube-system", "agent-x", Some(("DaemonSet", "agent")), &[]);
        assert_eq!(
            WorkloadIdentity::of(&d).unwrap().key().as_str(),
            "kube-system_daemonset_agent"
        );
        assert_eq!(
            WorkloadIdentity::of(&pod("", "x", None, &[])),
            Err(IdentityError::Unnamed)
        );
        assert_eq!(
            WorkloadIdentity::of(&pod("ns", "", None, &[])),
            Err(IdentityError::Unnamed)
        );
        // A generateName pod seen at admission (no name yet) still has its workload.
        let unnamed = pod(
            "prod",
            "",
            Some(("ReplicaSet", "counter-7d9f8b6c5")),
            &[(POD_TEMPLATE_HASH_LABEL, "7d9f8b6c5")],
        );
        assert_eq!(
            WorkloadIdentity::of(&unnamed).unwrap().key().as_str(),
            "prod_deploy_counter"
        );
    }

    #[test]
    fn namespaces_and_kinds_never_collide() {
        // "a" + "pod_b" can't be forged: '_' never appears in Kubernetes names.
        let x = pod("a", "b", None, &[]);
        let y = pod("a", "b", Some(("Job", "b")), &[]);
        assert_ne!(
            WorkloadIdentity::of(&x).unwrap().key(),
            WorkloadIdentity::of(&y).unwrap().key()
        );
    }

    #[test]
    fn long_keys_are_bounded_and_distinct() {
        let long_a = format!("{}a", "n".repeat(200));
        let long_b = format!("{}b", "n".repeat(200));
        let ka = WorkloadIdentity::of(&pod("ns", &long_a, None, &[]))
            .unwrap()
            .key();
        let kb = WorkloadIdentity::of(&pod("ns", &long_b, None, &[]))
            .unwrap()
            .key();
        assert!(ka.as_str().len() <= 128, "{}", ka.as_str().len());
        assert_ne!(ka, kb);
        assert!(WorkloadName::new(ka.as_str()).is_ok());
        // Deterministic.
        assert_eq!(
            ka,
            WorkloadIdentity::of(&pod("ns", &long_a, None, &[]))
                .unwrap()
                .key()
        );
    }
}
