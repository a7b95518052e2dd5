//! What the agent writes to the API server: `PodCheckpoint` / `PodRestore` statuses, pod
//! Events, the records of checkpoints it starts itself.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use k8s_openapi::NamespaceResourceScope;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Resource;
use stasis_api::{PodCheckpoint, PodCheckpointSpec, PodRestore};
use tracing::warn;

use super::{KubeCluster, MANAGER};
use crate::fence::Stamp;
use crate::node::PodInfo;
use crate::status::{self, PodKey};
use stasis_api::names;

/// Creates as [`MANAGER`] (the field manager of every object the agent writes).
pub(crate) fn created_by_agent() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.to_owned()),
        ..Default::default()
    }
}

impl KubeCluster {
    pub(crate) async fn emit(&self, pod: &PodKey, reason: &str, message: &str, warning: bool) {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &pod.namespace);
        let ev = status::pod_event(pod, reason, message, warning, &self.node, status::now());
        if let Err(e) = api.create(&created_by_agent(), &ev).await {
            warn!(pod = %pod.name, %reason, error = %e, "cannot create an Event");
            self.exec.metrics.error("kube");
        }
    }

    /// Writes the status of a `K` by server-side apply as [`MANAGER`]: the fields the agent
    /// sets are its own, so the controller's writes to others (its `Failed` on a timeout) are
    /// merged, not overwritten, and `kubectl get --show-managed-fields` says who wrote what.
    /// Forced: the agent is the authority on the status of the work it runs.
    async fn apply_status<K>(&self, ns: &str, name: &str, s: &impl serde::Serialize)
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), ns);
        let patch = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "status": s,
        });
        let params = PatchParams::apply(MANAGER).force();
        if let Err(e) = api.patch_status(name, &params, &Patch::Apply(&patch)).await {
            warn!(kind = %K::kind(&()), %name, error = %e, "cannot update a status");
            self.exec.metrics.error("kube");
        }
    }

    pub(crate) async fn patch_ckpt_status(
        &self,
        ns: &str,
        name: &str,
        s: &stasis_api::PodCheckpointStatus,
    ) {
        self.apply_status::<PodCheckpoint>(ns, name, s).await
    }

    pub(crate) async fn patch_restore_status(
        &self,
        ns: &str,
        name: &str,
        s: &stasis_api::PodRestoreStatus,
    ) {
        self.apply_status::<PodRestore>(ns, name, s).await
    }

    /// The `PodRestore` of a pod (by `spec.targetPodName`, the target UID when set), newest.
    pub(crate) async fn restore_of(&self, pod: &PodKey) -> Option<PodRestore> {
        let api: Api<PodRestore> = Api::namespaced(self.client.clone(), &pod.namespace);
        let lp = ListParams::default().fields(&format!("spec.targetPodName={}", pod.name));
        let list = match api.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                warn!(pod = %pod.name, error = %e, "cannot list PodRestores");
                return None;
            }
        };
        list.into_iter()
            .filter(|r| {
                r.spec
                    .target_pod_uid
                    .as_deref()
                    .is_none_or(|u| u == pod.uid)
            })
            .max_by(|a, b| {
                a.metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|t| t.0)
                    .cmp(&b.metadata.creation_timestamp.as_ref().map(|t| t.0))
            })
    }

    pub(crate) async fn create_final_record(
        &self,
        pod: &PodInfo,
        stamp: &Stamp,
        timeout: Duration,
    ) -> Option<String> {
        let api: Api<PodCheckpoint> = Api::namespaced(self.client.clone(), &pod.key.namespace);
        let base: String = pod.key.name.chars().take(200).collect();
        let name = format!("{base}-final-{:08x}", rand::random::<u32>());
        let mut c = PodCheckpoint::new(
            &name,
            PodCheckpointSpec {
                source_pod_name: pod.key.name.clone(),
                source_pod_uid: Some(pod.key.uid.clone()),
                reason: stasis_api::CheckpointReason::Termination,
                timeout_seconds: Some(timeout.as_secs().max(1) as i32),
            },
        );
        c.metadata.labels = Some(BTreeMap::from([
            (names::CREATED_BY.to_owned(), MANAGER.to_owned()),
            // (the API server lets an agent create it only for its own node)
            (names::NODE.to_owned(), self.node.clone()),
        ]));
        match api.create(&created_by_agent(), &c).await {
            Ok(_) => {
                let s = status::checkpoint_running(
                    &Default::default(),
                    &self.node,
                    &pod.key.uid,
                    stamp,
                    status::now(),
                );
                self.patch_ckpt_status(&pod.key.namespace, &name, &s).await;
                Some(name)
            }
            Err(e) => {
                warn!(pod = %pod.key.name, error = %e, "cannot record the termination checkpoint");
                None
            }
        }
    }
}
