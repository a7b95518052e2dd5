//! Checkpoints of every container of a pod at one instant.
//!
//! A pod's containers often share state outside each one's memory (a volume, a socket, a
//! request one sent and the other has not answered yet): captured one after the other, each
//! would describe another instant, and a restore would put them back out of step. So every
//! member is paused (cgroup freezer, `runc pause`) before any is captured, each is captured
//! (its filesystem changes, then `runc checkpoint`, which leaves a paused container paused),
//! and only then are they all resumed. A failure anywhere resumes every member: one
//! [`ThawGuard`] per paused member, each with its own watchdog for the case where this process
//! dies while they are frozen.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use stasis_core::manifest::{ProcessInfo, Source, Timings};
use tracing::{info, warn};

use crate::checkpoint::{
    blocked_ms, finish_gpu, host_file_fds, Captured, WorkloadLock, IMAGE_DIGEST_ANNOTATIONS,
};
use crate::cuda;
use crate::error::EngineError;
use crate::image::ImageDir;
use crate::proctree;
use crate::rootfs::{self, RootfsKind};
use crate::runc::{CheckpointOpts, ContainerState, Runc};
use crate::sockets::{self, CriuConf, SocketRecord};
use crate::tools;

/// One container of a pod checkpoint: its runc id and the image directory it is captured into.
#[derive(Debug, Clone, Copy)]
pub struct PodMember<'a> {
    pub id: &'a str,
    pub image: &'a ImageDir,
}

/// A checkpoint of several containers (a pod's) at one instant.
#[derive(Debug, Clone)]
pub struct PodCheckpoint<'a> {
    pub runc: &'a Runc,
    /// Captured in this order; at least one, ids distinct.
    pub members: &'a [PodMember<'a>],
    pub leave_running: bool,
    pub tcp_established: bool,
}

/// A member once everything that needs no freeze is done.
struct Ready<'a> {
    member: PodMember<'a>,
    state: ContainerState,
    processes: Vec<ProcessInfo>,
    started: i128,
    image_digest: Option<String>,
    conf: CriuConf,
    gpu: Option<cuda::SuspendedGpu>,
    rootfs_kind: RootfsKind,
    _lock: WorkloadLock,
}

/// Checkpoints every member at one instant (module docs); the captures come back in the
/// members' order. Leave-running resumes them all; stop mode leaves them stopped.
pub fn checkpoint_pod(req: &PodCheckpoint<'_>) -> Result<Vec<Captured>, EngineError> {
    checkpoint_pod_inner(req, false).map(|(captured, _)| captured)
}

/// [`checkpoint_pod`] in leave-running mode, the members left frozen after the capture: the
/// [`Held`] resumes them when released or dropped, and its watchdogs resume them if this
/// process dies. `None` when they could not be held and were resumed at once: members with
/// CUDA processes (the driver needs them running to restore their device memory), or members
/// someone else had paused.
pub fn checkpoint_pod_holding(
    req: &PodCheckpoint<'_>,
) -> Result<(Vec<Captured>, Option<Held>), EngineError> {
    checkpoint_pod_inner(req, true)
}

/// Members of a pod checkpoint kept frozen after their capture ([`checkpoint_pod_holding`]).
pub struct Held {
    guards: Vec<ThawGuard>,
}

impl Held {
    /// The containers held.
    pub fn ids(&self) -> Vec<String> {
        self.guards.iter().map(|g| g.id.clone()).collect()
    }

