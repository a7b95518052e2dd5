//! The webhook's pure part: the JSONPatch that records a decision in the pod and, for a restore, makes the pod wait for its archive outside the CRI call path
//! (docs/design.md §13.3).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, EnvVar, EnvVarSource, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector, Pod, PreferredSchedulingTerm,
    ResourceRequirements, SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};
use stasis_api::names;

/// The only key of that domain a user may set on a pod: it can only force a cold start.
pub const USER_KEYS: &[&str] = &[names::COLD_START];

/// A `stasis.dev/` label or annotation only stasis may set on a pod (the claim token, lineage,
/// generation, decision and the rest the controller and the agents read): the webhook removes
/// it from every pod it sees created, the chart's ValidatingAdmissionPolicy refuses changes to
/// it by anyone but stasis (docs/design.md §13.3). `declare.stasis.dev/` keys are the user's.
pub fn is_reserved(key: &str) -> bool {
    key.starts_with(names::PREFIX) && !USER_KEYS.contains(&key)
}

/// How the injected wait container is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitConfig {
    /// Image holding `stasis-controller`.
    pub image: String,
    /// Path of `stasis-controller` in that image.
    pub command: String,
    /// Base URL of the controller's status endpoint (its Service, plain HTTP: the answer is a
    /// phase, nothing secret), e.g. `http://stasis-controller.stasis-system.svc:8080`.
    pub status_url: String,
    /// Longest wait; then the pod starts cold.
    pub timeout_seconds: u64,
}

/// The init container that waits until the restore is ready on the node (the `PodRestore`'s
/// phase, which the node's agent sets), failed, or past the timeout: then a cold start. It
/// needs no API credentials, no host path and no privileges: it asks the controller's status
/// endpoint (`GET <status_url>/v1/restores/<namespace>/<pod>/<uid>`), naming itself through
/// the downward API (its UID is what the endpoint answers to).
pub fn wait_container(cfg: &WaitConfig) -> Container {
    let field = |path: &str| EnvVarSource {
        field_ref: Some(ObjectFieldSelector {
            field_path: path.to_owned(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let env = |name: &str, from: Option<EnvVarSource>, value: Option<String>| EnvVar {
        name: name.to_owned(),
        value,
        value_from: from,
    };
    let q = |s: &str| Quantity(s.to_owned());
    Container {
        name: stasis_api::pod::RESTORE_WAIT_CONTAINER.to_owned(),
        image: Some(cfg.image.clone()),
        image_pull_policy: Some("IfNotPresent".to_owned()),
        command: Some(vec![cfg.command.clone()]),
        args: Some(vec![
            "wait-restore".to_owned(),
            "--timeout-seconds".to_owned(),
            cfg.timeout_seconds.to_string(),
        ]),
        env: Some(vec![
            env("STASIS_POD_NAME", Some(field("metadata.name")), None),
            env(
                "STASIS_POD_NAMESPACE",
                Some(field("metadata.namespace")),
                None,
            ),
            // The status endpoint answers only to the pod's UID (docs/design.md §13.4).
            env("STASIS_POD_UID", Some(field("metadata.uid")), None),
            env("STASIS_STATUS_URL", None, Some(cfg.status_url.clone())),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), q("10m")),
                ("memory".to_owned(), q("16Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".to_owned(), q("64Mi"))])),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Default::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod's affinity with `requirements` added to its required node affinity: appended to
/// every existing term (terms are ORed, expressions within one ANDed), or one new term.
pub fn with_node_requirements(
    existing: Option<&Affinity>,
    requirements: &[(String, Vec<String>)],
) -> Affinity {
    let exprs: Vec<NodeSelectorRequirement> = requirements
        .iter()
        .map(|(k, v)| NodeSelectorRequirement {
            key: k.clone(),
            operator: "In".to_owned(),
            values: Some(v.clone()),
        })
        .collect();
    let mut affinity = existing.cloned().unwrap_or_default();
    let node = affinity
        .node_affinity
        .get_or_insert_with(NodeAffinity::default);
    let required = node
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(|| NodeSelector {
            node_selector_terms: Vec::new(),
        });
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    for term in &mut required.node_selector_terms {
        term.match_expressions
            .get_or_insert_with(Vec::new)
            .extend(exprs.iter().cloned());
    }
    affinity
}

/// The weight of the preference for the nodes that pre-staged a pod's checkpoint: the highest
/// the scheduler takes, since a restore from the node's cache is what a replacement gains most.
pub const PRESTAGED_WEIGHT: i32 = 100;

/// `affinity` with one preferred node-affinity term more: the nodes `names` (by
/// `metadata.name`), at [`PRESTAGED_WEIGHT`]; unchanged when `names` is empty.
pub fn with_preferred_nodes(mut affinity: Affinity, names: &[String]) -> Affinity {
    if names.is_empty() {
        return affinity;
    }
    affinity
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .preferred_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new)
        .push(PreferredSchedulingTerm {
            weight: PRESTAGED_WEIGHT,
            preference: NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".to_owned(),
                    operator: "In".to_owned(),
                    values: Some(names.to_vec()),
                }]),
                ..Default::default()
            },
        });
    affinity
}

