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

/// runc's default state root (for `kill` reading runc's state when `--root` is absent).
const RUNC_DEFAULT_ROOT: &str = "/run/runc";

/// The record of a container `create` restored (`<run dir>/restored/<id>`), consumed by `start`.
#[derive(Debug, Serialize, Deserialize)]
pub struct RestoredMarker {
    pub v: u32,
    pub checkpoint_ref: String,
    /// runc's `--root` of the restore: `start` must come with the same one.
    pub root: Option<String>,
    pub restored_at_unix_ms: u64,
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

    /// Fire and forget, bounded by the connect timeout.
    fn report(&self, id: &str, pod: PodRef, event: ReportEvent) {
        let _ = self.client(self.cfg.connect_timeout).report(ReportRequest {
            container_id: id.to_owned(),
            pod,
            event,
        });
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

    fn lookup_plan(&self, id: &str, kind: &ContainerKind, deadline: Instant) -> Lookup {
        let dir = self.cfg.plans_dir();
        let pod = pod_of(kind);
        let candidates = [
            planfile::path_for_container(&dir, id),
            planfile::path_for_pod(&dir, &pod.pod_uid, &pod.container_name),
        ];
        for p in candidates.into_iter().flatten() {
            match planfile::read(&p) {
                Ok(Some(plan)) => {
                    // A restart in place prepared before this create: its wait is over.
                    inplace::clear_pending(&dir, &pod.pod_uid, &pod.container_name);
                    return Lookup::Found {
                        plan,
                        file: Some(p),
                    };
                }
                Ok(None) => {}
                Err(e) => {
                    return Lookup::Missing {
                        cause: ColdStartCause::PlanRefused,
                        reason: format!("unusable plan file: {e}"),
                        skip_report: false,
                        expected: false,
                    }
                }
            }
        }
        // A restart in place the agent is preparing: wait for its plan (bounded by its answer).
        let missing = |cause, reason| Lookup::Missing {
            cause,
            reason,
            skip_report: false,
            expected: false,
        };
        match inplace::wait_for_plan(&dir, &pod.pod_uid, &pod.container_name, now_ms()) {
            Waited::NotPending => {}
            Waited::Plan { plan, file } => {
                return Lookup::Found {
                    plan,
                    file: Some(file),
                }
            }
            Waited::Unusable { reason } => return missing(ColdStartCause::PlanRefused, reason),
            // The agent said why with its own Event when it wrote the note.
            Waited::Failed(f) => {
                return Lookup::Missing {
                    cause: ColdStartCause::RestoreFailed,
                    reason: format!(
                        "the restart in place from {} could not be prepared: {}",
                        f.checkpoint_ref, f.reason
                    ),
                    skip_report: true,
                    expected: false,
                }
            }
            Waited::TimedOut {
                checkpoint_ref,
                waited_ms,
            } => {
                return missing(
                    ColdStartCause::Other,
                    format!("the restart in place from {checkpoint_ref} was not prepared within {waited_ms} ms"),
                )
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Lookup::Missing {
                cause: ColdStartCause::Other,
                reason: "no plan file, and no time left to ask the agent".into(),
                skip_report: false,
                expected: false,
            };
        }
        match self.client(left).restore_plan(RestorePlanRequest {
            container_id: id.to_owned(),
            pod,
        }) {
            Ok(PlanAnswer::Plan(plan)) => Lookup::Found {
                plan: PlanFile {
                    v: PROTOCOL_VERSION,
                    container_id: Some(id.to_owned()),
                    pod_uid: None,
                    container_name: None,
                    plan,
                    expires_at_unix_ms: None,
                },
                file: None,
            },
            // The agent has just heard of this container and said no: no report needed.
            Ok(PlanAnswer::NoPlan { reason }) => Lookup::Missing {
                cause: ColdStartCause::NoPlan,
                reason: format!("no restore plan: {reason}"),
                skip_report: true,
                expected: true,
            },
            Err(e) if e.is_no_agent() => Lookup::Missing {
                cause: ColdStartCause::NoPlan,
                reason: "no restore plan (no plan file, no agent)".into(),
                skip_report: true,
                expected: true,
            },
            Err(e) => Lookup::Missing {
                cause: ColdStartCause::Other,
                reason: format!("no plan file, and the agent did not answer in time: {e}"),
                skip_report: false,
                expected: false,
            },
        }
    }

    fn create(&self, c: &CreateArgs) -> ! {
        let Some(id) = c.id.as_deref() else {
            self.passthrough()
        };
        let bundle_dir = PathBuf::from(c.bundle.as_deref().unwrap_or("."));
        let bundle = match bundle::read(&bundle_dir) {
            Ok(b) => b,
            // runc will refuse it too, with its own message.
            Err(_) => self.passthrough(),
        };
        let kind = bundle::classify(&bundle.annotations);
        match decide::precheck(
            &self.inv,
            c,
            &kind,
            bundle::forces_cold_start(&bundle.annotations),
        ) {
            Precheck::Passthrough => self.passthrough(),
            Precheck::Cold(cause, reason) => self.cold(id, &kind, Cold::doubt(cause, reason, None)),
            Precheck::LookForPlan => {}
        }
        let deadline = Instant::now() + self.cfg.plan_timeout;
        let (pf, file) = match self.lookup_plan(id, &kind, deadline) {
            Lookup::Found { plan, file } => (plan, file),
            Lookup::Missing {
                cause,
                reason,
                skip_report,
                expected,
            } => self.cold(
                id,
                &kind,
                Cold {
                    cause,
                    reason,
                    checkpoint_ref: None,
                    skip_report,
                    expected,
                },
            ),
        };
        let ckpt = Some(pf.plan.checkpoint_ref.clone());
        let img = &pf.plan.image_dir;
        let facts = ImageFacts {
            criu_inventory: img.join("criu/inventory.img").is_file(),
            rootfs_diff: img.join("rootfs/diff.tar").is_file(),
            stamp: planfile::read_verified_stamp(img)
                .map(|s| s.map(|s| s.checkpoint_ref))
                .map_err(|e| e.to_string()),
        };
        let verdict = decide::accept(&pf, id, &kind, now_ms(), &facts);
        // A plan is used once, accepted or not: no restore loops.
        if let Some(f) = &file {
            if planfile::consume(f).is_err() {
                self.cold(
                    id,
                    &kind,
                    Cold::doubt(
                        ColdStartCause::PlanRefused,
                        "the plan was taken by another create".into(),
                        ckpt,
                    ),
                );
            }
        }
        match verdict {
            Ok(plan) => self.restore(id, c, &bundle, &kind, &plan),
            Err(reason) => self.cold(
                id,
                &kind,
                Cold::doubt(ColdStartCause::PlanRefused, reason, ckpt),
            ),
        }
    }

    fn restore(
        &self,
        id: &str,
        c: &CreateArgs,
        bundle: &bundle::Bundle,
        kind: &ContainerKind,
        plan: &stasis_node_api::Plan,
    ) -> ! {
        let ckpt = Some(plan.checkpoint_ref.clone());
        let started = Instant::now();
        if let Some(method) = plan.rootfs_method {
            if let Err(e) = stasis_engine::rootfs::apply(
                &ImageDir::new(&plan.image_dir),
                method,
                &bundle.rootfs,
            ) {
                self.cold(
                    id,
                    kind,
                    Cold::doubt(
                        ColdStartCause::RestoreFailed,
                        format!("putting the checkpoint's files back failed ({e}); the rootfs may hold part of them"),
                        ckpt,
                    ),
                );
            }
        }
        let work = self.cfg.work_dir().join(id);
        let _ = std::fs::remove_dir_all(&work);
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&work)
        {
            self.cold(
                id,
                kind,
                Cold::doubt(
                    ColdStartCause::RestoreFailed,
                    format!("cannot make the work dir {}: {e}", work.display()),
                    ckpt,
                ),
            );
        }
        // Established TCP connections: kept where they can continue, closed elsewhere (a pod's
        // new network namespace has another address; DESIGN §9.8). Closing is `tcp-close`,
        // which runc has no flag for: a CRIU configuration file in the work dir.
        let tcp = stasis_engine::sockets::decide_for(
            stasis_engine::sockets::read_record(&plan.image_dir.join("criu")).as_ref(),
            &bundle.tcp_target(),
            !plan.tcp_established,
        );
        let conf = if tcp.keeps() {
            None
        } else {
            stasis_engine::sockets::CriuConf::write(&work, &["tcp-close"])
                .map_err(|e| {
                    self.log(
                        Level::Warning,
                        &format!("cannot write the CRIU configuration: {e}"),
                    )
                })
                .ok()
        };
        let plan_tcp = stasis_node_api::Plan {
            tcp_established: tcp.keeps(),
            ..plan.clone()
        };
        let args = decide::restore_args(&self.inv, c, id, &plan_tcp, &work);
        let mut runc = Command::new(&self.real);
        if let Some(conf) = &conf {
            runc.env(stasis_engine::sockets::CRIU_CONFIG_ENV, &conf.path);
        }
        let status = runc.args(&args).status();
        let failure = match status {
            Ok(s) if s.success() => self
                .resume_gpu(id, c, &bundle.dir, plan)
                .and_then(|()| {
                    self.mark_restored(id, plan).map_err(|e| {
                        format!("restored, but the marker for start could not be written: {e}")
                    })
                })
                .err(),
            Ok(s) => Some(format!(
                "runc restore failed ({s}){}",
                criu_errors(&work.join("restore.log"))
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            )),
            Err(e) => Some(format!("cannot run {}: {e}", self.real.display())),
        };
        if let Some(why) = failure {
            let _ = Command::new(&self.real)
                .args(decide::delete_args(&self.inv, id))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
            let _ = std::fs::remove_file(self.cfg.restored_dir().join(id));
            let files = if plan.rootfs_method.is_some() {
                " (the checkpoint's files stay in the rootfs, as after a crash)"
            } else {
                ""
            };
            self.cold(
                id,
                kind,
                Cold::doubt(ColdStartCause::RestoreFailed, format!("{why}{files}"), ckpt),
            );
        }
        if bundle.own_netns {
            self.loopback_up(id, c.pid_file.as_deref());
        }
        let restore_ms = started.elapsed().as_millis() as u64;
        self.log(
            Level::Info,
            &format!(
                "restored {id} from checkpoint {} in {restore_ms} ms, {} (CRIU log: {})",
                plan.checkpoint_ref,
                tcp.describe(),
                work.join("restore.log").display()
            ),
        );
        self.report(
            id,
            pod_of(kind),
            ReportEvent::Restored {
                checkpoint_ref: plan.checkpoint_ref.clone(),
                restore_ms,
            },
        );
        std::process::exit(0)
    }

    /// The checkpoint's CUDA processes come back from `runc restore` with their GPU state in host
    /// memory (CHECKPOINTED, every CUDA call blocked): restore it onto the GPUs the device plugin
    /// gave this container and unlock them (DESIGN §7). `Err`: why the restore becomes a cold
    /// start (the caller deletes the container; killing CHECKPOINTED processes is safe).
    fn resume_gpu(
        &self,
        id: &str,
        c: &CreateArgs,
        bundle_dir: &Path,
        plan: &stasis_node_api::Plan,
    ) -> Result<(), String> {
        let record = match stasis_engine::cuda::read_gpu_record(&plan.image_dir) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("the checkpoint's GPU record: {e}")),
        };
        let pid = c
            .pid_file
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse::<i32>().ok())
            .ok_or("the restored container's pid is unknown (no --pid-file), so its GPU state cannot be restored")?;
        let report = stasis_engine::cuda::resume_after_restore(
            pid,
            record.processes,
            &record.recorded,
            Some(bundle_dir),
        )
        .map_err(|e| format!("restoring the GPU state failed: {e}"))?;
        self.log(
            Level::Info,
            &format!(
                "restored {id}: GPU state of {} CUDA process(es) restored in {:.0} ms{}",
                report.processes,
                report.total_ms,
                if report.remapped {
                    " onto the GPUs this container was given"
                } else {
                    ""
                }
            ),
        );
        Ok(())
    }

    /// A restored network namespace of its own comes back with `lo` down (DESIGN §8).
    fn loopback_up(&self, id: &str, pid_file: Option<&str>) {
        let pid = pid_file
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse::<u32>().ok());
        let ok = pid.is_some_and(|pid| {
            Command::new("nsenter")
                .args([
                    "-t",
                    &pid.to_string(),
                    "-n",
                    "ip",
                    "link",
                    "set",
                    "lo",
                    "up",
                ])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        if !ok {
            self.log(
                Level::Warning,
                &format!("restored {id}: could not bring up loopback in its network namespace"),
            );
        }
    }

    fn mark_restored(&self, id: &str, plan: &stasis_node_api::Plan) -> std::io::Result<()> {
        let dir = self.cfg.restored_dir();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let m = RestoredMarker {
            v: PROTOCOL_VERSION,
            checkpoint_ref: plan.checkpoint_ref.clone(),
            root: self.inv.globals.root.clone(),
            restored_at_unix_ms: now_ms(),
        };
        let tmp = dir.join(format!(".{id}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(&m)?)?;
        std::fs::rename(&tmp, dir.join(id))
    }

    fn start(&self, id: Option<&str>) -> ! {
        let Some(id) = id.filter(|i| planfile::path_for_container(Path::new("/"), i).is_some())
        else {
            self.passthrough()
        };
        let marker = self.cfg.restored_dir().join(id);
        let m: Option<RestoredMarker> = std::fs::read(&marker)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        match m {
            Some(m) if m.root == self.inv.globals.root => {
                let _ = std::fs::remove_file(&marker);
                self.log(
                    Level::Info,
                    &format!(
                        "start {id}: restored from {} and already running",
                        m.checkpoint_ref
                    ),
                );
                std::process::exit(0)
            }
            _ => self.passthrough(),
        }
    }

    fn kill(&self, k: &KillArgs) -> ! {
        let Some(id) = k.id.as_deref() else {
            self.passthrough()
        };
        if !argv::is_sigterm(k.signal.as_deref())
            || self.cfg.final_checkpoint_timeout.is_zero()
            || planfile::path_for_container(Path::new("/"), id).is_none()
        {
            self.passthrough()
        }
        let kind = self
            .runc_state(id)
            .map_or(ContainerKind::Plain, |(_, kind)| kind);
        if kind == ContainerKind::Sandbox {
            self.passthrough()
        }
        let deadline_ms = self.cfg.final_checkpoint_timeout.as_millis() as u64;
        let started = Instant::now();
        let answer =
            self.client(Duration::from_millis(500))
                .final_checkpoint(FinalCheckpointRequest {
                    container_id: id.to_owned(),
                    pod: pod_of(&kind),
                    deadline_ms,
                    answer_when_captured: true,
                });
        let ms = started.elapsed().as_millis();
        let end_with_kill = answer.as_ref().is_ok_and(CheckpointAnswer::end_with_kill);
        match answer {
            Ok(CheckpointAnswer::Done { checkpoint_ref, .. }) => self.log(
                Level::Info,
                &format!("final checkpoint of {id} before SIGTERM: {checkpoint_ref} ({ms} ms)"),
            ),
            Ok(CheckpointAnswer::Captured { checkpoint_ref, .. }) => self.log(
                Level::Info,
                &format!(
                    "final checkpoint of {id} before SIGTERM: {checkpoint_ref} captured ({ms} ms), uploading"
                ),
            ),
            Ok(CheckpointAnswer::Skipped { reason }) => self.log(
                Level::Info,
                &format!("no final checkpoint of {id}: {reason}"),
            ),
            Ok(CheckpointAnswer::Failed { reason }) => self.log(
                Level::Warning,
                &format!("final checkpoint of {id} failed ({ms} ms): {reason}"),
            ),
            Err(e) if e.is_no_agent() => {}
            Err(e) => self.log(
                Level::Warning,
                &format!("final checkpoint of {id}: no answer from the agent ({ms} ms): {e}"),
            ),
        }
        if end_with_kill {
            // Its continuation is in the checkpoint; a clean exit on SIGTERM would tell the
            // pod's owner (a Job) that the work is finished.
            self.log(
                Level::Info,
                &format!("{id} ends with SIGKILL: its pod's exit would read as finished work"),
            );
            self.exec(&self.inv.kill_with_signal(k, "KILL"))
        }
        self.passthrough()
    }

    /// runc's state of a container (`<root>/<id>/state.json`) and what kind of container its
    /// annotations say it is (sandbox, app container of a pod, plain).
    fn runc_state(&self, id: &str) -> Option<(Vec<u8>, ContainerKind)> {
        let root = self
            .inv
            .globals
            .root
            .as_deref()
            .unwrap_or(RUNC_DEFAULT_ROOT);
        let raw = std::fs::read(Path::new(root).join(id).join("state.json")).ok()?;
        let kind = bundle::annotations_from_runc_state(&raw)
            .map_or(ContainerKind::Plain, |a| bundle::classify(&a));
        Some((raw, kind))
    }

    fn delete(&self, id: Option<&str>) -> ! {
        if let Some(id) = id.filter(|i| planfile::path_for_container(Path::new("/"), i).is_some()) {
            let _ = std::fs::remove_file(self.cfg.restored_dir().join(id));
            let _ = std::fs::remove_dir_all(self.cfg.work_dir().join(id));
            self.tell_exit(id);
        }
        self.passthrough()
    }

    /// An app container killed by the OOM killer: tell the agent before runc deletes its state
    /// and cgroup (the only place that still says so). The agent answers at once that it is
    /// preparing the restore in place; the note of it makes the restart's `create` wait for the
    /// plan (`inplace`). Bounded (500 ms); a missing agent is quiet; an answer this runtime does
    /// not know is no plan (a cold start).
    fn tell_exit(&self, id: &str) {
        let Some((raw, kind)) = self.runc_state(id) else {
            return;
        };
        if !matches!(kind, ContainerKind::App(_)) || !bundle::oom_killed_from_runc_state(&raw) {
            return;
        }
        let answer =
            self.client(Duration::from_millis(500))
                .container_exited(ContainerExitedRequest {
                    container_id: id.to_owned(),
                    pod: pod_of(&kind),
                    oom_killed: true,
                    wait_for_plan: true,
                });
        match answer {
            Ok(ExitAnswer::Preparing {
                checkpoint_ref,
                wait_ms,
            }) => {
                let pod = pod_of(&kind);
                match inplace::record_pending(
                    &self.cfg.plans_dir(),
                    &pod.pod_uid,
                    &pod.container_name,
                    &checkpoint_ref,
                    wait_ms,
                    now_ms(),
                ) {
                    Ok(bound) => self.log(
                        Level::Info,
                        &format!("{id} was OOM-killed: the agent is preparing its restart in place from {checkpoint_ref}; its create waits up to {bound} ms for it"),
                    ),
                    Err(e) => self.log(
                        Level::Warning,
                        &format!("{id} was OOM-killed; its restart cannot wait for the restore in place being prepared ({e}) and may start cold"),
                    ),
                }
            }
            Ok(ExitAnswer::Plan(p)) => self.log(
                Level::Info,
                &format!(
                    "{id} was OOM-killed: its restart restores {} in place",
                    p.checkpoint_ref
                ),
            ),
            Ok(ExitAnswer::NoPlan { reason }) => self.log(
                Level::Info,
                &format!("{id} was OOM-killed; its restart starts cold: {reason}"),
            ),
            Err(e) if e.is_no_agent() => {}
            Err(e) => self.log(
                Level::Warning,
                &format!("{id} was OOM-killed; no answer from the agent: {e}"),
            ),
        }
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
