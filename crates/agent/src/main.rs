//! `stasisd`: flags and environment → logging → [`stasis_agent::run::run`].

use anyhow::Context;
use clap::Parser;
use stasis_agent::run::Config;
use stasis_service::shutdown::Shutdown;
use stasis_service::telemetry::{self, LogArgs};

/// The stasis node agent.
#[derive(Debug, Parser)]
#[command(name = "stasisd", version)]
struct Args {
    #[command(flatten)]
    agent: Config,
    #[command(flatten)]
    log: LogArgs,
    /// Runtime worker threads (the store's I/O; the engine runs on its own threads).
    #[arg(long, env = "STASIS_WORKER_THREADS", default_value_t = 2)]
    worker_threads: usize,
}

fn main() -> anyhow::Result<()> {
    // Before any thread exists (it changes the environment); logged once tracing is up.
    let env_changes = stasis_engine::cuda::prepare_process_env();
    let a = Args::parse();
    stasis_agent::mem::limit_arenas(2);
    // kube enables rustls's ring provider and the S3 client aws-lc-rs: choose one explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    telemetry::init(&a.log);
    for change in env_changes {
        tracing::info!("{change}");
    }
    if a.agent.node_name.is_empty() && !a.agent.standalone {
        anyhow::bail!("NODE_NAME is not set (the DaemonSet gives it from spec.nodeName)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.worker_threads.max(1))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let shutdown = {
        let _in_runtime = rt.enter();
        Shutdown::on_signal()
    };
    stasis_agent::run::run(a.agent, &rt, shutdown).context("stasisd")?;
    Ok(())
}
