//! `stasis export` and `stasis import`: checkpoints as the kubelet's checkpoint API writes
//! them (KEP-2008), read by checkpointctl; the format is the engine's `upstream` module.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde::Serialize;
use stasis_core::fingerprint::{NodeFingerprint, Requirements};
use stasis_core::manifest::{Manifest, Source, SCHEMA_VERSION};
use stasis_core::names::manifest as label;
use stasis_core::reference::{CheckpointId, WorkloadName};
use stasis_engine::image::ImageDir;
use stasis_engine::node;
use stasis_engine::upstream::{self, ExportInfo, ExportReport};

use super::{now_millis, open_store, pod, runtime, Access, Opened};
use crate::args::{ExportArgs, ImportArgs};
use crate::output::{self, bytes};
use crate::progress::Bars;
use crate::scratch::ScratchDir;
use crate::signals;

/// An archive written: what `stasis export` and `kubectl stasis export` report.
#[derive(Debug, Serialize)]
pub struct Exported {
    pub reference: String,
    pub file: PathBuf,
    #[serde(flatten)]
    pub report: ExportReport,
}

impl Exported {
    /// The summary both commands print.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "exported {} to {} ({}, {} CRIU files",
            self.reference,
            self.file.display(),
            bytes(self.report.bytes),
            self.report.images
        );
        if self.report.rootfs_entries > 0 || self.report.deletions_left_out {
            s.push_str(&format!(
                ", filesystem changes: {} entries, {} deletions",
                self.report.rootfs_entries, self.report.rootfs_whiteouts
            ));
        }
        s.push(')');
        if self.report.deletions_left_out {
            s.push_str("\nnote: the container's rootfs was a plain directory: the archive carries its changed files, not its deletions");
        }
        s
    }
}

pub fn export(args: ExportArgs, bars: &Bars) -> anyhow::Result<ExitCode> {
    let _orderly = signals::Orderly::enter();
    let opened = Opened::new(&args.store, &args.reference)?;
    let out = export_archive(
        &opened,
        args.container.as_deref(),
        args.file.clone(),
        &args.work_dir,
        bars,
    )?;
    output::emit(&out, || out.summary());
    Ok(ExitCode::SUCCESS)
}

/// Writes the KEP-2008 archive of `opened`'s checkpoint (for a pod checkpoint: of `container`,
/// which it must name) to `file` (refusing to overwrite; default: the name the kubelet gives
/// such an archive, `checkpoint-<pod>_<namespace>-<container>-<time>.tar`, in the current
/// directory), fetching the checkpoint into a scratch directory under `work_dir` that is
/// removed afterwards. The export of both `stasis export`
/// and `kubectl stasis export`.
pub fn export_archive(
    opened: &Opened,
    container: Option<&str>,
    file: Option<PathBuf>,
    work_dir: &Path,
    bars: &Bars,
) -> anyhow::Result<Exported> {
    let exact = opened.manifest.reference();
    let chosen = pod::choose(&opened.manifest, container, "export")?;
    let file = file.unwrap_or_else(|| default_name(&opened.manifest, chosen.as_deref()));
    if file.exists() {
        anyhow::bail!("{} exists: choose another --file", file.display());
    }
    let scratch = ScratchDir::new(work_dir, "export")?;
    // A pod checkpoint's container is exported as the one-container checkpoint it is part of.
    let fetched = pod::fetch(opened, chosen.as_deref(), &scratch.path, bars)?;
    let manifest = &fetched.manifest;
    let info = ExportInfo::of(manifest);
    let spinner = bars.spinner("writing the archive");
    let image = ImageDir::new(&fetched.dir);
    let report = upstream::export(
        &image,
        manifest.rootfs.as_ref().map(|r| r.method),
        &info,
        &file,
    )
    .inspect_err(|_| {
        // No half-written archive is left for a reader to take for a whole one.
        let _ = std::fs::remove_file(&file);
    })?;
    spinner.finish_and_clear();
    Ok(Exported {
        reference: exact.to_string(),
        file,
        report,
    })
}

