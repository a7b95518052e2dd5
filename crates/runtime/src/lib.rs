//! stasis-runtime: `stasis-runc`, the runtime binary of the `stasis` RuntimeClass (DESIGN §2,
//! docs/design.md §11).
//!
//! containerd's runc shim calls it exactly like runc. It passes every command through to the
//! real runc by `exec`, except:
//!
//! - `create` of an application container for which the node agent left a verified restore plan:
//!   the checkpoint's filesystem changes go into the bundle's rootfs and `runc restore --detach`
//!   runs with the same bundle, pid file and console socket; `start` of that container is then a
//!   no-op. Any doubt or failure: the original `runc create` (cold start), with the reason.
//! - `create` of an init container of a restored pod that ran before the checkpoint (the agent's
//!   skip note): it runs stasis's own exit-0 program instead of its command ([`skip`]).
//! - `kill` with SIGTERM: the agent is asked for a final checkpoint, bounded, then the signal is
//!   forwarded.
//!
//! Small on purpose (no tokio, no kube): it sits on every container create and stop.

pub mod argv;
pub mod bundle;
pub mod config;
pub mod decide;
pub mod inplace;
pub mod runlog;
pub mod skip;
pub mod wrapper;
