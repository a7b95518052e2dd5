//! Pre-staging: which nodes are about to lose their pods, which nodes are likely to receive
//! them, and which checkpoints a receiver fetches into its chunk cache ahead of the restore, in
//! what order and within what bound. Pure: the agent turns Nodes, Pods and PodCheckpoints into
//! these facts and acts on the answers.
//!
//! **At risk** ([`risk`]): a node whose pods are about to be moved. In order of urgency: the
//! agent's notice label (`stasis.dev/notice`: the cloud announced the node's end), a `NoExecute`
//! taint (the taint manager evicts what does not tolerate it: a drain by taint, or the node
//! controller's `unreachable`/`not-ready`), a disruption taint of an autoscaler (Karpenter's
//! `karpenter.sh/disrupted`, the cluster autoscaler's `ToBeDeletedByClusterAutoscaler`: the node
//! is being drained to be deleted), or a cordon (`spec.unschedulable`: what `kubectl drain` and
//! node upgrades do first).
//!
//! **Likely receiver** ([`can_receive`]) of a pod of an at-risk node: a node where its
//! replacement can be scheduled and restored, by the same rules the scheduler and the webhook
//! apply — not itself at risk, `Ready`, schedulable, with the stasis runtime (`stasis.dev/ready`,
//! which the RuntimeClass's nodeSelector and the webhook's affinity require), the checkpointing
//! node's CPU architecture and GPU driver branch (the webhook pins a restore to them), every
//! `NoSchedule`/`NoExecute` taint tolerated by the pod, and the pod's nodeSelector matched. Of the
//! nodes that qualify, the pod's [`receivers`] are at most `k`, chosen by rendezvous hashing of
//! the pod's UID and the node's name: every agent computes the same set from the same Nodes
//! without talking to the others, so each pod's checkpoint is fetched by `k` nodes, not by every
//! node of a large cluster (which would multiply the store's reads and evict every node's cache).
//!
//! **What first** ([`plan`]): GPU pods first (the costliest state to rebuild, as for the cloud
//! notices' checkpoints), then the larger checkpoint (the more fetch time its restore is
//! spared), then the most recent; taken while the checkpoints' sizes fit the cache's bound (one
//! that does not fit is left out, a smaller one after it may still fit), so that a pre-stage
//! never evicts what it fetched a moment earlier.

use std::collections::BTreeMap;

use crate::names::node as label;

/// Karpenter's taint on a node it is disrupting (consolidation, drift, expiry).
pub const KARPENTER_DISRUPTED: &str = "karpenter.sh/disrupted";
/// The cluster autoscaler's taint on a node it is scaling down.
pub const CLUSTER_AUTOSCALER_DELETING: &str = "ToBeDeletedByClusterAutoscaler";

/// A node taint (`spec.taints[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// A pod toleration (`spec.tolerations[]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Toleration {
    /// Empty with `Exists`: every taint.
    pub key: Option<String>,
    /// `Equal` (the default) or `Exists`.
    pub operator: Option<String>,
    pub value: Option<String>,
    /// Empty: every effect.
    pub effect: Option<String>,
}

impl Toleration {
    /// Whether it tolerates `t`, as the scheduler decides it.
    pub fn tolerates(&self, t: &Taint) -> bool {
        if self
            .effect
            .as_deref()
            .is_some_and(|e| !e.is_empty() && e != t.effect)
        {
            return false;
        }
        let exists = self.operator.as_deref() == Some("Exists");
        match self.key.as_deref().filter(|k| !k.is_empty()) {
            None => exists,
            Some(k) if k != t.key => false,
            Some(_) => {
                exists || self.value.as_deref().unwrap_or("") == t.value.as_deref().unwrap_or("")
            }
        }
    }
}

/// What pre-staging reads of a Node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    pub taints: Vec<Taint>,
    pub labels: BTreeMap<String, String>,
}

/// Why a node is about to lose its pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Risk {
    /// The cloud announced its end (the agent's `stasis.dev/notice` label; its value).
    Notice(String),
    /// A `NoExecute` taint (its key): pods that do not tolerate it are evicted.
    NoExecute(String),
    /// An autoscaler is draining it to delete it (the taint's key).
    Disruption(String),
    /// Cordoned: `kubectl drain` and node upgrades start so.
    Cordoned,
}

