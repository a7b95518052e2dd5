//! stasis-gpu: checkpoint and restore CUDA processes through the NVIDIA driver's
//! `cuCheckpointProcess*` API (r570+; GPU remapping r580+), and the node's GPU fingerprint.
//!
//! `libcuda.so.1` and `libnvidia-ml.so.1` are loaded at run time: the crate builds and tests on
//! machines without a GPU, where [`probe`](fn@probe) says "no NVIDIA driver" and [`Driver::load`] returns
//! [`GpuError::NoDriver`].
//!
//! - [`Driver`]: the loaded driver; [`CheckpointApi`]: its checkpoint calls (also implemented by
//!   [`sim::SimDriver`] for tests);
//! - [`ProcessState`], [`Op`]: `CUprocessState` and its legal transitions;
//! - [`suspend_all`] / [`Suspension`] / [`resume_restored`]: every CUDA process of a tree, in
//!   DESIGN §7's order, never leaving one locked;
//! - [`WithDeadline`]: every driver call returns within a deadline (a hung call cannot wedge
//!   the caller);
//! - [`plan_remap`]: GPU UUID pairs for a restore onto other GPUs;
//! - [`detect`]: CUDA processes and unsupported setups (MPS, NCCL) from `/proc`;
//! - [`fingerprint`] (NVML) and [`probe`](fn@probe) (for `stasis doctor`);
//! - [`CuResult`]: `CUresult` codes and names.
//!
//! All `unsafe` is in the private `ffi` module.

mod ffi;

pub mod deadline;
pub mod detect;
pub mod driver;
pub mod error;
pub mod group;
pub mod nvml;
pub mod probe;
pub mod result;
pub mod sim;
pub mod state;
pub mod uuid;

pub use deadline::WithDeadline;
pub use driver::{CheckpointApi, Driver};
pub use error::GpuError;
pub use group::{
    resume_restored, suspend_all, suspend_all_with, PhaseTimings, StrandedHandler, Suspension,
};
pub use nvml::fingerprint;
pub use probe::{probe, GpuProbe};
pub use result::{CuResult, NvmlReturn};
pub use state::{Op, ProcessState};
pub use uuid::{plan_remap, plan_remap_assigned, visible_devices, GpuPair, GpuUuid};
