//! The mapping from objects to advice, without an API server (the plugin's API-server test runs
//! the same over real objects).

use super::figures::Source;
use super::*;
use serde_json::{json, Value};

const NOW: i64 = 1_800_000_000_000;

fn t(s_ago: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(NOW - s_ago * 1000)
        .unwrap()
        .to_string()
}

fn obj<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// A pod of Deployment `app` (its ReplicaSet `app-h1`), on `node`, with `spec` merged in.
fn pod(name: &str, app: &str, node: &str, spec: Value, ann: Value) -> Pod {
    let mut s =
        json!({"nodeName": node, "runtimeClassName": "stasis", "containers": [{"name": "c"}]});
    s.as_object_mut()
        .unwrap()
        .extend(spec.as_object().unwrap().clone());
    obj(json!({
        "metadata": {"name": name, "namespace": "prod", "uid": format!("uid-{name}"),
                     "creationTimestamp": t(600),
                     "labels": {"app": app, "pod-template-hash": "h1"}, "annotations": ann,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                        "name": format!("{app}-h1"), "uid": "00000000-0000-0000-0000-000000000001",
                        "controller": true}]},
        "spec": s,
        "status": {"startTime": t(590)},
    }))
}

fn gke_spot_node(name: &str) -> Node {
    obj(json!({
        "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": "gpu",
                                               "cloud.google.com/gke-spot": "true"}},
        "spec": {"providerID": format!("gce://p/europe-west4-a/{name}"),
                 "taints": [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}]},
    }))
}

fn on_demand_node(name: &str) -> Node {
    obj(json!({
        "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": "main"}},
        "spec": {"providerID": format!("gce://p/europe-west4-a/{name}")},
    }))
}

fn policy(name: &str, app: &str, interval: &str, status: Value) -> CheckpointPolicy {
    obj(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": name, "namespace": "prod"},
        "spec": {"selector": {"matchLabels": {"app": app}}, "interval": interval},
        "status": status,
    }))
}

/// Policy `auto` for `app`, whose status lists `pod` in pool `gpu/spot` as the controller writes
/// it.
fn auto_policy(app: &str, pod: &str, interval_ms: i64, mtbf_s: i64) -> CheckpointPolicy {
    policy(
        "auto",
        app,
        "auto",
        json!({"autoIntervals": [{"pod": pod, "nodePool": "gpu/spot", "intervalMillis": interval_ms,
            "optimumMillis": interval_ms, "costMillis": 1000, "costMeasured": true,
            "mtbfSeconds": mtbf_s, "interruptions": 3, "exposureSeconds": 5400}]}),
    )
}

fn checkpoint(
    name: &str,
    pod: &str,
    s_ago: i64,
    freeze: i64,
    upload: i64,
    total: i64,
) -> PodCheckpoint {
    obj(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": name, "namespace": "prod"},
        "spec": {"sourcePodName": pod, "reason": "Heartbeat"},
        "status": {"phase": "Succeeded", "sourcePodUID": format!("uid-{pod}"), "startTime": t(s_ago),
                   "freezeMillis": freeze, "uploadMillis": upload, "totalMillis": total},
    }))
}

fn budget(app: &str) -> PodDisruptionBudget {
    obj(json!({
        "metadata": {"name": app, "namespace": "prod"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": app}}},
    }))
}

fn facts(pods: Vec<Pod>, nodes: Result<Vec<Node>, String>) -> Facts {
    Facts {
        scope: "namespace prod".into(),
        pods,
        budgets: vec![],
        nodes,
        policies: vec![],
        checkpoints: vec![],
        restores: vec![],
        now_ms: NOW,
    }
}

fn codes(w: &WorkloadAdvice) -> Vec<&'static str> {
    w.findings.iter().map(|f| f.code).collect()
}

