//! A pod restored from one checkpoint stays in step: when one of its containers starts cold
//! (its plan refused, its `runc restore` failed, its lazily restored memory could not arrive)
//! after its peers were restored, they would run from the checkpoint beside a member that
//! starts over, out of step (design §12.3a). So the peers restored so far are stopped (the
//! kubelet restarts them, and their creates find no plan: cold) and the plans of the peers not
//! yet created are withdrawn: every container of the pod starts cold together.
//!
//! What is kept is in memory: an agent restarted between two members' creates forgets it, and
//! the pod then runs as before this check (the member starts cold on its own).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use stasis_engine::runc::Runc;
use tracing::warn;

use super::Executor;

/// The pod restores of several containers this agent prepared, by pod UID, until every
/// member is restored and none is still served lazily.
#[derive(Default)]
pub(super) struct PodRestores(Mutex<HashMap<String, Members>>);

struct Members {
    /// Every container the restore holds.
    all: Vec<String>,
    /// Those restored so far: name → container id.
    restored: BTreeMap<String, String>,
}

impl PodRestores {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Members>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What one member's cold start did to the rest of its pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutOfStep {
    /// The member that starts cold.
    pub cold: String,
    /// Restored peers stopped (by name), so that the kubelet starts them again, cold.
    pub stopped: Vec<String>,
    /// Peers not created yet whose plans were withdrawn: they start cold.
    pub withdrawn: Vec<String>,
    /// Restored peers that could not be stopped, with why: they run on from the checkpoint.
    pub not_stopped: Vec<(String, String)>,
}

impl OutOfStep {
    /// What happened, for the pod's Event.
    pub fn message(&self) -> String {
        let mut m = format!(
            "container {} could not be restored, so the whole pod starts cold to stay consistent",
            self.cold
        );
        if !self.stopped.is_empty() {
            m.push_str(&format!(
                "; its restored containers {} were stopped and start again cold",
                self.stopped.join(", ")
            ));
        }
        if !self.withdrawn.is_empty() {
            m.push_str(&format!(
                "; {} will start cold instead of restoring",
                self.withdrawn.join(", ")
            ));
        }
        for (name, why) in &self.not_stopped {
            m.push_str(&format!(
                "; container {name} could not be stopped ({why}) and runs on from the checkpoint: delete the pod to start it whole"
            ));
        }
        m
    }
}

impl Executor {
    /// A restore of `members` was prepared for a pod: kept while some are not restored.
    pub(super) fn restoring_members(&self, pod_uid: &str, members: &[&str]) {
        let mut map = self.in_step.lock();
        if members.len() < 2 {
            map.remove(pod_uid);
            return;
        }
        map.insert(
            pod_uid.to_owned(),
            Members {
                all: members.iter().map(|m| m.to_string()).collect(),
                restored: BTreeMap::new(),
            },
        );
    }

    /// A member of a pod restore was restored as container `container_id`.
    pub fn member_restored(&self, pod_uid: &str, container_name: &str, container_id: &str) {
        if let Some(m) = self.in_step.lock().get_mut(pod_uid) {
            if m.all.iter().any(|n| n == container_name) {
                m.restored
                    .insert(container_name.to_owned(), container_id.to_owned());
            }
        }
    }

    /// A member of a pod restore starts cold: stops its restored peers and withdraws the
    /// plans of the others. `None` when the container is not a member of a restore this agent
    /// holds. In a pod that never restarts its containers the stopped peers stay ended (native
    /// sidecars excepted, which the kubelet always restarts): the pod then fails as a whole
    /// and its owner replaces it, rather than running on half restored.
    pub fn member_cold(&self, pod_uid: &str, container_name: &str) -> Option<OutOfStep> {
        let members = {
            let mut map = self.in_step.lock();
            if !map
                .get(pod_uid)
                .is_some_and(|m| m.all.iter().any(|n| n == container_name))
            {
                return None;
            }
            map.remove(pod_uid)?
        };
        let mut out = OutOfStep {
            cold: container_name.to_owned(),
            ..Default::default()
        };
        let to_stop: Vec<(String, String)> = members
            .restored
            .into_iter()
            .filter(|(name, _)| name != container_name)
            .collect();
        for name in &members.all {
            if name != container_name && !to_stop.iter().any(|(n, _)| n == name) {
                self.forget(pod_uid, name);
                out.withdrawn.push(name.clone());
            }
        }
        let runc = Runc::new(Some(&self.cfg.runc_root));
        for (name, id) in to_stop {
            match runc
                .as_ref()
                .map_err(|e| e.to_string())
                .and_then(|r| r.kill(&id).map_err(|e| e.to_string()))
            {
                Ok(()) => out.stopped.push(name),
                Err(why) => {
                    warn!(pod_uid, container = %name, %why, "could not stop a restored container");
                    out.not_stopped.push((name, why));
                }
            }
        }
        self.metrics.restore("out_of_step");
        Some(out)
    }

    /// Drops the pod restores that are over: the pod left the node, or every member is
    /// restored and none is served lazily any more (a lazy restore can still fail).
    pub(super) fn members_settled(&self, live_pod_uids: &HashSet<String>) {
        self.in_step.lock().retain(|uid, m| {
            live_pod_uids.contains(uid)
                && (m.restored.len() < m.all.len()
                    || m.all.iter().any(|name| self.lazy.serves(uid, name)))
        });
    }
}