impl std::fmt::Display for Risk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Risk::Notice(kind) => write!(f, "cloud notice {kind}"),
            Risk::NoExecute(key) => write!(f, "NoExecute taint {key}"),
            Risk::Disruption(key) => write!(f, "disruption taint {key}"),
            Risk::Cordoned => f.write_str("cordoned"),
        }
    }
}

/// Why `n` is about to lose its pods, the most urgent reason; `None`: it is not.
pub fn risk(n: &NodeFacts) -> Option<Risk> {
    if let Some(kind) = n.labels.get(label::NOTICE) {
        return Some(Risk::Notice(kind.clone()));
    }
    if let Some(t) = n.taints.iter().find(|t| t.effect == "NoExecute") {
        return Some(Risk::NoExecute(t.key.clone()));
    }
    if let Some(t) = n
        .taints
        .iter()
        .find(|t| t.key == KARPENTER_DISRUPTED || t.key == CLUSTER_AUTOSCALER_DELETING)
    {
        return Some(Risk::Disruption(t.key.clone()));
    }
    n.unschedulable.then_some(Risk::Cordoned)
}

/// What decides where a pod's replacement can go (its spec's, which the replacement shares).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
}

/// Why a node is not a likely receiver of a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReceiver {
    #[error("it is at risk itself ({0})")]
    AtRisk(Risk),
    #[error("it is not Ready")]
    NotReady,
    #[error("it is cordoned")]
    Unschedulable,
    #[error("it cannot restore (no {} label)", label::READY)]
    NoRuntime,
    #[error("its {label} differs from the checkpointing node's")]
    Mismatch { label: &'static str },
    #[error("the pod does not tolerate its taint {0}")]
    Taint(String),
    #[error("the pod's nodeSelector does not match it ({0})")]
    Selector(String),
}

/// Whether `node` can receive a replacement of a pod of `from` with `pod`'s placement (see the
/// module docs).
pub fn can_receive(node: &NodeFacts, from: &NodeFacts, pod: &Placement) -> Result<(), NotReceiver> {
    if let Some(r) = risk(node) {
        return Err(NotReceiver::AtRisk(r));
    }
    if !node.ready {
        return Err(NotReceiver::NotReady);
    }
    if node.unschedulable {
        return Err(NotReceiver::Unschedulable);
    }
    if node.labels.get(label::READY).map(String::as_str) != Some("true") {
        return Err(NotReceiver::NoRuntime);
    }
    for l in [label::CPU_ARCH, label::GPU_DRIVER_BRANCH] {
        if let Some(want) = from.labels.get(l) {
            if node.labels.get(l) != Some(want) {
                return Err(NotReceiver::Mismatch { label: l });
            }
        }
    }
    if let Some(t) = node.taints.iter().find(|t| {
        (t.effect == "NoSchedule" || t.effect == "NoExecute")
            && !pod.tolerations.iter().any(|tol| tol.tolerates(t))
    }) {
        return Err(NotReceiver::Taint(format!("{}:{}", t.key, t.effect)));
    }
    if let Some((k, _)) = pod
        .node_selector
        .iter()
        .find(|(k, v)| node.labels.get(*k) != Some(v))
    {
        return Err(NotReceiver::Selector(k.clone()));
    }
    Ok(())
}

/// A node's rendezvous score for a pod: the same on every agent.
fn score(pod_uid: &str, node: &str) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(pod_uid.as_bytes());
    h.update(&[0]);
    h.update(node.as_bytes());
    let b = h.finalize();
    u64::from_le_bytes(b.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The nodes of `nodes` that pre-stage the checkpoint of pod `pod_uid` of node `from`: those
/// that [`can_receive`] it, the `k` of highest rendezvous score (`k` = 0: all of them).
pub fn receivers<'a>(
    nodes: &'a [NodeFacts],
    from: &NodeFacts,
    pod_uid: &str,
    pod: &Placement,
    k: usize,
) -> Vec<&'a str> {
    let mut ok: Vec<(u64, &str)> = nodes
        .iter()
        .filter(|n| n.name != from.name && can_receive(n, from, pod).is_ok())
        .map(|n| (score(pod_uid, &n.name), n.name.as_str()))
        .collect();
    ok.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    if k > 0 {
        ok.truncate(k);
    }
    ok.into_iter().map(|(_, n)| n).collect()
}