/// A spot-tolerating web Deployment with a long grace, no budget and do-not-disrupt, on a GKE
/// spot node: each check fires; the figures say where they came from.
#[test]
fn each_check_fires_and_each_figure_names_its_source() {
    let spot = json!({"terminationGracePeriodSeconds": 120,
                      "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                       "value": "true", "effect": "NoSchedule"}]});
    let ann = json!({"karpenter.sh/do-not-disrupt": "true"});
    let mut f = facts(
        vec![
            pod("web-h1-a", "web", "spot-1", spot.clone(), ann.clone()),
            pod("web-h1-b", "web", "spot-1", spot, ann),
        ],
        Ok(vec![gke_spot_node("spot-1"), on_demand_node("main-1")]),
    );
    f.policies = vec![policy("every-30s", "web", "30s", json!({}))];
    f.checkpoints = vec![
        checkpoint("c1", "web-h1-a", 90, 100, 900, 1100),
        checkpoint("c2", "web-h1-a", 60, 300, 1700, 2100),
    ];
    let r = report(&f);
    assert!(r.notes.is_empty(), "{:?}", r.notes);
    assert_eq!(
        r.workloads.len(),
        1,
        "two pods of one Deployment: one workload"
    );
    let w = &r.workloads[0];
    assert_eq!(w.workload, "deployment/web");
    assert_eq!(w.pods, ["web-h1-a", "web-h1-b"]);
    assert_eq!((w.node_pool.as_deref(), w.spot), (Some("gpu/spot"), true));
    assert_eq!(w.provider.as_deref(), Some("gcp"));
    assert_eq!(
        codes(w),
        [
            "DoNotDisruptBlocksConsolidation",
            "GraceExceedsNotice",
            "TolerationWithoutAffinity",
            "NoDisruptionBudget",
            "NoSpread"
        ]
    );
    let i = w.interval_seconds.as_ref().unwrap();
    assert_eq!((i.value, i.source), (30.0, Source::Policy));
    // mean of (100 + 900) and (300 + 1700) ms; freeze: mean of 100 and 300 ms
    assert_eq!(
        (w.checkpoint_seconds.value, w.checkpoint_seconds.source),
        (1.5, Source::Measured)
    );
    assert_eq!(w.freeze_seconds.value, 0.2);
    assert_eq!(w.restore_seconds.source, Source::Default);
    assert_eq!(w.cold_start_seconds.source, Source::Default);
    // no policy status for the pool: the controller's prior for spot, one per six hours
    assert_eq!(w.evictions_per_hour.source, Source::Default);
    assert!((w.evictions_per_hour.value - 1.0 / 6.0).abs() < 1e-9);
    let g = w.goodput.unwrap();
    assert_eq!(
        g.loss_per_eviction_s,
        15.0 + 10.0,
        "half the interval + the default restore"
    );
    // a server that starts in a minute, evicted once in six hours: its freezes cost more than
    // stasis saves, and the advice says so
    let rate = 1.0 / 6.0 / 3600.0;
    assert!((g.with_stasis - (1.0 - 0.2 / 30.0) * (1.0 - rate * 25.0)).abs() < 1e-12);
    assert!((g.without_stasis - (1.0 - rate * 60.0)).abs() < 1e-12);
    assert!(g.with_stasis < g.without_stasis, "{g:?}");
}

/// Toleration and a required affinity, a grace within the notice, a budget, one replica, an
/// `auto` policy whose status lists the pod: nothing to say, and the figures come from the
/// status and the records.
#[test]
fn a_workload_that_passes_every_check_has_no_findings() {
    let spec = json!({"terminationGracePeriodSeconds": 25,
        "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}]}]}}}});
    let mut cold: Pod = pod(
        "ok-h1-a",
        "ok",
        "spot-1",
        spec,
        json!({"stasis.dev/decision": "ColdStart", "stasis.dev/lineage": "L"}),
    );
    cold.status = Some(obj(json!({"startTime": t(590), "conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": t(588)}]})));
    let mut f = facts(vec![cold], Ok(vec![gke_spot_node("spot-1")]));
    f.budgets = vec![budget("ok")];
    f.policies = vec![auto_policy("ok", "ok-h1-a", 84_000, 1800)];
    f.restores = vec![obj(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
        "metadata": {"name": "r", "namespace": "prod", "creationTimestamp": t(300)},
        "spec": {"checkpointRef": "L/1", "targetPodName": "gone", "lineage": "L"},
        "status": {"phase": "Restored", "completionTime": t(296)},
    }))];
    let r = report(&f);
    let w = &r.workloads[0];
    assert!(w.findings.is_empty(), "{:?}", w.findings);
    let i = w.interval_seconds.as_ref().unwrap();
    assert_eq!((i.value, i.source), (84.0, Source::PolicyStatus));
    assert_eq!(
        (w.evictions_per_hour.value, w.evictions_per_hour.source),
        (2.0, Source::PolicyStatus)
    );
    assert!(
        w.evictions_per_hour.from.contains("MTBF 1800 s"),
        "{}",
        w.evictions_per_hour.from
    );
    assert_eq!(
        (w.restore_seconds.value, w.restore_seconds.source),
        (4.0, Source::Measured),
        "a restore of its lineage, creation to completion"
    );
    assert_eq!(
        (w.cold_start_seconds.value, w.cold_start_seconds.source),
        (12.0, Source::Measured),
        "the pod's creation (600 s ago) to Ready (588 s ago)"
    );
    assert_eq!(w.checkpoint_seconds.source, Source::Default);
    let text = render(&r, false);
    assert!(text.contains("no findings"), "{text}");
}

