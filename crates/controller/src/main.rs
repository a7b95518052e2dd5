//! `stasis-controller`: arguments → logging → run (docs/design.md §13).

use clap::Parser;
use stasis_controller::app::{self, Cli, Command};

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
    stasis_controller::telemetry::init(cli.log_json);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(app::run(run))
}