/// A checkpoint that could be pre-staged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staging<K> {
    pub key: K,
    /// `<lineage>/<id>`.
    pub checkpoint_ref: String,
    /// Its size (the captured bytes: at least what its chunks take in the cache).
    pub bytes: u64,
    /// When it was published (Unix ms).
    pub completed_unix_ms: i64,
    /// The pod asks for a GPU.
    pub uses_gpu: bool,
}

/// The checkpoints to pre-stage, in order, and those left out because the cache's bound
/// (`budget` bytes) is reached (see the module docs).
pub fn plan<K>(mut all: Vec<Staging<K>>, budget: u64) -> (Vec<Staging<K>>, Vec<Staging<K>>) {
    all.sort_by(|a, b| {
        b.uses_gpu
            .cmp(&a.uses_gpu)
            .then(b.bytes.cmp(&a.bytes))
            .then(b.completed_unix_ms.cmp(&a.completed_unix_ms))
            .then(a.checkpoint_ref.cmp(&b.checkpoint_ref))
    });
    let (mut take, mut left, mut used) = (Vec::new(), Vec::new(), 0u64);
    for s in all {
        if used.saturating_add(s.bytes) <= budget {
            used += s.bytes;
            take.push(s);
        } else {
            left.push(s);
        }
    }
    (take, left)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeFacts {
        NodeFacts {
            name: name.into(),
            ready: true,
            labels: [
                (label::READY.to_owned(), "true".to_owned()),
                (label::CPU_ARCH.to_owned(), "amd64".to_owned()),
            ]
            .into(),
            ..Default::default()
        }
    }

    fn taint(key: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: None,
            effect: effect.into(),
        }
    }

    #[test]
    fn at_risk_nodes_and_why() {
        let healthy = node("a");
        assert_eq!(risk(&healthy), None);
        let mut cordoned = node("a");
        cordoned.unschedulable = true;
        assert_eq!(risk(&cordoned), Some(Risk::Cordoned));
        let mut karpenter = node("a");
        karpenter
            .taints
            .push(taint(KARPENTER_DISRUPTED, "NoSchedule"));
        assert_eq!(
            risk(&karpenter),
            Some(Risk::Disruption(KARPENTER_DISRUPTED.into()))
        );
        let mut ca = node("a");
        ca.taints
            .push(taint(CLUSTER_AUTOSCALER_DELETING, "NoSchedule"));
        assert!(matches!(risk(&ca), Some(Risk::Disruption(_))));
        let mut no_exec = cordoned.clone();
        no_exec.taints.push(taint("drain", "NoExecute"));
        assert_eq!(
            risk(&no_exec),
            Some(Risk::NoExecute("drain".into())),
            "the more urgent reason"
        );
        let mut noticed = no_exec.clone();
        noticed
            .labels
            .insert(label::NOTICE.into(), "Reclaim".into());
        assert_eq!(risk(&noticed), Some(Risk::Notice("Reclaim".into())));
        let mut other = node("a");
        other.taints.push(taint("dedicated", "NoSchedule"));
        other.taints.push(taint("soft", "PreferNoSchedule"));
        assert_eq!(
            risk(&other),
            None,
            "an ordinary NoSchedule taint is no risk"
        );
    }

    #[test]
    fn a_receiver_is_healthy_schedulable_able_to_restore_and_matching() {
        let from = node("from");
        let none = Placement::default();
        assert_eq!(can_receive(&node("b"), &from, &none), Ok(()));
        let mut b = node("b");
        b.unschedulable = true;
        assert!(matches!(
            can_receive(&b, &from, &none),
            Err(NotReceiver::AtRisk(Risk::Cordoned))
        ));
        let mut b = node("b");
        b.ready = false;
        assert_eq!(can_receive(&b, &from, &none), Err(NotReceiver::NotReady));
        let mut b = node("b");
        b.labels.remove(label::READY);
        assert_eq!(can_receive(&b, &from, &none), Err(NotReceiver::NoRuntime));
        let mut b = node("b");
        b.labels.insert(label::CPU_ARCH.into(), "arm64".into());
        assert_eq!(
            can_receive(&b, &from, &none),
            Err(NotReceiver::Mismatch {
                label: label::CPU_ARCH
            })
        );
        let mut gpu_from = node("from");
        gpu_from
            .labels
            .insert(label::GPU_DRIVER_BRANCH.into(), "580".into());
        assert!(can_receive(&node("b"), &gpu_from, &none).is_err());
        // Taints: tolerated or not.
        let mut tainted = node("b");
        tainted.taints.push(Taint {
            key: "dedicated".into(),
            value: Some("ml".into()),
            effect: "NoSchedule".into(),
        });
        assert_eq!(
            can_receive(&tainted, &from, &none),
            Err(NotReceiver::Taint("dedicated:NoSchedule".into()))
        );
        let tolerating = Placement {
            tolerations: vec![Toleration {
                key: Some("dedicated".into()),
                value: Some("ml".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(can_receive(&tainted, &from, &tolerating), Ok(()));
        let wrong_value = Placement {
            tolerations: vec![Toleration {
                key: Some("dedicated".into()),
                value: Some("web".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(can_receive(&tainted, &from, &wrong_value).is_err());
        let everything = Placement {
            tolerations: vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(can_receive(&tainted, &from, &everything), Ok(()));
        let mut soft = node("b");
        soft.taints.push(taint("x", "PreferNoSchedule"));
        assert_eq!(
            can_receive(&soft, &from, &none),
            Ok(()),
            "only a preference"
        );
        // nodeSelector.
        let pool = Placement {
            node_selector: [("pool".to_owned(), "gpu".to_owned())].into(),
            ..Default::default()
        };
        assert_eq!(
            can_receive(&node("b"), &from, &pool),
            Err(NotReceiver::Selector("pool".into()))
        );
        let mut in_pool = node("b");
        in_pool.labels.insert("pool".into(), "gpu".into());
        assert_eq!(can_receive(&in_pool, &from, &pool), Ok(()));
    }

    #[test]
    fn receivers_are_k_of_the_eligible_the_same_on_every_agent() {
        let mut from = node("from");
        from.unschedulable = true;
        let mut nodes: Vec<NodeFacts> = (0..10).map(|i| node(&format!("n{i}"))).collect();
        nodes.push(from.clone());
        nodes[3].ready = false;
        let p = Placement::default();
        let all = receivers(&nodes, &from, "uid-1", &p, 0);
        assert_eq!(all.len(), 9, "every eligible node, not the source, not n3");
        assert!(!all.contains(&"n3") && !all.contains(&"from"));
        let three = receivers(&nodes, &from, "uid-1", &p, 3);
        assert_eq!(three, all[..3], "the top of the same order");
        // The same answer whatever the order the nodes were listed in.
        let mut shuffled = nodes.clone();
        shuffled.reverse();
        assert_eq!(receivers(&shuffled, &from, "uid-1", &p, 3), three);
        // Another pod spreads over other nodes (not all pods on the same three).
        let spread: std::collections::BTreeSet<&str> = (0..20)
            .flat_map(|i| receivers(&nodes, &from, &format!("uid-{i}"), &p, 3))
            .collect();
        assert!(spread.len() > 5, "{spread:?}");
        // A small cluster: every eligible node.
        assert_eq!(receivers(&nodes[..2], &from, "uid-1", &p, 3).len(), 2);
    }

    fn staging(name: &str, gpu: bool, done: i64, bytes: u64) -> Staging<String> {
        Staging {
            key: name.into(),
            checkpoint_ref: format!("l/{name}"),
            bytes,
            completed_unix_ms: done,
            uses_gpu: gpu,
        }
    }

    #[test]
    fn plan_takes_gpu_then_larger_then_newer_within_the_bound() {
        let all = vec![
            staging("small-old", false, 1, 100),
            staging("small-new", false, 2, 100),
            staging("large", false, 1, 600),
            staging("gpu", true, 1, 300),
        ];
        let keys = |v: &[Staging<String>]| v.iter().map(|s| s.key.clone()).collect::<Vec<_>>();
        let (take, left) = plan(all.clone(), u64::MAX);
        assert_eq!(keys(&take), ["gpu", "large", "small-new", "small-old"]);
        assert!(left.is_empty());
        // 1000 bytes: gpu (300) + large (600) fit, then only 100 left: small-new fits.
        let (take, left) = plan(all.clone(), 1000);
        assert_eq!(keys(&take), ["gpu", "large", "small-new"]);
        assert_eq!(keys(&left), ["small-old"]);
        // A checkpoint too large for the bound is left out; a smaller one after it still fits.
        let (take, left) = plan(all, 450);
        assert_eq!(keys(&take), ["gpu", "small-new"]);
        assert_eq!(keys(&left), ["large", "small-old"]);
    }
}
