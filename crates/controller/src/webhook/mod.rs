//! The mutating admission webhook (`POST /mutate`): the restore decision for a new pod with
//! `runtimeClassName: stasis` (DESIGN §3 "Restore", docs/design.md §10.8, §13.3).
//!
//! It never refuses a pod: every failure is logged and answered with "allowed" (the pod starts
//! cold), and the chart registers it with `failurePolicy: Ignore`. Whatever the outcome, the
//! `stasis.dev/` labels and annotations only stasis may write are removed from the pod
//! ([`patch::is_reserved`]).
//!
//! The request itself is not authenticated (docs/design.md §13.3), so the webhook writes
//! nothing: it claims and decides in memory ([`crate::claim`], `Mode::Predict`) and its answer
//! is a prediction, which the controller commits against the real pod once it exists. The
//! pod's owners are read from the API server and must have the UIDs the owner references name
//! ([`verified_identity`]), or the answer names no lineage.

mod decide;
mod identity;
pub mod patch;
mod placement;
mod requester;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ApiResource, ListParams, PostParams};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use stasis_api::names;
use stasis_api::{pod as podfacts, CheckpointPolicy};
use stasis_core::decision::{decide, Decision, Requester};
use stasis_core::workload::{check_owner, OwnerFacts, ReplicaSetOwner, WorkloadIdentity};

use crate::claim::{claim_and_decide, restore_inputs, Claimed, Mode, Stores};
use crate::metrics::Metrics;
use crate::record::Records;
use crate::schedule::policy_for;
use crate::{Error, Result};
use patch::{patch, Mutation, RestoreMutation, WaitConfig};

pub use identity::verified_identity;
#[allow(unused_imports)]
use {decide::*, identity::*, placement::*, requester::*};

/// Settings of the webhook.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub runtime_class: String,
    pub wait: WaitConfig,
    /// Longest time an admission waits for a source's in-flight final checkpoint (kept under
    /// the webhook's `timeoutSeconds`); after it, the claim goes ahead and fences a late one.
    pub final_wait: Duration,
    /// A claim whose pod has not appeared after this long is released.
    pub phantom_after: Duration,
    /// The nodes that pre-stage each at-risk pod's checkpoint (the agents' `k`): a restoring
    /// pod prefers them. 0: no preference.
    pub prestage_receivers: usize,
}

/// What the webhook needs.
pub struct Webhook {
    pub client: Client,
    pub records: Records,
    /// The process's `PodCheckpoint` cache ([`crate::cache::Checkpoints::watch`]).
    pub checkpoints: crate::cache::Checkpoints,
    /// The process's lineage record cache (`None`: read from the API server per admission, as
    /// in tests).
    pub record_index: Option<crate::cache::RecordIndex>,
    /// The process's `CheckpointPolicy` cache (`None`: listed per admission, as in tests).
    pub policies: Option<kube::runtime::reflector::Store<CheckpointPolicy>>,
    /// The process's Node cache, for the nodes a restoring pod prefers (`None`: no preference).
    pub nodes: Option<kube::runtime::reflector::Store<Node>>,
    /// The process's cache of owners' metadata, asked before the API server (`None`: every
    /// owner read from the API server, as in tests).
    pub owners: Option<crate::owners::OwnerCache>,
    pub metrics: Metrics,
    pub cfg: WebhookConfig,
}

/// How long an admission may wait for a final checkpoint: the configured wait, and at most the
/// API server's own timeout for this call (its `?timeout=` query parameter, e.g. `10s`) less
/// 3 s for the rest of the decision, so the answer always comes before the API server gives up.
pub fn final_wait_budget(configured: Duration, query: Option<&str>) -> Duration {
    let timeout = query
        .into_iter()
        .flat_map(|q| form_urlencoded::parse(q.as_bytes()))
        .find_map(|(k, v)| (k == "timeout").then_some(v))
        .and_then(|t| stasis_core::policy::parse_duration(&t).ok());
    match timeout {
        Some(t) => configured.min(t.saturating_sub(Duration::from_secs(3))),
        None => configured,
    }
}

/// Answers one AdmissionReview (the request body) with an AdmissionReview; `final_wait` is
/// [`final_wait_budget`].
pub async fn review(hook: Arc<Webhook>, body: &[u8], final_wait: Duration) -> Vec<u8> {
    let review: AdmissionReview<Pod> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return serde_json::to_vec(&AdmissionResponse::invalid(e).into_review())
                .unwrap_or_default()
        }
    };
    let req: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(e) => {
            return serde_json::to_vec(&AdmissionResponse::invalid(e).into_review())
                .unwrap_or_default()
        }
    };
    let mut resp = AdmissionResponse::from(&req);
    let ops = match mutate(&hook, &req, final_wait).await {
        Ok(ops) => ops,
        Err(e) => {
            hook.metrics.admitted("Error", e.metric_label());
            tracing::warn!(error = %e, namespace = ?req.namespace, "restore decision failed: pod admitted without stasis's keys (cold start)");
            // Still without user-supplied stasis keys: a cold start, nothing else.
            stasis_pod(&hook.cfg, &req).map(|p| patch(p, &Mutation::default()))
        }
    };
    if let Some(ops) = ops.filter(|o| o.as_array().is_some_and(|a| !a.is_empty())) {
        match serde_json::from_value::<json_patch::Patch>(ops) {
            Ok(p) => match resp.clone().with_patch(p) {
                Ok(r) => resp = r,
                Err(e) => {
                    tracing::warn!(error = %e, "patch not serialisable: pod admitted unchanged")
                }
            },
            Err(e) => tracing::warn!(error = %e, "patch invalid: pod admitted unchanged"),
        }
    }
    let review: AdmissionReview<DynamicObject> = resp.into_review();
    serde_json::to_vec(&review).unwrap_or_default()
}

/// The pod of a request that is stasis's concern: the creation of a pod of its RuntimeClass.
fn stasis_pod<'a>(cfg: &WebhookConfig, req: &'a AdmissionRequest<Pod>) -> Option<&'a Pod> {
    let pod = req.object.as_ref()?;
    let class = pod.spec.as_ref()?.runtime_class_name.as_deref();
    (req.operation == Operation::Create && class == Some(cfg.runtime_class.as_str())).then_some(pod)
}
