//! `stasis checkpoint container|process`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;
use stasis_core::{
    CheckpointId, Manifest, NodeFingerprint, Requirements, WorkloadName, SCHEMA_VERSION,
};
use stasis_engine::checkpoint::{self, Captured, ContainerCheckpoint, ProcessCheckpoint};
use stasis_engine::image::ImageDir;
use stasis_engine::node;
use stasis_engine::runc::Runc;

use stasis_store::StoreError;

use super::{keep_failure_logs, now_millis, open_store, peak_rss_bytes, runtime, Access};
use crate::args::{CheckpointCmd, CheckpointCommon};
use crate::output::{self, bytes};
use crate::progress::Bars;
use crate::scratch::ScratchDir;
use crate::signals;

#[derive(Debug, Serialize)]
struct Report {
    reference: String,
    workload: String,
    id: String,
    leave_running: bool,
    timings: stasis_core::Timings,
    stats: stasis_core::StoreStats,
    /// Peak resident memory of this stasis process.
    peak_rss_bytes: u64,
    /// stasis's GPU phases, the bytes the driver moved and how long CUDA was blocked, when CUDA
    /// processes were checkpointed.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<stasis_engine::cuda::GpuCheckpointReport>,
}

pub fn run(cmd: CheckpointCmd, bars: &Bars) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let (common, default_workload) = match &cmd {
        CheckpointCmd::Container { id, common, .. } => (common, WorkloadName::sanitize(id)),
        CheckpointCmd::Process { pid, common } => {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            (common, WorkloadName::sanitize(comm.trim()))
        }
    };
    let workload = match &common.workload {
        Some(w) => WorkloadName::new(w.clone())?,
        None => default_workload,
    };
    // A signal from here on stops in order: nothing frozen, nothing published, no images left.
    let _orderly = signals::Orderly::enter();
    // Key and store first: a bad key, an unreachable store or one that cannot be written must
    // fail before the workload is touched.
    let (key, store) = open_store(&common.store, Access::Write)?;
    let rt = runtime()?;
    rt.block_on(async {
        tokio::select! {
            r = store.check_writable() => r.map_err(anyhow::Error::from),
            () = signals::cancelled() => Err(signals::interrupted().into()),
        }
    })
    .context("the store cannot be written; nothing was frozen")?;
    let scratch = ScratchDir::new(&common.work_dir, "checkpoint")?;
    let image = ImageDir::new(&scratch.path);
    let leave_running = !common.stop;
    let tcp = !common.no_tcp_established;

    let spinner = bars.spinner("freezing and dumping");
    let captured = match &cmd {
        CheckpointCmd::Container { id, runc_root, .. } => {
            let runc = Runc::new(Some(runc_root))?;
            checkpoint::checkpoint_container(&ContainerCheckpoint {
                runc: &runc,
                id,
                image: &image,
                leave_running,
                tcp_established: tcp,
            })
        }
        CheckpointCmd::Process { pid, .. } => checkpoint::checkpoint_process(&ProcessCheckpoint {
            pid: *pid,
            image: &image,
            leave_running,
            tcp_established: tcp,
        }),
    }
    .map_err(|e| keep_failure_logs(e, &scratch))?;
    spinner.finish_and_clear();
    signals::check()?;

    let gpu_report = captured.gpu_report;
    let mut draft = draft_manifest(workload, common, captured);
    // The engine's part; the store adds its own before it publishes the manifest.
    draft.timings.total_ms = started.elapsed().as_millis() as u64;
    let manifest = match rt.block_on(store.put_checkpoint_until(
        &key,
        draft,
        &scratch.path,
        bars,
        signals::cancelled(),
    )) {
        Ok(m) => m,
        Err(StoreError::Cancelled) => return Err(signals::interrupted().into()),
        Err(e) => {
            return Err(anyhow::Error::from(e)
                .context("storing the checkpoint failed; the previous checkpoint is unchanged"))
        }
    };

    let report = Report {
        reference: manifest.reference().to_string(),
        workload: manifest.workload.to_string(),
        id: manifest.id.to_string(),
        leave_running,
        timings: manifest.timings,
        stats: manifest.stats,
        peak_rss_bytes: peak_rss_bytes(),
        gpu: gpu_report,
    };
    output::emit(&report, || {
        if output::json_mode() {
            return String::new();
        }
        let s = &report.stats;
        eprintln!(
            "checkpointed {} in {} ms (frozen {} ms): {} in {} chunks, {} new ({} written)",
            report.reference,
            report.timings.total_ms,
            report.timings.frozen_ms,
            bytes(s.logical_bytes),
            s.chunks,
            bytes(s.new_bytes),
            bytes(s.written_bytes),
        );
        report.reference.clone()
    });
    Ok(ExitCode::SUCCESS)
}

fn draft_manifest(workload: WorkloadName, common: &CheckpointCommon, c: Captured) -> Manifest {
    let id = CheckpointId::from_parts(now_millis(), rand::random());
    let declared: BTreeMap<String, String> = common.declare.iter().cloned().collect();
    Manifest {
        schema_version: SCHEMA_VERSION,
        workload,
        created_at: id.created_rfc3339(),
        id,
        key_id: String::new(),
        source: c.source,
        leave_running: c.leave_running,
        requirements: Requirements {
            // The GPUs only when CUDA processes were checkpointed: a CPU-only checkpoint made on
            // a GPU node must still restore on a node without those GPUs.
            node: NodeFingerprint {
                gpu: c.gpu,
                ..node::fingerprint()
            },
            needs_runc: c.needs_runc,
            image_digest: c.image_digest,
            declared,
        },
        processes: c.processes,
        rootfs: c.rootfs,
        timings: c.timings,
        stats: Default::default(),
        files: Vec::new(),
        gpu_processes: c.gpu_processes,
        labels: common.labels.iter().cloned().collect(),
    }
}
