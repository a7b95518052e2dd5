//! Workload identity: which workload a Kubernetes pod belongs to (DESIGN §3).
//!
//! A replacement pod continues the history of the pod it replaces only if both belong to the same
//! workload, so the identity must survive exactly what a replacement changes (pod name, UID, node,
//! the ReplicaSet's template hash after a rollout) and nothing else:
//!
//! | controller owner           | workload                                   | member            |
//! |----------------------------|--------------------------------------------|-------------------|
//! | ReplicaSet controlled by Deployment `X` | Deployment `X`                | —                 |
//! | ReplicaSet without a Deployment | ReplicaSet (its name and UID)         | —                 |
//! | StatefulSet `S`            | StatefulSet `S` (its name and UID)         | ordinal           |
//! | Job `J`                    | Job `J` (its name and UID)                 | completion index  |
//! | none                       | the bare pod's own name                    | —                 |
//! | any other kind `K`         | `K`, its name and UID (DaemonSet, operators) | —               |
//!
//! Which Deployment controls a ReplicaSet is known only from the API server: the webhook looks
//! the owners up and fills in [`PodFacts::replicaset_owner`] ([`ReplicaSetOwner::Verified`]),
//! after checking every link's UID with [`check_owner`]. Without the look-up (the agent and
//! the controller deriving a pod's key from the pod alone) a ReplicaSet named `X-<hash>` whose
//! pods carry `pod-template-hash=<hash>` is taken for Deployment `X`, the shape the Deployment
//! controller gives the ReplicaSets it owns.
//!
//! Owner UIDs: a key includes the UID of the owner object wherever a recreated object of the
//! same name must not inherit the old one's checkpoints (a Job run again, a StatefulSet deleted
//! and created anew, a DaemonSet, an operator's object). A Deployment's key is its name only:
//! its rollouts replace the ReplicaSets (and their UIDs) but must keep the workload, and the
//! pod carries the UID of its ReplicaSet, never its Deployment's, so a key with the
//! Deployment's UID could not be derived from the pod by the agent and the controller. A
//! Deployment deleted and created again under the same name therefore continues the old one's
//! lineages, as a rollout would; its pods still restore only with an equal spec hash.
//!
//! Replicas of one workload without a member (Deployment replicas, non-indexed Job pods) share
//! the workload but never a lineage: each running pod holds its own (see [`crate::lineage`]).
//!
//! The key is `<namespace>_<kind>_<name>[_<owner uid>][_<member>]` (the owner UID as its first
//! 16 hex digits). Kubernetes names and namespaces never contain `_` (DNS-1123), so the key is
//! unambiguous; it is a valid [`WorkloadName`], and a key longer than 128 characters is cut and
//! suffixed with a digest of the whole key so that two long names never collide.

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
    /// When the controller is a ReplicaSet: its own controlling owner, if looked up.
    pub replicaset_owner: ReplicaSetOwner,
}

/// A controlling owner reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerFacts {
    pub kind: String,
    pub name: String,
    /// The owner object's UID, as the reference names it.
    pub uid: String,
}

/// The controlling owner of a pod's ReplicaSet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ReplicaSetOwner {
    /// Not looked up: the ReplicaSet's name shape decides (see the module documentation).
    #[default]
    Unknown,
    /// Read from the API server, every UID checked ([`check_owner`]): the ReplicaSet's
    /// controlling owner, `None` when it has none.
    Verified(Option<OwnerFacts>),
}

/// Why a pod's owner references do not name real objects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unverified {
    #[error("its controlling owner {kind} {name:?} does not exist")]
    Missing { kind: String, name: String },
    #[error("its controlling owner {kind} {name:?} has another UID than the owner reference names ({claimed:?})")]
    OtherUid {
        kind: String,
        name: String,
        claimed: String,
    },
}

