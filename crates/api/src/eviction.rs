//! The `Eviction` of Kubernetes' EvictionRequest API (`lifecycle.k8s.io/v1alpha1`, KEP-4563,
//! alpha in 1.37 behind the `EvictionRequestAPI` gate), hand-written: k8s-openapi has no
//! `lifecycle` group. Only what a responder reads and writes; unknown fields are ignored on read
//! and never written (a responder patches only its own `status.responders[]` entry).
//!
//! Read from Kubernetes v1.37.2: `staging/src/k8s.io/api/lifecycle/v1alpha1/types.go` (the
//! fields and who sets them) and `pkg/apis/lifecycle/validation/validation.go` (the rules the
//! API server enforces on a status update):
//!
//! - a requester creates an `EvictionRequest` (target pod name + UID, `requester`, `intent:
//!   Eviction`); the evictionrequest-controller turns the requests of one target into an
//!   `Eviction`, copies the pod's `spec.evictionResponders` into `status.targetResponders` (plus
//!   the default `imperative-eviction.k8s.io/evictor` at priority 100), labels the `Eviction` with
//!   each responder's name as a key (value `responder`), and makes one responder at a time
//!   `Active`, highest priority first, setting its `status.responders[].startTime`;
//! - the `Active` responder reports in its own `status.responders[]` entry: `heartbeatTime` (the
//!   present time, ±30 s; never decreasing; at most every 20 s), `expectedCompletionTime`
//!   (optional, not in the past), `message` (≤ 4000 characters), and `completionTime` (the
//!   present time, once, immutable) when it has finished, successfully or not. Only the `Active`
//!   responder's entry may change; a responder that reports nothing for 20 minutes is
//!   `Interrupted` and the next one runs;
//! - with `completionTime` set the controller marks it `Completed` and activates the next: in the
//!   end the imperative evictor, which calls `pods/<name>/eviction`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use serde::{Deserialize, Serialize};

/// The API group, version and resource.
pub const GROUP: &str = "lifecycle.k8s.io";
pub const VERSION: &str = "v1alpha1";
pub const PLURAL: &str = "evictions";

/// stasis's responder name: the key of its `spec.evictionResponders` entry, of its
/// `status.targetResponders` / `status.responders` entries, and of the label the controller puts
/// on the `Eviction`.
pub const RESPONDER: &str = "stasis.dev/checkpoint";
/// Its priority: the lowest a responder outside `*.k8s.io` may have (0–999 are reserved for
/// those), so that stasis runs after every other responder (a managing controller registers at
/// 10000) and just before the imperative evictor (100): the final checkpoint is then as recent as
/// it can be when the pod ends.
pub const RESPONDER_PRIORITY: i32 = 1000;
/// The most entries a pod's `spec.evictionResponders` may have.
pub const MAX_POD_RESPONDERS: usize = 10;
/// A responder's heartbeats should be at least this far apart (the API's ask).
pub const HEARTBEAT_MIN_INTERVAL_SECS: u64 = 20;
/// With no report for this long the controller interrupts the responder and moves on.
pub const HEARTBEAT_DEADLINE_SECS: u64 = 20 * 60;
/// `status.responders[].message` is at most this long.
pub const MESSAGE_MAX: usize = 4000;

/// `lifecycle.k8s.io/v1alpha1` `Eviction`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Eviction {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: EvictionSpec,
    #[serde(default)]
    pub status: EvictionStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvictionSpec {
    #[serde(default)]
    pub target: EvictionTarget,
}

/// A union: only `pod` exists in v1alpha1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvictionTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodReference>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PodReference {
    pub name: String,
    pub uid: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EvictionStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_responders: Vec<TargetResponder>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub responders: Vec<ResponderStatus>,
}

/// A responder as the controller assigns it (`status.targetResponders[]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TargetResponder {
    pub name: String,
    #[serde(default)]
    pub priority: Option<i32>,
    /// `Inactive`, `Active`, `Interrupted`, `Canceled` or `Completed`.
    #[serde(default)]
    pub state: String,
}

/// A responder's own report (`status.responders[]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResponderStatus {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_completion_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `status.targetResponders[].state`.
pub mod state {
    pub const INACTIVE: &str = "Inactive";
    pub const ACTIVE: &str = "Active";
    pub const INTERRUPTED: &str = "Interrupted";
    pub const CANCELED: &str = "Canceled";
    pub const COMPLETED: &str = "Completed";
}

impl kube::Resource for Eviction {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "Eviction".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Where a responder stands in an `Eviction`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Turn {
    /// Not among the `Eviction`'s responders (the pod did not name it), or the target is not a
    /// pod.
    NotNamed,
    /// Named, not (or no longer) its turn: the state the controller gave it.
    NotActive(String),
    /// Its turn, and it has not reported its completion.
    Active,
    /// It reported its completion.
    Completed,
}

impl Eviction {
    /// The pod this `Eviction` targets.
    pub fn target_pod(&self) -> Option<&PodReference> {
        self.spec.target.pod.as_ref()
    }

