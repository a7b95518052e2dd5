//! Where a restoring pod may run: the node requirements a checkpoint imposes (ready nodes of
//! its architecture and GPU driver branch), and the nodes it should prefer (those that
//! pre-staged its checkpoint).

use super::*;

/// Node labels a restoring pod needs: an agent ready to restore, the checkpointing node's CPU
/// architecture and GPU driver branch (when that node is still known).
pub(crate) async fn node_requirements(
    client: &Client,
    node: Option<String>,
) -> Vec<(String, Vec<String>)> {
    let mut reqs = vec![(names::node::READY.to_owned(), vec!["true".to_owned()])];
    let Some(node) = node else { return reqs };
    if let Ok(Some(n)) = Api::<Node>::all(client.clone()).get_opt(&node).await {
        let labels = n.labels();
        for key in [names::node::CPU_ARCH, names::node::GPU_DRIVER_BRANCH] {
            if let Some(v) = labels.get(key) {
                reqs.push((key.to_owned(), vec![v.clone()]));
            }
        }
    }
    reqs
}

/// The nodes that pre-staged the checkpoint `reference` (of `lineage`, taken on `from`) ahead of
/// its restore, which the replacement should prefer: the source pod's receivers by the agents'
/// own rule (`stasis_core::prestage::receivers`: the same Nodes, the same pod, the same `k`), so
/// nothing an agent says is trusted. Empty when the Nodes are not cached yet, the checkpoint's
/// record or source pod is not known, or pre-staging is off (`k` = 0 means every likely
/// receiver, which is no preference).
pub(crate) fn prestaged_on(
    hook: &Webhook,
    ns: &str,
    lineage: &str,
    reference: &str,
    from: Option<&str>,
    pod: &Pod,
) -> Vec<String> {
    let k = hook.cfg.prestage_receivers;
    let (Some(nodes), Some(from), Some(spec), true) = (&hook.nodes, from, pod.spec.as_ref(), k > 0)
    else {
        return Vec::new();
    };
    if !hook.checkpoints.is_ready() {
        return Vec::new();
    }
    let source_uid = hook
        .checkpoints
        .of_lineage(ns, lineage)
        .iter()
        .filter_map(|c| {
            let s = c.status.as_ref()?;
            (s.checkpoint_ref.as_deref() == Some(reference)).then(|| {
                s.source_pod_uid
                    .clone()
                    .or_else(|| c.spec.source_pod_uid.clone())
            })?
        })
        .next();
    let Some(source_uid) = source_uid else {
        return Vec::new();
    };
    let facts: Vec<_> = nodes
        .state()
        .iter()
        .map(|n| stasis_api::prestage::node_facts(n))
        .collect();
    let Some(from) = facts.iter().find(|n| n.name == from) else {
        return Vec::new();
    };
    let placement = stasis_api::prestage::placement(spec);
    stasis_core::prestage::receivers(&facts, from, &source_uid, &placement, k)
        .into_iter()
        .map(str::to_owned)
        .collect()
}