/// `checkpoint-<pod>_<namespace>-<container>-<time>.tar`, as the kubelet names it (the
/// workload and `stasis` stand in for a pod and namespace a CLI checkpoint does not have);
/// `container`: the one exported of a pod checkpoint.
fn default_name(m: &Manifest, container: Option<&str>) -> PathBuf {
    let l = |k: &str| m.labels.get(k).cloned();
    let safe = |s: String| s.replace(['/', '\0'], "_");
    PathBuf::from(format!(
        "checkpoint-{}_{}-{}-{}.tar",
        safe(l(label::POD_NAME).unwrap_or_else(|| m.workload.to_string())),
        safe(l(label::NAMESPACE).unwrap_or_else(|| "stasis".into())),
        safe(
            container
                .map(str::to_owned)
                .or_else(|| l(label::CONTAINER_NAME))
                .unwrap_or_else(|| "container".into())
        ),
        m.created_at
    ))
}

#[derive(Debug, Serialize)]
struct ImportReport {
    reference: String,
    images: u64,
    bytes: u64,
    rootfs_entries: u64,
    rootfs_deletions: u64,
    /// Members of the archive not taken (logs, a runtime's status files, volumes).
    ignored: Vec<String>,
}

pub fn import(args: ImportArgs, bars: &Bars) -> anyhow::Result<ExitCode> {
    let _orderly = signals::Orderly::enter();
    let (key, store) = open_store(&args.store, Access::Write)?;
    let scratch = ScratchDir::new(&args.work_dir, "import")?;
    let image = ImageDir::new(&scratch.path);
    let spinner = bars.spinner("reading the archive");
    let imported = upstream::import(&args.archive, &image)?;
    spinner.finish_and_clear();
    signals::check()?;

    let workload = match &args.workload {
        Some(w) => WorkloadName::new(w.clone())?,
        None if !imported.config.name.is_empty() => WorkloadName::sanitize(&imported.config.name),
        None => anyhow::bail!("the archive names no container: pass --workload"),
    };
    let mut labels = imported.labels();
    labels.insert(label::REASON.to_owned(), "Imported".to_owned());
    let id = CheckpointId::from_parts(now_millis(), rand::random());
    let here = node::fingerprint();
    let draft = Manifest {
        schema_version: SCHEMA_VERSION,
        workload,
        created_at: id.created_rfc3339(),
        id,
        key_id: String::new(),
        source: Source::Container {
            container_id: imported.config.id.clone(),
        },
        leave_running: true,
        requirements: Requirements {
            // What the archive cannot tell (the kernel, CPU features and CRIU of the machine
            // that wrote it) is left open; CRIU checks the CPU itself when it restores. The
            // architecture is this machine's: the images were read here as such.
            node: NodeFingerprint {
                cpu: stasis_core::fingerprint::CpuFingerprint {
                    arch: here.cpu.arch.clone(),
                    ..Default::default()
                },
                ..Default::default()
            },
            needs_runc: true,
            image_digest: imported.image_digest(),
            declared: args.declare.iter().cloned().collect::<BTreeMap<_, _>>(),
        },
        processes: Vec::new(),
        rootfs: imported.rootfs.clone(),
        timings: Default::default(),
        stats: Default::default(),
        files: Vec::new(),
        gpu_processes: 0,
        labels,
    };
    let rt = runtime()?;
    let m = rt
        .block_on(store.put_checkpoint_until(
            &key,
            draft,
            &scratch.path,
            bars,
            signals::cancelled(),
        ))
        .context("storing the imported checkpoint failed")?;
    let out = ImportReport {
        reference: m.reference().to_string(),
        images: imported.images,
        bytes: m.logical_bytes(),
        rootfs_entries: imported.rootfs.as_ref().map_or(0, |r| r.entries),
        rootfs_deletions: imported.rootfs.as_ref().map_or(0, |r| r.deleted),
        ignored: imported.ignored,
    };
    output::emit(&out, || {
        format!(
            "imported {} as {} ({}, {} CRIU files, filesystem changes: {} entries, {} deletions)",
            args.archive.display(),
            out.reference,
            bytes(out.bytes),
            out.images,
            out.rootfs_entries,
            out.rootfs_deletions
        )
    });
    Ok(ExitCode::SUCCESS)
}
