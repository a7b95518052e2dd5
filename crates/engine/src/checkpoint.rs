//! Taking a checkpoint: of a runc container (through `runc checkpoint`) or of a plain process tree
//! (through CRIU's RPC).

use std::os::fd::AsRawFd;
use std::path::Path;

use std::time::Instant;

use stasis_core::manifest::{ProcessInfo, RootfsCapture, Source, Timings};
use tracing::info;

use crate::cuda;
use crate::error::EngineError;
use crate::image::ImageDir;
use crate::proctree;
use crate::runc::Runc;
use crate::sockets::{self, CriuConf, SocketRecord};
use crate::tools;

pub use crate::pod::{checkpoint_pod, checkpoint_pod_holding, Held, PodCheckpoint, PodMember};

/// Bundle annotations that carry the digest of the image a rootfs was made from.
pub const IMAGE_DIGEST_ANNOTATIONS: &[&str] =
    &["dev.stasis.image.digest", "org.opencontainers.image.digest"];

/// What the engine captured, for the manifest.
#[derive(Debug, Clone)]
pub struct Captured {
    pub source: Source,
    pub processes: Vec<ProcessInfo>,
    pub rootfs: Option<RootfsCapture>,
    /// `frozen_ms`, `dump_ms`, `rootfs_ms`; the store adds the rest.
    pub timings: Timings,
    pub image_digest: Option<String>,
    /// Whether a restore needs runc (container checkpoints).
    pub needs_runc: bool,
    pub leave_running: bool,
    /// The GPUs, when CUDA processes were checkpointed (then a restore needs matching GPUs).
    pub gpu: Option<stasis_core::gpu::GpuFingerprint>,
    /// How many CUDA processes were checkpointed through the driver API.
    pub gpu_processes: u32,
    /// stasis's GPU phases (lock, checkpoint, restore, unlock), the bytes the driver moved and
    /// how long CUDA was blocked, when CUDA processes were checkpointed.
    pub gpu_report: Option<cuda::GpuCheckpointReport>,
}

/// A container checkpoint request.
#[derive(Debug, Clone)]
pub struct ContainerCheckpoint<'a> {
    pub runc: &'a Runc,
    pub id: &'a str,
    pub image: &'a ImageDir,
    pub leave_running: bool,
    pub tcp_established: bool,
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

fn mkdir(p: &Path) -> Result<(), EngineError> {
    std::fs::create_dir_all(p).map_err(EngineError::io(p))
}

/// Checkpoints a runc container: [`checkpoint_pod`] with one member.
pub fn checkpoint_container(req: &ContainerCheckpoint<'_>) -> Result<Captured, EngineError> {
    let mut v = checkpoint_pod(&PodCheckpoint {
        runc: req.runc,
        members: &[PodMember {
            id: req.id,
            image: req.image,
        }],
        leave_running: req.leave_running,
        tcp_established: req.tcp_established,
    })?;
    Ok(v.pop().expect("one member, one capture"))
}

/// After the dump: leave-running resumes the GPU processes (restore, unlock); stop mode drops
/// the suspension (the processes are gone). Returns the GPUs to record (those the processes were
/// checkpointed on) and the report of the GPU phases.
pub(crate) fn finish_gpu(
    gpu: Option<cuda::SuspendedGpu>,
    leave_running: bool,
) -> Result<
    (
        Option<stasis_core::gpu::GpuFingerprint>,
        Option<cuda::GpuCheckpointReport>,
    ),
    EngineError,
> {
    let Some(gpu) = gpu else {
        return Ok((None, None));
    };
    let fp = gpu.fingerprint().clone();
    let report = if leave_running {
        gpu.resume()?
    } else {
        gpu.discard()
    };
    Ok((Some(fp), Some(report)))
}

/// The workload's downtime: the freeze, or for CUDA processes the time their CUDA calls were
/// blocked when that is longer (it starts at the lock, before the freeze).
pub(crate) fn blocked_ms(frozen_ms: u64, gpu: Option<&cuda::GpuCheckpointReport>) -> u64 {
    gpu.map_or(frozen_ms, |g| frozen_ms.max(g.blocked_ms.ceil() as u64))
}

/// A process-tree checkpoint request.
#[derive(Debug, Clone)]
pub struct ProcessCheckpoint<'a> {
    pub pid: i32,
    pub image: &'a ImageDir,
    pub leave_running: bool,
    pub tcp_established: bool,
}

/// What a process restore needs to know that CRIU's images do not say.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ProcessImageInfo {
    pub root_pid: i32,
    pub shell_job: bool,
    pub tcp_established: bool,
    /// CRIU's keys for the root process's stdout and stderr when they were pipes or regular
    /// files (`pipe:[123]`, `var/log/x.log`): a restore can hand the restored process a new
    /// log file in their place (`inherit_fd`), since the pipe's reader is gone and a file that
    /// grew after the dump would fail CRIU's size check.
    #[serde(default)]
    pub stdio_keys: Vec<String>,
}

