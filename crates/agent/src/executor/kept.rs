//! The latest checkpoint of each container, kept on the node after the upload, so a container
//! the OOM killer ended restarts in place from it without a fetch.

use super::*;

use std::path::PathBuf;

use stasis_node_api::planfile::{self};
use stasis_node_api::Plan;
use tracing::info;

use crate::error::{AgentError, Result};

/// What a kept latest checkpoint is (`.stasis-latest.json` in its directory).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct KeptLatest {
    pub(super) checkpoint_ref: String,
    pub(super) rootfs_method: Option<stasis_core::manifest::RootfsMethod>,
    pub(super) tcp_established: bool,
}
pub(super) const KEPT_LATEST: &str = ".stasis-latest.json";
/// Written when a kept checkpoint is planned for a restart in place: a second OOM kill before
/// the next checkpoint does not restore it again (no restore loop).
pub(super) const RESTORED_IN_PLACE: &str = ".stasis-restored-in-place";

/// Why a container the OOM killer ended restarts cold instead of in place from its kept
/// checkpoint (the wrapper's `NoPlan` reason, and the pod's `ColdStart` Event).
#[derive(Debug, thiserror::Error)]
pub enum NotInPlace {
    #[error("its pod is being deleted")]
    PodDeleting,
    #[error("its pod's restartPolicy is Never")]
    RestartPolicyNever,
    #[error("no valid pod UID and container name")]
    InvalidNames,
    #[error("no checkpoint of this container kept on this node")]
    NothingKept,
    #[error("the record of its kept checkpoint {path} is unreadable: {why}")]
    Unreadable { path: PathBuf, why: String },
    #[error("its latest checkpoint {0} was restored in place already and the container was OOM-killed again (no restore loop)")]
    RestoredAlready(String),
    #[error(transparent)]
    Agent(#[from] AgentError),
}

impl Executor {
    pub(super) fn pod_images(&self, pod_uid: &str) -> PathBuf {
        self.cfg.images_dir.join(pod_uid)
    }

    pub(super) fn kept_dir(&self, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
        (safe_component(pod_uid) && safe_component(container_name)).then(|| {
            self.pod_images(pod_uid)
                .join(format!(".latest-{container_name}"))
        })
    }

    pub(super) fn keep_latest(
        &self,
        scratch: Scratch,
        pod_uid: &str,
        container_name: &str,
        kept: &KeptLatest,
        (gpu, gpu_processes): (Option<&stasis_core::gpu::GpuFingerprint>, u32),
    ) -> Result<()> {
        let Some(dir) = self.kept_dir(pod_uid, container_name) else {
            return Ok(());
        };
        private_dir(&self.cfg.images_dir)?;
        private_dir(&self.pod_images(pod_uid))?;
        scratch.keep(&dir)?;
        planfile::write_verified_stamp(&dir, &kept.checkpoint_ref).map_err(AgentError::io(&dir))?;
        // What stasis-runc's restore must do on the GPU (it restores with runc, not the engine).
        stasis_engine::cuda::write_gpu_record(&dir, gpu, gpu_processes)
            .map_err(AgentError::io(&dir))?;
        let f = dir.join(KEPT_LATEST);
        let json = serde_json::to_vec(kept).map_err(|e| AgentError::Invalid(e.to_string()))?;
        std::fs::write(&f, json).map_err(AgentError::io(&f))
    }

    /// A restart in place (the container was OOM-killed): a plan file for the container's kept
    /// latest checkpoint, which the wrapper's `create` of the restarted container takes. `Err`
    /// says why not: nothing kept, or the kept checkpoint was restored in place already (it
    /// ended the same way: a cold start, not a restore loop).
    pub fn plan_in_place(
        &self,
        pod_uid: &str,
        container_name: &str,
    ) -> std::result::Result<Plan, NotInPlace> {
        let dir = self
            .kept_dir(pod_uid, container_name)
            .ok_or(NotInPlace::InvalidNames)?;
        let file = dir.join(KEPT_LATEST);
        let raw = match std::fs::read(&file) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(NotInPlace::NothingKept)
            }
            Err(e) => return Err(NotInPlace::Agent(AgentError::io(&file)(e))),
        };
        // A damaged record is said as such, not taken for "nothing kept".
        let kept: KeptLatest =
            serde_json::from_slice(&raw).map_err(|e| NotInPlace::Unreadable {
                path: file.clone(),
                why: e.to_string(),
            })?;
        if dir.join(RESTORED_IN_PLACE).exists() {
            return Err(NotInPlace::RestoredAlready(kept.checkpoint_ref));
        }
        let plan = Plan {
            image_dir: dir.clone(),
            rootfs_method: kept.rootfs_method,
            checkpoint_ref: kept.checkpoint_ref.clone(),
            tcp_established: kept.tcp_established,
        };
        self.write_plan(pod_uid, container_name, &plan)?;
        let marker = dir.join(RESTORED_IN_PLACE);
        std::fs::write(&marker, b"").map_err(AgentError::io(&marker))?;
        info!(checkpoint_ref = %kept.checkpoint_ref, %pod_uid, container = %container_name, "restart in place prepared");
        Ok(plan)
    }
}
