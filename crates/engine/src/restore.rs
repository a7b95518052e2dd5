//! Restoring a checkpoint image: into a new runc container, or as a process tree.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use stasis_core::manifest::RootfsMethod;
use tracing::{info, warn};

use crate::checkpoint::{
    criu_failed, open_dir_inheritable, ProcessImageInfo, WorkloadLock, IMAGE_DIGEST_ANNOTATIONS,
    PROCESS_INFO_FILE,
};
use crate::error::EngineError;
use crate::image::ImageDir;
use crate::proctree;
use crate::rootfs;
use crate::runc::{RestoreOpts, Runc};
use crate::sockets;
use crate::tools;

pub mod lazy;

/// A container restore request.
#[derive(Debug, Clone)]
pub struct ContainerRestore<'a> {
    pub runc: &'a Runc,
    pub new_id: &'a str,
    /// A fresh bundle made from the same rootfs image as the checkpointed container's.
    pub bundle: &'a Path,
    pub image: &'a ImageDir,
    /// How the filesystem changes were captured (from the manifest); `None`: nothing to apply.
    pub rootfs_method: Option<RootfsMethod>,
    pub tcp_established: bool,
    /// Where the restored container's stdout and stderr go (appended).
    pub stdio_log: Option<&'a Path>,
    /// GPU state to resume after CRIU's restore, when the checkpoint has any.
    pub gpu: Option<GpuRestore<'a>>,
    /// Leave the lazy pages to a `criu lazy-pages` already serving them ([`lazy`]); `false`:
    /// every page is in place before the processes run.
    pub lazy_pages: bool,
}

/// What the checkpoint recorded about its CUDA processes.
#[derive(Debug, Clone, Copy)]
pub struct GpuRestore<'a> {
    /// How many CUDA processes were checkpointed.
    pub processes: u32,
    /// The GPUs they ran on.
    pub recorded: &'a stasis_core::gpu::GpuFingerprint,
}

/// A restored tree: its root pid, and how its GPU steps went when it had CUDA processes.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    pub pid: i32,
    pub gpu: Option<crate::cuda::GpuRestoreReport>,
}

/// After CRIU restored a tree rooted at `root`: restore the GPU state of its CUDA processes (onto
/// this node's GPUs, remapping UUIDs when they differ) and unlock them (DESIGN §7).
///
/// `bundle`: the new container's, whose `NVIDIA_VISIBLE_DEVICES` names the GPUs the device plugin
/// gave it: the workload's GPU memory goes onto those (r580+; refused below, naming the GPUs).
fn resume_gpu(
    root: i32,
    gpu: Option<GpuRestore<'_>>,
    bundle: Option<&Path>,
) -> Result<Option<crate::cuda::GpuRestoreReport>, EngineError> {
    let Some(g) = gpu.filter(|g| g.processes > 0) else {
        return Ok(None);
    };
    Ok(Some(crate::cuda::resume_after_restore(
        root,
        g.processes,
        g.recorded,
        bundle,
    )?))
}

/// The parts of a bundle's `config.json` a restore reads.
#[derive(Debug, serde::Deserialize)]
struct BundleConfig {
    root: BundleRoot,
    #[serde(default)]
    annotations: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    linux: Option<BundleLinux>,
}
#[derive(Debug, serde::Deserialize)]
struct BundleRoot {
    path: PathBuf,
    #[serde(default)]
    readonly: bool,
}
#[derive(Debug, Default, serde::Deserialize)]
struct BundleLinux {
    #[serde(default)]
    namespaces: Vec<BundleNamespace>,
    #[serde(default)]
    resources: Option<BundleResources>,
}
#[derive(Debug, Default, serde::Deserialize)]
struct BundleResources {
    #[serde(default)]
    memory: Option<BundleMemory>,
}
#[derive(Debug, Default, serde::Deserialize)]
struct BundleMemory {
    #[serde(default)]
    limit: Option<i64>,
}