    /// Resumes every member; the first error after all were tried.
    pub fn release(self) -> Result<(), EngineError> {
        let mut first_err = None;
        for mut g in self.guards {
            if let Err(e) = g.release() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("ids", &self.ids()).finish()
    }
}

fn checkpoint_pod_inner(
    req: &PodCheckpoint<'_>,
    hold: bool,
) -> Result<(Vec<Captured>, Option<Held>), EngineError> {
    if req.members.is_empty() {
        return Err(EngineError::CheckpointRefused {
            id: String::new(),
            reason: "a pod checkpoint needs at least one container".into(),
        });
    }
    for (i, m) in req.members.iter().enumerate() {
        if req.members[..i].iter().any(|o| o.id == m.id) {
            return Err(EngineError::CheckpointRefused {
                id: m.id.into(),
                reason: "the container is named twice in one pod checkpoint".into(),
            });
        }
    }
    // CRIU must be usable before anything is frozen.
    let (criu_path, _) = tools::criu_checked()?;
    let mut ready = Vec::with_capacity(req.members.len());
    for m in req.members {
        ready.push(prepare(req, *m, &criu_path)?);
    }

    // The freeze: every member paused before any is captured. A member paused already (by
    // someone else) stays paused afterwards.
    let freeze = Instant::now();
    let mut guards = Vec::with_capacity(ready.len());
    for r in &ready {
        let was_paused = r.state.status == "paused";
        if !was_paused {
            req.runc.pause(r.member.id)?;
        }
        guards.push(ThawGuard::arm(req.runc, r.member.id, !was_paused));
    }
    // Held only when this checkpoint paused every member and none has CUDA processes.
    let hold = hold
        && req.leave_running
        && guards.iter().all(|g| g.armed)
        && ready.iter().all(|r| r.gpu.is_none());

    let mut captured = Vec::with_capacity(ready.len());
    for (r, guard) in ready.iter().zip(guards.iter_mut()) {
        captured.push(capture(req, r, guard)?);
    }
    // Every member is captured: resume them all (each guard resumes its own; the first error is
    // returned after all were tried, so one failure never leaves another frozen), unless they
    // are held.
    let mut first_err = None;
    let mut held = None;
    if hold {
        // CRIU puts the freezer back as it found it, but not always: in a cluster's pod cgroup
        // the container was found running again right after its dump (the e2e's EvictionRequest
        // path counted on through the hold). Held means paused: pause again what runs.
        // (runc refuses to pause a paused container: only a refusal that leaves it running
        // is a failure)
        for g in &guards {
            if req.runc.pause(&g.id).is_err()
                && req.runc.state(&g.id).is_ok_and(|s| s.status != "paused")
            {
                warn!(container = %g.id, "could not pause the held container again after its dump");
            }
        }
        held = Some(Held { guards });
    } else {
        for mut g in guards {
            if req.leave_running {
                if let Err(e) = g.release() {
                    first_err.get_or_insert(e);
                }
            } else {
                g.disarm();
            }
        }
    }
    let frozen_window = ms(freeze);
    if let Some(e) = first_err {
        return Err(e);
    }

    let mut out = Vec::with_capacity(ready.len());
    for (r, (rootfs, sockets, dump_ms, rootfs_ms)) in ready.into_iter().zip(captured) {
        let (gpu_fp, gpu_report) = finish_gpu(r.gpu, req.leave_running)?;
        // A CUDA process is blocked from its lock, before the freeze, to its unlock, after it.
        let frozen_ms = blocked_ms(frozen_window, gpu_report.as_ref());
        drop(r.conf);
        sockets::write_record(&r.member.image.criu(), &sockets)?;
        info!(
            container = r.member.id,
            frozen_ms,
            dump_ms,
            rootfs_ms,
            members = req.members.len(),
            "container checkpointed"
        );
        out.push(Captured {
            source: Source::Container {
                container_id: r.member.id.into(),
            },
            processes: r.processes,
            rootfs: Some(rootfs),
            timings: Timings {
                frozen_ms,
                dump_ms,
                rootfs_ms,
                ..Timings::default()
            },
            image_digest: r.image_digest,
            needs_runc: true,
            leave_running: req.leave_running,
            gpu_processes: gpu_report.map_or(0, |g| g.processes),
            gpu: gpu_fp,
            gpu_report,
        });
    }
    Ok((out, held))
}

/// Everything before the freeze: the container's state, what CRIU cannot dump, CRIU's options,
/// the GPU lock and checkpoint (the driver needs the processes running), the rootfs kind.
fn prepare<'a>(
    req: &PodCheckpoint<'_>,
    m: PodMember<'a>,
    criu_path: &Path,
) -> Result<Ready<'a>, EngineError> {
    let state = req.runc.state(m.id)?;
    if state.status != "running" && state.status != "paused" {
        return Err(EngineError::ContainerNotRunning {
            id: m.id.into(),
            status: state.status,
        });
    }
    let lock = WorkloadLock::acquire_as(
        &format!("container-{}-{}", req.runc.root.display(), m.id),
        &format!("another checkpoint of container {:?}", m.id),
    )?;
    let processes = proctree::tree(state.pid);
    // What CRIU cannot dump is refused before anything is frozen.
    if let Some(f) = processes
        .iter()
        .find_map(|p| host_file_fds(p.pid).into_iter().next())
    {
        return Err(EngineError::CheckpointRefused {
            id: m.id.into(),
            reason: format!(
                "process {} ({}) has fd {} open on {}, a file of the host outside the container's mounts, which CRIU cannot checkpoint ({}); start the container with its stdout and stderr going to a pipe or /dev/null (`runc run -d ... 2>&1 | cat >> file`, or a shim such as containerd's), not redirected to a host file",
                f.pid,
                f.command,
                f.fd,
                f.path.display(),
                if f.fd <= 2 { "a redirected stdio" } else { "an open file" }
            ),
        });
    }
    // Unknown creation time: everything counts as changed (safe, only slower).
    let started = stasis_core::time::parse_rfc3339_nanos(&state.created).unwrap_or(0);
    let image_digest = state.annotations.as_ref().and_then(|a| {
        IMAGE_DIGEST_ANNOTATIONS
            .iter()
            .find_map(|k| a.get(*k).cloned())
    });
    let criu_dir = m.image.criu();
    std::fs::create_dir_all(&criu_dir).map_err(EngineError::io(&criu_dir))?;
    // CRIU's options depend on nothing the freeze changes: written before the GPU lock and the
    // freeze (finding the network lock asks CRIU itself, tens of milliseconds, once a process).
    let conf = CriuConf::write(
        &m.image.root,
        &sockets::dump_options(!req.tcp_established, sockets::nftables_lock(criu_path)),
    )?;
    // GPU first (DESIGN §7): lock and checkpoint every CUDA process while it still runs; its
    // device memory moves to host memory, which CRIU then dumps. The suspension restores and
    // unlocks on drop, so an error below never leaves a process locked.
    let pids: Vec<i32> = processes.iter().map(|p| p.pid).collect();
    let gpu = cuda::suspend(&pids, cuda::DEFAULT_LOCK_TIMEOUT)?;
    let rootfs_kind = rootfs::detect(&state.rootfs, state.pid)?;
    Ok(Ready {
        member: m,
        state,
        processes,
        started,
        image_digest,
        conf,
        gpu,
        rootfs_kind,
        _lock: lock,
    })
}

