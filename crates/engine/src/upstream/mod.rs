//! Checkpoint archives as Kubernetes makes them: the `checkpoint-<pod>_<namespace>-<container>-
//! <time>.tar` that the kubelet's checkpoint API (KEP-2008, "forensic container checkpointing")
//! has the container runtime write, and that `checkpointctl show` / `inspect` read.
//!
//! Layout (containerd and CRI-O write the same names; checkpointctl's `lib/metadata.go`):
//! `config.dump` (JSON: id, name, image, runtime, times), `spec.dump` (the OCI runtime spec;
//! its annotations say which pod and container), `checkpoint/` (CRIU's images), and
//! `rootfs-diff.tar` (the container's filesystem changes as an OCI layer: whiteouts are
//! `.wh.` files; CRI-O adds `deleted.files`, a JSON list of deleted paths). Optional members
//! (`dump.log`, `stats-dump`, `status`, `container.log`, ...) are informative.
//!
//! [`export`] writes one from a stasis image directory; [`import`] makes a stasis image
//! directory from one. An archive to import is untrusted input: it is read by the engine's own
//! reader, only regular files and directories are taken, CRIU image names must be single plain
//! names, and the filesystem changes go through the same check as every restore.

mod layer;
mod writer;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};
use stasis_core::manifest::{Manifest, RootfsCapture, RootfsMethod, Source};
use stasis_core::names::{cri, manifest as label};

use crate::error::EngineError;
use crate::image::ImageDir;
use crate::tarball::Header;
use crate::tarball::Reader;
use writer::Writer;

const CONFIG_DUMP: &str = "config.dump";
const SPEC_DUMP: &str = "spec.dump";
const CHECKPOINT_DIR: &str = "checkpoint";
const ROOTFS_DIFF: &str = "rootfs-diff.tar";
const DELETED_FILES: &str = "deleted.files";
/// The most a JSON member (`config.dump`, `spec.dump`, `deleted.files`) may hold.
const MAX_JSON: u64 = 16 << 20;

/// `config.dump`, with the field names checkpointctl and the runtimes use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerConfig {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(
        rename = "rootfsImage",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image: String,
    #[serde(
        rename = "rootfsImageRef",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image_ref: String,
    #[serde(
        rename = "rootfsImageName",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub rootfs_image_name: String,
    #[serde(rename = "runtime", default, skip_serializing_if = "String::is_empty")]
    pub runtime: String,
    /// RFC 3339.
    #[serde(rename = "createdTime", default)]
    pub created_time: String,
    /// RFC 3339.
    #[serde(rename = "checkpointedTime", default)]
    pub checkpointed_time: String,
}

/// The part of `spec.dump` stasis writes and reads: its annotations.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SpecDump {
    #[serde(rename = "ociVersion", default)]
    oci_version: String,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// What an export writes besides the images.
#[derive(Debug, Clone, Default)]
pub struct ExportInfo {
    pub config: ContainerConfig,
    /// Annotations of `spec.dump` (`io.kubernetes.cri.container-name`,
    /// `io.kubernetes.cri.sandbox-name`, `io.kubernetes.cri.sandbox-namespace`, ...).
    pub annotations: BTreeMap<String, String>,
    /// Unix seconds, the members' modification time.
    pub mtime: u64,
}

/// What an export wrote.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ExportReport {
    pub bytes: u64,
    /// CRIU image files under `checkpoint/`.
    pub images: u64,
    /// Whether `rootfs-diff.tar` is there, and what it holds.
    pub rootfs_entries: u64,
    pub rootfs_whiteouts: u64,
    pub rootfs_opaque_dirs: u64,
    /// A plain-rootfs capture records deletions as the list of paths that remain, which a
    /// layer cannot say: such an export carries the changed files and no deletions.
    pub deletions_left_out: bool,
}

/// What an import made.
#[derive(Debug, Clone)]
pub struct Imported {
    pub config: ContainerConfig,
    pub annotations: BTreeMap<String, String>,
    pub rootfs: Option<RootfsCapture>,
    /// CRIU image files taken.
    pub images: u64,
    /// Members not taken (logs, a runtime's own status files, volumes), by name.
    pub ignored: Vec<String>,
}

