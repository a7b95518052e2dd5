//! Where a restoring pod may run: the node requirements a checkpoint imposes (ready nodes of
//! its architecture and GPU driver branch).

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
