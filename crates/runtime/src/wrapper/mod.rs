//! The thin side: what `stasis-runc` does with a command line. Everything that decides is in
//! [`crate::argv`], [`crate::bundle`] and [`crate::decide`]; this module reads files, talks to the
//! agent, runs runc, and `exec`s runc for everything it does not take over (same pid, stdio, fds
//! and environment: the shim relies on that).
//!
//! Fail-safe rules: every doubt or failure on `create` ends in the original `runc create`
//! (cold start), logged to runc's `--log` and reported to the agent; nothing is ever written to
//! stdout or stderr on `create` (they are the container's stdio); `kill` forwards the signal
//! whatever the agent says, and waits for it at most the configured deadline.

use std::ffi::OsString;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stasis_core::time::now_ms;
use stasis_engine::image::ImageDir;
use stasis_node_api::planfile::{self, PlanFile};
use stasis_node_api::{
    CheckpointAnswer, Client, ColdStartCause, ContainerExitedRequest, ExitAnswer,
    FinalCheckpointRequest, PlanAnswer, PodRef, ReportEvent, ReportRequest, RestorePlanRequest,
    PROTOCOL_VERSION,
};

use crate::argv::{self, Command as RuncCommand, CreateArgs, Invocation, KillArgs};
use crate::bundle::{self, ContainerKind};
use crate::config::Config;
use crate::decide::{self, ImageFacts, Precheck};
use crate::inplace::{self, Waited};
use crate::runlog::{self, Level};

mod create;
mod lifecycle;

/// runc's default state root (for `kill` reading runc's state when `--root` is absent).
const RUNC_DEFAULT_ROOT: &str = "/run/runc";

/// The record of a container `create` restores (`<run dir>/restored/<id>`, written before the
/// restore), consumed by `start`; found by `delete` when the container never started.
#[derive(Debug, Serialize, Deserialize)]
pub struct RestoredMarker {
    pub v: u32,
    pub checkpoint_ref: String,
    /// runc's `--root` of the restore: `start` must come with the same one.
    pub root: Option<String>,
    pub restored_at_unix_ms: u64,
    /// The pod container restored: `delete` tells the agent of a lost restore with it when
    /// runc has no state of the container (the create was stopped before runc made it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
}