impl BundleConfig {
    /// The memory limit (`linux.resources.memory.limit`), when there is a positive one.
    fn memory_limit(&self) -> Option<u64> {
        let l = self
            .linux
            .as_ref()?
            .resources
            .as_ref()?
            .memory
            .as_ref()?
            .limit?;
        u64::try_from(l).ok().filter(|l| *l > 0)
    }
}
#[derive(Debug, serde::Deserialize)]
struct BundleNamespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: Option<String>,
}

fn read_bundle(bundle: &Path) -> Result<BundleConfig, EngineError> {
    let cfg = bundle.join("config.json");
    let raw = std::fs::read(&cfg).map_err(|e| EngineError::Bundle {
        bundle: bundle.into(),
        reason: format!("cannot read config.json: {e}"),
    })?;
    serde_json::from_slice(&raw).map_err(|e| EngineError::Bundle {
        bundle: bundle.into(),
        reason: format!("config.json is not a valid OCI runtime config: {e}"),
    })
}

/// The digest of the image a bundle's rootfs was made from, from its annotations.
pub fn bundle_image_digest(bundle: &Path) -> Result<Option<String>, EngineError> {
    let cfg = read_bundle(bundle)?;
    Ok(IMAGE_DIGEST_ANNOTATIONS
        .iter()
        .find_map(|k| cfg.annotations.get(*k).cloned()))
}

/// What a container restore requires of its target bundle, checked before anything is fetched
/// or changed (the CLI calls it before fetching; [`restore_container`] again before writing).
///
/// A restore writes the checkpoint's filesystem changes into the bundle's rootfs and deletes
/// what the checkpoint does not list there, so the rootfs must be the bundle's own fresh copy
/// of the image. Refused, naming why: a rootfs that is the host's `/`, the bundle directory
/// itself, or outside the bundle (a shared directory: an absolute `root.path` elsewhere); a
/// `root.readonly` rootfs; a rootfs that a process (a running, paused or created container)
/// has as its root; a memory limit smaller than the memory the checkpoint restores (CRIU would
/// be killed for memory half-way). Returns the rootfs path.
pub fn check_target(
    bundle: &Path,
    writes_rootfs: bool,
    memory_bytes: Option<u64>,
) -> Result<PathBuf, EngineError> {
    let cfg = read_bundle(bundle)?;
    check_target_cfg(bundle, &cfg, writes_rootfs, memory_bytes)
}

fn check_target_cfg(
    bundle: &Path,
    cfg: &BundleConfig,
    writes_rootfs: bool,
    memory_bytes: Option<u64>,
) -> Result<PathBuf, EngineError> {
    let refuse = |reason: String| EngineError::Bundle {
        bundle: bundle.into(),
        reason,
    };
    let rootfs = if cfg.root.path.is_absolute() {
        cfg.root.path.clone()
    } else {
        bundle.join(&cfg.root.path)
    };
    if !rootfs.is_dir() {
        return Err(refuse(format!(
            "rootfs {} is not a directory",
            rootfs.display()
        )));
    }
    if let (Some(limit), Some(need)) = (cfg.memory_limit(), memory_bytes) {
        if limit < need {
            return Err(refuse(format!(
                "its memory limit (linux.resources.memory.limit) is {}, less than the {} of memory the checkpoint restores: CRIU would be killed for memory; raise the limit",
                mib(limit),
                mib(need)
            )));
        }
    }
    if !writes_rootfs {
        return Ok(rootfs);
    }
    let canon = |p: &Path| {
        p.canonicalize()
            .map_err(|e| refuse(format!("cannot resolve {}: {e}", p.display())))
    };
    let (root_c, bundle_c) = (canon(&rootfs)?, canon(bundle)?);
    let fix = "a restore rewrites the rootfs (it writes the checkpoint's files and deletes what the checkpoint does not list), so it needs the bundle's own fresh copy of the image at <bundle>/rootfs";
    if root_c == Path::new("/") {
        return Err(refuse(format!(
            "rootfs {} is the host's root filesystem; {fix}",
            rootfs.display()
        )));
    }
    if root_c == bundle_c || !root_c.starts_with(&bundle_c) {
        return Err(refuse(format!(
            "rootfs {} is not inside the bundle directory (a shared directory?); {fix}",
            root_c.display()
        )));
    }
    if cfg.root.readonly {
        return Err(refuse(format!(
            "root.readonly is true, but a restore writes the checkpoint's filesystem changes into rootfs {}; use a bundle with a writable rootfs",
            root_c.display()
        )));
    }
    if let Some((pid, comm)) = processes_rooted_at(&root_c).into_iter().next() {
        return Err(refuse(format!(
            "rootfs {} is in use: process {pid} ({comm}) runs in it (a container from this bundle?); {fix}",
            root_c.display()
        )));
    }
    Ok(rootfs)
}

fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1024.0 * 1024.0))
}

/// Processes whose root directory is `dir` (same device and inode: a container's root seen
/// from the host, whatever its mount namespace calls it).
fn processes_rooted_at(dir: &Path) -> Vec<(i32, String)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(r) = std::fs::metadata(format!("/proc/{pid}/root")) else {
            continue;
        };
        if r.dev() == md.dev() && r.ino() == md.ino() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push((pid, comm.trim().to_owned()));
        }
    }
    out.sort_unstable();
    out
}

/// Bytes of memory a checkpoint image restores: the sizes of CRIU's page images.
pub fn memory_bytes<'a>(files: impl IntoIterator<Item = (&'a str, u64)>) -> u64 {
    files
        .into_iter()
        .filter(|(p, _)| {
            p.strip_prefix("criu/pages-")
                .is_some_and(|r| r.ends_with(".img"))
        })
        .map(|(_, n)| n)
        .sum()
}

fn image_memory_bytes(image: &ImageDir) -> Option<u64> {
    let rd = std::fs::read_dir(image.criu()).ok()?;
    let files: Vec<(String, u64)> = rd
        .flatten()
        .filter_map(|e| {
            let len = e.metadata().ok()?.len();
            Some((format!("criu/{}", e.file_name().to_str()?), len))
        })
        .collect();
    Some(memory_bytes(files.iter().map(|(p, n)| (p.as_str(), *n))))
}

/// The network namespace a restore into `bundle` puts the sockets in: the restoring process's
/// (no network namespace in the config), the one the config joins by path, or a new one.
pub fn tcp_target(bundle: &Path) -> Result<sockets::Target, EngineError> {
    let cfg = read_bundle(bundle)?;
    let ns = cfg.linux.unwrap_or_default().namespaces;
    Ok(match ns.iter().find(|n| n.kind == "network") {
        None => sockets::Target::Current,
        Some(n) => match n.path.as_deref().filter(|p| !p.is_empty()) {
            Some(p) => sockets::Target::Joined(p.into()),
            None => sockets::Target::New,
        },
    })
}

/// Restores a container checkpoint into a new container (detached, running).
///
/// The target bundle is checked first ([`check_target`]). One restore per (runc root, id) at a
/// time. On failure the half-restored container is deleted, but only when it is the one this
/// restore created (runc did not refuse the id as taken, and the container under that id has
/// this bundle): a container someone else created under the id is never touched.
pub fn restore_container(req: &ContainerRestore<'_>) -> Result<i32, EngineError> {
    restore_container_reporting(req).map(|r| r.pid)
}

