//! Finding and running the external tools the engine drives (CRIU, runc, tar).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use stasis_core::fingerprint::{Version, MIN_CRIU};

use crate::error::EngineError;

/// Looks a program up on `PATH` (and the sbin directories root tools live in).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Where this process sees a path of the node (the machine whose runc runs the containers).
///
/// `STASIS_HOST_ROOT` (default `/`): the node agent runs in a pod that sees the node's `/` at
/// `/host`, while the paths runc and the kernel report (an overlay's `upperdir`, a bundle's
/// rootfs) are the node's. In-process reads of such paths go through this; the external tools
/// get the node's paths unchanged (the chart runs them in the node's `/`, `chroot /host`).
pub fn host_path(p: &Path) -> PathBuf {
    match std::env::var_os("STASIS_HOST_ROOT") {
        Some(root) if !root.is_empty() && root != "/" => {
            PathBuf::from(root).join(p.strip_prefix("/").unwrap_or(p))
        }
        _ => p.to_path_buf(),
    }
}

/// The CRIU binary: `$STASIS_CRIU`, else `criu` on PATH.
pub fn criu_binary() -> Result<PathBuf, EngineError> {
    if let Some(p) = std::env::var_os("STASIS_CRIU") {
        return Ok(PathBuf::from(p));
    }
    which("criu").ok_or_else(|| EngineError::ToolMissing {
        tool: "criu".into(),
        hint: "install CRIU >= 4.2 (run scripts/setup, which takes it from Debian testing into a private prefix), or set STASIS_CRIU".into(),
    })
}

/// CRIU's version, from `criu --version`.
pub fn criu_version(criu: &Path) -> Result<Version, EngineError> {
    let out = run_capture(Command::new(criu).arg("--version"), "criu --version")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Version::find_in(&text).ok_or_else(|| EngineError::ToolFailed {
        what: "criu --version".into(),
        detail: format!("no version in output {text:?}"),
        log: None,
    })
}

/// The CRIU binary, checked to be new enough.
pub fn criu_checked() -> Result<(PathBuf, Version), EngineError> {
    let criu = criu_binary()?;
    let v = criu_version(&criu)?;
    if (v.major, v.minor) < (MIN_CRIU.major, MIN_CRIU.minor) {
        return Err(EngineError::CriuTooOld {
            found: v.to_string(),
        });
    }
    Ok((criu, v))
}

/// runc's version, from `runc --version`.
pub fn runc_version(runc: &Path) -> Option<Version> {
    let out = Command::new(runc).arg("--version").output().ok()?;
    Version::find_in(&String::from_utf8_lossy(&out.stdout))
}

/// Runs a command to completion, capturing its output; a non-zero exit is an error carrying the
/// last lines of stderr.
pub fn run_capture(cmd: &mut Command, what: &str) -> Result<Output, EngineError> {
    let out = cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            EngineError::ToolMissing {
                tool: program_name(cmd),
                hint: "install it (scripts/setup installs everything stasis needs)".into(),
            }
        } else {
            EngineError::ToolFailed {
                what: what.into(),
                detail: e.to_string(),
                log: None,
            }
        }
    })?;
    if !out.status.success() {
        return Err(EngineError::ToolFailed {
            what: what.into(),
            detail: format!("{}: {}", out.status, tail(&out.stderr, 8)),
            log: None,
        });
    }
    Ok(out)
}

fn program_name(cmd: &Command) -> String {
    Path::new(cmd.get_program())
        .file_name()
        .unwrap_or(OsStr::new("?"))
        .to_string_lossy()
        .into_owned()
}

/// The last `n` non-empty lines of a tool's output, trimmed, joined with " | ".
pub fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The CRIU error lines of a log file (lines with "Error" or "Warn"), for error messages.
pub fn criu_log_errors(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let errs: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") || l.contains("error"))
        // Harmless on these machines (DESIGN §8).
        .filter(|l| !l.contains("RLIMIT_NOFILE"))
        .collect();
    if errs.is_empty() {
        return None;
    }
    Some(errs[errs.len().saturating_sub(4)..].join(" | "))
}

/// runc's own error messages from its `--log-format json` log (the last three), if any.
pub fn runc_log_errors(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let msgs: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| matches!(v["level"].as_str(), Some("error" | "fatal")))
        .filter_map(|v| v["msg"].as_str().map(str::to_owned))
        // runc points at CRIU's log in the work directory, which the caller cites (and keeps)
        // itself: the path runc names is gone by the time anyone reads the message.
        .map(|m| {
            m.lines()
                .filter(|l| !l.trim_start().starts_with("log file:"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|m| !m.trim().is_empty())
        .collect();
    if msgs.is_empty() {
        return None;
    }
    Some(msgs[msgs.len().saturating_sub(3)..].join(" | "))
}

/// What a failed `runc checkpoint` or `runc restore` said: CRIU's error lines, then runc's own
/// message (from its log, else its stderr), else the exit status.
pub fn failure_detail(
    criu_log: &Path,
    runc_log: &Path,
    status: std::process::ExitStatus,
    stderr: &[u8],
) -> String {
    let criu = criu_log_errors(criu_log);
    let runc = runc_log_errors(runc_log).or_else(|| {
        let t = tail(stderr, 4);
        (!t.is_empty()).then_some(t)
    });
    match (criu, runc) {
        // "criu failed: type NOTIFY errno 0" adds nothing to CRIU's own lines.
        (Some(c), Some(r)) if r.starts_with("criu failed") => c,
        (Some(c), Some(r)) => format!("{c} (runc: {r})"),
        (Some(c), None) => c,
        (None, Some(r)) => format!("runc: {r} ({status})"),
        (None, None) => format!("{status}, with no message from runc or CRIU"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runc_messages_leave_out_the_log_path_runc_names() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("runc.log");
        std::fs::write(
            &log,
            concat!(
                r#"{"level":"info","msg":"starting"}"#,
                "\n",
                r#"{"level":"error","msg":"criu failed: type NOTIFY errno 0\nlog file: /w/restore-1-0a1b2c3d/criu/restore.log"}"#,
                "\n",
                r#"{"level":"error","msg":"container with given ID already exists"}"#,
                "\n"
            ),
        )
        .unwrap();
        let m = runc_log_errors(&log).unwrap();
        assert_eq!(
            m,
            "criu failed: type NOTIFY errno 0 | container with given ID already exists"
        );
        assert!(runc_log_errors(&dir.path().join("none")).is_none());
    }
}