    /// `responder`'s own report, if the controller has made its entry.
    pub fn responder_status(&self, responder: &str) -> Option<&ResponderStatus> {
        self.status.responders.iter().find(|r| r.name == responder)
    }

    /// Where `responder` stands. `Active` needs the controller's `startTime` as well (the API
    /// refuses a report before it).
    pub fn turn(&self, responder: &str) -> Turn {
        let Some(t) = self
            .status
            .target_responders
            .iter()
            .find(|t| t.name == responder)
            .filter(|_| self.target_pod().is_some())
        else {
            return Turn::NotNamed;
        };
        let own = self.responder_status(responder);
        if own.is_some_and(|s| s.completion_time.is_some()) {
            return Turn::Completed;
        }
        if t.state == state::ACTIVE && own.is_some_and(|s| s.start_time.is_some()) {
            Turn::Active
        } else {
            Turn::NotActive(t.state.clone())
        }
    }
}

/// The strategic-merge patch of `status` that sets `responder`'s own entry (merged by `name`,
/// the list's key): only the fields given are written.
pub fn responder_patch(report: &ResponderStatus) -> serde_json::Value {
    let mut r = report.clone();
    if let Some(m) = &mut r.message {
        if m.len() > MESSAGE_MAX {
            let mut end = MESSAGE_MAX;
            while !m.is_char_boundary(end) {
                end -= 1;
            }
            m.truncate(end);
        }
    }
    serde_json::json!({"status": {"responders": [r]}})
}

/// The `spec.evictionResponders` entry a pod names stasis with.
pub fn pod_responder_entry() -> serde_json::Value {
    serde_json::json!({"name": RESPONDER, "priority": RESPONDER_PRIORITY})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An `Eviction` as the API server serves it (the shape of types.go's JSON tags).
    fn eviction(state: &str, own: serde_json::Value) -> Eviction {
        serde_json::from_value(json!({
            "apiVersion": "lifecycle.k8s.io/v1alpha1", "kind": "Eviction",
            "metadata": {"name": "e1", "namespace": "ns", "labels": {RESPONDER: "responder"}},
            "spec": {"target": {"pod": {"name": "p", "uid": "u1"}}},
            "status": {
                "requesters": [{"name": "acme.io/drain", "intent": "Eviction"}],
                "targetResponders": [
                    {"name": RESPONDER, "priority": 1000, "state": state},
                    {"name": "imperative-eviction.k8s.io/evictor", "priority": 100, "state": "Inactive"}],
                "responders": [own, {"name": "imperative-eviction.k8s.io/evictor"}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn a_responder_acts_only_when_active_and_started() {
        let started = json!({"name": RESPONDER, "startTime": "2026-12-02T05:00:00Z"});
        assert_eq!(
            eviction("Active", started.clone()).turn(RESPONDER),
            Turn::Active
        );
        assert_eq!(
            eviction("Active", json!({"name": RESPONDER})).turn(RESPONDER),
            Turn::NotActive("Active".into()),
            "no startTime yet: a report would be refused"
        );
        assert_eq!(
            eviction("Inactive", json!({"name": RESPONDER})).turn(RESPONDER),
            Turn::NotActive("Inactive".into())
        );
        assert_eq!(
            eviction("Canceled", started.clone()).turn(RESPONDER),
            Turn::NotActive("Canceled".into())
        );
        let done = json!({"name": RESPONDER, "startTime": "2026-12-02T05:00:00Z",
                          "completionTime": "2026-12-02T05:00:09Z"});
        assert_eq!(
            eviction("Active", done.clone()).turn(RESPONDER),
            Turn::Completed
        );
        assert_eq!(eviction("Completed", done).turn(RESPONDER), Turn::Completed);
        assert_eq!(
            eviction("Active", started).turn("acme.io/other"),
            Turn::NotNamed
        );
        let mut no_pod = eviction("Active", json!({"name": RESPONDER}));
        no_pod.spec.target.pod = None;
        assert_eq!(no_pod.turn(RESPONDER), Turn::NotNamed);
    }

    #[test]
    fn the_patch_writes_only_the_responders_own_fields() {
        let long = "é".repeat(MESSAGE_MAX);
        let p = responder_patch(&ResponderStatus {
            name: RESPONDER.into(),
            heartbeat_time: Some(Time("2026-12-02T05:00:20Z".parse().unwrap())),
            message: Some(long),
            ..Default::default()
        });
        let r = &p["status"]["responders"][0];
        assert_eq!(r["name"], RESPONDER);
        assert_eq!(r["heartbeatTime"], "2026-12-02T05:00:20Z");
        assert!(r.get("startTime").is_none() && r.get("completionTime").is_none());
        assert!(r["message"].as_str().unwrap().len() <= MESSAGE_MAX);
        assert_eq!(p["status"].as_object().unwrap().len(), 1);
    }
}