pub(crate) const PROCESS_INFO_FILE: &str = "stasis-process.json";

/// Checkpoints a process tree through CRIU's RPC (`criu swrk`).
pub fn checkpoint_process(req: &ProcessCheckpoint<'_>) -> Result<Captured, EngineError> {
    if !proctree::alive(req.pid) {
        return Err(EngineError::ProcessNotFound { pid: req.pid });
    }
    if let Some(reason) = refuse_process(req.pid) {
        return Err(EngineError::ProcessRefused {
            pid: req.pid,
            reason,
        });
    }
    let (criu_path, _) = tools::criu_checked()?;
    let _lock = WorkloadLock::acquire_as(
        &format!("process-{}", req.pid),
        &format!("another checkpoint of process {}", req.pid),
    )?;
    let processes = proctree::tree(req.pid);
    let dir = req.image.criu();
    mkdir(&dir)?;
    // A process whose session leader is outside the dumped tree is a "shell job" to CRIU.
    let sid = session_id(req.pid).unwrap_or(req.pid);
    let shell_job = !processes.iter().any(|p| p.pid == sid);
    let info = ProcessImageInfo {
        root_pid: req.pid,
        shell_job,
        tcp_established: req.tcp_established,
        stdio_keys: stdio_keys(req.pid),
    };
    let info_path = dir.join(PROCESS_INFO_FILE);
    std::fs::write(&info_path, serde_json::to_vec(&info).unwrap_or_default())
        .map_err(EngineError::io(&info_path))?;

    let pids: Vec<i32> = processes.iter().map(|p| p.pid).collect();
    let sockets = SocketRecord {
        state_dumped: req.tcp_established,
        leave_running: req.leave_running,
        own_netns: sockets::own_netns(req.pid),
        ..sockets::scan(&pids)
    };
    sockets::write_record(&dir, &sockets)?;
    // `tcp-close` has no setter in CRIU's RPC client: a configuration file, handed to
    // `criu swrk` by a wrapper.
    let mut conf = None;
    let criu_bin = if req.tcp_established {
        criu_path.clone()
    } else {
        let c = conf.insert(CriuConf::write(
            &req.image.root,
            &sockets::dump_options(true, false),
        )?);
        c.criu_wrapper(&criu_path)?
    };
    let gpu = cuda::suspend(&pids, cuda::DEFAULT_LOCK_TIMEOUT)?;
    let dir_fd = open_dir_inheritable(&dir)?;
    let mut criu = rust_criu::Criu::new_with_criu_path(criu_bin.display().to_string())
        .map_err(|e| criu_failed("criu dump", e, None))?;
    criu.set_pid(req.pid);
    criu.set_images_dir_fd(dir_fd.as_raw_fd());
    criu.set_log_file("dump.log".into());
    criu.set_log_level(4);
    criu.set_leave_running(req.leave_running);
    criu.set_tcp_established(req.tcp_established);
    // A connection half-way through the accept queue of a listening socket is left out (its
    // client retries): a busy server's checkpoint must not fail on it (B5).
    criu.set_tcp_skip_in_flight(true);
    criu.set_shell_job(shell_job);
    criu.set_file_locks(true);
    criu.set_ext_unix_sk(true);
    let t = Instant::now();
    criu.dump().map_err(|e| {
        criu_failed(
            &format!("criu dump of pid {}", req.pid),
            e,
            Some(req.image.criu_log("dump")),
        )
    })?;
    let dump_ms = ms(t);
    drop(conf);
    let (gpu_fp, gpu_report) = finish_gpu(gpu, req.leave_running)?;
    let gpu_processes = gpu_report.map_or(0, |r| r.processes);
    info!(
        pid = req.pid,
        dump_ms, gpu_processes, "process tree checkpointed"
    );
    Ok(Captured {
        source: Source::Process { pid: req.pid },
        processes,
        rootfs: None,
        timings: Timings {
            frozen_ms: blocked_ms(dump_ms, gpu_report.as_ref()),
            dump_ms,
            ..Timings::default()
        },
        image_digest: None,
        needs_runc: false,
        leave_running: req.leave_running,
        gpu: gpu_fp,
        gpu_processes,
        gpu_report,
    })
}

pub(crate) fn criu_failed(
    what: &str,
    e: rust_criu::CriuError,
    log: Option<std::path::PathBuf>,
) -> EngineError {
    let detail = log
        .as_deref()
        .and_then(tools::criu_log_errors)
        .unwrap_or_else(|| e.to_string());
    EngineError::ToolFailed {
        what: what.into(),
        detail,
        log,
    }
}