/// [`restore_container`], with the report of its GPU steps.
pub fn restore_container_reporting(req: &ContainerRestore<'_>) -> Result<Restored, EngineError> {
    let _lock = WorkloadLock::acquire_as(
        &format!("restore-{}-{}", req.runc.root.display(), req.new_id),
        &format!("a restore into container {:?}", req.new_id),
    )?;
    if req.runc.exists(req.new_id)? {
        return Err(EngineError::ContainerExists {
            id: req.new_id.into(),
            root: req.runc.root.clone(),
        });
    }
    let cfg = read_bundle(req.bundle)?;
    let rootfs = check_target_cfg(
        req.bundle,
        &cfg,
        req.rootfs_method.is_some(),
        image_memory_bytes(req.image),
    )?;
    if let Some(method) = req.rootfs_method {
        rootfs::apply(req.image, method, &rootfs)?;
    }
    let pid_file = req.bundle.join("stasis-restored.pid");
    let _ = std::fs::remove_file(&pid_file);
    let stdio = req.stdio_log.map(log_forwarder).transpose()?;
    // Connections are restored as they were, or closed (`tcp-close`, which runc has no flag
    // for); the caller decides with `sockets::decide_for` (DESIGN §9.8).
    let conf = if req.tcp_established {
        None
    } else {
        Some(sockets::CriuConf::write(&req.image.root, &["tcp-close"])?)
    };
    let opts = RestoreOpts {
        image_path: &req.image.criu(),
        work_path: &req.image.criu(),
        bundle: req.bundle,
        pid_file: &pid_file,
        tcp_established: req.tcp_established,
        criu_conf: conf.as_ref().map(|c| c.path.as_path()),
        lazy_pages: req.lazy_pages,
    };
    let restored = req
        .runc
        .restore(req.new_id, &opts, stdio.as_ref())
        .and_then(|()| read_pid(&pid_file))
        .and_then(|pid| {
            resume_gpu(pid, req.gpu, Some(req.bundle)).map(|gpu| Restored { pid, gpu })
        });
    let restored = match restored {
        Ok(r) => r,
        Err(e) => {
            if !matches!(e, EngineError::ContainerExists { .. }) {
                remove_if_ours(req.runc, req.new_id, req.bundle);
            }
            return Err(name_cause(e, cfg.memory_limit()));
        }
    };
    let pid = restored.pid;
    // A restored network namespace comes back with its loopback down (DESIGN §8).
    let own_netns = cfg
        .linux
        .unwrap_or_default()
        .namespaces
        .iter()
        .any(|n| n.kind == "network" && n.path.is_none());
    if own_netns {
        if let Err(e) = tools::run_capture(
            std::process::Command::new("nsenter").args([
                "-t",
                &pid.to_string(),
                "-n",
                "ip",
                "link",
                "set",
                "lo",
                "up",
            ]),
            "bringing up loopback in the restored network namespace",
        ) {
            warn!(error = %e, "restored container's loopback may be down");
        }
    }
    info!(container = req.new_id, pid, "container restored");
    Ok(restored)
}

/// The restored container's stdout and stderr: a pipe whose reader, a `cat` in a session of its
/// own, appends to `log`. Not the file itself: a container holding a host file open cannot be
/// checkpointed again (CRIU cannot find its mount), while a pipe to the outside is what runc
/// checkpoints and restores as external stdio, as with containerd's shim.
fn log_forwarder(log: &Path) -> Result<std::fs::File, EngineError> {
    use std::process::{Command, Stdio};
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(EngineError::io(log))?;
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| EngineError::Io {
            path: log.to_path_buf(),
            source: e.into(),
        })?;
    // Not waited for: it outlives this process (its reaper takes it over) and ends when the
    // container's last writer closes the pipe.
    #[allow(clippy::zombie_processes)]
    Command::new("setsid")
        .arg("cat")
        .stdin(Stdio::from(read))
        .stdout(Stdio::from(file))
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| EngineError::ToolMissing {
            tool: "setsid/cat".into(),
            hint: format!("cannot start the log forwarder for {}: {e}", log.display()),
        })?;
    Ok(std::fs::File::from(write))
}

/// Deletes the container `id` after a failed restore, if it is the one this restore created
/// (its bundle is ours); anything else under that id is someone else's and is left alone.
fn remove_if_ours(runc: &Runc, id: &str, bundle: &Path) {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    match runc.state(id) {
        Ok(st) if same(&st.bundle, bundle) => {
            if let Err(de) = runc.delete_force(id) {
                warn!(container = id, error = %de, "could not remove the failed restore");
            }
        }
        Ok(st) => warn!(
            container = id,
            bundle = %st.bundle.display(),
            "a container with this id and another bundle exists: not ours, left alone"
        ),
        Err(_) => {}
    }
}