/// Finds the real runc: `STASIS_REAL_RUNC`, else `/usr/sbin/runc`, else `runc` on `PATH` —
/// never this binary (it may be installed as `runc`).
pub fn find_real_runc(cfg: &Config) -> Result<PathBuf, String> {
    let me = std::env::current_exe().and_then(|p| p.canonicalize()).ok();
    let is_me = |p: &Path| me.is_some() && p.canonicalize().ok() == me;
    if let Some(p) = &cfg.real_runc {
        return if is_me(p) {
            Err(format!(
                "STASIS_REAL_RUNC={} is stasis-runc itself",
                p.display()
            ))
        } else {
            Ok(p.clone())
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::iter::once(PathBuf::from("/usr/sbin/runc"))
        .chain(std::env::split_paths(&path).map(|d| d.join("runc")))
        .find(|p| p.is_file() && !is_me(p))
        .ok_or_else(|| "no runc found (set STASIS_REAL_RUNC)".to_owned())
}

struct Ctx {
    cfg: Config,
    real: PathBuf,
    inv: Invocation,
}

enum Lookup {
    Found {
        plan: PlanFile,
        file: Option<PathBuf>,
    },
    Missing {
        cause: ColdStartCause,
        reason: String,
        skip_report: bool,
        /// The ordinary case (no plan): logged as info, not as a warning.
        expected: bool,
    },
}

impl Ctx {
    fn log(&self, level: Level, msg: &str) {
        let json = self.inv.globals.log_format.as_deref() == Some("json");
        runlog::append(self.inv.globals.log.as_deref(), json, level, msg);
    }

    /// Replaces this process with `runc args` (same pid, stdio, fds and environment).
    fn exec(&self, args: &[OsString]) -> ! {
        let err = Command::new(&self.real).args(args).exec();
        let msg = format!("cannot execute {}: {err}", self.real.display());
        self.log(Level::Error, &msg);
        eprintln!("stasis-runc: {msg}");
        std::process::exit(127)
    }

    fn passthrough(&self) -> ! {
        self.exec(&self.inv.args)
    }

    fn client(&self, io: Duration) -> Client {
        Client::new(&self.cfg.socket)
            .with_connect_timeout(self.cfg.connect_timeout.min(io))
            .with_io_timeout(io)
    }

    /// Tells the agent how a restore ended: the report is written to the plans directory
    /// first, then sent (fire and forget, bounded by the connect timeout). The agent removes
    /// the file once it has handled the report, so a report sent to no agent (it is
    /// restarting), or to one killed before it had handled it, is still taken by the agent that
    /// runs next: a restore's outcome, a cold start above all, must not go unsaid because of an
    /// agent restart. A report that cannot be written is still sent.
    fn report(&self, id: &str, pod: PodRef, event: ReportEvent) {
        let req = ReportRequest {
            container_id: id.to_owned(),
            pod,
            event,
        };
        let left = planfile::path_for_report(&self.cfg.plans_dir(), id)
            .ok_or_else(|| "not a plain container id".to_owned())
            .and_then(|p| planfile::write_report(&p, &req).map_err(|e| e.to_string()));
        if let Err(e) = &left {
            self.log(
                Level::Warning,
                &format!("{id}'s report cannot be left for the agent ({e}): only sent"),
            );
        }
        match (self.client(self.cfg.connect_timeout).report(req), left) {
            (Ok(()), _) => {}
            (Err(e), Ok(())) => self.log(
                Level::Info,
                &format!("{id}'s report not delivered ({e}): left for the agent"),
            ),
            (Err(e), Err(_)) => self.log(
                Level::Warning,
                &format!("{id}'s report not delivered ({e}), and not left for the agent"),
            ),
        }
    }

    /// Cold start: log, report, then the original `runc create`.
    fn cold(&self, id: &str, kind: &ContainerKind, cold: Cold) -> ! {
        let level = if cold.expected {
            Level::Info
        } else {
            Level::Warning
        };
        self.log(level, &format!("cold start of {id}: {}", cold.reason));
        if !cold.skip_report && *kind != ContainerKind::Sandbox {
            self.report(
                id,
                pod_of(kind),
                ReportEvent::ColdStart {
                    cause: cold.cause,
                    reason: cold.reason,
                    checkpoint_ref: cold.checkpoint_ref,
                },
            );
        }
        self.passthrough()
    }
}

struct Cold {
    cause: ColdStartCause,
    reason: String,
    checkpoint_ref: Option<String>,
    /// No agent, or the agent already knows (it answered `no_plan`).
    skip_report: bool,
    /// An ordinary cold start (no plan), logged as info rather than a warning.
    expected: bool,
}

impl Cold {
    fn doubt(cause: ColdStartCause, reason: String, checkpoint_ref: Option<String>) -> Self {
        Self {
            cause,
            reason,
            checkpoint_ref,
            skip_report: false,
            expected: false,
        }
    }
}

fn pod_of(kind: &ContainerKind) -> PodRef {
    match kind {
        ContainerKind::App(p) => p.clone(),
        _ => PodRef::default(),
    }
}

/// The last error lines of a CRIU log (its "rlimit" line is harmless and skipped).
fn criu_errors(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let errs: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE"))
        .collect();
    let tail = &errs[errs.len().saturating_sub(3)..];
    (!tail.is_empty()).then(|| tail.join(" | "))
}

/// The wrapper: never returns.
pub fn run(args: Vec<OsString>) -> ! {
    let cfg = Config::from_env();
    let inv = argv::parse(args);
    let real = match find_real_runc(&cfg) {
        Ok(r) => r,
        Err(e) => {
            let json = inv.globals.log_format.as_deref() == Some("json");
            runlog::append(inv.globals.log.as_deref(), json, Level::Error, &e);
            eprintln!("stasis-runc: {e}");
            std::process::exit(127)
        }
    };
    let ctx = Ctx { cfg, real, inv };
    if ctx.cfg.passthrough {
        ctx.passthrough()
    }
    match ctx.inv.command.clone() {
        Some(RuncCommand::Create(c)) => ctx.create(&c),
        Some(RuncCommand::Start { id }) => ctx.start(id.as_deref()),
        Some(RuncCommand::Kill(k)) => ctx.kill(&k),
        Some(RuncCommand::Delete { id, .. }) => ctx.delete(id.as_deref()),
        _ => ctx.passthrough(),
    }
}
