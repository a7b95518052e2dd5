//! A thin synchronous driver of the `runc` binary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;

use crate::error::EngineError;
use crate::tools;

/// runc's default state root for root.
pub const DEFAULT_ROOT: &str = "/run/runc";

/// `runc state` output (the fields stasis uses).
#[derive(Debug, Clone, Deserialize)]
pub struct ContainerState {
    pub id: String,
    pub pid: i32,
    pub status: String,
    pub bundle: PathBuf,
    pub rootfs: PathBuf,
    /// RFC 3339 with nanoseconds.
    pub created: String,
    #[serde(default)]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// Options of a `runc checkpoint`.
#[derive(Debug, Clone)]
pub struct CheckpointOpts<'a> {
    pub image_path: &'a Path,
    pub work_path: &'a Path,
    pub leave_running: bool,
    pub tcp_established: bool,
    /// A CRIU configuration file for the options runc has no flag for (`sockets::CriuConf`).
    pub criu_conf: Option<&'a Path>,
}

/// Options of a `runc restore`.
#[derive(Debug, Clone)]
pub struct RestoreOpts<'a> {
    pub image_path: &'a Path,
    pub work_path: &'a Path,
    pub bundle: &'a Path,
    pub pid_file: &'a Path,
    pub tcp_established: bool,
    /// A CRIU configuration file for the options runc has no flag for (`sockets::CriuConf`).
    pub criu_conf: Option<&'a Path>,
    /// Leave the lazy pages to a running `criu lazy-pages` (`restore::lazy`). runc always tells
    /// CRIU whether to, so a CRIU configuration file cannot turn it on: only this flag does.
    pub lazy_pages: bool,
}

/// runc with a given binary and state root.
#[derive(Debug, Clone)]
pub struct Runc {
    pub binary: PathBuf,
    pub root: PathBuf,
}

impl Runc {
    /// `runc` from PATH (or `$STASIS_RUNC`) with the given state root.
    pub fn new(root: Option<&Path>) -> Result<Self, EngineError> {
        let binary = match std::env::var_os("STASIS_RUNC") {
            Some(p) => PathBuf::from(p),
            None => tools::which("runc").ok_or_else(|| EngineError::ToolMissing {
                tool: "runc".into(),
                hint: "install runc (scripts/setup does), or set STASIS_RUNC".into(),
            })?,
        };
        Ok(Self {
            binary,
            root: root.map_or_else(|| PathBuf::from(DEFAULT_ROOT), Path::to_path_buf),
        })
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.arg("--root").arg(&self.root);
        c.stdin(Stdio::null());
        c
    }