/// What the webhook does to a pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mutation {
    /// Annotations to set (the decision, the lineage, the claim token).
    pub annotations: BTreeMap<String, String>,
    /// Labels to set (the claim token, so the pod is found by it).
    pub labels: BTreeMap<String, String>,
    /// For a restore: node requirements and the wait container.
    pub restore: Option<RestoreMutation>,
}

/// The restore part of a [`Mutation`].
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreMutation {
    /// Node labels the target node must have (`key In values`).
    pub node_requirements: Vec<(String, Vec<String>)>,
    /// Nodes to prefer (they pre-staged the checkpoint): one preferred term, by node name.
    pub prefer_nodes: Vec<String>,
    pub wait: WaitConfig,
}

/// RFC 6901 escaping of one path segment.
fn escape(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

fn add(path: String, value: Value) -> Value {
    json!({"op": "add", "path": path, "value": value})
}

/// `remove` operations for the reserved keys ([`is_reserved`]) of `existing` that `entries`
/// does not set anyway.
fn strip_ops(
    ops: &mut Vec<Value>,
    existing: Option<&BTreeMap<String, String>>,
    base: &str,
    entries: &BTreeMap<String, String>,
) {
    for k in existing.into_iter().flat_map(|m| m.keys()) {
        if is_reserved(k) && !entries.contains_key(k) {
            ops.push(json!({"op": "remove", "path": format!("{base}/{}", escape(k))}));
        }
    }
}

fn map_ops(ops: &mut Vec<Value>, present: bool, base: &str, entries: &BTreeMap<String, String>) {
    if entries.is_empty() {
        return;
    }
    if present {
        for (k, v) in entries {
            ops.push(add(format!("{base}/{}", escape(k)), json!(v)));
        }
    } else {
        ops.push(add(base.to_owned(), json!(entries)));
    }
}

/// The JSONPatch (RFC 6902) for `mutation` on `pod`, as JSON: `remove` operations for every
/// reserved `stasis.dev/` label and annotation the pod was created with ([`is_reserved`]: only
/// stasis writes them, whatever the decision), then `add` operations (an `add` on an existing
/// member replaces it), so the patch applies to exactly the pod it was built from.
pub fn patch(pod: &Pod, mutation: &Mutation) -> Value {
    let mut ops = Vec::new();
    strip_ops(
        &mut ops,
        pod.metadata.annotations.as_ref(),
        "/metadata/annotations",
        &mutation.annotations,
    );
    strip_ops(
        &mut ops,
        pod.metadata.labels.as_ref(),
        "/metadata/labels",
        &mutation.labels,
    );
    map_ops(
        &mut ops,
        pod.metadata.annotations.is_some(),
        "/metadata/annotations",
        &mutation.annotations,
    );
    map_ops(
        &mut ops,
        pod.metadata.labels.is_some(),
        "/metadata/labels",
        &mutation.labels,
    );
    if let Some(r) = &mutation.restore {
        let spec = pod.spec.as_ref();
        let affinity = with_preferred_nodes(
            with_node_requirements(spec.and_then(|s| s.affinity.as_ref()), &r.node_requirements),
            &r.prefer_nodes,
        );
        ops.push(add("/spec/affinity".into(), json!(affinity)));
        let wait = json!(wait_container(&r.wait));
        let has_inits = spec
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|c| !c.is_empty());
        let already = spec
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.name == stasis_api::pod::RESTORE_WAIT_CONTAINER)
            });
        if already {
            // A pod copied from a restored one: leave its wait container alone.
        } else if has_inits {
            // First, so the archive is being prepared while nothing of the workload has run.
            ops.push(add("/spec/initContainers/0".into(), wait));
        } else {
            ops.push(add("/spec/initContainers".into(), json!([wait])));
        }
    }
    // With a decision (every admission but a dry run's): the pod is stasis's from now on.
    if mutation.annotations.contains_key(names::DECISION) {
        ops.extend(responder_op(pod));
    }
    Value::Array(ops)
}