/// The CRI annotations of `spec.dump` and the manifest labels they correspond to (containerd's
/// names first; CRI-O's and the kubelet's are read on import).
const ANNOTATIONS: &[(&str, &[&str])] = &[
    (label::CONTAINER_NAME, cri::CONTAINER_NAME),
    (label::POD_NAME, cri::POD_NAME),
    (label::NAMESPACE, cri::POD_NAMESPACE),
    (label::POD_UID, cri::POD_UID),
];
/// The `spec.dump` annotation naming the stasis checkpoint an archive was exported from.
pub const EXPORTED_FROM: &str = "dev.stasis.checkpoint";

impl ExportInfo {
    /// What an export of the checkpoint `m` says of it: the container, its image digest, when,
    /// and the pod it came from (as containerd's annotations).
    pub fn of(m: &Manifest) -> Self {
        let id = match &m.source {
            Source::Container { container_id } => container_id.clone(),
            Source::Process { pid } => format!("process-{pid}"),
        };
        let mut annotations: BTreeMap<String, String> = ANNOTATIONS
            .iter()
            .filter_map(|(l, keys)| Some((keys[0].to_owned(), m.labels.get(*l)?.clone())))
            .collect();
        // checkpointctl names the container from this annotation: a checkpoint taken outside
        // Kubernetes has the workload's name there.
        annotations
            .entry(ANNOTATIONS[0].1[0].to_owned())
            .or_insert_with(|| m.workload.to_string());
        annotations.insert(EXPORTED_FROM.to_owned(), m.reference().to_string());
        let image = m.requirements.image_digest.clone().unwrap_or_default();
        let secs = stasis_core::time::parse_rfc3339_nanos(&m.created_at)
            .map_or(0, |n| (n / 1_000_000_000).max(0) as u64);
        Self {
            config: ContainerConfig {
                name: m
                    .labels
                    .get(label::CONTAINER_NAME)
                    .cloned()
                    .unwrap_or_else(|| m.workload.to_string()),
                id,
                // stasis records the image by digest only: that is its name here too.
                rootfs_image: image.clone(),
                rootfs_image_name: image.clone(),
                rootfs_image_ref: image,
                runtime: "io.containerd.runc.v2".to_owned(),
                created_time: m.created_at.clone(),
                checkpointed_time: m.created_at.clone(),
            },
            annotations,
            mtime: secs,
        }
    }
}

impl Imported {
    /// Manifest labels from the archive's annotations (the pod and container it came from).
    pub fn labels(&self) -> BTreeMap<String, String> {
        ANNOTATIONS
            .iter()
            .filter_map(|(l, keys)| {
                let v = keys.iter().find_map(|k| self.annotations.get(*k))?;
                Some(((*l).to_owned(), v.clone()))
            })
            .collect()
    }

    /// The image digest the archive names (`rootfsImageRef`, as `sha256:<hex>`), if any.
    pub fn image_digest(&self) -> Option<String> {
        let r = &self.config.rootfs_image_ref;
        let d = r.rsplit_once('@').map_or(r.as_str(), |(_, d)| d);
        d.starts_with("sha256:").then(|| d.to_owned())
    }
}

fn refused(archive: &Path, entry: impl Into<String>, reason: impl Into<String>) -> EngineError {
    EngineError::CheckpointArchive {
        archive: archive.to_path_buf(),
        entry: entry.into(),
        reason: reason.into(),
    }
}

