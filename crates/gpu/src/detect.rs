//! What `/proc` tells about CUDA processes and setups the checkpoint API cannot handle.
//!
//! Knowable without the driver, and checked here:
//! - which processes touch the GPU at all: an open `/dev/nvidia*` fd or a mapped `libcuda.so`
//!   (a cheap pre-filter; the driver then confirms a CUDA context with
//!   `cuCheckpointProcessGetState`);
//! - MPS: an MPS control daemon or server visible on the node, or `CUDA_MPS_PIPE_DIRECTORY` in a
//!   target's environment;
//! - NCCL with a live communicator using shared memory: `/dev/shm/nccl-*` mapped into a target.
//!
//! MIG comes from NVML (see [`crate::nvml`]). Not knowable up front and left to the driver's
//! answer (which [`crate::GpuError`] explains): managed/UVM memory, CUDA IPC handles, NCCL
//! communicators over the network only.

use std::fs;
use std::path::PathBuf;

use crate::error::GpuError;

/// A view of `/proc` (a different root in tests).
#[derive(Debug, Clone)]
pub struct Procfs {
    root: PathBuf,
}

impl Default for Procfs {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl Procfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn pid_dir(&self, pid: i32) -> PathBuf {
        self.root.join(pid.to_string())
    }

    /// Whether `pid` has a `/dev/nvidia*` file open (CRIU cannot dump those).
    pub fn has_nvidia_fd(&self, pid: i32) -> bool {
        let Ok(fds) = fs::read_dir(self.pid_dir(pid).join("fd")) else {
            return false;
        };
        fds.flatten().any(|fd| {
            fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/dev/nvidia"))
        })
    }

    /// Whether `pid` has a `/dev/nvidia*` file open or `libcuda.so` mapped. Unreadable
    /// entries (the process exited, no permission) count as "no".
    pub fn touches_gpu(&self, pid: i32) -> bool {
        self.has_nvidia_fd(pid) || self.maps_contain(pid, "libcuda.so")
    }

    /// The pids of `pids` that touch the GPU, in the given order.
    pub fn gpu_candidates(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter()
            .copied()
            .filter(|&p| self.touches_gpu(p))
            .collect()
    }

    /// The pids of visible MPS daemons (`nvidia-cuda-mps-control`, `nvidia-cuda-mps-server`;
    /// `comm` is truncated to 15 characters, `nvidia-cuda-mps`).
    pub fn mps_daemons(&self) -> Vec<i32> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out: Vec<i32> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| {
                fs::read_to_string(self.pid_dir(pid).join("comm"))
                    .is_ok_and(|c| c.trim_end().starts_with("nvidia-cuda-mps"))
            })
            .collect();
        out.sort_unstable();
        out
    }

    fn environ_has(&self, pid: i32, key: &str) -> bool {
        self.environ_var(pid, key).is_some()
    }

    /// The value of `name` in `pid`'s environment as the process started (`/proc/<pid>/environ`).
    pub fn environ_var(&self, pid: i32, name: &str) -> Option<String> {
        let raw = fs::read(self.pid_dir(pid).join("environ")).ok()?;
        raw.split(|&b| b == 0).find_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            kv.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
                .map(str::to_owned)
        })
    }

    fn maps_contain(&self, pid: i32, needle: &str) -> bool {
        fs::read_to_string(self.pid_dir(pid).join("maps")).is_ok_and(|m| m.contains(needle))
    }

    /// Refuses setups the checkpoint API cannot handle, for the CUDA processes `pids`, with a
    /// message saying what was found. Checks MPS and NCCL shared-memory communicators.
    pub fn check_supported(&self, pids: &[i32]) -> Result<(), GpuError> {
        if pids.is_empty() {
            return Ok(());
        }
        let daemons = self.mps_daemons();
        if !daemons.is_empty() {
            return Err(GpuError::Unsupported(format!(
                "an MPS daemon runs on this node (pid {}); its clients cannot be checkpointed \
                 (the CUDA checkpoint API does not support MPS)",
                join(&daemons)
            )));
        }
        for &pid in pids {
            if self.environ_has(pid, "CUDA_MPS_PIPE_DIRECTORY") {
                return Err(GpuError::Unsupported(format!(
                    "process {pid} is set up as an MPS client (CUDA_MPS_PIPE_DIRECTORY); the CUDA \
                     checkpoint API does not support MPS"
                )));
            }
            if self.maps_contain(pid, "/dev/shm/nccl-") {
                return Err(GpuError::Unsupported(format!(
                    "process {pid} has a live NCCL communicator (/dev/shm/nccl-* mapped); \
                     checkpointing NCCL is not supported (a rank can hang the checkpoint)"
                )));
            }
        }
        Ok(())
    }
}