/// Names stasis among the pod's eviction responders: the EvictionRequest API takes a pod's
/// responders from its `spec.evictionResponders` alone (settable only at creation), so a pod
/// that does not name stasis is evicted without its final checkpoint being waited for. Not when
/// it names stasis already, is in a PodGroup (no responders allowed there) or has a full list.
/// An API server without the `EvictionRequestAPI` gate drops the field.
fn responder_op(pod: &Pod) -> Option<Value> {
    use stasis_api::eviction::{pod_responder_entry, MAX_POD_RESPONDERS, RESPONDER};
    let spec = pod.spec.as_ref()?;
    if spec.scheduling_group.is_some() {
        return None;
    }
    let named = spec.eviction_responders.as_deref().unwrap_or_default();
    if named.iter().any(|r| r.name == RESPONDER) || named.len() >= MAX_POD_RESPONDERS {
        return None;
    }
    Some(match &spec.eviction_responders {
        None => add(
            "/spec/evictionResponders".into(),
            json!([pod_responder_entry()]),
        ),
        Some(_) => add("/spec/evictionResponders/-".into(), pod_responder_entry()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn apply(doc: &Value, p: &Value) -> Value {
        let mut doc = doc.clone();
        let p: json_patch::Patch = serde_json::from_value(p.clone()).unwrap();
        json_patch::patch(&mut doc, &p).unwrap();
        doc
    }

    fn wait_cfg() -> WaitConfig {
        WaitConfig {
            image: "stasis-controller:dev".into(),
            command: "/usr/local/bin/stasis-controller".into(),
            status_url: "http://stasis-controller.stasis-system.svc:8080".into(),
            timeout_seconds: 180,
        }
    }

    #[test]
    fn stasis_is_named_an_eviction_responder_once() {
        let m = Mutation {
            annotations: BTreeMap::from([(names::DECISION.into(), "ColdStart".into())]),
            ..Default::default()
        };
        let named = |spec: Value| {
            let p = pod(json!({"metadata": {"name": "p"}, "spec": spec}));
            let out = apply(&serde_json::to_value(&p).unwrap(), &patch(&p, &m));
            out["spec"]["evictionResponders"].clone()
        };
        let ours = json!({"name": "stasis.dev/checkpoint", "priority": 1000});
        assert_eq!(named(json!({"containers": []})), json!([ours]));
        let other = json!({"name": "acme.io/drain", "priority": 10000});
        assert_eq!(
            named(json!({"containers": [], "evictionResponders": [other]})),
            json!([other, ours])
        );
        assert_eq!(
            named(json!({"containers": [], "evictionResponders": [ours]})),
            json!([ours]),
            "a pod copied from an admitted one names it once"
        );
        let full: Vec<Value> = (0..10)
            .map(|i| json!({"name": format!("acme.io/r{i}"), "priority": 2000}))
            .collect();
        assert_eq!(
            named(json!({"containers": [], "evictionResponders": full})),
            json!(full)
        );
        let grouped = json!({"containers": [], "schedulingGroup": {"podGroupName": "g"}});
        assert_eq!(
            named(grouped),
            Value::Null,
            "PodGroup pods take no responders"
        );
        let p = pod(json!({"spec": {"containers": []}}));
        assert_eq!(
            patch(&p, &Mutation::default()),
            json!([]),
            "no decision (a dry run): nothing named"
        );
    }

    #[test]
    fn cold_start_patch_only_annotates_and_labels() {
        let p = pod(
            json!({"metadata": {"generateName": "c-", "labels": {"app": "c"}}, "spec": {"containers": [{"name": "c"}]}}),
        );
        let m = Mutation {
            annotations: BTreeMap::from([("stasis.dev/decision".into(), "ColdStart".into())]),
            labels: BTreeMap::from([("stasis.dev/claim-token".into(), "abc".into())]),
            restore: None,
        };
        let ops = patch(&p, &m);
        assert_eq!(
            ops,
            json!([
                {"op": "add", "path": "/metadata/annotations", "value": {"stasis.dev/decision": "ColdStart"}},
                {"op": "add", "path": "/metadata/labels/stasis.dev~1claim-token", "value": "abc"},
                {"op": "add", "path": "/spec/evictionResponders", "value": [{"name": "stasis.dev/checkpoint", "priority": 1000}]}
            ])
        );
        let out = apply(&serde_json::to_value(&p).unwrap(), &ops);
        assert_eq!(out["metadata"]["labels"]["app"], "c");
        assert_eq!(out["metadata"]["labels"]["stasis.dev/claim-token"], "abc");
    }

    #[test]
    fn restore_patch_adds_affinity_and_wait_container_first() {
        let p = pod(json!({
            "metadata": {"annotations": {"a": "b"}},
            "spec": {
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                ]}, "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 5, "preference": {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}}
                ]}},
                "initContainers": [{"name": "setup"}],
                "containers": [{"name": "c"}]
            }
        }));
        let m = Mutation {
            annotations: BTreeMap::from([("stasis.dev/decision".into(), "Restore".into())]),
            labels: BTreeMap::new(),
            restore: Some(RestoreMutation {
                node_requirements: vec![
                    ("stasis.dev/ready".into(), vec!["true".into()]),
                    ("kubernetes.io/arch".into(), vec!["amd64".into()]),
                ],
                prefer_nodes: vec!["node-b".into(), "node-c".into()],
                wait: wait_cfg(),
            }),
        };
        let out = apply(&serde_json::to_value(&p).unwrap(), &patch(&p, &m));
        assert_eq!(out["metadata"]["annotations"]["a"], "b");
        // The nodes that pre-staged the checkpoint: preferred, beside the pod's own preference.
        let preferred = out["spec"]["affinity"]["nodeAffinity"]
            ["preferredDuringSchedulingIgnoredDuringExecution"]
            .as_array()
            .unwrap();
        assert_eq!(preferred.len(), 2);
        assert_eq!(preferred[0]["weight"], 5);
        assert_eq!(preferred[1]["weight"], PRESTAGED_WEIGHT);
        assert_eq!(
            preferred[1]["preference"]["matchFields"],
            json!([{"key": "metadata.name", "operator": "In", "values": ["node-b", "node-c"]}])
        );
        assert_eq!(
            out["metadata"]["annotations"]["stasis.dev/decision"],
            "Restore"
        );
        let terms = &out["spec"]["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        assert_eq!(terms[0]["matchExpressions"].as_array().unwrap().len(), 3);
        assert_eq!(terms[1]["matchExpressions"][0]["key"], "stasis.dev/ready");
        assert_eq!(terms[1]["matchFields"][0]["key"], "metadata.name");
        assert_eq!(
            out["spec"]["initContainers"][0]["name"],
            stasis_api::pod::RESTORE_WAIT_CONTAINER
        );
        assert_eq!(out["spec"]["initContainers"][1]["name"], "setup");
        let wait = &out["spec"]["initContainers"][0];
        assert_eq!(wait["args"][0], "wait-restore");
        assert_eq!(
            wait["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.name"
        );
        // The pod's UID, which the status endpoint asks for (only those who can read the pod
        // know it).
        assert_eq!(wait["env"][2]["name"], "STASIS_POD_UID");
        assert_eq!(
            wait["env"][2]["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.uid"
        );
        assert_eq!(wait["env"][3]["name"], "STASIS_STATUS_URL");
        assert_eq!(wait["securityContext"]["runAsNonRoot"], true);
        // The result is still a valid Pod.
        let back: Pod = serde_json::from_value(out).unwrap();
        assert_eq!(back.spec.unwrap().init_containers.unwrap().len(), 2);
    }

    #[test]
    fn user_supplied_stasis_keys_are_removed_whatever_the_decision() {
        // A pod created with a copied claim token and decision, through any path (here: the
        // webhook adds nothing, as on a cold start without a claim or after an error).
        let p = pod(json!({
            "metadata": {
                "labels": {"app": "c", "stasis.dev/claim-token": "T", "stasis.dev/system": "true"},
                "annotations": {
                    "stasis.dev/claim-token": "T", "stasis.dev/decision": "Restore",
                    "stasis.dev/decision-reported": "true", "stasis.dev/restore-from": "l/c",
                    "stasis.dev/lineage": "prod_deploy_web.aa", "stasis.dev/generation": "9",
                    "stasis.dev/cold-start": "true", "declare.stasis.dev/engine": "v1", "a": "b"
                }
            },
            "spec": {"containers": [{"name": "c"}]}
        }));
        let out = apply(
            &serde_json::to_value(&p).unwrap(),
            &patch(&p, &Mutation::default()),
        );
        assert_eq!(
            out["metadata"]["annotations"],
            json!({"stasis.dev/cold-start": "true", "declare.stasis.dev/engine": "v1", "a": "b"})
        );
        assert_eq!(out["metadata"]["labels"], json!({"app": "c"}));
        // With a decision: the webhook's own values replace the user's.
        let m = Mutation {
            annotations: BTreeMap::from([
                ("stasis.dev/decision".into(), "ColdStart".into()),
                ("stasis.dev/claim-token".into(), "mine".into()),
            ]),
            labels: BTreeMap::from([("stasis.dev/claim-token".into(), "mine".into())]),
            restore: None,
        };
        let out = apply(&serde_json::to_value(&p).unwrap(), &patch(&p, &m));
        let ann = &out["metadata"]["annotations"];
        assert_eq!(ann["stasis.dev/decision"], "ColdStart");
        assert_eq!(ann["stasis.dev/claim-token"], "mine");
        assert!(ann.get("stasis.dev/restore-from").is_none());
        assert!(ann.get("stasis.dev/decision-reported").is_none());
        assert_eq!(out["metadata"]["labels"]["stasis.dev/claim-token"], "mine");
        assert!(out["metadata"]["labels"].get("stasis.dev/system").is_none());
        // Nothing to remove, nothing to add: an empty patch.
        let clean = pod(json!({"metadata": {"labels": {"app": "c"}}, "spec": {"containers": []}}));
        assert_eq!(patch(&clean, &Mutation::default()), json!([]));
    }

    #[test]
    fn restore_patch_on_a_bare_spec() {
        let p = pod(json!({"spec": {"containers": [{"name": "c"}]}}));
        let m = Mutation {
            restore: Some(RestoreMutation {
                node_requirements: vec![("stasis.dev/ready".into(), vec!["true".into()])],
                prefer_nodes: Vec::new(),
                wait: wait_cfg(),
            }),
            ..Default::default()
        };
        let out = apply(&serde_json::to_value(&p).unwrap(), &patch(&p, &m));
        assert_eq!(
            out["spec"]["affinity"]["nodeAffinity"]
                ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
                ["matchExpressions"][0]["values"][0],
            "true"
        );
        // No node pre-staged it: no preference.
        assert!(out["spec"]["affinity"]["nodeAffinity"]
            .get("preferredDuringSchedulingIgnoredDuringExecution")
            .is_none());
        assert_eq!(out["spec"]["initContainers"].as_array().unwrap().len(), 1);
    }
}