/// Names the cause of a failed restore where CRIU's own lines do not: a file the processes had
/// mapped that the bundle's rootfs lacks or has in another version (not the same image), or a
/// SIGKILL under a memory limit (CRIU's words are then about a process `killed by signal 9`, or,
/// when CRIU itself was killed, only about its lost helper, `cgroupd: recv req error`).
fn name_cause(e: EngineError, limit: Option<u64>) -> EngineError {
    let EngineError::ToolFailed { what, detail, log } = e else {
        return e;
    };
    let file = detail.contains("Can't open file") || detail.contains("has bad size");
    let killed = detail.contains("signal 9")
        || detail.contains(": Killed")
        || detail
            .split(" | ")
            .all(|l| l.contains("cgroupd") || l.contains("Restoring FAILED"));
    let detail = match limit {
        _ if file => format!(
            "a file the checkpointed processes had mapped is missing from the bundle's rootfs or differs from the one they had: make the bundle from the same image as the checkpointed container ({detail})"
        ),
        Some(limit) if killed => format!(
            "CRIU or the restored processes were killed (SIGKILL), most likely by the bundle's memory limit of {}: raise linux.resources.memory.limit ({detail})",
            mib(limit)
        ),
        _ => detail,
    };
    EngineError::ToolFailed { what, detail, log }
}

fn open_inheritable_log(p: &Path) -> Result<std::fs::File, EngineError> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(p)
        .map_err(EngineError::io(p))?;
    fcntl(f.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::empty())).map_err(|e| EngineError::Io {
        path: p.to_path_buf(),
        source: e.into(),
    })?;
    Ok(f)
}

