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

/// The largest chunk the store cuts (its FastCDC maximum). A manifest naming a longer chunk is
/// refused: readers size buffers from `ChunkRef::len`, so it must be bounded before anything is
/// allocated (the store's `chunk::MAX_CHUNK` is this value).
pub const MAX_CHUNK_LEN: u32 = 4 << 20;

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

/// The label of a pod checkpoint's manifest naming its containers, comma-separated, in the order
/// they were captured. Absent: a checkpoint of one container, its images at the root of the
/// files (`criu/`, `rootfs/`), as every checkpoint before pod checkpoints was.
pub const POD_CONTAINERS_LABEL: &str = "stasis.dev/containers";

/// The directory of a pod checkpoint's files that holds one directory per container, each laid
/// out as a one-container checkpoint: `containers/<name>/criu/`, `containers/<name>/rootfs/`.
pub const POD_CONTAINERS_DIR: &str = "containers";

/// The pod index: `pod.json` at the root of a pod checkpoint's files, what the manifest's
/// top-level fields say of a one-container checkpoint, per container.
pub const POD_INDEX_FILE: &str = "pod.json";

/// The contents of [`POD_INDEX_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIndex {
    pub containers: Vec<PodContainer>,
}

/// One container of a pod checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodContainer {
    /// The container's name in the pod spec (its directory under [`POD_CONTAINERS_DIR`]).
    pub name: String,
    pub source: Source,
    pub processes: Vec<ProcessInfo>,
    pub rootfs: Option<RootfsCapture>,
    #[serde(default)]
    pub image_digest: Option<String>,
    #[serde(default)]
    pub gpu_processes: u32,
}

impl PodIndex {
    /// The index of the pod checkpoint `manifest`: names as the manifest's label says, in its
    /// order.
    pub fn check(&self, manifest: &Manifest) -> Result<(), ManifestError> {
        let names: Vec<&str> = self.containers.iter().map(|c| c.name.as_str()).collect();
        match manifest.pod_containers()? {
            Some(want) if want == names => Ok(()),
            _ => Err(ManifestError::PodContainers(format!(
                "the pod index names {names:?}, the manifest {:?}",
                manifest.labels.get(POD_CONTAINERS_LABEL)
            ))),
        }
    }
}

/// The directory of container `name` in a pod checkpoint's files.
pub fn pod_container_dir(name: &str) -> String {
    format!("{POD_CONTAINERS_DIR}/{name}")
}

/// A Kubernetes container name: a DNS-1123 label.
fn is_container_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
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
    #[error(
        "manifest file {path:?}: chunk {chunk} is {len} bytes long, outside 1..={MAX_CHUNK_LEN}"
    )]
    ChunkLength {
        path: String,
        chunk: String,
        len: u32,
    },
    #[error("pod checkpoint containers: {0}")]
    PodContainers(String),
    #[error("manifest totals do not match its files: {field} is {recorded}, the files add up to {actual}")]
    TotalsMismatch {
        field: &'static str,
        recorded: u64,
        actual: u64,
    },
}

impl Manifest {
    /// The exact reference of this checkpoint.
    pub fn reference(&self) -> CheckpointRef {
        CheckpointRef::exact(self.workload.clone(), self.id.clone())
    }

