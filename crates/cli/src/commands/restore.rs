//! `stasis restore`.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use stasis_core::fingerprint::RestoreTarget;
use stasis_core::manifest::Source;
use stasis_engine::image::ImageDir;
use stasis_engine::restore::{self, ContainerRestore};
use stasis_engine::runc::Runc;
use stasis_engine::sockets;
use stasis_engine::{node, EngineError};

use super::{keep_failure_logs, peak_rss_bytes, pod, Opened};
use crate::args::RestoreArgs;
use crate::output::{self, bytes};
use crate::progress::Bars;
use crate::scratch::ScratchDir;
use crate::signals;

#[path = "restore_lazy.rs"]
mod lazy;

#[derive(Debug, Serialize)]
struct Report {
    reference: String,
    restored_as: String,
    pid: i32,
    fetch_ms: u64,
    restore_ms: u64,
    total_ms: u64,
    bytes: u64,
    /// Peak resident memory of this stasis process.
    peak_rss_bytes: u64,
    /// What became of the checkpoint's established TCP connections (kept or closed, and why).
    tcp: sockets::Decision,
    /// stasis's GPU steps (driver load, restore, unlock), when the checkpoint had CUDA processes.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<stasis_engine::cuda::GpuRestoreReport>,
    /// A lazy restore: when the container ran, when its last page was in place.
    #[serde(skip_serializing_if = "Option::is_none")]
    lazy: Option<restore::lazy::LazyReport>,
}

pub fn run(args: RestoreArgs, bars: &Bars) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    // A signal from here on stops in order: no container half made, no images left.
    let _orderly = signals::Orderly::enter();
    let opened = Opened::new(&args.store, &args.reference)?;
    let exact = opened.manifest.reference();

    match (&opened.manifest.source, args.process) {
        (Source::Container { .. }, true) => {
            bail!("{exact} is a container checkpoint: restore it with --bundle and --container-id, not --process")
        }
        (Source::Process { .. }, false) => {
            bail!("{exact} is a process checkpoint: restore it with --process")
        }
        _ => {}
    }
    let chosen = pod::choose(&opened.manifest, args.container.as_deref(), "restore")?;
    if args.lazy && chosen.is_some() {
        bail!("{exact} is a pod checkpoint: --lazy restores single-container checkpoints only");
    }

    // Refuse before fetching anything or touching runc: nothing is left behind.
    let image_digest = match (&args.image_digest, &args.bundle) {
        (Some(d), _) => Some(d.clone()),
        (None, Some(b)) => restore::bundle_image_digest(b)?,
        (None, None) => None,
    };
    let target = RestoreTarget {
        // With this node's GPUs when the checkpoint recorded GPUs: without them every GPU
        // checkpoint would be refused as "this node has no NVIDIA driver".
        node: node::fingerprint_for_restore(&opened.manifest.requirements.node),
        image_digest: if args.process {
            opened.manifest.requirements.image_digest.clone()
        } else {
            image_digest
        },
        declared: args.declare.iter().cloned().collect(),
    };
    let compatible = |m: &stasis_core::manifest::Manifest| -> anyhow::Result<()> {
        let mismatches = m.requirements.check(&target);
        if !mismatches.is_empty() {
            return Err(EngineError::Incompatible(mismatches).into());
        }
        Ok(())
    };
    compatible(&opened.manifest)?;
    // A container of a pod checkpoint is described by the pod index, one of the checkpoint's
    // files: fetched, then checked (its image digest) and restored as a one-container
    // checkpoint (its part); still before runc is touched.
    let (fetched, part) = match &chosen {
        None => (None, None),
        Some(name) => {
            let t = Instant::now();
            let scratch = ScratchDir::new(&args.work_dir, "restore")?;
            let part = pod::fetch(&opened, Some(name), &scratch.path, bars)?;
            compatible(&part.manifest)?;
            (Some((scratch, t.elapsed().as_millis() as u64)), Some(part))
        }
    };
    let manifest = part.as_ref().map_or(&opened.manifest, |p| &p.manifest);
    // What the target bundle must be (fresh, the bundle's own rootfs, not in use, memory).
    let source_container = match &manifest.source {
        Source::Container { container_id } => Some(container_id.as_str()),
        Source::Process { .. } => None,
    };
    if let Some(bundle) = &args.bundle {
        restore::check_target(
            bundle,
            manifest.rootfs.is_some(),
            Some(restore::memory_bytes(
                manifest.files.iter().map(|f| (f.path.as_str(), f.size)),
            )),
        )?;
        if manifest.rootfs.is_some() {
            check_not_restored_into(bundle, source_container)?;
        }
    }

    let (scratch, fetch_ms) = match fetched {
        Some(done) => done,
        None => {
            let scratch = ScratchDir::new(&args.work_dir, "restore")?;
            let t = Instant::now();
            // A lazy restore fetches as it restores.
            if !args.lazy {
                opened.fetch(&scratch.path, bars)?;
            }
            (scratch, t.elapsed().as_millis() as u64)
        }
    };
    let image = ImageDir::new(part.as_ref().map_or(&scratch.path, |p| &p.dir));

    let t = Instant::now();
    let spinner = bars.spinner("restoring");
    let tcp = !args.no_tcp_established;
    let gpu = manifest
        .requirements
        .node
        .gpu
        .as_ref()
        .map(|recorded| restore::GpuRestore {
            processes: manifest.gpu_processes,
            recorded,
        });
    let mut lazy_report = None;
    let (restored_as, restored, tcp_decision) = if args.process {
        let (r, decision) = restore::restore_process_tcp(&image, args.log.as_deref(), gpu, !tcp)
            .map_err(|e| keep_failure_logs(e, &scratch))?;
        (format!("pid {}", r.pid), r, decision)
    } else {
        let (Some(bundle), Some(new_id)) = (&args.bundle, &args.container_id) else {
            bail!("--bundle and --container-id are required to restore a container");
        };
        let runc = Runc::new(Some(&args.runc_root))?;
        // Kept where they can be, closed elsewhere (DESIGN §9.8).
        let decision = sockets::decide_for(
            sockets::read_record(&image.criu()).as_ref(),
            &restore::tcp_target(bundle)?,
            !tcp,
        );
        let log = args
            .log
            .clone()
            .unwrap_or_else(|| bundle.join("container.log"));
        let marker = manifest
            .rootfs
            .is_some()
            .then(|| Marker::write(bundle, new_id, &exact.to_string(), source_container))
            .transpose()?;
        let req = ContainerRestore {
            runc: &runc,
            new_id,
            bundle,
            image: &image,
            rootfs_method: manifest.rootfs.as_ref().map(|r| r.method),
            tcp_established: decision.keeps(),
            stdio_log: Some(&log),
            gpu,
            // the lazy restore sets it, once its page server runs
            lazy_pages: false,
        };
        let r = if args.lazy {
            lazy::restore(&opened, &args.store, manifest, &req, |r, ms| {
                spinner.set_message(format!(
                    "running (pid {}) after {ms} ms; its memory arriving",
                    r.pid
                ));
            })?
            .map(|(r, report)| {
                lazy_report = Some(report);
                r
            })
        } else {
            restore::restore_container_reporting(&req)
        }
        .map_err(|e| {
            // Refused before its rootfs was touched: the bundle is as fresh as it was.
            if let (
                EngineError::ContainerExists { .. }
                | EngineError::Busy { .. }
                | EngineError::Bundle { .. },
                Some(m),
            ) = (&e, &marker)
            {
                m.undo();
            }
            keep_failure_logs(e, &scratch)
        })?;
        (format!("container {new_id}"), r, decision)
    };
    spinner.finish_and_clear();
    let restore_ms = t.elapsed().as_millis() as u64;

    let report = Report {
        reference: exact.to_string(),
        restored_as,
        pid: restored.pid,
        fetch_ms,
        restore_ms,
        total_ms: started.elapsed().as_millis() as u64,
        bytes: opened.manifest.logical_bytes(),
        peak_rss_bytes: peak_rss_bytes(),
        tcp: tcp_decision,
        gpu: restored.gpu,
        lazy: lazy_report,
    };
    output::emit(&report, || {
        match &report.lazy {
        Some(l) => format!(
            "restored {} as {} (pid {}) lazily: running after {} ms ({} fetched first), all {} in place after {} ms; {}",
            report.reference,
            report.restored_as,
            report.pid,
            l.running_ms,
            bytes(l.staged_bytes),
            bytes(report.bytes),
            l.resident_ms,
            report.tcp.describe()
        ),
        None => format!(
            "restored {} as {} (pid {}): fetched {} in {} ms, restored in {} ms; {}",
            report.reference,
            report.restored_as,
            report.pid,
            bytes(report.bytes),
            report.fetch_ms,
            report.restore_ms,
            report.tcp.describe()
        ),
    }
    });
    Ok(ExitCode::SUCCESS)
}

