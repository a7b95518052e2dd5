//! The `stasis` command line. `main.rs` only calls [`main`]; arguments are in [`args`], one
//! module per command in [`commands`].

pub mod advise;
pub mod args;
pub mod commands;
pub mod output;
pub mod progress;
pub mod scratch;
pub mod signals;

use std::process::ExitCode;

use clap::Parser;

/// Parses arguments, sets up logging, runs the command, and turns errors into a message and an
/// exit code.
pub fn main() -> ExitCode {
    // `stasis advise` is the kubectl plugin's: handed over before anything else.
    if let Some(code) = advise::forward_if_asked(std::env::args_os()) {
        return code;
    }
    // Before any thread exists (it changes the environment); logged once tracing is up.
    let env_changes = stasis_engine::cuda::prepare_process_env();
    signals::install();
    let cli = match args::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return argument_error(&e, std::env::args_os().skip(1)),
    };
    init_tracing(&cli.global);
    for change in env_changes {
        tracing::debug!("{change}");
    }
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            output::error(&e);
            match signals::received() {
                Some(sig) => ExitCode::from(128 + sig as u8),
                None => ExitCode::from(1),
            }
        }
    }
}

/// An argument error (exit 2): clap's text on stderr, and in JSON mode (`-o json`, or
/// `STASIS_OUTPUT=json`) also `{"error": ..., "causes": [...]}` on stdout, as for every other
/// error. Help and version are printed as they are.
fn argument_error(e: &clap::Error, args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    use clap::error::ErrorKind;
    let shown = matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    );
    if shown || !json_requested(args, std::env::var("STASIS_OUTPUT").ok().as_deref()) {
        e.exit();
    }
    let text = e.render().to_string();
    // The message: clap's first paragraph (a required argument is named on the next lines).
    let first = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
        .trim_start_matches("error: ")
        .to_owned();
    println!(
        "{}",
        serde_json::json!({ "error": first, "causes": [first], "usage": text.trim_end() })
    );
    eprint!("{text}");
    ExitCode::from(2)
}

/// Whether the command line (else `STASIS_OUTPUT`) asks for JSON output; the last `-o` wins.
fn json_requested(args: impl Iterator<Item = std::ffi::OsString>, env: Option<&str>) -> bool {
    let args: Vec<String> = args.map(|a| a.to_string_lossy().into_owned()).collect();
    let mut chosen: Option<String> = None;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            break;
        }
        if a == "-o" || a == "--output" {
            chosen = args.get(i + 1).cloned();
            i += 1;
        } else if let Some(v) = a.strip_prefix("--output=").or_else(|| a.strip_prefix("-o")) {
            chosen = Some(v.trim_start_matches('=').to_owned());
        }
        i += 1;
    }
    chosen.as_deref().or(env) == Some("json")
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

#[cfg(test)]
mod tests {
    use super::json_requested;

    fn args(s: &str) -> impl Iterator<Item = std::ffi::OsString> + '_ {
        s.split_whitespace().map(Into::into)
    }

    #[test]
    fn json_mode_is_found_without_a_parse() {
        assert!(json_requested(args("-o json gc --keep-last -1"), None));
        assert!(json_requested(args("gc --output=json --keep-last x"), None));
        assert!(json_requested(args("gc -ojson"), None));
        assert!(json_requested(args("gc --keep-last -1"), Some("json")));
        assert!(!json_requested(args("-o human gc"), Some("json")));
        assert!(!json_requested(args("gc --keep-last -1"), None));
        assert!(!json_requested(args("key generate -- -o json"), None));
    }
}
