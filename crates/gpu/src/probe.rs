//! What `stasis doctor` says about the GPU side of a machine.

use std::fmt;
use std::path::Path;

use serde::Serialize;
use stasis_core::gpu::{GpuFingerprint, MIN_CHECKPOINT_BRANCH};

use crate::detect::Procfs;
use crate::driver::{cuda_version_string, libcuda_candidates, load_error, MIGRATION_CUDA_VERSION};
use crate::ffi::CudaLib;
use crate::result::CuResult;

/// The GPU side of a machine, as far as stasis cares.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuProbe {
    /// Set when there is no usable NVIDIA driver, saying why; everything else is then empty.
    pub no_driver: Option<String>,
    /// The libcuda file loaded.
    pub libcuda: Option<String>,
    /// CUDA driver API version (`cuDriverGetVersion`), e.g. `12.8`.
    pub cuda_driver_version: Option<String>,
    /// Full driver version from NVML, e.g. `580.65.06`.
    pub driver_version: Option<String>,
    /// Whether the `cuCheckpointProcess*` API is there (symbols present, driver >= r570).
    pub checkpoint_api: bool,
    /// Checkpoint API symbols this driver lacks.
    pub missing_symbols: Vec<String>,
    /// Whether restores can remap GPUs (r580+).
    pub gpu_migration: bool,
    /// Persistence mode on every GPU.
    pub persistence_mode: Option<bool>,
    /// The node's GPUs (NVML).
    pub fingerprint: Option<GpuFingerprint>,
    /// What stops GPU checkpoints here, each with what to do.
    pub problems: Vec<String>,
    /// What works but could be better.
    pub notes: Vec<String>,
}

impl GpuProbe {
    /// Whether GPU checkpoints can run here.
    pub fn ready(&self) -> bool {
        self.no_driver.is_none() && self.checkpoint_api && self.problems.is_empty()
    }

