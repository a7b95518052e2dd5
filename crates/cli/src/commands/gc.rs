//! `stasis gc`.

use std::process::ExitCode;
use std::time::Duration;

use super::{open_store, runtime, Access};
use crate::args::GcArgs;
use crate::output;

pub fn run(args: GcArgs) -> anyhow::Result<ExitCode> {
    let (key, store) = open_store(&args.store, Access::Read)?;
    let report = runtime()?.block_on(store.gc(
        &key,
        args.keep_last,
        Duration::from_secs(args.grace_secs),
    ))?;
    output::emit(&report, || {
        let mut s = format!(
            "kept {} checkpoints, deleted {}; deleted {} unreferenced chunks ({}), kept {}, spared {} younger than the grace period",
            report.manifests_kept,
            report.manifests_deleted.len(),
            report.chunks_deleted,
            output::bytes(report.bytes_deleted),
            report.chunks_kept,
            report.chunks_spared_young
        );
        for d in &report.manifests_deleted {
            s.push_str(&format!("\n  deleted {d}"));
        }
        if let Some(why) = &report.sweep_skipped {
            s.push_str(&format!("\nchunk sweep skipped: {why}"));
        }
        s
    });
    Ok(ExitCode::SUCCESS)
}
