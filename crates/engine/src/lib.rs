//! stasis-engine: checkpoint and restore of runc containers and plain process trees.
//!
//! Synchronous by design (no tokio): this code forks runc and CRIU, and later enters
//! namespaces. The flows follow DESIGN §3:
//!
//! - [`checkpoint::checkpoint_container`]: freeze (runc pause) → filesystem capture → CRIU dump
//!   through `runc checkpoint` → thaw, so files and memory describe the same instant;
//! - [`checkpoint::checkpoint_pod`]: the same for every container of a pod at one instant
//!   (all paused before any is captured);
//! - [`checkpoint::checkpoint_process`]: CRIU dump of a process tree through CRIU's RPC;
//! - [`restore::restore_container`] / [`restore::restore_process`]: the reverse.
//!
//! The engine writes and reads a checkpoint *image directory* (layout in [`image`]); moving it
//! to and from a store is the store's job.

pub mod cgroup;
pub mod checkpoint;
pub mod containerd;
pub mod cuda;
pub mod error;
pub mod image;
pub mod mounts;
pub mod node;
mod pod;
pub mod proctree;
pub mod restore;
pub mod rootfs;
pub mod runc;
pub mod sockets;
mod tarball;
pub mod tools;
mod unpack;
pub mod upstream;

pub use error::EngineError;