/// A namespace user who may not list nodes: the pool comes from the policy's status, the
/// cloud stays unknown, and the report says so; the spot checks that need no cloud still run.
#[test]
fn without_nodes_the_report_says_what_it_could_not_check() {
    let spec = json!({"nodeSelector": {"cloud.google.com/gke-spot": "true"}});
    let mut f = facts(
        vec![pod("x-h1-a", "x", "spot-1", spec, json!({}))],
        Err("nodes is forbidden: User \"dev\" cannot list resource \"nodes\"".into()),
    );
    f.policies = vec![auto_policy("x", "x-h1-a", 60_000, 21_600)];
    let r = report(&f);
    assert_eq!(r.notes.len(), 1);
    assert!(
        r.notes[0].contains("nodes are not readable"),
        "{}",
        r.notes[0]
    );
    let w = &r.workloads[0];
    assert_eq!(
        (w.node_pool.as_deref(), w.spot, w.provider.as_deref()),
        (Some("gpu/spot"), true, None)
    );
    assert_eq!(codes(w), ["NoDisruptionBudget"]);
}

/// An `auto` policy that lists none of the workload's pods yet: the interval is chosen here from
/// the measured cost, as the controller would; a workload without a policy is told so and gets
/// no goodput; a Job counts the work since its pod's start.
#[test]
fn auto_without_status_no_policy_and_a_jobs_lost_work() {
    let mut job: Pod = pod("train-0", "train", "main-1", json!({}), json!({}));
    job.metadata.owner_references =
        Some(vec![obj(json!({"apiVersion": "batch/v1", "kind": "Job",
        "name": "train", "uid": "00000000-0000-0000-0000-000000000002", "controller": true}))]);
    let mut f = facts(
        vec![job, pod("web-h1-a", "web", "main-1", json!({}), json!({}))],
        Ok(vec![on_demand_node("main-1")]),
    );
    f.policies = vec![policy("auto", "train", "auto", json!({}))];
    f.checkpoints = vec![checkpoint("c", "train-0", 30, 2000, 0, 2000)];
    let r = report(&f);
    let names: Vec<&str> = r.workloads.iter().map(|w| w.workload.as_str()).collect();
    assert_eq!(names, ["deployment/web", "job/train"]);
    let web = &r.workloads[0];
    assert_eq!(codes(web), ["NoPolicy", "NoDisruptionBudget"]);
    assert!(web.interval_seconds.is_none() && web.goodput.is_none());
    let train = &r.workloads[1];
    let i = train.interval_seconds.as_ref().unwrap();
    let want = stasis_core::interval::auto_interval(
        Some(Duration::from_secs(2)),
        Some(Duration::from_secs(2)),
        Duration::from_secs(24 * 3600),
        0.5,
    );
    assert_eq!(
        (i.source, i.value),
        (Source::Estimated, want.interval.as_secs_f64())
    );
    assert_eq!(
        train.lost_work_without_seconds.value, 590.0,
        "started 590 s ago"
    );
    let g = train.goodput.unwrap();
    assert_eq!(g.loss_per_eviction_without_s, 60.0 + 590.0);
}

/// The newest succeeded checkpoint's total time is what must fit in the notice: an older slow
/// one does not count, a newer one does.
#[test]
fn the_newest_checkpoints_total_must_fit_the_notice() {
    let spec = json!({"terminationGracePeriodSeconds": 25});
    let mut f = facts(
        vec![pod("big-h1-a", "big", "spot-1", spec, json!({}))],
        Ok(vec![gke_spot_node("spot-1")]),
    );
    f.policies = vec![policy("p", "big", "5m", json!({}))];
    f.checkpoints = vec![
        checkpoint("old", "big-h1-a", 900, 500, 40_000, 41_000),
        checkpoint("new", "big-h1-a", 300, 500, 9_000, 9_600),
    ];
    assert!(!codes(&report(&f).workloads[0]).contains(&"FinalCheckpointTooSlow"));
    f.checkpoints
        .push(checkpoint("newest", "big-h1-a", 10, 800, 30_000, 31_200));
    let r = report(&f);
    let slow = r.workloads[0]
        .findings
        .iter()
        .find(|x| x.code == "FinalCheckpointTooSlow")
        .expect("the newest took 31.2 s, the pod gets 25 s");
    assert!(
        slow.what.contains("31.2 s") && slow.what.contains("25 s"),
        "{}",
        slow.what
    );
}

