//! stasis-core: the domain model of stasis, with no I/O.
//!
//! - [`reference`](mod@reference): workload names, checkpoint ids and `<workload>/<id|latest>` references;
//! - [`manifest`]: the schema-versioned checkpoint manifest the store writes last;
//! - [`fingerprint`]: what a node is (CPU, kernel, CRIU, runc, GPU) and the rule that decides
//!   whether a checkpoint may be restored on it;
//! - [`gpu`]: the GPU part of the fingerprint and its compatibility rule;
//! - Kubernetes decisions (docs/design.md §10): [`workload`] identity, [`lineage`] claims and
//!   fencing, [`policy`] math, the [`podspec`] hash and the restore [`decision`];
//! - triggers: the [`memory`] trigger's arithmetic and the automatic [`interval`] (Young/Daly).
//!
//! - [`names`]: every `stasis.dev/*` label and annotation key and every condition reason.
//!
//! Everything here is pure (but [`time::now_ms`], the one clock): the engine and the CLI gather
//! facts from the machine and hand them in.

pub mod advise;
pub mod deadline;
pub mod decision;
pub mod fingerprint;
pub mod gpu;
pub mod interval;
pub mod lineage;
pub mod manifest;
pub mod memory;
pub mod names;
pub mod notice;
pub mod podspec;
pub mod policy;
pub mod prestage;
pub mod reference;
pub mod time;
pub mod workload;

pub use fingerprint::{
    CpuFingerprint, Mismatch, NodeFingerprint, Requirements, RestoreTarget, Version,
};
pub use manifest::{
    ChunkRef, FileEntry, Manifest, ManifestError, ProcessInfo, RootfsCapture, RootfsMethod, Source,
    StoreStats, Timings, SCHEMA_VERSION,
};
pub use reference::{CheckpointId, CheckpointRef, RefError, Selector, WorkloadName};
