//! Plan files (what the wrapper's `create` reads) and the sweep of stale plans and images.

use super::*;

use std::collections::HashSet;
use std::path::PathBuf;

use stasis_node_api::planfile::{self, PlanFile};
use stasis_node_api::{Plan, PROTOCOL_VERSION};
use tracing::info;

use crate::error::{AgentError, Result};

impl Executor {
    /// Writes the plan file `pod_<uid>_<container>.json` the wrapper's `create` of that
    /// container takes (valid for `plan_ttl`).
    pub(super) fn write_plan(
        &self,
        pod_uid: &str,
        container_name: &str,
        plan: &Plan,
    ) -> Result<PathBuf> {
        let expires = now_ms() + self.cfg.plan_ttl.as_millis() as u64;
        self.write_plan_until(pod_uid, container_name, plan, expires)
    }

    /// [`Executor::write_plan`], valid until `expires_at_unix_ms`.
    pub(super) fn write_plan_until(
        &self,
        pod_uid: &str,
        container_name: &str,
        plan: &Plan,
        expires_at_unix_ms: u64,
    ) -> Result<PathBuf> {
        let path = planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name)
            .ok_or_else(|| AgentError::Invalid("no plan path for this pod".into()))?;
        private_dir(&self.cfg.plans_dir)?;
        planfile::write(
            &path,
            &PlanFile {
                v: PROTOCOL_VERSION,
                container_id: None,
                pod_uid: Some(pod_uid.to_owned()),
                container_name: Some(container_name.to_owned()),
                plan: plan.clone(),
                expires_at_unix_ms: Some(expires_at_unix_ms),
            },
        )
        .map_err(AgentError::io(&path))?;
        Ok(path)
    }

    /// Writes the skip note `pod_<uid>_<container>.skip`: the init container `container_name`
    /// of the pod being restored from `checkpoint_ref` ran before that checkpoint, and the
    /// wrapper makes it exit 0 without running it (valid for `plan_ttl`).
    pub(super) fn write_skip(
        &self,
        pod_uid: &str,
        container_name: &str,
        checkpoint_ref: &str,
    ) -> Result<PathBuf> {
        let path = planfile::path_for_skip(&self.cfg.plans_dir, pod_uid, container_name)
            .ok_or_else(|| AgentError::Invalid("no skip note path for this pod".into()))?;
        private_dir(&self.cfg.plans_dir)?;
        planfile::write_skip(
            &path,
            &planfile::Skip {
                v: PROTOCOL_VERSION,
                checkpoint_ref: checkpoint_ref.to_owned(),
                expires_at_unix_ms: now_ms() + self.cfg.plan_ttl.as_millis() as u64,
            },
        )
        .map_err(AgentError::io(&path))?;
        Ok(path)
    }

    /// The plan for a container, from the plan files (the `restore_plan` request).
    pub fn plan_for(
        &self,
        container_id: &str,
        pod_uid: &str,
        container_name: &str,
    ) -> Option<Plan> {
        let candidates = [
            planfile::path_for_container(&self.cfg.plans_dir, container_id),
            planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name),
        ];
        candidates
            .into_iter()
            .flatten()
            .find_map(|p| planfile::read(&p).ok().flatten())
            .filter(|f| f.expires_at_unix_ms.is_none_or(|t| t > now_ms()))
            .map(|f| f.plan)
    }

    /// Forgets a pod container's restore: its plan files (consumed or not) and image dir.
    pub fn forget(&self, pod_uid: &str, container_name: &str) {
        if let Some(p) = planfile::path_for_pod(&self.cfg.plans_dir, pod_uid, container_name) {
            let _ = std::fs::remove_file(planfile::consumed_path(&p));
            let _ = std::fs::remove_file(p);
        }
        // A container running on a lazy restore's images: they go when its pages are in.
        if safe_component(pod_uid)
            && safe_component(container_name)
            && !self.release_lazy(pod_uid, container_name)
        {
            // Its images, and a lazy restore's work dir; each pod's directory once empty.
            for d in [self.pod_images(pod_uid), self.cfg.lazy_dir().join(pod_uid)] {
                let _ = std::fs::remove_dir_all(d.join(container_name));
                let _ = std::fs::remove_dir(d);
            }
        }
    }

    /// Removes consumed plans, and the plans and images of pods no longer on this node.
    pub fn sweep(&self, live_pod_uids: &HashSet<String>) {
        self.cancel_lazy_gone(live_pod_uids);
        self.release_holds_gone(live_pod_uids);
        self.members_settled(live_pod_uids);
        if let Ok(rd) = std::fs::read_dir(&self.cfg.plans_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let stale = name.ends_with(".consumed")
                    || name
                        .strip_prefix("pod_")
                        .and_then(|r| r.split('_').next())
                        .is_some_and(|uid| !live_pod_uids.contains(uid));
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.cfg.lazy_dir()) {
            for e in rd.flatten() {
                if !live_pod_uids.contains(e.file_name().to_string_lossy().as_ref()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.cfg.images_dir) {
            for e in rd.flatten() {
                let uid = e.file_name().to_string_lossy().into_owned();
                if !live_pod_uids.contains(&uid) {
                    info!(pod_uid = %uid, "removing the restore images of a pod no longer here");
                    let _ = std::fs::remove_dir_all(e.path());
                } else {
                    purge_kept_images(&e.path());
                }
            }
        }
    }
}

/// Removes everything but the reference and the restore-loop marker from the `.latest-*`
/// directories of a pod's images: the memory images that agents before the chunk cache kept
/// there for restarts in place.
fn purge_kept_images(pod_dir: &std::path::Path) {
    let Ok(rd) = std::fs::read_dir(pod_dir) else {
        return;
    };
    for kept in rd.flatten() {
        if !kept.file_name().to_string_lossy().starts_with(".latest-") {
            continue;
        }
        let Ok(inner) = std::fs::read_dir(kept.path()) else {
            continue;
        };
        for e in inner.flatten() {
            let name = e.file_name();
            if name == super::kept::KEPT_LATEST || name == super::kept::RESTORED_IN_PLACE {
                continue;
            }
            info!(path = %e.path().display(), "removing a memory image kept by an older agent");
            let p = e.path();
            let _ = if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::NotInPlace;
    use stasis_store::Key;
    use std::collections::HashSet;

    #[test]
    fn plans_are_found_swept_and_forgotten() {
        let t = tempfile::tempdir().unwrap();
        let rt = test_runtime();
        let exec = test_executor(t.path(), &rt, None, Key::random());
        private_dir(&exec.cfg.plans_dir).unwrap();
        let plan = |expires: u64| PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("live".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: t.path().join("images/live/app"),
                rootfs_method: None,
                checkpoint_ref: "l/1".into(),
                tcp_established: true,
                lazy: false,
                work_dir: None,
            },
            expires_at_unix_ms: Some(expires),
        };
        let live = planfile::path_for_pod(&exec.cfg.plans_dir, "live", "app").unwrap();
        planfile::write(&live, &plan(now_ms() + 60_000)).unwrap();
        assert_eq!(
            exec.plan_for("cid", "live", "app")
                .map(|p| p.checkpoint_ref),
            Some("l/1".into())
        );
        assert!(exec.plan_for("cid", "live", "other").is_none());
        // Expired plans are not offered.
        planfile::write(&live, &plan(1)).unwrap();
        assert!(exec.plan_for("cid", "live", "app").is_none());
        planfile::write(&live, &plan(now_ms() + 60_000)).unwrap();

        let gone = planfile::path_for_pod(&exec.cfg.plans_dir, "gone", "app").unwrap();
        planfile::write(&gone, &plan(now_ms() + 60_000)).unwrap();
        let consumed = exec.cfg.plans_dir.join("x.json.consumed");
        std::fs::write(&consumed, "{}").unwrap();
        for uid in ["live", "gone"] {
            std::fs::create_dir_all(exec.cfg.images_dir.join(uid).join("app")).unwrap();
        }
        exec.sweep(&HashSet::from(["live".to_owned()]));
        assert!(live.exists() && !gone.exists() && !consumed.exists());
        assert!(exec.cfg.images_dir.join("live/app").exists());
        assert!(!exec.cfg.images_dir.join("gone").exists());

        exec.forget("live", "app");
        assert!(!live.exists());
        assert!(!exec.cfg.images_dir.join("live").exists());
        // Unsafe names never reach the file system.
        exec.forget("../x", "app");
        assert!(!safe_component("../x") && !safe_component(".hidden") && safe_component("a-b_c.1"));

        // A restart in place: nothing kept is said as such, and a damaged record as damaged.
        assert!(matches!(
            exec.kept_for_restart("live", "app"),
            Err(NotInPlace::NothingKept)
        ));
        let kept = exec.kept_dir("live", "app").unwrap();
        std::fs::create_dir_all(&kept).unwrap();
        std::fs::write(kept.join(".stasis-latest.json"), b"{not json").unwrap();
        let e = exec.kept_for_restart("live", "app").unwrap_err();
        assert!(matches!(e, NotInPlace::Unreadable { .. }), "{e}");
        assert!(exec.kept_for_restart("../x", "app").is_err());
    }
}