/// A finished pod gets no advice; a pod that waits for a node and requires spot capacity is
/// taken at the spot prior.
#[test]
fn ended_pods_are_left_out_and_a_pending_spot_pod_gets_the_spot_prior() {
    let mut done = pod("old-h1-a", "old", "main-1", json!({}), json!({}));
    done.status = Some(obj(json!({"phase": "Succeeded"})));
    let required =
        json!({"nodeName": null, "nodeSelector": {"karpenter.sh/capacity-type": "spot"}});
    let f = facts(
        vec![done, pod("new-h1-a", "new", "", required, json!({}))],
        Ok(vec![on_demand_node("main-1")]),
    );
    let r = report(&f);
    assert_eq!(r.workloads.len(), 1);
    let w = &r.workloads[0];
    assert_eq!(
        (w.workload.as_str(), w.node_pool.as_deref()),
        ("deployment/new", None)
    );
    assert!((w.evictions_per_hour.value - 1.0 / 6.0).abs() < 1e-9);
    assert!(
        w.evictions_per_hour.from.contains("for spot capacity"),
        "{}",
        w.evictions_per_hour.from
    );
}

#[test]
fn spot_affinity_reads_node_selector_required_and_preferred_terms() {
    let p = |spec: Value| pod("p", "a", "n", spec, json!({}));
    let expr = json!([{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}]);
    assert_eq!(
        facts::spot_affinity(&p(json!({}))),
        advise::SpotAffinity::None
    );
    assert_eq!(
        facts::spot_affinity(&p(
            json!({"nodeSelector": {"kubernetes.azure.com/scalesetpriority": "spot"}})
        )),
        advise::SpotAffinity::Required
    );
    assert_eq!(
        facts::spot_affinity(&p(json!({"affinity": {"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": expr}}]}}}))),
        advise::SpotAffinity::Preferred
    );
    let on_demand =
        json!([{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}]);
    assert_eq!(
        facts::spot_affinity(&p(json!({"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": on_demand}]}}}}))),
        advise::SpotAffinity::None
    );
    // Exists without a key tolerates everything; PreferNoSchedule keeps nothing off.
    let tol = p(
        json!({"tolerations": [{"operator": "Exists"}, {"key": "k", "effect": "PreferNoSchedule"}]}),
    );
    assert_eq!(facts::tolerated_taint_keys(&tol), ["*"]);
}

/// The taints a spot workload must tolerate are those every spot node carries (a GPU taint on
/// some of them is not the spot pool's).
#[test]
fn spot_taints_are_those_every_spot_node_carries() {
    let karpenter = |name: &str, taints: Value| -> Node {
        obj(
            json!({"metadata": {"name": name, "labels": {"karpenter.sh/capacity-type": "spot",
            "karpenter.sh/nodepool": "spot"}}, "spec": {"providerID": format!("aws:///us-east-1a/{name}"), "taints": taints}}),
        )
    };
    let nodes = facts::Nodes::of(&[
        karpenter(
            "a",
            json!([{"key": "workload-class", "value": "interruptible", "effect": "NoSchedule"},
                               {"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),
        ),
        karpenter(
            "b",
            json!([{"key": "workload-class", "value": "interruptible", "effect": "NoSchedule"}]),
        ),
        on_demand_node("c"),
    ]);
    assert_eq!(nodes.spot_taint_keys, ["workload-class"]);
}

/// `-o json`'s shape: scripts read these names.
#[test]
fn the_json_shape_is_stable() {
    let mut f = facts(
        vec![pod("web-h1-a", "web", "spot-1", json!({}), json!({}))],
        Ok(vec![gke_spot_node("spot-1")]),
    );
    f.policies = vec![policy("p", "web", "1m", json!({}))];
    let v = serde_json::to_value(report(&f)).unwrap();
    let w = &v["workloads"][0];
    let mut keys: Vec<&String> = w.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "checkpointSeconds",
            "coldStartSeconds",
            "evictionsPerHour",
            "findings",
            "freezeSeconds",
            "goodput",
            "intervalSeconds",
            "lostWorkWithoutSeconds",
            "namespace",
            "nodePool",
            "pods",
            "policy",
            "provider",
            "restoreSeconds",
            "spot",
            "workload"
        ]
    );
    assert_eq!(
        w["intervalSeconds"],
        json!({"value": 60.0, "source": "policy", "from": "policy p"})
    );
    assert_eq!(w["findings"][0]["severity"], "info");
    assert!(w["findings"][0]["why"].is_string() && w["findings"][0]["fix"].is_string());
    let g = w["goodput"].as_object().unwrap();
    for k in [
        "lossPerEvictionSeconds",
        "lossPerEvictionWithoutSeconds",
        "withStasis",
        "withoutStasis",
        "suggestedIntervalSeconds",
    ] {
        assert!(g.contains_key(k), "{k} missing from {g:?}");
    }
}
