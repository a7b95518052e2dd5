//! Restoring a checkpoint image: into a new runc container, or as a process tree.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use stasis_core::manifest::RootfsMethod;
use tracing::{info, warn};

use crate::checkpoint::{
    criu_failed, open_dir_inheritable, ProcessImageInfo, IMAGE_DIGEST_ANNOTATIONS,
    PROCESS_INFO_FILE,
};
use crate::error::EngineError;
use crate::image::ImageDir;
use crate::proctree;
use crate::rootfs;
use crate::runc::{RestoreOpts, Runc};
use crate::sockets;
use crate::tools;

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
    let started = std::time::Instant::now();
    // Loaded here so that its cost shows on its own line of the report (kept for later calls).
    let _ = crate::cuda::driver();
    let driver_load = started.elapsed();
    let node = crate::cuda::gpu_fingerprint().ok_or_else(|| {
        crate::cuda::CudaError::NoDriver(
            "the checkpoint holds GPU state and this node has no NVIDIA driver".into(),
        )
    })?;
    let assigned = match bundle {
        Some(b) => crate::cuda::bundle_gpus(b, &node)?,
        None => Vec::new(),
    };
    let remap = crate::cuda::remap_onto(g.recorded, &node, &assigned)?;
    let phases = crate::cuda::resume_restored_tree(root, g.processes as usize, remap.as_deref())?;
    Ok(Some(crate::cuda::GpuRestoreReport {
        processes: g.processes,
        driver_load_ms: crate::cuda::ms_f64(driver_load),
        phases,
        remapped: remap.is_some(),
        total_ms: crate::cuda::ms_f64(started.elapsed()),
    }))
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
}
#[derive(Debug, Default, serde::Deserialize)]
struct BundleLinux {
    #[serde(default)]
    namespaces: Vec<BundleNamespace>,
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

/// Restores a container checkpoint into a new container (detached, running). On failure nothing
/// is left behind: the half-restored container is deleted.
pub fn restore_container(req: &ContainerRestore<'_>) -> Result<i32, EngineError> {
    restore_container_reporting(req).map(|r| r.pid)
}

/// [`restore_container`], with the report of its GPU steps.
pub fn restore_container_reporting(req: &ContainerRestore<'_>) -> Result<Restored, EngineError> {
    if req.runc.exists(req.new_id)? {
        return Err(EngineError::ContainerExists {
            id: req.new_id.into(),
            root: req.runc.root.clone(),
        });
    }
    let cfg = read_bundle(req.bundle)?;
    let rootfs = if cfg.root.path.is_absolute() {
        cfg.root.path.clone()
    } else {
        req.bundle.join(&cfg.root.path)
    };
    if !rootfs.is_dir() {
        return Err(EngineError::Bundle {
            bundle: req.bundle.into(),
            reason: format!("rootfs {} is not a directory", rootfs.display()),
        });
    }
    if let Some(method) = req.rootfs_method {
        rootfs::apply(req.image, method, &rootfs)?;
    }
    let pid_file = req.bundle.join("stasis-restored.pid");
    let _ = std::fs::remove_file(&pid_file);
    let stdio = req
        .stdio_log
        .map(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(EngineError::io(p))
        })
        .transpose()?;
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
            if let Err(de) = req.runc.delete_force(req.new_id) {
                warn!(container = req.new_id, error = %de, "could not remove the failed restore");
            }
            return Err(e);
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
    if proctree::alive(info.root_pid) {
        return Err(EngineError::ToolFailed {
            what: "criu restore".into(),
            detail: format!(
                "pid {} is in use by a running process; a process tree restores with its original pids (stop the original first)",
                info.root_pid
            ),
            log: None,
        });
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
    info!(pid = info.root_pid, "process tree restored");
    Ok(Restored {
        pid: info.root_pid,
        gpu,
    })
}
