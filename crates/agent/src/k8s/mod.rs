//! The Kubernetes side of the agent.
//!
//! - a reflector of the pods bound to this node (`spec.nodeName=<node>`), and one of the
//!   `CheckpointPolicy`s (which pods want a termination checkpoint);
//! - a controller of the `PodCheckpoint`s whose source pod is on this node and whose phase is
//!   unset or `Pending`: run on a job pool (one at a time per pod), status `Running` →
//!   `Succeeded` / `Failed` with the `Ready` condition;
//! - a controller of the `PodRestore`s whose target pod is on this node and whose phase is unset
//!   or `Pending`: `Fetching` → fetch, verify, plan file → `Ready`, or `Failed` with a
//!   `ColdStart` Event;
//! - the wrapper's reports → `PodRestore` `Restored` / `ColdStart` and a pod Event;
//! - the node labels (`stasis.dev/ready` and the fingerprint labels), refreshed periodically and
//!   `ready` removed on shutdown;
//! - the `Eviction`s of the pods of this node, answered as an eviction responder
//!   ([`eviction_request`]);
//! - pre-staging: other nodes' checkpoints fetched into this node's chunk cache while their
//!   node is at risk ([`prestage`]);
//! - namespace data keys from Secrets in stasis's namespace, created if absent (create-only:
//!   the first writer wins, a loser reads the winner's key).
//!
//! The reconcilers run on tokio; every job that forks (the engine) or blocks runs on the plain
//! threads of a bounded pool ([`crate::fair::JobPool`]), which reach the API server through
//! `Handle::block_on`.

mod cluster;
mod controllers;
mod data_keys;
pub mod eviction_request;
mod jobs;
mod node_labels;
mod pod_facts;
pub mod prestage;
mod status_writer;

pub use cluster::KubeCluster;
pub use controllers::{
    retry_delay, start, KubeSettings, ReconcileError, Running, QUEUED_PER_NAMESPACE,
    WORKERS_PER_QUEUE,
};
pub use data_keys::{BrokerClient, KeyOrigin, SecretKeys, BROKER_KEY_TTL};
pub use node_labels::{label_loop, patch_node_labels};
pub use pod_facts::{image_digest, not_opted_in, pod_info, restore_mismatch, single_container};
pub(crate) use status_writer::created_by_agent;

/// Field manager of the agent's patches.
pub const MANAGER: &str = "stasisd";

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}