/// The file a container restore leaves in its bundle before it writes into the rootfs: that
/// rootfs then holds the restored container's files (and, later, what it writes), so it is no
/// longer a fresh copy of the image.
const RESTORED_MARKER: &str = ".stasis-restored";

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct MarkerDoc {
    container_id: String,
    checkpoint: String,
    #[serde(default)]
    source_container: Option<String>,
}

/// A bundle stasis already restored into is not fresh: a restore of another container's
/// checkpoint would delete or overwrite the files of the one restored there. Allowed: a
/// checkpoint of that very container (migrating it in place: checkpoint --stop, restore into the
/// same bundle).
fn check_not_restored_into(bundle: &Path, source: Option<&str>) -> anyhow::Result<()> {
    let p = bundle.join(RESTORED_MARKER);
    let Ok(raw) = std::fs::read(&p) else {
        return Ok(());
    };
    let doc: Option<MarkerDoc> = serde_json::from_slice(&raw).ok();
    if let (Some(d), Some(src)) = (&doc, source) {
        if d.container_id == src {
            return Ok(());
        }
    }
    let what = doc.map_or_else(
        || "an earlier restore".to_owned(),
        |d| format!("container {:?} (from {})", d.container_id, d.checkpoint),
    );
    bail!(
        "bundle {}: it was already restored into ({what}, per {}): its rootfs holds that container's files, which this restore would delete or overwrite; make a fresh bundle from the image{}",
        bundle.display(),
        p.display(),
        source.map_or_else(String::new, |_| ", or restore a checkpoint of that container".to_owned())
    )
}

/// The marker this restore wrote, and what it replaced (to put back if the restore is refused
/// before it touches the rootfs).
struct Marker {
    path: std::path::PathBuf,
    before: Option<Vec<u8>>,
}

impl Marker {
    fn write(
        bundle: &Path,
        id: &str,
        checkpoint: &str,
        source: Option<&str>,
    ) -> anyhow::Result<Self> {
        let path = bundle.join(RESTORED_MARKER);
        let before = std::fs::read(&path).ok();
        let doc = MarkerDoc {
            container_id: id.to_owned(),
            checkpoint: checkpoint.to_owned(),
            source_container: source.map(str::to_owned),
        };
        std::fs::write(&path, serde_json::to_vec(&doc)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Self { path, before })
    }

    fn undo(&self) {
        let _ = match &self.before {
            Some(b) => std::fs::write(&self.path, b),
            None => std::fs::remove_file(&self.path),
        };
    }
}
