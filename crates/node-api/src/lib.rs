//! stasis-node-api: what the node agent (`stasisd`) and the runtime wrapper (`stasis-runc`) say to
//! each other on one node.
//!
//! Two channels, both local to the node and both root-only:
//!
//! - a unix socket (default [`DEFAULT_SOCKET`], mode 0600) that the agent serves: one request per
//!   connection, one line of JSON each way (see [`codec`]); messages in [`proto`]; a synchronous
//!   client with timeouts on connect, write and read in [`client`]; server-side helpers and a tiny
//!   std-threads server for tests in [`server`];
//! - plan files (default [`DEFAULT_PLANS_DIR`]) that the agent drops, by atomic rename, so the
//!   wrapper can decide a restore with no round trip at all ([`planfile`]).
//!
//! No tokio and no kube here: `stasis-runc` links this crate and sits on every container create
//! and stop, so it must stay small and start in milliseconds.

pub mod client;
pub mod codec;
pub mod cri;
pub mod planfile;
pub mod proto;
pub mod server;

pub use client::{Client, ClientError};
pub use proto::*;

/// The agent's state directory on a node.
pub const DEFAULT_RUN_DIR: &str = "/run/stasis";
/// Where the agent listens.
pub const DEFAULT_SOCKET: &str = "/run/stasis/agent.sock";
/// Where the agent drops restore plans.
pub const DEFAULT_PLANS_DIR: &str = "/run/stasis/plans";
