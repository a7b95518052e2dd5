//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default [`DEFAULT_FILTER`]), as text or
//! JSON lines. Both daemons flatten [`LogArgs`] into their command lines.

use clap::{Args, ValueEnum};
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// The filter when `RUST_LOG` is unset: the daemons' own logs at info, their HTTP and
/// Kubernetes clients' only when something is wrong.
pub const DEFAULT_FILTER: &str = "info,kube=warn,hyper=warn,rustls=warn";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The logging flags of every stasis daemon.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log line format (the level filter is `RUST_LOG`).
    #[arg(
        long,
        env = "STASIS_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// The same as `--log-format json` (kept for existing deployments).
    #[arg(long, env = "STASIS_LOG_JSON", hide = true, global = true)]
    pub log_json: bool,
}

impl LogArgs {
    /// The format asked for, by either flag.
    pub fn format(&self) -> LogFormat {
        if self.log_json {
            LogFormat::Json
        } else {
            self.log_format
        }
    }
}

/// Installs the global subscriber (once, from `main`; a second call changes nothing).
pub fn init(args: &LogArgs) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match args.format() {
        LogFormat::Json => registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init(),
        LogFormat::Text => registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn both_spellings_of_json() {
        let f = |args: &[&str]| Cli::try_parse_from(args).unwrap().log.format();
        assert_eq!(f(&["d"]), LogFormat::Text);
        assert_eq!(f(&["d", "--log-format", "json"]), LogFormat::Json);
        assert_eq!(f(&["d", "--log-json"]), LogFormat::Json);
        assert!(Cli::try_parse_from(["d", "--log-format", "xml"]).is_err());
    }
}