fn join(pids: &[i32]) -> String {
    pids.iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pids of every process in the tree rooted at `root_pid` (root first), from
/// `/proc/<pid>/task/*/children`. Needs a kernel with `CONFIG_PROC_CHILDREN` (all current
/// distributions).
pub fn process_tree(procfs: &Procfs, root_pid: i32) -> Vec<i32> {
    let mut out = vec![root_pid];
    let mut i = 0;
    while i < out.len() {
        let pid = out[i];
        let tasks = procfs.pid_dir(pid).join("task");
        if let Ok(entries) = fs::read_dir(&tasks) {
            for t in entries.flatten() {
                if let Ok(kids) = fs::read_to_string(t.path().join("children")) {
                    for k in kids.split_whitespace().filter_map(|k| k.parse().ok()) {
                        if !out.contains(&k) {
                            out.push(k);
                        }
                    }
                }
            }
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;
    use std::path::Path;

    use super::*;

    fn fake_proc() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn add(root: &Path, pid: i32, comm: &str, fds: &[&str], maps: &str, environ: &[&str]) {
        let d = root.join(pid.to_string());
        fs::create_dir_all(d.join("fd")).unwrap();
        fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
        for (i, target) in fds.iter().enumerate() {
            symlink(target, d.join("fd").join(i.to_string())).unwrap();
        }
        fs::write(d.join("maps"), maps).unwrap();
        let env: Vec<u8> = environ
            .iter()
            .flat_map(|kv| kv.bytes().chain([0]))
            .collect();
        fs::write(d.join("environ"), env).unwrap();
    }

    #[test]
    fn gpu_candidates_by_device_fd_or_libcuda_mapping() {
        let t = fake_proc();
        let r = t.path();
        add(r, 1, "init", &["/dev/null"], "", &[]);
        add(
            r,
            2,
            "python3",
            &["/dev/nvidiactl", "/dev/nvidia0"],
            "",
            &[],
        );
        add(
            r,
            3,
            "worker",
            &[],
            "7f00-7f01 r-xp 0 0:0 1 /usr/lib/libcuda.so.580.65.06\n",
            &[],
        );
        let p = Procfs::new(r);
        assert_eq!(p.gpu_candidates(&[1, 2, 3, 4]), [2, 3]);
        assert!(p.has_nvidia_fd(2) && !p.has_nvidia_fd(3));
    }

    #[test]
    fn this_machine_has_no_gpu_processes() {
        // Real /proc, no GPU here: our own process touches no NVIDIA device.
        let me = std::process::id() as i32;
        assert!(Procfs::default().gpu_candidates(&[me]).is_empty());
        assert_eq!(process_tree(&Procfs::default(), me)[0], me);
    }

    #[test]
    fn mps_daemon_is_refused() {
        let t = fake_proc();
        add(t.path(), 2, "python3", &["/dev/nvidia0"], "", &[]);
        add(t.path(), 50, "nvidia-cuda-mps", &[], "", &[]);
        let e = Procfs::new(t.path()).check_supported(&[2]).unwrap_err();
        assert!(
            e.to_string()
                .contains("MPS daemon runs on this node (pid 50)"),
            "{e}"
        );
        // No CUDA process: nothing to refuse.
        assert!(Procfs::new(t.path()).check_supported(&[]).is_ok());
    }

    #[test]
    fn mps_client_environment_is_refused() {
        let t = fake_proc();
        add(
            t.path(),
            2,
            "python3",
            &[],
            "",
            &["PATH=/bin", "CUDA_MPS_PIPE_DIRECTORY=/tmp/mps"],
        );
        let e = Procfs::new(t.path()).check_supported(&[2]).unwrap_err();
        assert!(
            e.to_string()
                .contains("process 2 is set up as an MPS client"),
            "{e}"
        );
    }

    #[test]
    fn nccl_shared_memory_communicator_is_refused() {
        let t = fake_proc();
        add(
            t.path(),
            2,
            "python3",
            &[],
            "7f-80 rw-s 0 0:0 1 /dev/shm/nccl-Ab12Cd (deleted)\n",
            &[],
        );
        add(
            t.path(),
            3,
            "python3",
            &[],
            "7f-80 r-xp 0 0:0 1 /usr/lib/libnccl.so.2\n",
            &[],
        );
        let p = Procfs::new(t.path());
        assert!(
            p.check_supported(&[3]).is_ok(),
            "libnccl loaded but unused is fine"
        );
        let e = p.check_supported(&[3, 2]).unwrap_err();
        assert!(
            e.to_string()
                .contains("process 2 has a live NCCL communicator"),
            "{e}"
        );
    }

    #[test]
    fn process_tree_follows_children_files() {
        let t = fake_proc();
        for (pid, kids) in [(1, "5 6"), (5, "7"), (6, ""), (7, "")] {
            let d = t.path().join(format!("{pid}/task/{pid}"));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("children"), kids).unwrap();
        }
        assert_eq!(process_tree(&Procfs::new(t.path()), 1), [1, 5, 6, 7]);
    }
}