/// Writes the checkpoint in `image` as a kubelet checkpoint archive at `out` (created; an
/// existing file is not replaced). `rootfs` is how its filesystem changes were captured.
pub fn export(
    image: &ImageDir,
    rootfs: Option<RootfsMethod>,
    info: &ExportInfo,
    out: &Path,
) -> Result<ExportReport, EngineError> {
    let io_err = EngineError::io(out);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(EngineError::io(out))?;
    let mut w = Writer::new(BufWriter::with_capacity(1 << 20, file));
    let mut report = ExportReport::default();
    let t = info.mtime;

    let config = serde_json::to_vec_pretty(&info.config).unwrap_or_default();
    let spec = serde_json::to_vec_pretty(&SpecDump {
        oci_version: "1.0.2".into(),
        annotations: info.annotations.clone(),
    })
    .unwrap_or_default();
    let put = |w: &mut Writer<_>, name: &str, data: &[u8]| {
        w.append(
            &Header::file(name, data.len() as u64, 0o600, t),
            &mut &data[..],
        )
    };
    put(&mut w, CONFIG_DUMP, &config).map_err(EngineError::io(out))?;
    put(&mut w, SPEC_DUMP, &spec).map_err(EngineError::io(out))?;

    let criu = image.criu();
    let mut names: Vec<_> = std::fs::read_dir(&criu)
        .map_err(EngineError::io(&criu))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(EngineError::io(&criu))?;
    names.sort_by_key(|e| e.file_name());
    w.append(
        &Header::dir(&format!("{CHECKPOINT_DIR}/"), t),
        &mut io::empty(),
    )
    .map_err(EngineError::io(out))?;
    for e in names {
        let md = e.metadata().map_err(EngineError::io(e.path()))?;
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !md.is_file() {
            continue;
        }
        let mut f = File::open(e.path()).map_err(EngineError::io(e.path()))?;
        w.append(
            &Header::file(&format!("{CHECKPOINT_DIR}/{name}"), md.len(), 0o600, t),
            &mut f,
        )
        .map_err(EngineError::io(out))?;
        report.images += 1;
        // checkpointctl reads CRIU's log and statistics at the top of the archive.
        if matches!(name.as_str(), "dump.log" | "stats-dump") {
            let mut f = File::open(e.path()).map_err(EngineError::io(e.path()))?;
            w.append(&Header::file(&name, md.len(), 0o600, t), &mut f)
                .map_err(EngineError::io(out))?;
        }
    }

    let diff = image.rootfs_diff();
    if let (Some(method), true) = (rootfs, diff.exists()) {
        let layer = image.rootfs_dir().join("export-layer.tar");
        let _ = std::fs::remove_file(&layer);
        let from = match method {
            RootfsMethod::OverlayUpper => {
                let n = layer::upper_to_layer(&diff, &layer).map_err(EngineError::io(&diff))?;
                report.rootfs_entries = n.entries;
                report.rootfs_whiteouts = n.whiteouts;
                report.rootfs_opaque_dirs = n.opaque_dirs;
                layer.clone()
            }
            RootfsMethod::ChangedSinceStart => {
                report.deletions_left_out = true;
                diff.clone()
            }
        };
        let len = std::fs::metadata(&from)
            .map_err(EngineError::io(&from))?
            .len();
        let mut f = File::open(&from).map_err(EngineError::io(&from))?;
        let r = w.append(&Header::file(ROOTFS_DIFF, len, 0o600, t), &mut f);
        let _ = std::fs::remove_file(&layer);
        r.map_err(EngineError::io(out))?;
    }
    let (_, bytes) = w.finish().map_err(io_err)?;
    report.bytes = bytes;
    Ok(report)
}

/// A name under `checkpoint/` that is one plain file name: CRIU's images are
/// `<kind>-<id>.img`, its logs and statistics `dump.log`, `stats-dump`.
fn image_name(name: &str) -> Result<&str, &'static str> {
    if name.is_empty() || name.len() > 255 {
        return Err("not a file name CRIU writes");
    }
    if name.starts_with('.') {
        return Err("a hidden name");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err("a name with characters CRIU's image names never have");
    }
    Ok(name)
}

/// Reads a bounded member as JSON.
fn json_member<T: for<'de> Deserialize<'de>>(
    archive: &Path,
    name: &str,
    size: u64,
    data: &mut impl Read,
) -> Result<T, EngineError> {
    if size > MAX_JSON {
        return Err(refused(
            archive,
            name,
            format!("{size} bytes; at most {MAX_JSON} are read"),
        ));
    }
    let mut buf = Vec::with_capacity(size as usize);
    data.take(size)
        .read_to_end(&mut buf)
        .map_err(EngineError::io(archive))?;
    serde_json::from_slice(&buf).map_err(|e| refused(archive, name, format!("not valid: {e}")))
}