/// Checks one owner reference against the object the API server returned for it (`found`: its
/// UID, `None` when there is no such object): the pod counts as created for that owner only if
/// the UIDs are equal, since owner references are written by whoever creates the pod.
pub fn check_owner(claimed: &OwnerFacts, found: Option<&str>) -> Result<(), Unverified> {
    match found {
        None => Err(Unverified::Missing {
            kind: claimed.kind.clone(),
            name: claimed.name.clone(),
        }),
        Some(uid) if uid.is_empty() || uid != claimed.uid => Err(Unverified::OtherUid {
            kind: claimed.kind.clone(),
            name: claimed.name.clone(),
            claimed: claimed.uid.clone(),
        }),
        Some(_) => Ok(()),
    }
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
    #[error("the pod's owner reference to {kind} {name:?} has no UID")]
    NoOwnerUid { kind: String, name: String },
}

/// The workload a pod belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkloadIdentity {
    pub namespace: String,
    pub kind: WorkloadKind,
    pub name: String,
    /// The owner object's UID where a recreated object of the same name must not inherit (see
    /// the module documentation); `None` for Deployments and bare pods.
    pub owner_uid: Option<String>,
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
        if let Some(owner) = pod.controller.as_ref().filter(|o| o.uid.is_empty()) {
            return Err(IdentityError::NoOwnerUid {
                kind: owner.kind.clone(),
                name: owner.name.clone(),
            });
        }
        let (kind, name, member) = match &pod.controller {
            None => (WorkloadKind::Pod, pod.name.clone(), None),
            Some(owner) => match owner.kind.as_str() {
                "ReplicaSet" => {
                    let deployment = match &pod.replicaset_owner {
                        ReplicaSetOwner::Verified(o) => o
                            .as_ref()
                            .filter(|o| o.kind == "Deployment")
                            .map(|o| o.name.as_str()),
                        ReplicaSetOwner::Unknown => deployment_of(&owner.name, &pod.labels),
                    };
                    match deployment {
                        Some(deploy) => {
                            let id = Self {
                                namespace: pod.namespace.clone(),
                                kind: WorkloadKind::Deployment,
                                name: deploy.to_owned(),
                                owner_uid: None,
                                member: None,
                            };
                            return Ok(id);
                        }
                        None => (WorkloadKind::ReplicaSet, owner.name.clone(), None),
                    }
                }
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
        let owner_uid = pod.controller.as_ref().map(|o| uid_fragment(&o.uid));
        Ok(Self {
            namespace: pod.namespace.clone(),
            kind,
            name,
            owner_uid,
            member,
        })
    }

    /// The key under which the workload's lineages live: `<ns>_<kind>_<name>[_<member>]`, a
    /// valid [`WorkloadName`] (see the module documentation for long names).
    pub fn key(&self) -> WorkloadName {
        let mut key = format!("{}_{}_{}", self.namespace, self.kind.short(), self.name);
        if let Some(u) = &self.owner_uid {
            key.push('_');
            key.push_str(u);
        }
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

/// The first 16 hex digits of a UID (a UUID: dashes and case dropped), the form keys carry.
fn uid_fragment(uid: &str) -> String {
    let hex: String = uid.chars().filter(|c| *c != '-').collect();
    if hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        hex[..16].to_ascii_lowercase()
    } else {
        // Not a UUID: still distinct per UID, and still a valid key.
        blake3::hash(uid.as_bytes()).to_hex()[..16].to_owned()
    }
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
                uid: UID.into(),
            }),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            annotations: BTreeMap::new(),
            replicaset_owner: ReplicaSetOwner::Unknown,
        }
    }

    /// The owners' UID in these tests, and its form in keys.
    const UID: &str = "3F2A9C10-0000-4000-8000-0000000000AA";
    const U: &str = "3f2a9c1000004000";

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
        assert_eq!(id.key().as_str(), &format!("ns_rs_web_{U}"));
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
            &format!("db_sts_pg_{U}_2")
        );
        let b = pod("db", "pg-10", Some(("StatefulSet", "pg")), &[]);
        let id = WorkloadIdentity::of(&b).unwrap();
        assert_eq!(id.member.as_deref(), Some("10"));
        assert_eq!(id.key().as_str(), &format!("db_sts_pg_{U}_10"));
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
            &format!("ml_job_train_{U}_3")
        );
        let q = pod(
            "ml",
            "train-4-xyz",
            Some(("Job", "train")),
            &[(JOB_COMPLETION_INDEX, "4")],
        );
        assert_eq!(
            WorkloadIdentity::of(&q).unwrap().key().as_str(),
            &format!("ml_job_train_{U}_4")
        );
        // Non-indexed jobs: one workload, replicas told apart by lineage.
        let r = pod("ml", "train-abcde", Some(("Job", "train")), &[]);
        assert_eq!(
            WorkloadIdentity::of(&r).unwrap().key().as_str(),
            &format!("ml_job_train_{U}")
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
            &format!("kube-system_daemonset_agent_{U}")
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
    fn a_recreated_owner_of_the_same_name_is_another_workload() {
        let other = |mut p: PodFacts| {
            p.controller.as_mut().unwrap().uid = "9b2a9c10-0000-4000-8000-0000000000bb".into();
            p
        };
        for p in [
            pod(
                "db",
                "pg-2",
                Some(("StatefulSet", "pg")),
                &[(POD_INDEX_LABEL, "2")],
            ),
            pod("ml", "train-abcde", Some(("Job", "train")), &[]),
            pod("ns", "web-x1", Some(("ReplicaSet", "web")), &[]),
            pod("ns", "agent-x", Some(("DaemonSet", "agent")), &[]),
        ] {
            let a = WorkloadIdentity::of(&p).unwrap().key();
            let b = WorkloadIdentity::of(&other(p.clone())).unwrap().key();
            assert_ne!(a, b, "{p:?}");
        }
        // A Deployment's pods keep their workload across ReplicaSets (rollouts): the key has
        // no UID.
        let d = pod(
            "prod",
            "counter-7d9f8b6c5-abcde",
            Some(("ReplicaSet", "counter-7d9f8b6c5")),
            &[(POD_TEMPLATE_HASH_LABEL, "7d9f8b6c5")],
        );
        assert_eq!(
            WorkloadIdentity::of(&other(d)).unwrap().key().as_str(),
            "prod_deploy_counter"
        );
        // An owner reference without a UID names no object.
        let mut n = pod(
            "db",
            "pg-2",
            Some(("StatefulSet", "pg")),
            &[(POD_INDEX_LABEL, "2")],
        );
        n.controller.as_mut().unwrap().uid.clear();
        assert!(matches!(
            WorkloadIdentity::of(&n),
            Err(IdentityError::NoOwnerUid { .. })
        ));
    }

    #[test]
    fn a_looked_up_replicaset_owner_decides_over_the_name_shape() {
        // The M1 shape: a ReplicaSet `web-zz9` made by a user (no Deployment controls it), its
        // pods labelled `pod-template-hash: zz9`.
        let mut p = pod(
            "prod",
            "",
            Some(("ReplicaSet", "web-zz9")),
            &[(POD_TEMPLATE_HASH_LABEL, "zz9")],
        );
        assert_eq!(
            WorkloadIdentity::of(&p).unwrap().key().as_str(),
            "prod_deploy_web",
            "from the pod alone, the name shape decides"
        );
        p.replicaset_owner = ReplicaSetOwner::Verified(None);
        assert_eq!(
            WorkloadIdentity::of(&p).unwrap().key().as_str(),
            format!("prod_rs_web-zz9_{U}")
        );
        // Controlled by Deployment `api`: that is the workload, whatever the names say.
        p.replicaset_owner = ReplicaSetOwner::Verified(Some(OwnerFacts {
            kind: "Deployment".into(),
            name: "api".into(),
            uid: UID.into(),
        }));
        assert_eq!(
            WorkloadIdentity::of(&p).unwrap().key().as_str(),
            "prod_deploy_api"
        );
    }

    #[test]
    fn owners_are_checked_by_uid() {
        let claimed = OwnerFacts {
            kind: "ReplicaSet".into(),
            name: "web-1".into(),
            uid: UID.into(),
        };
        assert_eq!(check_owner(&claimed, Some(UID)), Ok(()));
        assert!(matches!(
            check_owner(&claimed, None),
            Err(Unverified::Missing { .. })
        ));
        let e = check_owner(&claimed, Some("other")).unwrap_err();
        assert!(matches!(e, Unverified::OtherUid { .. }));
        assert!(e.to_string().contains("ReplicaSet \"web-1\""), "{e}");
        assert!(check_owner(&claimed, Some("")).is_err());
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
