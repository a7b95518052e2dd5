//! The agent's labels on its node (`stasis.dev/ready` and the fingerprint labels), refreshed
//! periodically by a plain thread, with the sweep of stale plans and images.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use tracing::{info, warn};

use super::{KubeSettings, Running, MANAGER};
use crate::checks;
use crate::error::Result;

/// Sets (or removes) the agent's labels on its node, as field manager [`MANAGER`].
///
/// A merge patch, not an apply: withdrawing `stasis.dev/ready` must work whoever set it (an
/// agent of an earlier version, which wrote without this field manager), and an apply removes
/// only the fields its manager owns.
pub async fn patch_node_labels(
    client: &Client,
    node: &str,
    labels: &BTreeMap<String, Option<String>>,
) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let params = PatchParams {
        field_manager: Some(MANAGER.to_owned()),
        ..Default::default()
    };
    api.patch(node, &params, &Patch::Merge(&checks::labels_patch(labels)))
        .await?;
    Ok(())
}

/// Periodically runs the node checks, publishes the labels and sweeps stale plans and images
/// (a plain thread: the checks fork `criu` and `runc`).
pub fn label_loop(
    running: &Running,
    settings: KubeSettings,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let cluster = running.cluster.clone();
    let pods_ready = running.pods_ready.clone();
    std::thread::Builder::new()
        .name("node-checks".into())
        .spawn(move || {
            let mut last_ready = None;
            while !stop.load(Ordering::SeqCst) {
                let c = checks::run(&settings.containerd_configs, &settings.runtime_binary);
                let ready = c.ready();
                if last_ready != Some(ready) {
                    if ready {
                        info!(criu = ?c.criu, runc = ?c.runc, handler = ?c.handler, "node ready for restores");
                    } else {
                        warn!(problems = ?c.problems(), "node not ready for restores");
                    }
                }
                cluster.exec.metrics.set_ready(ready);
                let gpu = stasis_engine::cuda::gpu_fingerprint();
                // A node whose end its cloud announced takes no more restores.
                let labels = checks::node_labels(
                    ready && !crate::notice::node_ending(),
                    &stasis_engine::node::arch(),
                    gpu.as_ref(),
                );
                match cluster
                    .rt
                    .block_on(patch_node_labels(&cluster.client, &settings.node, &labels))
                {
                    Ok(()) => last_ready = Some(ready),
                    Err(e) => warn!(error = %e, "cannot label the node"),
                }
                if pods_ready.load(Ordering::SeqCst) {
                    let live: HashSet<String> = cluster
                        .pods
                        .state()
                        .iter()
                        .filter_map(|p| p.metadata.uid.clone())
                        .collect();
                    cluster.exec.sweep(&live);
                }
                let until = Instant::now() + settings.check_interval;
                while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        })
        .expect("spawn the node-checks thread")
}
