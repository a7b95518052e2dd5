//! `stasis inspect`.

use std::collections::HashSet;
use std::fmt::Write;
use std::process::ExitCode;

use serde::Serialize;
use stasis_core::manifest::{pod_container_dir, Manifest, PodContainer};
use stasis_core::Source;

use super::{pod, Opened};
use crate::args::InspectArgs;
use crate::output::{self, bytes};
use crate::progress::Bars;
use crate::scratch::ScratchDir;

/// The manifest, and for a pod checkpoint what each of its containers holds (its pod index).
#[derive(Serialize)]
struct Inspected<'a> {
    #[serde(flatten)]
    manifest: &'a Manifest,
    #[serde(skip_serializing_if = "Option::is_none")]
    containers: Option<Vec<PodContainer>>,
}

pub fn run(args: InspectArgs, bars: &Bars) -> anyhow::Result<ExitCode> {
    let opened = Opened::new(&args.store, &args.reference)?;
    // The pod index is one of the checkpoint's files: the store reads files whole checkpoints
    // at a time, so a pod checkpoint is fetched to read it.
    let containers = match opened.manifest.pod_containers()? {
        None => None,
        Some(_) => {
            let _orderly = crate::signals::Orderly::enter();
            let scratch = ScratchDir::new(&args.work_dir, "inspect")?;
            opened.fetch(&scratch.path, bars)?;
            Some(pod::read_index(&scratch.path, &opened.manifest)?.containers)
        }
    };
    let m = &opened.manifest;
    let shown = Inspected {
        manifest: m,
        containers,
    };
    output::emit(&shown, || {
        let mut s = String::new();
        let st = &m.stats;
        let unique: HashSet<&str> = m.chunk_ids().collect();
        let _ = writeln!(s, "checkpoint   {}", m.reference());
        let _ = writeln!(s, "created      {}", m.created_at);
        let _ = writeln!(s, "source       {:?}", m.source);
        let _ = writeln!(
            s,
            "mode         {}",
            if m.leave_running {
                "leave-running"
            } else {
                "stop"
            }
        );
        let _ = writeln!(s, "key id       {}", m.key_id);
        let _ = writeln!(
            s,
            "size         {} in {} files, {} chunks ({} unique)",
            bytes(m.logical_bytes()),
            m.files.len(),
            st.chunks,
            unique.len()
        );
        let reused = st.chunks.saturating_sub(st.new_chunks);
        let _ = writeln!(
            s,
            "reuse        {reused} of {} chunks were already stored; new data {} ({} written after compression and encryption)",
            st.chunks,
            bytes(st.new_bytes),
            bytes(st.written_bytes)
        );
        let t = &m.timings;
        let _ = writeln!(
            s,
            "timings      frozen {} ms (dump {} ms, filesystem {} ms), store {} ms, total {} ms",
            t.frozen_ms, t.dump_ms, t.rootfs_ms, t.store_ms, t.total_ms
        );
        if let Some(r) = &m.rootfs {
            let _ = writeln!(
                s,
                "filesystem   {:?}: {} entries, {} deletions, {}",
                r.method,
                r.entries,
                r.deleted,
                bytes(r.bytes)
            );
        }
        let n = &m.requirements.node;
        let _ = writeln!(
            s,
            "fingerprint  {} {} ({} ISA features), kernel {}, CRIU {}, runc {}",
            n.cpu.arch,
            n.cpu.model,
            n.cpu.features.len(),
            n.kernel,
            n.criu.map_or("-".into(), |v| v.to_string()),
            n.runc.map_or("-".into(), |v| v.to_string())
        );
        if let Some(d) = &m.requirements.image_digest {
            let _ = writeln!(s, "image        {d}");
        }
        for (k, v) in &m.requirements.declared {
            let _ = writeln!(s, "declared     {k}={v}");
        }
        if let Some(g) = &n.gpu {
            let _ = writeln!(
                s,
                "gpu          driver {} ({} GPUs)",
                g.driver_version,
                g.devices.len()
            );
        }
        if let Some(cs) = &shown.containers {
            describe_containers(&mut s, m, cs);
        }
        let _ = writeln!(s, "processes");
        for p in &m.processes {
            let _ = writeln!(s, "  {:>7} {:>7}  {}", p.pid, p.ppid, p.command);
        }
        s.trim_end().to_owned()
    });
    Ok(ExitCode::SUCCESS)
}

/// A pod checkpoint's containers, one line each, and how to choose one.
fn describe_containers(s: &mut String, m: &Manifest, cs: &[PodContainer]) {
    let _ = writeln!(
        s,
        "containers   {} (a pod checkpoint: restore or export one with --container NAME)",
        cs.len()
    );
    let width = cs.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in cs {
        let dir = format!("{}/", pod_container_dir(&c.name));
        let size: u64 = m
            .files
            .iter()
            .filter(|f| f.path.starts_with(&dir))
            .map(|f| f.size)
            .sum();
        let source = match &c.source {
            Source::Container { container_id } => format!("container {container_id}"),
            Source::Process { pid } => format!("process {pid}"),
        };
        let fs = c.rootfs.as_ref().map_or_else(
            || "no filesystem".to_owned(),
            |r| {
                format!(
                    "filesystem {:?} ({} entries, {} deletions)",
                    r.method, r.entries, r.deleted
                )
            },
        );
        let _ = writeln!(
            s,
            "  {:<width$}  {source}, {} processes, {}, {fs}, image {}",
            c.name,
            c.processes.len(),
            bytes(size),
            c.image_digest.as_deref().unwrap_or("-")
        );
    }
}