/// Makes a stasis image directory (`image`, empty) from the kubelet checkpoint archive at
/// `archive`. Refused, naming the entry, when it holds anything but files and directories, an
/// image name that is not a plain file name, filesystem changes the restore would refuse, or
/// lacks `config.dump` or CRIU's images.
pub fn import(archive: &Path, image: &ImageDir) -> Result<Imported, EngineError> {
    let f = File::open(archive).map_err(EngineError::io(archive))?;
    let mut r = Reader::new(BufReader::with_capacity(1 << 20, f));
    let criu = image.criu();
    let rootfs_dir = image.rootfs_dir();
    for d in [&criu, &rootfs_dir] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(d)
            .map_err(EngineError::io(d))?;
    }
    let layer = rootfs_dir.join("layer.tar");
    let unreadable = |e: io::Error| refused(archive, "(archive)", format!("unreadable: {e}"));

    let mut config: Option<ContainerConfig> = None;
    let mut spec = SpecDump::default();
    let mut deleted: Vec<String> = Vec::new();
    let mut has_layer = false;
    let mut images = 0u64;
    let mut ignored = Vec::new();
    while let Some(h) = r.next().map_err(unreadable)? {
        let raw = String::from_utf8_lossy(&h.path).into_owned();
        let name = raw.strip_prefix("./").unwrap_or(&raw);
        let name = name.strip_suffix('/').unwrap_or(name);
        match h.typeflag {
            b'5' => {
                if !(name.is_empty() || name == "." || name == CHECKPOINT_DIR) {
                    ignored.push(raw.clone());
                }
                continue;
            }
            b'0' | 0 => {}
            _ => {
                return Err(refused(
                    archive,
                    raw,
                    "a checkpoint archive holds only files and directories; the archive was refused before anything was stored",
                ))
            }
        }
        let size = h.size;
        if let Some(img) = name.strip_prefix("checkpoint/") {
            let img = image_name(img).map_err(|why| refused(archive, &raw, why))?;
            let path = criu.join(img);
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| refused(archive, &raw, format!("cannot be stored: {e}")))?;
            let n = io::copy(&mut r.data(), &mut out).map_err(unreadable)?;
            if n != size {
                return Err(refused(archive, &raw, "the archive ends inside it"));
            }
            images += 1;
            continue;
        }
        match name {
            CONFIG_DUMP => config = Some(json_member(archive, name, size, &mut r.data())?),
            SPEC_DUMP => spec = json_member(archive, name, size, &mut r.data())?,
            DELETED_FILES => deleted = json_member(archive, name, size, &mut r.data())?,
            ROOTFS_DIFF => {
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&layer)
                    .map_err(|e| {
                        refused(archive, &raw, format!("twice, or cannot be stored: {e}"))
                    })?;
                io::copy(&mut r.data(), &mut out).map_err(unreadable)?;
                has_layer = true;
            }
            _ => ignored.push(raw.clone()),
        }
    }
    let config = config.ok_or_else(|| {
        refused(
            archive,
            CONFIG_DUMP,
            "missing: this is not a container checkpoint archive",
        )
    })?;
    if !criu.join("inventory.img").exists() {
        return Err(refused(
            archive,
            "checkpoint/inventory.img",
            "missing: the archive holds no CRIU checkpoint",
        ));
    }

    let rootfs = if has_layer || !deleted.is_empty() {
        let diff = image.rootfs_diff();
        if !has_layer {
            Writer::new(File::create(&layer).map_err(EngineError::io(&layer))?)
                .finish()
                .map_err(EngineError::io(&layer))?;
        }
        let n = layer::layer_to_upper(&layer, &diff, &deleted)
            .map_err(|e| refused(archive, ROOTFS_DIFF, format!("unreadable: {e}")))?;
        let _ = std::fs::remove_file(&layer);
        crate::unpack::check(&diff, crate::unpack::Flavor::OverlayUpper).map_err(|e| match e {
            EngineError::RootfsEntry { entry, reason, .. } => {
                refused(archive, format!("{ROOTFS_DIFF}: {entry}"), reason)
            }
            other => other,
        })?;
        Some(RootfsCapture {
            method: RootfsMethod::OverlayUpper,
            entries: n.entries,
            deleted: n.whiteouts,
            bytes: std::fs::metadata(&diff).map(|m| m.len()).unwrap_or(0),
        })
    } else {
        None
    };
    Ok(Imported {
        config,
        annotations: spec.annotations,
        rootfs,
        images,
        ignored,
    })
}

#[cfg(test)]
mod tests;
