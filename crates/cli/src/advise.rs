//! `stasis advise`: the advisor reads the cluster (pods, nodes, disruption budgets, stasis's
//! policies, checkpoints and restores) through the API server, which this node tool never talks
//! to. It runs the kubectl plugin, `kubectl-stasis advise`, found on `PATH`, with the same
//! arguments, or says where to get it: one advisor, in one place, and no Kubernetes client here.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::ExitCode;

/// The kubectl plugin's binary.
pub const PLUGIN: &str = "kubectl-stasis";

/// When the command line is `stasis advise ...`: runs the plugin and returns its exit status.
/// Checked before anything else (before the arguments are parsed, so the plugin's own `-o
/// yaml`, `-n` and `-A` pass through, and before signals are blocked).
pub fn forward_if_asked(mut args: impl Iterator<Item = OsString>) -> Option<ExitCode> {
    let _program = args.next();
    if args.next().as_deref() != Some(OsStr::new("advise")) {
        return None;
    }
    let rest: Vec<OsString> = args.collect();
    Some(run(&rest))
}

/// The plugin on `path` (a `PATH` value), if there is one to execute.
pub fn find_plugin(path: Option<&OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path?)
        .map(|dir| dir.join(PLUGIN))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs `kubectl-stasis advise ARGS` from `PATH` and returns its exit status (also the parsed
/// command's path: `stasis -v advise ...`; a child gets an empty signal mask from
/// `std::process`, so the plugin takes Ctrl-C as usual).
pub fn run(args: &[OsString]) -> ExitCode {
    let Some(plugin) = find_plugin(std::env::var_os("PATH").as_deref()) else {
        eprintln!(
            "error: stasis advise reads the cluster through the API server, which this command does not talk to; it runs the kubectl plugin, and {PLUGIN} is not on PATH: install it (README, \"kubectl stasis\": cargo build --release -p stasis-kubectl, or the krew manifest deploy/krew/stasis.yaml) and run `kubectl stasis advise`"
        );
        return ExitCode::from(1);
    };
    match std::process::Command::new(&plugin)
        .arg("advise")
        .args(args)
        .status()
    {
        Ok(s) => match s.code() {
            Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
            // ended by a signal: the shell's convention
            None => {
                use std::os::unix::process::ExitStatusExt;
                ExitCode::from(128 + u8::try_from(s.signal().unwrap_or(0)).unwrap_or(0))
            }
        },
        Err(e) => {
            eprintln!("error: running {}: {e}", plugin.display());
            ExitCode::from(1)
        }
    }
}
