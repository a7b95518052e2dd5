//! `stasis-controller`: arguments → logging → run (docs/design.md §13).

use clap::Parser;
use stasis_controller::app::{self, Cli, Command};
use stasis_service::shutdown::Shutdown;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let run = match cli.command {
        Some(Command::WaitRestore(a)) => {
            // The init container: no runtime, no logging setup, always exit 0.
            app::wait_restore(&a);
            return Ok(());
        }
        Some(Command::Run(a)) => a,
        None => cli.run,
    };
    stasis_service::telemetry::init(&cli.log);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async { app::run(run, Shutdown::on_signal()).await })
}
