//! The checkpoint manifest: the one document that makes a checkpoint exist.
//!
//! The store writes it last and atomically, after every chunk it names is stored, so a manifest
//! that can be read describes a complete checkpoint. It is JSON with a `schema_version`; readers
//! refuse versions they do not know rather than guess.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::fingerprint::Requirements;
use crate::reference::{CheckpointId, CheckpointRef, WorkloadName};

/// The manifest schema this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// What was checkpointed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Source {
    /// A runc container, dumped through `runc checkpoint`.
    Container { container_id: String },
    /// A plain process tree, dumped through CRIU's RPC.
    Process { pid: i32 },
}

/// One process of the dumped tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: i32,
    pub ppid: i32,
    pub command: String,
}

/// How the container's filesystem changes were captured (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RootfsMethod {
    /// The overlayfs upper directory, whiteouts, modes, owners and xattrs included.
    OverlayUpper,
    /// A plain-directory rootfs: every entry changed since the container started (ctime at or
    /// after its creation), plus the list of all paths so that deletions are replayed.
    ChangedSinceStart,
}

/// Summary of the captured filesystem changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootfsCapture {
    pub method: RootfsMethod,
    /// Entries written into the diff archive.
    pub entries: u64,
    /// Entries removed since the container started (replayed as deletions on restore).
    pub deleted: u64,
    pub bytes: u64,
}

/// Where the time of a checkpoint went, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Timings {
    /// The workload's downtime: from freeze to thaw.
    pub frozen_ms: u64,
    /// CRIU dump (inside the freeze).
    pub dump_ms: u64,
    /// Filesystem capture (inside the freeze).
    pub rootfs_ms: u64,
    /// Chunk, compress, encrypt, upload, publish.
    pub store_ms: u64,
    pub total_ms: u64,
}

/// How much of the checkpoint was new to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoreStats {
    /// Bytes of the checkpoint's files.
    pub logical_bytes: u64,
    pub chunks: u64,
    /// Chunks this checkpoint had to write (the rest were already in the store).
    pub new_chunks: u64,
    /// Uncompressed bytes of the new chunks.
    pub new_bytes: u64,
    /// Bytes actually written to the backend for the new chunks (compressed and encrypted).
    pub written_bytes: u64,
}

/// A chunk of a file: its keyed address and its uncompressed length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Keyed BLAKE3 of the plaintext, hex.
    pub id: String,
    pub len: u32,
}

/// A file of the checkpoint image (CRIU images, the rootfs diff, metadata), by relative path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub mode: u32,
    pub size: u64,
    pub chunks: Vec<ChunkRef>,
}

/// The checkpoint manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    pub workload: WorkloadName,
    pub id: CheckpointId,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// The key the chunks are addressed and encrypted with (not the key).
    pub key_id: String,
    pub source: Source,
    /// Whether the workload kept running after the checkpoint.
    pub leave_running: bool,
    pub requirements: Requirements,
    pub processes: Vec<ProcessInfo>,
    pub rootfs: Option<RootfsCapture>,
    pub timings: Timings,
    pub stats: StoreStats,
    pub files: Vec<FileEntry>,
    /// How many processes held a CUDA context and were checkpointed through the driver API
    /// (their GPU memory is in the CRIU images); a restore resumes that many.
    #[serde(default)]
    pub gpu_processes: u32,
    /// Free-form labels (lineage, generation, pod, reason...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("manifest schema version {found} is not supported (this build reads {SCHEMA_VERSION}); upgrade stasis")]
    UnsupportedSchema { found: u32 },
    #[error("manifest file path {0:?} is not a safe relative path")]
    UnsafePath(String),
    #[error(
        "manifest file {path:?}: chunks add up to {chunks} bytes, but the file is {size} bytes"
    )]
    SizeMismatch {
        path: String,
        size: u64,
        chunks: u64,
    },
    #[error("manifest chunk id {0:?} is not 64 lower-case hex digits")]
    BadChunkId(String),
}

impl Manifest {
    /// The exact reference of this checkpoint.
    pub fn reference(&self) -> CheckpointRef {
        CheckpointRef::exact(self.workload.clone(), self.id.clone())
    }

    /// Checks what a reader must be able to trust before acting on a manifest: a known schema,
    /// paths that cannot escape the restore directory, chunk lists that add up.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(ManifestError::UnsupportedSchema {
                found: self.schema_version,
            });
        }
        for f in &self.files {
            if !is_safe_relative_path(&f.path) {
                return Err(ManifestError::UnsafePath(f.path.clone()));
            }
            let sum: u64 = f.chunks.iter().map(|c| u64::from(c.len)).sum();
            if sum != f.size {
                return Err(ManifestError::SizeMismatch {
                    path: f.path.clone(),
                    size: f.size,
                    chunks: sum,
                });
            }
            if let Some(c) = f.chunks.iter().find(|c| !is_chunk_id(&c.id)) {
                return Err(ManifestError::BadChunkId(c.id.clone()));
            }
        }
        Ok(())
    }

    /// Every chunk id the checkpoint needs (with repeats).
    pub fn chunk_ids(&self) -> impl Iterator<Item = &str> {
        self.files
            .iter()
            .flat_map(|f| f.chunks.iter().map(|c| c.id.as_str()))
    }

    pub fn logical_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A relative path of normal components only: no root, no `..`, no `.`, no empty segment.
pub fn is_safe_relative_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && p.split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
        && !p.contains('\0')
}

fn is_chunk_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            schema_version: SCHEMA_VERSION,
            workload: WorkloadName::new("w").unwrap(),
            id: CheckpointId::from_parts(1_795_000_000_000, 7),
            created_at: "2026-11-18T08:06:40.000Z".into(),
            key_id: "k".into(),
            source: Source::Process { pid: 42 },
            leave_running: true,
            requirements: Requirements::default(),
            processes: vec![],
            rootfs: None,
            timings: Timings::default(),
            stats: StoreStats::default(),
            files: vec![FileEntry {
                path: "criu/pages-1.img".into(),
                mode: 0o600,
                size: 5,
                chunks: vec![
                    ChunkRef {
                        id: "a".repeat(64),
                        len: 2,
                    },
                    ChunkRef {
                        id: "b".repeat(64),
                        len: 3,
                    },
                ],
            }],
            gpu_processes: 0,
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn valid_manifest_round_trips_through_json() {
        let m = sample();
        m.validate().unwrap();
        let back: Manifest = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.chunk_ids().count(), 2);
        assert_eq!(back.logical_bytes(), 5);
    }

    #[test]
    fn unsafe_and_inconsistent_manifests_are_refused() {
        let mut m = sample();
        m.schema_version = 99;
        assert_eq!(
            m.validate(),
            Err(ManifestError::UnsupportedSchema { found: 99 })
        );

        for bad in ["../etc/passwd", "/abs", "a//b", "a/./b", ""] {
            let mut m = sample();
            m.files[0].path = bad.into();
            assert_eq!(
                m.validate(),
                Err(ManifestError::UnsafePath(bad.into())),
                "{bad}"
            );
        }

        let mut m = sample();
        m.files[0].size = 6;
        assert!(matches!(
            m.validate(),
            Err(ManifestError::SizeMismatch { .. })
        ));

        let mut m = sample();
        m.files[0].chunks[0].id = "../x".into();
        assert!(matches!(m.validate(), Err(ManifestError::BadChunkId(_))));
    }
}
