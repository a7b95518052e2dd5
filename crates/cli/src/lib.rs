//! The `stasis` command line. `main.rs` only calls [`main`]; arguments are in [`args`], one
//! module per command in [`commands`].

pub mod args;
pub mod commands;
pub mod output;
pub mod progress;

use std::process::ExitCode;

use clap::Parser;

/// Parses arguments, sets up logging, runs the command, and turns errors into a message and an
/// exit code.
pub fn main() -> ExitCode {
    // Before any thread exists (it changes the environment); logged once tracing is up.
    let env_changes = stasis_engine::cuda::prepare_process_env();
    let cli = args::Cli::parse();
    init_tracing(&cli.global);
    for change in env_changes {
        tracing::debug!("{change}");
    }
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            output::error(&e);
            ExitCode::from(1)
        }
    }
}

fn init_tracing(g: &args::Global) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("STASIS_LOG").unwrap_or_else(|_| {
        EnvFilter::new(match g.verbose {
            0 => "warn",
            1 => "info",
            _ => "debug",
        })
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if g.log_json {
        builder.json().init();
    } else {
        builder.without_time().with_target(false).init();
    }
}