/// Opens a directory for CRIU's `images_dir_fd`: CRIU runs as a child and uses the same fd
/// number, so the descriptor must survive exec (no close-on-exec).
pub(crate) fn open_dir_inheritable(dir: &Path) -> Result<std::fs::File, EngineError> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let f = std::fs::File::open(dir).map_err(EngineError::io(dir))?;
    fcntl(f.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::empty())).map_err(|e| EngineError::Io {
        path: dir.to_path_buf(),
        source: e.into(),
    })?;
    Ok(f)
}

/// CRIU inherit-fd keys of a process's stdout and stderr (deduplicated).
fn stdio_keys(pid: i32) -> Vec<String> {
    let mut keys = Vec::new();
    for fd in [1, 2] {
        let Ok(target) = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")) else {
            continue;
        };
        let t = target.to_string_lossy();
        let key = if t.starts_with("pipe:[") {
            t.into_owned()
        } else if let Some(path) = t.strip_prefix('/') {
            if t.starts_with("/dev/") {
                continue;
            }
            path.to_owned()
        } else {
            continue;
        };
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys
}

/// Why a process tree must not be checkpointed, if it must not: pid 1 (CRIU would seize every
/// process of the machine, in tree order, before failing) and this process or its ancestors
/// (the tree would hold stasis and CRIU themselves).
fn refuse_process(pid: i32) -> Option<String> {
    if pid == 1 {
        return Some("it is pid 1, the init of this pid namespace: CRIU would stop every process of the machine".into());
    }
    let me = std::process::id() as i32;
    if pid == me {
        return Some("it is this stasis process".into());
    }
    let mut p = me;
    for _ in 0..4096 {
        let ppid = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| proctree::parse_stat(&s))
            .map(|(pp, _)| pp)?;
        if ppid == pid {
            return Some(format!(
                "it is an ancestor of this stasis process (pid {me}): its tree would hold stasis and CRIU themselves"
            ));
        }
        if ppid <= 1 {
            return None;
        }
        p = ppid;
    }
    None
}

/// A regular file a process holds open on a mount its own mount namespace does not have (a
/// host file handed to a container as its stdout, say): CRIU fails on it with
/// `Can't lookup mount=N for fd=M`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFileFd {
    pub pid: i32,
    pub command: String,
    pub fd: i32,
    pub path: std::path::PathBuf,
}

/// The regular files `pid` holds open on mounts outside its mount namespace.
pub fn host_file_fds(pid: i32) -> Vec<HostFileFd> {
    let Ok(mountinfo) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
        return Vec::new();
    };
    let mounts: std::collections::HashSet<&str> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').next())
        .collect();
    let command = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // Regular files only: pipes, sockets and devices are not looked up by mount.
        if !std::fs::metadata(e.path()).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let Ok(path) = std::fs::read_link(e.path()) else {
            continue;
        };
        // memfd files live on an internal mount that CRIU handles on its own.
        if path.to_string_lossy().starts_with("/memfd:") {
            continue;
        }
        let mnt_id = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("mnt_id:").map(|v| v.trim().to_owned()))
            });
        if let Some(m) = mnt_id {
            if !mounts.contains(m.as_str()) {
                out.push(HostFileFd {
                    pid,
                    command: command.clone(),
                    fd,
                    path,
                });
            }
        }
    }
    out.sort_by_key(|f| f.fd);
    out
}

fn session_id(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    // fields after comm: state ppid pgrp session
    stat.get(close + 2..)?.split(' ').nth(3)?.parse().ok()
}

/// One checkpoint per container or process at a time. Two overlapping container checkpoints
/// would each pause and resume the container, and the second CRIU dump would put the freezer
/// back to the state it found (frozen) after the first had resumed: the container would stay
/// frozen. The second checkpoint is refused instead; the lock is an `flock`, so it dies with its
/// holder.
pub(crate) struct WorkloadLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Where the per-workload lock files live.
pub const LOCK_DIR: &str = "/run/stasis/locks";

impl WorkloadLock {
    /// Takes the lock `what` (a file name under [`LOCK_DIR`]); `shown` names the operation
    /// holding it in the error when it is taken (`another checkpoint of container "web"`).
    pub(crate) fn acquire_as(what: &str, shown: &str) -> Result<Self, EngineError> {
        use nix::fcntl::{Flock, FlockArg};
        let dir = Path::new(LOCK_DIR);
        mkdir(dir)?;
        let name: String = what
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("{name}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(EngineError::io(&path))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Self { _lock: lock }),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(EngineError::Busy {
                what: shown.to_owned(),
            }),
            Err((_, e)) => Err(EngineError::Io {
                path,
                source: e.into(),
            }),
        }
    }
}
