//! `stasis inspect`.

use std::collections::HashSet;
use std::fmt::Write;
use std::process::ExitCode;

use super::Opened;
use crate::args::InspectArgs;
use crate::output::{self, bytes};

pub fn run(args: InspectArgs) -> anyhow::Result<ExitCode> {
    let m = Opened::new(&args.store, &args.reference)?.manifest;
    output::emit(&m, || {
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
        let _ = writeln!(s, "processes");
        for p in &m.processes {
            let _ = writeln!(s, "  {:>7} {:>7}  {}", p.pid, p.ppid, p.command);
        }
        s.trim_end().to_owned()
    });
    Ok(ExitCode::SUCCESS)
}
