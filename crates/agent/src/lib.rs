//! stasis-agent: `stasisd`, the node agent (DaemonSet).
//!
//! - [`executor`]: synchronous checkpoints (engine + store upload) and restore preparation
//!   (fetch + verify into `/var/lib/stasis/images/<pod-uid>/<container>/`, plan file);
//! - [`resolve`]: a pod's containers from runc state and CRI annotations;
//! - [`server`] and [`node`]: the node-api socket (`restore_plan`, `final_checkpoint`,
//!   `report`) and the per-pod serialisation of checkpoints; [`reports`]: the runtime's
//!   reports delivered at least once (claimed report files);
//! - [`k8s`]: the Kubernetes side (PodCheckpoint / PodRestore watchers, status, Events,
//!   node labels, data keys);
//! - pure helpers with unit tests: [`keys`] (data key wrap/unwrap), [`fence`], [`status`],
//!   [`checks`], [`selector`], [`metrics`].
//!
//! docs/design.md §12 describes the agent.

pub mod busy;
pub mod checks;
pub mod config;
pub mod error;
pub mod executor;
pub mod fair;
pub mod fence;
/// The keyring and data key Secrets, shared with the controller's key broker.
pub use stasis_api::keys;
pub mod k8s;
pub mod mem;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod notice;
pub mod reports;
pub mod resolve;
pub mod run;
pub mod selector;
pub mod server;
pub mod status;

pub use error::{AgentError, Result};