    /// Checks what a reader must be able to trust before acting on a manifest: a known schema,
    /// paths that cannot escape the restore directory, chunk lengths within the chunker's
    /// bounds, chunk lists that add up to the file sizes, and totals (`stats`) that match the
    /// files. After this, every number a reader sizes memory or files from is bounded by the
    /// manifest's own (bounded) length: a key holder cannot make a reader allocate more than
    /// the chunks and files it really lists.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(ManifestError::UnsupportedSchema {
                found: self.schema_version,
            });
        }
        let (mut chunks, mut bytes) = (0u64, 0u64);
        for f in &self.files {
            if !is_safe_relative_path(&f.path) {
                return Err(ManifestError::UnsafePath(f.path.clone()));
            }
            if let Some(c) = f.chunks.iter().find(|c| !is_chunk_id(&c.id)) {
                return Err(ManifestError::BadChunkId(c.id.clone()));
            }
            if let Some(c) = f
                .chunks
                .iter()
                .find(|c| c.len == 0 || c.len > MAX_CHUNK_LEN)
            {
                return Err(ManifestError::ChunkLength {
                    path: f.path.clone(),
                    chunk: c.id.clone(),
                    len: c.len,
                });
            }
            // No overflow: at most 2^32 chunks of at most 2^22 bytes each.
            let sum: u64 = f.chunks.iter().map(|c| u64::from(c.len)).sum();
            if sum != f.size {
                return Err(ManifestError::SizeMismatch {
                    path: f.path.clone(),
                    size: f.size,
                    chunks: sum,
                });
            }
            chunks += f.chunks.len() as u64;
            bytes = bytes.saturating_add(sum);
        }
        self.pod_containers()?;
        let s = &self.stats;
        for (field, recorded, actual) in [
            ("stats.chunks", s.chunks, chunks),
            ("stats.logical_bytes", s.logical_bytes, bytes),
        ] {
            if recorded != actual {
                return Err(ManifestError::TotalsMismatch {
                    field,
                    recorded,
                    actual,
                });
            }
        }
        for (field, recorded, actual) in [
            ("stats.new_chunks", s.new_chunks, chunks),
            ("stats.new_bytes", s.new_bytes, bytes),
        ] {
            if recorded > actual {
                return Err(ManifestError::TotalsMismatch {
                    field,
                    recorded,
                    actual,
                });
            }
        }
        Ok(())
    }

    /// Number of chunk references (with repeats), counted from the files, never from the
    /// recorded `stats` (which only [`Manifest::validate`] ties to the files).
    pub fn chunk_count(&self) -> usize {
        self.files.iter().map(|f| f.chunks.len()).sum()
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

    /// The containers of a pod checkpoint, in capture order ([`POD_CONTAINERS_LABEL`]);
    /// `None` for a checkpoint of one container. Refused: names that are not container names,
    /// or a name twice.
    pub fn pod_containers(&self) -> Result<Option<Vec<&str>>, ManifestError> {
        let Some(v) = self.labels.get(POD_CONTAINERS_LABEL) else {
            return Ok(None);
        };
        let names: Vec<&str> = v.split(',').collect();
        for (i, n) in names.iter().enumerate() {
            if !is_container_name(n) || names[..i].contains(n) {
                return Err(ManifestError::PodContainers(format!(
                    "{v:?} is not a list of distinct container names"
                )));
            }
        }
        Ok(Some(names))
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
            stats: StoreStats {
                logical_bytes: 5,
                chunks: 2,
                ..StoreStats::default()
            },
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

    #[test]
    fn pod_checkpoints_name_their_containers() {
        let mut m = sample();
        assert_eq!(m.pod_containers(), Ok(None));
        m.labels
            .insert(POD_CONTAINERS_LABEL.into(), "sidecar,app-1".into());
        m.validate().unwrap();
        assert_eq!(m.pod_containers(), Ok(Some(vec!["sidecar", "app-1"])));
        assert_eq!(pod_container_dir("app-1"), "containers/app-1");
        let c = |name: &str| PodContainer {
            name: name.into(),
            source: Source::Container {
                container_id: format!("id-{name}"),
            },
            processes: vec![],
            rootfs: None,
            image_digest: None,
            gpu_processes: 0,
        };
        let index = PodIndex {
            containers: vec![c("sidecar"), c("app-1")],
        };
        index.check(&m).unwrap();
        let back: PodIndex = serde_json::from_str(&serde_json::to_string(&index).unwrap()).unwrap();
        assert_eq!(back, index);
        // Another order, another set, or a one-container manifest: not this index's.
        for other in [
            vec![c("app-1"), c("sidecar")],
            vec![c("sidecar")],
            vec![c("sidecar"), c("app-1"), c("x")],
        ] {
            assert!(PodIndex { containers: other }.check(&m).is_err());
        }
        assert!(index.check(&sample()).is_err());
        // Names that could escape their directory, or repeat, are refused.
        for bad in ["a,a", "../x", "a,", "A", "a/b", ""] {
            let mut m = sample();
            m.labels.insert(POD_CONTAINERS_LABEL.into(), bad.into());
            assert!(
                matches!(m.validate(), Err(ManifestError::PodContainers(_))),
                "{bad}"
            );
        }
    }

    /// A key holder's inflated numbers are refused before a reader sizes anything from them.
    #[test]
    fn inflated_numbers_are_refused() {
        for len in [0, MAX_CHUNK_LEN + 1, u32::MAX] {
            let mut m = sample();
            m.files[0].chunks[0].len = len;
            m.files[0].size = u64::from(len) + 3;
            m.stats.logical_bytes = m.files[0].size;
            assert!(
                matches!(m.validate(), Err(ManifestError::ChunkLength { len: l, .. }) if l == len),
                "{len}: {:?}",
                m.validate()
            );
        }
        let mut m = sample();
        m.files[0].chunks[0].len = MAX_CHUNK_LEN;
        m.files[0].size = u64::from(MAX_CHUNK_LEN) + 3;
        m.stats.logical_bytes = m.files[0].size;
        m.validate().unwrap();

        let mut m = sample();
        m.stats.chunks = u64::MAX;
        assert_eq!(
            m.validate(),
            Err(ManifestError::TotalsMismatch {
                field: "stats.chunks",
                recorded: u64::MAX,
                actual: 2
            })
        );
        let mut m = sample();
        m.stats.logical_bytes = 1 << 40;
        assert!(matches!(
            m.validate(),
            Err(ManifestError::TotalsMismatch {
                field: "stats.logical_bytes",
                ..
            })
        ));
        let mut m = sample();
        m.stats.new_chunks = 3;
        assert!(matches!(
            m.validate(),
            Err(ManifestError::TotalsMismatch {
                field: "stats.new_chunks",
                ..
            })
        ));
        assert_eq!(sample().chunk_count(), 2);
    }
}