    /// One line for a summary table: `no NVIDIA driver` or `driver 580.65.06, 1 × NVIDIA H200`.
    pub fn summary(&self) -> String {
        if self.no_driver.is_some() {
            return "no NVIDIA driver".to_owned();
        }
        let driver = self
            .driver_version
            .clone()
            .or_else(|| {
                self.cuda_driver_version
                    .clone()
                    .map(|c| format!("CUDA {c}"))
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let gpus = self.fingerprint.as_ref().map_or_else(String::new, |f| {
            let mut names: Vec<&str> = f.devices.iter().map(|d| d.name.as_str()).collect();
            names.dedup();
            format!(", {} × {}", f.devices.len(), names.join("/"))
        });
        format!(
            "driver {driver}{gpus}, checkpoint API {}",
            if self.checkpoint_api { "yes" } else { "no" }
        )
    }
}

impl fmt::Display for GpuProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = &self.no_driver {
            return write!(
                f,
                "no NVIDIA driver ({why}); GPU checkpoints are not available"
            );
        }
        let yn = |b: bool| if b { "yes" } else { "no" };
        writeln!(
            f,
            "NVIDIA driver {} (CUDA {}), {}",
            self.driver_version.as_deref().unwrap_or("unknown"),
            self.cuda_driver_version.as_deref().unwrap_or("unknown"),
            self.libcuda.as_deref().unwrap_or("?")
        )?;
        writeln!(f, "checkpoint API: {}", yn(self.checkpoint_api))?;
        writeln!(f, "GPU migration (r580+): {}", yn(self.gpu_migration))?;
        writeln!(
            f,
            "persistence mode: {}",
            self.persistence_mode
                .map_or("unknown", |p| if p { "on" } else { "off" })
        )?;
        if let Some(fp) = &self.fingerprint {
            for (i, d) in fp.devices.iter().enumerate() {
                writeln!(
                    f,
                    "GPU {i}: {}, {:.1} GiB, {}{}",
                    d.name,
                    d.memory_bytes as f64 / (1u64 << 30) as f64,
                    d.uuid,
                    if d.mig_enabled == Some(true) {
                        ", MIG on"
                    } else {
                        ""
                    }
                )?;
            }
        }
        for p in &self.problems {
            writeln!(f, "problem: {p}")?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}

/// Probes the machine: loads libcuda (no driver: says so and stops), reads the driver version and
/// the checkpoint API's symbols, calls `cuInit`, and asks NVML for the GPUs.
pub fn probe() -> GpuProbe {
    probe_with(&libcuda_candidates(), &Procfs::default())
}

/// [`probe`] with explicit libcuda candidates and `/proc`.
pub fn probe_with(libcuda: &[String], procfs: &Procfs) -> GpuProbe {
    let mut p = GpuProbe::default();
    let lib = match CudaLib::open(libcuda) {
        Ok(lib) => lib,
        Err(e) => {
            p.no_driver = Some(match load_error(e) {
                crate::GpuError::NoDriver(why) => why,
                other => other.to_string(),
            });
            return p;
        }
    };
    p.libcuda = Some(lib.path().to_owned());
    let cuda = lib.driver_version().ok();
    p.cuda_driver_version = cuda.map(cuda_version_string);
    p.missing_symbols = lib
        .missing_checkpoint_symbols()
        .into_iter()
        .map(str::to_owned)
        .collect();
    match CuResult(lib.init()) {
        CuResult::SUCCESS => {}
        CuResult::STUB_LIBRARY => {
            p.no_driver = Some(format!(
                "{} is the CUDA toolkit's stub library, not a driver",
                lib.path()
            ));
            return p;
        }
        code => p.problems.push(format!(
            "cuInit failed: {code}; check that the NVIDIA kernel module is loaded and the GPUs \
             are visible (nvidia-smi)"
        )),
    }
    match crate::nvml::fingerprint() {
        Ok(fp) => {
            p.driver_version = Some(fp.driver_version.clone());
            p.persistence_mode = fp.persistence_mode;
            for (i, d) in fp.devices.iter().enumerate() {
                if d.mig_enabled == Some(true) {
                    p.problems.push(format!(
                        "GPU {i} ({}) is in MIG mode: the CUDA checkpoint API does not support \
                         MIG; disable it (nvidia-smi -i {i} -mig 0) to checkpoint its processes",
                        d.uuid
                    ));
                }
            }
            p.fingerprint = Some(fp);
        }
        Err(e) => p
            .notes
            .push(format!("NVML: {e}; GPU models and UUIDs unknown")),
    }
    let branch_ok = p
        .fingerprint
        .as_ref()
        .and_then(GpuFingerprint::driver_branch_number)
        .is_none_or(|b| b >= MIN_CHECKPOINT_BRANCH);
    p.checkpoint_api = p.missing_symbols.is_empty() && branch_ok;
    if !p.checkpoint_api {
        p.problems.push(format!(
            "the driver has no CUDA checkpoint API{}: install NVIDIA driver r570 or newer \
             (r580+ to restore onto other GPUs)",
            if p.missing_symbols.is_empty() {
                String::new()
            } else {
                format!(" (missing {})", p.missing_symbols.join(", "))
            }
        ));
    }
    p.gpu_migration = p.checkpoint_api && cuda.is_some_and(|v| v >= MIGRATION_CUDA_VERSION);
    if p.persistence_mode == Some(false) {
        p.notes.push(
            "persistence mode is off: restores work (stasis calls cuInit) but each may pay the \
             driver's start-up; enable it with nvidia-smi -pm 1 or nvidia-persistenced"
                .to_owned(),
        );
    }
    let mps = procfs.mps_daemons();
    if !mps.is_empty() {
        p.problems.push(format!(
            "an MPS daemon runs here (pid {mps:?}): MPS clients cannot be checkpointed"
        ));
    }
    if let Some(note) = criu_cuda_plugin_note(Path::new(CRIU_CUDA_PLUGIN)) {
        p.notes.push(note);
    }
    p
}

/// Where CRIU looks for its own CUDA plugin by default (`CR_PLUGIN_DEFAULT`).
pub const CRIU_CUDA_PLUGIN: &str = "/usr/lib/criu/cuda_plugin.so";

/// What to say when CRIU's own CUDA plugin is installed: it would act on the processes stasis
/// drives (restore them without GPU pairs, spawn cuda-checkpoint inside the freeze, mark images
/// as needing it) unless CRIU is pointed elsewhere, which the stasis binaries do.
fn criu_cuda_plugin_note(plugin: &Path) -> Option<String> {
    plugin.exists().then(|| {
        format!(
            "CRIU's CUDA plugin is installed ({}): stasis runs CRIU with an empty plugin \
             directory (CRIU_LIBS_DIR) so that the plugin leaves the CUDA processes stasis drives \
             alone; a CRIU_LIBS_DIR set by hand must not contain it",
            plugin.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_installed_criu_cuda_plugin_is_mentioned() {
        let t = tempfile::tempdir().unwrap();
        let plugin = t.path().join("cuda_plugin.so");
        assert_eq!(criu_cuda_plugin_note(&plugin), None);
        std::fs::write(&plugin, "").unwrap();
        let note = criu_cuda_plugin_note(&plugin).unwrap();
        assert!(note.contains("CRIU_LIBS_DIR"), "{note}");
    }

    #[test]
    fn without_libcuda_the_probe_says_no_nvidia_driver() {
        let p = probe_with(
            &["/nonexistent/libcuda.so.1".to_owned()],
            &Procfs::default(),
        );
        assert!(!p.ready());
        assert_eq!(p.summary(), "no NVIDIA driver");
        let text = p.to_string();
        assert!(text.starts_with("no NVIDIA driver ("), "{text}");
        assert!(text.contains("/nonexistent/libcuda.so.1"), "{text}");
        let json = serde_json::to_value(&p).unwrap();
        assert!(json["no_driver"].is_string());
        assert_eq!(json["checkpoint_api"], false);
    }

    #[test]
    fn this_machine_has_no_driver() {
        // CI and this development machine have no NVIDIA driver; a GPU machine skips this.
        if std::path::Path::new("/proc/driver/nvidia").exists() {
            return;
        }
        let p = probe();
        assert_eq!(p.summary(), "no NVIDIA driver", "{p}");
    }

    #[test]
    fn report_of_a_gpu_node() {
        let p = GpuProbe {
            libcuda: Some("libcuda.so.1".into()),
            cuda_driver_version: Some("13.0".into()),
            driver_version: Some("580.65.06".into()),
            checkpoint_api: true,
            gpu_migration: true,
            persistence_mode: Some(true),
            fingerprint: Some(GpuFingerprint {
                driver_version: "580.65.06".into(),
                cuda_driver_version: Some(13000),
                devices: vec![stasis_core::gpu::GpuDevice {
                    name: "NVIDIA H200".into(),
                    uuid: "GPU-1".into(),
                    memory_bytes: 141 << 30,
                    mig_enabled: Some(false),
                }],
                persistence_mode: Some(true),
                workload_gpus: Vec::new(),
            }),
            ..Default::default()
        };
        assert!(p.ready());
        assert_eq!(
            p.summary(),
            "driver 580.65.06, 1 × NVIDIA H200, checkpoint API yes"
        );
        let t = p.to_string();
        assert!(
            t.contains("checkpoint API: yes") && t.contains("GPU 0: NVIDIA H200, 141.0 GiB"),
            "{t}"
        );
    }
}
