//! `why <pod>`: what stasis decided when the pod was created, the restore it made of it, and the
//! Events stasis's components wrote about it.

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::ResourceExt;
use serde::Serialize;
use stasis_api::names::{DECISION, DECISION_REASON, GENERATION, LINEAGE, RESTORE_FROM};
use stasis_api::PodRestore;

use crate::table::{human_duration, Table};
use crate::view::ms;

/// The admission decision of one pod and what followed it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Why {
    pub namespace: String,
    pub pod: String,
    pub runtime_class: Option<String>,
    /// `Restore`, `ColdStart`, or none (stasis did not decide: another RuntimeClass, or the
    /// webhook was not reached).
    pub decision: Option<String>,
    pub reason: Option<String>,
    pub restore_from: Option<String>,
    pub lineage: Option<String>,
    pub generation: Option<String>,
    pub restores: Vec<RestoreLine>,
    pub events: Vec<EventLine>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreLine {
    pub name: String,
    pub checkpoint: String,
    pub phase: Option<String>,
    pub node: Option<String>,
    pub message: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventLine {
    #[serde(rename = "type")]
    pub kind: String,
    pub reason: String,
    pub age_seconds: u64,
    pub from: String,
    pub message: String,
}

/// The component that wrote an Event (events.k8s.io's reporting controller, else the source).
fn component(e: &Event) -> String {
    e.reporting_component
        .clone()
        .filter(|c| !c.is_empty())
        .or_else(|| e.source.as_ref().and_then(|s| s.component.clone()))
        .unwrap_or_default()
}

/// When an Event last happened, Unix ms.
fn when(e: &Event) -> i64 {
    e.last_timestamp
        .as_ref()
        .or(e.first_timestamp.as_ref())
        .map(ms)
        .or_else(|| e.event_time.as_ref().map(|t| t.0.as_millisecond()))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(ms))
        .unwrap_or(0)
}

/// Builds the answer from the pod, the `PodRestore`s of its namespace and the pod's Events
/// (only those stasis's components wrote, oldest first).
pub fn why(pod: &Pod, restores: &[PodRestore], events: &[Event], now_ms: i64) -> Why {
    let ann = pod.annotations();
    let get = |k: &str| ann.get(k).filter(|v| !v.is_empty()).cloned();
    let mut evs: Vec<&Event> = events
        .iter()
        .filter(|e| component(e).starts_with("stasis"))
        .collect();
    evs.sort_by_key(|e| when(e));
    Why {
        namespace: pod.namespace().unwrap_or_default(),
        pod: pod.name_any(),
        runtime_class: pod.spec.as_ref().and_then(|s| s.runtime_class_name.clone()),
        decision: get(DECISION),
        reason: get(DECISION_REASON),
        restore_from: get(RESTORE_FROM),
        lineage: get(LINEAGE),
        generation: get(GENERATION),
        restores: restores
            .iter()
            .filter(|r| r.spec.target_pod_name == pod.name_any())
            .filter(|r| {
                r.spec.target_pod_uid.is_none() || r.spec.target_pod_uid == pod.metadata.uid
            })
            .map(|r| {
                let s = r.status.clone().unwrap_or_default();
                RestoreLine {
                    name: r.name_any(),
                    checkpoint: r.spec.checkpoint_ref.clone(),
                    phase: s.phase.map(|p| format!("{p:?}")),
                    node: s.node,
                    message: s.message,
                }
            })
            .collect(),
        events: evs
            .into_iter()
            .map(|e| EventLine {
                kind: e.type_.clone().unwrap_or_default(),
                reason: e.reason.clone().unwrap_or_default(),
                age_seconds: u64::try_from((now_ms - when(e)) / 1000).unwrap_or(0),
                from: component(e),
                message: e.message.clone().unwrap_or_default(),
            })
            .collect(),
    }
}