fn read_pid(p: &Path) -> Result<i32, EngineError> {
    let s = std::fs::read_to_string(p).map_err(EngineError::io(p))?;
    s.trim().parse().map_err(|_| EngineError::Io {
        path: p.into(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a pid"),
    })
}

/// How long a restored process tree must stay alive before its restore counts as a success.
pub const SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

/// Whether the child `pid` ends within `wait` (then how: exit status or signal).
fn died_within(pid: i32, wait: std::time::Duration) -> Option<String> {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let deadline = std::time::Instant::now() + wait;
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => return Some(format!("exited with status {code}")),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Some(format!("was killed by {sig}")),
            Ok(_) => {}
            // Not our child (CRIU could not make it one): fall back to /proc.
            Err(_) if !proctree::alive(pid) => return Some("ended".into()),
            Err(_) => {}
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Restores a process tree through CRIU's RPC. The tree gets its original pids back and becomes a
/// child of this process (CRIU's `rst_sibling`); run under a reaping parent (DESIGN §8).
///
/// `stdio_log`: a file that takes the place of the original stdout/stderr (when they were pipes or
/// files), appended to.
pub fn restore_process(
    image: &ImageDir,
    stdio_log: Option<&Path>,
    gpu: Option<GpuRestore<'_>>,
) -> Result<i32, EngineError> {
    restore_process_reporting(image, stdio_log, gpu).map(|r| r.pid)
}

/// [`restore_process_reporting`], closing the tree's established TCP connections when
/// `close_tcp` or wherever they cannot be kept (`sockets::decide_for`), with that decision.
pub fn restore_process_tcp(
    image: &ImageDir,
    stdio_log: Option<&Path>,
    gpu: Option<GpuRestore<'_>>,
    close_tcp: bool,
) -> Result<(Restored, sockets::Decision), EngineError> {
    let record = sockets::read_record(&image.criu());
    let target = if record.as_ref().is_some_and(|r| r.own_netns) {
        sockets::Target::New
    } else {
        sockets::Target::Current
    };
    let tcp = sockets::decide_for(record.as_ref(), &target, close_tcp);
    restore_process_inner(image, stdio_log, gpu, &tcp).map(|r| (r, tcp))
}

/// [`restore_process`], with the report of its GPU steps.
pub fn restore_process_reporting(
    image: &ImageDir,
    stdio_log: Option<&Path>,
    gpu: Option<GpuRestore<'_>>,
) -> Result<Restored, EngineError> {
    restore_process_tcp(image, stdio_log, gpu, false).map(|(r, _)| r)
}

fn restore_process_inner(
    image: &ImageDir,
    stdio_log: Option<&Path>,
    gpu: Option<GpuRestore<'_>>,
    tcp: &sockets::Decision,
) -> Result<Restored, EngineError> {
    let (criu_path, _) = tools::criu_checked()?;
    let dir = image.criu();
    let info_path = dir.join(PROCESS_INFO_FILE);
    let info: ProcessImageInfo = std::fs::read(&info_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| EngineError::Image {
            dir: image.root.clone(),
            reason: format!(
                "{PROCESS_INFO_FILE} is missing or unreadable: not a process checkpoint"
            ),
        })?;
    let refuse = |detail: String| EngineError::ToolFailed {
        what: "criu restore".into(),
        detail,
        log: None,
    };
    if proctree::alive(info.root_pid) {
        return Err(refuse(format!(
            "pid {} is in use by a running process; a process tree restores with its original pids (stop the original first)",
            info.root_pid
        )));
    }
    if let Some(parent) = proctree::zombie_parent(info.root_pid) {
        return Err(refuse(format!(
            "pid {} is held by a zombie that its parent, pid {parent}, has not reaped yet; a process tree restores with its original pids: wait for the parent to reap it (run workloads under a reaping parent such as `tini -s`)",
            info.root_pid
        )));
    }
    // A pipe's reader is not part of the checkpoint: a tree restored onto the pipe it wrote to
    // dies of SIGPIPE at its first write. A log file takes the pipe's place instead.
    if stdio_log.is_none() {
        if let Some(pipe) = info.stdio_keys.iter().find(|k| k.starts_with("pipe:")) {
            return Err(EngineError::Image {
                dir: image.root.clone(),
                reason: format!(
                    "the checkpointed process wrote its stdout or stderr to a pipe ({pipe}) whose reader is not part of the checkpoint, so the restored tree would die at its first write; give it a file instead with --log FILE"
                ),
            });
        }
    }
    // `tcp-close` has no setter in CRIU's RPC client: a configuration file, handed to
    // `criu swrk` by a wrapper.
    let mut conf = None;
    let criu_bin = if tcp.keeps() {
        criu_path.clone()
    } else {
        let c = conf.insert(sockets::CriuConf::write(&image.root, &["tcp-close"])?);
        c.criu_wrapper(&criu_path)?
    };
    let dir_fd = open_dir_inheritable(&dir)?;
    let mut criu = rust_criu::Criu::new_with_criu_path(criu_bin.display().to_string())
        .map_err(|e| criu_failed("criu restore", e, None))?;
    criu.set_images_dir_fd(dir_fd.as_raw_fd());
    // Keep the log file open until CRIU is done with its fd number.
    let mut _log_file = None;
    if let Some(log) = stdio_log {
        let f = open_inheritable_log(log)?;
        for key in &info.stdio_keys {
            criu.add_inherit_fd(f.as_raw_fd(), key.clone())
                .map_err(|e| criu_failed("criu restore", e, None))?;
        }
        _log_file = Some(f);
    }
    criu.set_log_file("restore.log".into());
    criu.set_log_level(4);
    criu.set_rst_sibling(true);
    criu.set_tcp_established(tcp.keeps());
    criu.set_shell_job(info.shell_job);
    criu.set_file_locks(true);
    criu.set_ext_unix_sk(true);
    criu.restore()
        .map_err(|e| criu_failed("criu restore", e, Some(image.criu_log("restore"))))?;
    drop(conf);
    let gpu = match resume_gpu(info.root_pid, gpu, None) {
        Ok(g) => g,
        Err(e) => {
            // A process left waiting for GPU state it will never get is worse than none.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(info.root_pid),
                nix::sys::signal::SIGKILL,
            );
            return Err(e);
        }
    };
    // Success means a live tree: one that dies at once (a file it needs is gone, a signal)
    // is reported with how it ended. It is this process's child (`rst_sibling`).
    if let Some(how) = died_within(info.root_pid, SETTLE) {
        return Err(EngineError::ToolFailed {
            what: "criu restore".into(),
            detail: format!(
                "the restored tree did not stay alive: pid {} {how} within {} ms of the restore",
                info.root_pid,
                SETTLE.as_millis()
            ),
            log: Some(image.criu_log("restore")),
        });
    }
    info!(pid = info.root_pid, "process tree restored");
    Ok(Restored {
        pid: info.root_pid,
        gpu,
    })
}

#[cfg(test)]
mod tests;