type Capture = (stasis_core::manifest::RootfsCapture, SocketRecord, u64, u64);

/// One frozen member: its filesystem changes, its TCP sockets as CRIU is about to see them,
/// then `runc checkpoint` (leave-running keeps it paused: CRIU puts the freezer back as it
/// found it).
fn capture(
    req: &PodCheckpoint<'_>,
    r: &Ready<'_>,
    guard: &mut ThawGuard,
) -> Result<Capture, EngineError> {
    let (id, image) = (r.member.id, r.member.image);
    let t = Instant::now();
    let rootfs = rootfs::capture(&r.rootfs_kind, &r.state.rootfs, r.started, image)?;
    let rootfs_ms = ms(t);
    // For the restore's choice between keeping and closing its connections (DESIGN §9.8).
    let pids: Vec<i32> = r.processes.iter().map(|p| p.pid).collect();
    let sockets = SocketRecord {
        state_dumped: req.tcp_established,
        leave_running: req.leave_running,
        ..sockets::scan(&pids)
    };
    let t = Instant::now();
    let opts = CheckpointOpts {
        image_path: &image.criu(),
        work_path: &image.criu(),
        leave_running: req.leave_running,
        tcp_established: req.tcp_established,
        criu_conf: Some(&r.conf.path),
    };
    let runc_log = image.criu().join("runc.log");
    let child = req.runc.spawn_checkpoint(id, &opts, &runc_log)?;
    guard.watch(&child);
    let out = child
        .wait_with_output()
        .map_err(EngineError::io(&req.runc.binary))?;
    let dump_ms = ms(t);
    if !out.status.success() {
        let log = image.criu_log("dump");
        let detail = tools::failure_detail(&log, &runc_log, out.status, &out.stderr);
        return Err(EngineError::ToolFailed {
            what: format!("runc checkpoint {id}"),
            detail,
            log: Some(log),
        });
    }
    Ok((rootfs, sockets, dump_ms, rootfs_ms))
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

/// Resumes a container this checkpoint paused, whatever happens to the checkpoint.
///
/// Two layers: `Drop` resumes on every error path of this process; a watchdog (`sh`, in its own
/// process group) resumes if this process is killed outright. The watchdog reads commands on a
/// pipe: `wait <pid>` names the `runc checkpoint` process to let finish first (resuming in the
/// middle of a dump would be undone by CRIU restoring the freezer state), `done` means
/// the checkpoint ended normally. End of file without `done` means this process died.
struct ThawGuard {
    runc: Runc,
    id: String,
    armed: bool,
    watchdog: Option<(Child, ChildStdin)>,
}

const WATCHDOG: &str = r#"pid=
while IFS= read -r line; do
  case "$line" in
    done) exit 0 ;;
    wait\ *) pid=${line#wait } ;;
  esac
done
if [ -n "$pid" ]; then
  while [ -e "/proc/$pid" ] && ! grep -q '^State:.*[ZX]' "/proc/$pid/status" 2>/dev/null; do sleep 0.1; done
fi
exec "$0" --root "$1" resume "$2"
"#;

impl ThawGuard {
    fn arm(runc: &Runc, id: &str, armed: bool) -> Self {
        let watchdog = armed
            .then(|| {
                use std::os::unix::process::CommandExt;
                let mut child = Command::new("sh")
                    .arg("-c")
                    .arg(WATCHDOG)
                    .arg(&runc.binary)
                    .arg(&runc.root)
                    .arg(id)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .process_group(0)
                    .spawn()
                    .map_err(|e| warn!(error = %e, "could not start the thaw watchdog"))
                    .ok()?;
                let stdin = child.stdin.take()?;
                Some((child, stdin))
            })
            .flatten();
        Self {
            runc: runc.clone(),
            id: id.to_owned(),
            armed,
            watchdog,
        }
    }

    fn watch(&mut self, dump: &Child) {
        if let Some((_, stdin)) = &mut self.watchdog {
            let _ = writeln!(stdin, "wait {}", dump.id());
        }
    }

    /// Resumes now; errors if the container could not be resumed.
    fn release(&mut self) -> Result<(), EngineError> {
        let res = if self.armed {
            resume(&self.runc, &self.id)
        } else {
            Ok(())
        };
        self.disarm();
        res
    }

    /// The checkpoint ended without needing a resume (stop mode): tell the watchdog.
    fn disarm(&mut self) {
        self.armed = false;
        if let Some((mut child, mut stdin)) = self.watchdog.take() {
            let _ = writeln!(stdin, "done");
            drop(stdin);
            let _ = child.wait();
        }
    }
}

impl Drop for ThawGuard {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = resume(&self.runc, &self.id) {
                warn!(container = %self.id, error = %e, "could not resume the container after a failed checkpoint");
            }
        }
        self.disarm();
    }
}

/// Resumes a paused container; one that is already running (CRIU thawed it) is fine.
fn resume(runc: &Runc, id: &str) -> Result<(), EngineError> {
    match runc.resume(id) {
        Ok(()) => Ok(()),
        Err(e) => match runc.state(id) {
            Ok(s) if s.status != "paused" => Ok(()),
            _ => Err(e),
        },
    }
}