    /// The container's state; [`EngineError::ContainerNotFound`] when runc does not know it.
    pub fn state(&self, id: &str) -> Result<ContainerState, EngineError> {
        let out = self
            .cmd()
            .args(["state", id])
            .output()
            .map_err(EngineError::io(&self.binary))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("does not exist") || err.contains("not exist") {
                return Err(EngineError::ContainerNotFound {
                    id: id.into(),
                    root: self.root.clone(),
                });
            }
            return Err(EngineError::ToolFailed {
                what: format!("runc state {id}"),
                detail: tools::tail(&out.stderr, 4),
                log: None,
            });
        }
        serde_json::from_slice(&out.stdout).map_err(|e| EngineError::ToolFailed {
            what: format!("runc state {id}"),
            detail: format!("unreadable output: {e}"),
            log: None,
        })
    }

    pub fn exists(&self, id: &str) -> Result<bool, EngineError> {
        match self.state(id) {
            Ok(_) => Ok(true),
            Err(EngineError::ContainerNotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub fn pause(&self, id: &str) -> Result<(), EngineError> {
        tools::run_capture(self.cmd().args(["pause", id]), &format!("runc pause {id}")).map(drop)
    }

    pub fn resume(&self, id: &str) -> Result<(), EngineError> {
        tools::run_capture(
            self.cmd().args(["resume", id]),
            &format!("runc resume {id}"),
        )
        .map(drop)
    }

    /// `runc kill <id> KILL`: ends the container's init (its runtime's shim sees the exit, as
    /// it would an OOM kill, and the kubelet restarts it by the pod's restart policy, unlike
    /// `delete`, which removes the container under its shim); a container that is already gone
    /// is fine.
    pub fn kill(&self, id: &str) -> Result<(), EngineError> {
        match tools::run_capture(
            self.cmd().args(["kill", id, "KILL"]),
            &format!("runc kill {id}"),
        ) {
            Ok(_) => Ok(()),
            Err(EngineError::ToolFailed { detail, .. })
                if detail.contains("does not exist") || detail.contains("not running") =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// `runc delete --force`: kills and removes; a container that is already gone is fine.
    pub fn delete_force(&self, id: &str) -> Result<(), EngineError> {
        match tools::run_capture(
            self.cmd().args(["delete", "--force", id]),
            &format!("runc delete {id}"),
        ) {
            Ok(_) => Ok(()),
            Err(EngineError::ToolFailed { detail, .. }) if detail.contains("does not exist") => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The arguments of `runc checkpoint` (without the global ones).
    pub fn checkpoint_args(id: &str, o: &CheckpointOpts<'_>) -> Vec<String> {
        let mut a = vec![
            "checkpoint".to_owned(),
            "--image-path".to_owned(),
            o.image_path.display().to_string(),
            "--work-path".to_owned(),
            o.work_path.display().to_string(),
            "--file-locks".to_owned(),
        ];
        if o.leave_running {
            a.push("--leave-running".into());
        }
        if o.tcp_established {
            a.push("--tcp-established".into());
        }
        a.push(id.to_owned());
        a
    }

    /// Spawns `runc checkpoint` and returns the child, so the caller can hand its pid to a
    /// watchdog before waiting.
    /// runc's own messages go to `runc_log` (JSON lines), to be quoted when it fails.
    pub fn spawn_checkpoint(
        &self,
        id: &str,
        o: &CheckpointOpts<'_>,
        runc_log: &Path,
    ) -> Result<std::process::Child, EngineError> {
        let mut c = self.cmd();
        if let Some(conf) = o.criu_conf {
            c.env(crate::sockets::CRIU_CONFIG_ENV, conf);
        }
        c.arg("--log")
            .arg(runc_log)
            .args(["--log-format", "json"])
            .args(Self::checkpoint_args(id, o))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(EngineError::io(&self.binary))
    }

    /// The arguments of `runc restore --detach` (without the global ones).
    pub fn restore_args(id: &str, o: &RestoreOpts<'_>) -> Vec<String> {
        let mut a = vec![
            "restore".to_owned(),
            "--detach".to_owned(),
            "--image-path".to_owned(),
            o.image_path.display().to_string(),
            "--work-path".to_owned(),
            o.work_path.display().to_string(),
            "--bundle".to_owned(),
            o.bundle.display().to_string(),
            "--pid-file".to_owned(),
            o.pid_file.display().to_string(),
            "--file-locks".to_owned(),
        ];
        if o.tcp_established {
            a.push("--tcp-established".into());
        }
        if o.lazy_pages {
            a.push("--lazy-pages".into());
        }
        a.push(id.to_owned());
        a
    }

    /// `runc restore --detach`, with the restored container's stdout and stderr going to
    /// `stdio` (runc hands its own stdio to the restored process in place of the pipes it had).
    /// runc's own messages go to `runc.log` in the work path (JSON lines), so that its reason is
    /// quoted when it fails; an id that is taken is [`EngineError::ContainerExists`].
    pub fn restore(
        &self,
        id: &str,
        o: &RestoreOpts<'_>,
        stdio: Option<&std::fs::File>,
    ) -> Result<(), EngineError> {
        let runc_log = o.work_path.join("runc.log");
        let mut c = self.cmd();
        c.arg("--log").arg(&runc_log).args(["--log-format", "json"]);
        c.args(Self::restore_args(id, o));
        if let Some(conf) = o.criu_conf {
            c.env(crate::sockets::CRIU_CONFIG_ENV, conf);
        }
        let out = match stdio {
            Some(f) => {
                let err = f.try_clone().map_err(EngineError::io(o.bundle))?;
                let outf = f.try_clone().map_err(EngineError::io(o.bundle))?;
                c.stdout(outf).stderr(err);
                let st = c.status().map_err(EngineError::io(&self.binary))?;
                (st, Vec::new())
            }
            None => {
                let out = c.output().map_err(EngineError::io(&self.binary))?;
                (out.status, out.stderr)
            }
        };
        if !out.0.success() {
            let log = o.work_path.join("restore.log");
            if tools::runc_log_errors(&runc_log)
                .is_some_and(|m| m.contains("container with given ID already exists"))
            {
                return Err(EngineError::ContainerExists {
                    id: id.into(),
                    root: self.root.clone(),
                });
            }
            let detail = tools::failure_detail(&log, &runc_log, out.0, &out.1);
            let log = log.exists().then_some(log);
            return Err(EngineError::ToolFailed {
                what: format!("runc restore {id}"),
                detail,
                log,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_and_restore_arguments() {
        let p = Path::new("/i");
        let w = Path::new("/w");
        let a = Runc::checkpoint_args(
            "c1",
            &CheckpointOpts {
                image_path: p,
                work_path: w,
                leave_running: true,
                tcp_established: true,
                criu_conf: None,
            },
        );
        assert_eq!(
            a.join(" "),
            "checkpoint --image-path /i --work-path /w --file-locks --leave-running --tcp-established c1"
        );
        let plain = RestoreOpts {
            image_path: p,
            work_path: w,
            bundle: Path::new("/b"),
            pid_file: Path::new("/b/pid"),
            tcp_established: false,
            criu_conf: None,
            lazy_pages: false,
        };
        let r = Runc::restore_args("c2", &plain);
        assert_eq!(
            r.join(" "),
            "restore --detach --image-path /i --work-path /w --bundle /b --pid-file /b/pid --file-locks c2"
        );
        let lazy_pages = RestoreOpts {
            lazy_pages: true,
            ..plain
        };
        let lazy = Runc::restore_args("c3", &lazy_pages);
        assert!(
            lazy.join(" ").ends_with("--file-locks --lazy-pages c3"),
            "{lazy:?}"
        );
    }

    #[test]
    fn state_json_parses() {
        let s: ContainerState = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","id":"c","pid":12,"status":"running","bundle":"/b","rootfs":"/b/rootfs","created":"2026-11-29T08:00:00.123456789Z","owner":"","annotations":{"a":"b"}}"#,
        )
        .unwrap();
        assert_eq!(s.pid, 12);
        assert_eq!(s.annotations.unwrap()["a"], "b");
    }
}
