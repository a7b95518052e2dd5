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
                expires_at_unix_ms: Some(now_ms() + self.cfg.plan_ttl.as_millis() as u64),
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
            let _ = std::fs::remove_file(&p);
            let mut c = p.into_os_string();
            c.push(".consumed");
            let _ = std::fs::remove_file(PathBuf::from(c));
        }
        if safe_component(pod_uid) && safe_component(container_name) {
            let d = self.pod_images(pod_uid);
            let _ = std::fs::remove_dir_all(d.join(container_name));
            let _ = std::fs::remove_dir(d);
        }
    }

    /// Removes consumed plans, and the plans and images of pods no longer on this node.
    pub fn sweep(&self, live_pod_uids: &HashSet<String>) {
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
        if let Ok(rd) = std::fs::read_dir(&self.cfg.images_dir) {
            for e in rd.flatten() {
                let uid = e.file_name().to_string_lossy().into_owned();
                if !live_pod_uids.contains(&uid) {
                    info!(pod_uid = %uid, "removing the restore images of a pod no longer here");
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::NotInPlace;
    use crate::metrics::Metrics;
    use stasis_store::{Key, Store};
    use std::collections::HashSet;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn plans_are_found_swept_and_forgotten() {
        let t = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let exec = Executor::new(
            ExecutorConfig {
                runc_root: t.path().join("runc"),
                work_dir: t.path().join("work"),
                images_dir: t.path().join("images"),
                plans_dir: t.path().join("plans"),
                node_name: "n".into(),
                plan_ttl: Duration::from_secs(60),
                tcp_established: true,
                keep_latest: true,
            },
            Arc::new(Store::open(&format!("file://{}", t.path().join("store").display())).unwrap()),
            Arc::new(StaticKey(Key::random())),
            rt.handle().clone(),
            Arc::new(Metrics::default()),
        );
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
            exec.plan_in_place("live", "app"),
            Err(NotInPlace::NothingKept)
        ));
        let kept = exec.kept_dir("live", "app").unwrap();
        std::fs::create_dir_all(&kept).unwrap();
        std::fs::write(kept.join(".stasis-latest.json"), b"{not json").unwrap();
        let e = exec.plan_in_place("live", "app").unwrap_err();
        assert!(matches!(e, NotInPlace::Unreadable { .. }), "{e}");
        assert!(exec.plan_in_place("../x", "app").is_err());
    }
}