/// As `kubectl describe` prints: fields, then the restores and Events as tables.
pub fn render(w: &Why, runtime_class: &str) -> String {
    let mut out = String::new();
    let none = |v: &Option<String>| v.clone().unwrap_or_else(|| "<none>".into());
    let _ = writeln!(out, "Pod:            {}/{}", w.namespace, w.pod);
    let decision = match (&w.decision, w.runtime_class.as_deref()) {
        (Some(d), _) => d.clone(),
        (None, Some(rc)) if rc == runtime_class => {
            "<none> (the admission webhook did not decide: it was unreachable or failed, so the pod started as it was)".into()
        }
        (None, _) => format!("<none> (not opted in: runtimeClassName is not {runtime_class})"),
    };
    let _ = writeln!(out, "Decision:       {decision}");
    if w.decision.as_deref() == Some("ColdStart") || w.reason.is_some() {
        let _ = writeln!(out, "Reason:         {}", none(&w.reason));
    }
    if w.restore_from.is_some() {
        let _ = writeln!(out, "Restore from:   {}", none(&w.restore_from));
    }
    let _ = writeln!(out, "Lineage:        {}", none(&w.lineage));
    if w.generation.is_some() {
        let _ = writeln!(out, "Generation:     {}", none(&w.generation));
    }
    out.push_str("Restores:\n");
    if w.restores.is_empty() {
        out.push_str("  <none>\n");
    } else {
        let mut t = Table::new(&["name", "checkpoint", "phase", "node", "message"]);
        for r in &w.restores {
            t.row(vec![
                r.name.clone(),
                r.checkpoint.clone(),
                r.phase.clone().unwrap_or_default(),
                r.node.clone().unwrap_or_default(),
                r.message.clone().unwrap_or_default(),
            ]);
        }
        indent(&mut out, &t);
    }
    out.push_str("Events:\n");
    if w.events.is_empty() {
        out.push_str("  <none>\n");
    } else {
        let mut t = Table::new(&["type", "reason", "age", "from", "message"]);
        for e in &w.events {
            t.row(vec![
                e.kind.clone(),
                e.reason.clone(),
                human_duration(std::time::Duration::from_secs(e.age_seconds)),
                e.from.clone(),
                e.message.clone(),
            ]);
        }
        indent(&mut out, &t);
    }
    out
}

fn indent(out: &mut String, t: &Table) {
    for line in t.render().lines() {
        let _ = writeln!(out, "  {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_stasis_events_of_the_pod_and_its_own_restores_are_shown() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-2", "namespace": "prod", "uid": "u2", "annotations": {
                "stasis.dev/decision": "ColdStart",
                "stasis.dev/decision-reason": "pod spec differs from the checkpoint's in security-relevant fields"}},
            "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c"}]},
        }))
        .unwrap();
        let ev = |reason: &str, comp: &str, at: &str| -> Event {
            serde_json::from_value(json!({"metadata": {"name": reason}, "involvedObject": {},
                "type": "Normal", "reason": reason, "message": reason, "source": {"component": comp},
                "lastTimestamp": at}))
            .unwrap()
        };
        let events = [
            ev("Scheduled", "default-scheduler", "2026-12-01T10:00:00Z"),
            ev("ColdStart", "stasis-controller", "2026-12-01T10:00:02Z"),
            ev("Noted", "stasisd", "2026-12-01T10:00:01Z"),
        ];
        let pr = |name: &str, target: &str, uid: Option<&str>| -> PodRestore {
            serde_json::from_value(json!({"apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": name}, "spec": {"checkpointRef": "L/1", "targetPodName": target,
                "targetPodUID": uid}})).unwrap()
        };
        let restores = [
            pr("a", "web-2", None),
            pr("b", "web-2", Some("u1")),
            pr("c", "web-3", None),
        ];
        let now = k8s_openapi::jiff::Timestamp::from_second(1_796_119_210)
            .unwrap()
            .as_millisecond();
        let w = why(&pod, &restores, &events, now);
        assert_eq!(w.decision.as_deref(), Some("ColdStart"));
        let reasons: Vec<_> = w.events.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["Noted", "ColdStart"],
            "stasis's Events only, oldest first"
        );
        assert_eq!(
            w.restores.len(),
            1,
            "an earlier pod's restore (another UID) is not this pod's"
        );
        let text = render(&w, "stasis");
        assert!(text.contains("Reason:         pod spec differs"), "{text}");
        assert!(text.contains("  TYPE     REASON"), "{text}");
    }

    #[test]
    fn no_decision_is_explained() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "n"},
            "spec": {"containers": [{"name": "c"}]}}))
        .unwrap();
        let text = render(&why(&pod, &[], &[], 0), "stasis");
        assert!(
            text.contains("not opted in: runtimeClassName is not stasis"),
            "{text}"
        );
    }
}
