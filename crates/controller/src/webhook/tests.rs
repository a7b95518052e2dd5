use super::*;
use crate::record::{Holder, Record};
use crate::testing::*;
use serde_json::json;
use stasis_core::lineage::Lineage;
use stasis_core::reference::WorkloadName;

/// The stand-in API server answering these tests' routes (all `GET`s).
fn routed_client(routes: Vec<(&'static str, String, serde_json::Value)>) -> (Client, Seen) {
    api_server(routes.into_iter().map(|(_, p, v)| (p, v)).collect())
}

#[test]
fn final_wait_fits_the_api_servers_timeout() {
    let d = Duration::from_secs(20);
    assert_eq!(final_wait_budget(d, None), d);
    assert_eq!(final_wait_budget(d, Some("timeout=30s")), d);
    assert_eq!(
        final_wait_budget(d, Some("x=1&timeout=10s")),
        Duration::from_secs(7)
    );
    assert_eq!(final_wait_budget(d, Some("timeout=2s")), Duration::ZERO);
    assert_eq!(final_wait_budget(d, Some("timeout=1m0s")), d);
    // The query is URL-encoded: its names and values are read decoded.
    let seven = Duration::from_secs(7);
    assert_eq!(final_wait_budget(d, Some("time%6Fut=10s")), seven);
    assert_eq!(final_wait_budget(d, Some("timeout=10%73&x=1")), seven);
    assert_eq!(
        final_wait_budget(d, Some("x=timeout%3D1s")),
        d,
        "a value, not a name"
    );
}

pub(crate) fn offline_hook() -> Arc<Webhook> {
    let client = offline_client();
    Arc::new(Webhook {
        records: Records::new(client.clone(), "stasis"),
        // Not synced: the claim lists the namespace's checkpoints from the stand-in API server.
        checkpoints: crate::cache::Checkpoints::unsynced(),
        record_index: None,
        policies: None,
        nodes: None,
        owners: None,
        client,
        metrics: Metrics::default(),
        cfg: WebhookConfig {
            runtime_class: "stasis".into(),
            wait: WaitConfig {
                image: "i".into(),
                command: "/c".into(),
                status_url: "http://s:8080".into(),
                timeout_seconds: 5,
            },
            final_wait: Duration::from_secs(1),
            phantom_after: Duration::from_secs(60),
            prestage_receivers: 3,
        },
    })
}

pub(crate) fn admission_review(user: &str, pod: serde_json::Value, dry_run: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "req-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "prod",
            "operation": "CREATE",
            "userInfo": {"username": user},
            "object": pod,
            "dryRun": dry_run
        }
    }))
    .unwrap()
}

pub(crate) fn response(out: &[u8]) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(out).unwrap();
    assert_eq!(v["kind"], "AdmissionReview");
    v["response"].clone()
}

#[tokio::test]
async fn admits_unchanged_what_is_not_stasis_and_anything_it_cannot_decide() {
    let hook = offline_hook();
    let wait = Duration::from_secs(1);
    let plain = json!({"metadata": {"generateName": "c-"}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
    let r = response(&review(hook.clone(), &admission_review("alice", plain, false), wait).await);
    assert_eq!(
        (r["uid"].as_str(), r["allowed"].as_bool()),
        (Some("req-1"), Some(true))
    );
    assert!(r.get("patch").is_none());
    let stasis = json!({
        "metadata": {"generateName": "c-", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "c-7f", "uid": "u", "controller": true}
        ], "labels": {"pod-template-hash": "7f"}},
        "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
    });
    // A dry run decides nothing (no claim may be written).
    let r = response(
        &review(
            hook.clone(),
            &admission_review(
                "system:serviceaccount:kube-system:replicaset-controller",
                stasis.clone(),
                true,
            ),
            wait,
        )
        .await,
    );
    assert!(r["allowed"].as_bool().unwrap() && r.get("patch").is_none());
    // The API server cannot be reached: the pod is admitted unchanged (a cold start), for the
    // workload's controller and for a person (whose SubjectAccessReview fails) alike.
    for user in [
        "system:serviceaccount:kube-system:replicaset-controller",
        "alice",
    ] {
        let r = response(
            &review(
                hook.clone(),
                &admission_review(user, stasis.clone(), false),
                wait,
            )
            .await,
        );
        assert!(
            r["allowed"].as_bool().unwrap() && r.get("patch").is_none(),
            "{user}: {r}"
        );
    }
    assert!(hook.metrics.encode().contains("decision=\"Error\""));
}

#[tokio::test]
async fn cold_start_without_identity_is_annotated() {
    // A bare generateName pod has no identity at admission (it needs its own name).
    let hook = offline_hook();
    let pod = json!({"metadata": {"generateName": "x-"}, "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c"}]}});
    let r = response(
        &review(
            hook,
            &admission_review("alice", pod, false),
            Duration::from_secs(1),
        )
        .await,
    );
    assert_eq!(r["patchType"], "JSONPatch");
    // kube serialises the patch bytes as a JSON array of numbers (the API server's Go
    // decoder takes that as well as base64).
    let bytes: Vec<u8> = serde_json::from_value(r["patch"].clone()).unwrap();
    let patch: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(patch[0]["value"][names::DECISION], "ColdStart");
}

#[tokio::test]
async fn a_replacement_claims_the_orphaned_lineage_and_is_patched_to_restore() {
    replacement_restores(false).await;
}

/// The same admission with the lineage records from the replica's watch cache: the API server
/// is not asked for them.
#[tokio::test]
async fn a_prediction_reads_the_workloads_records_from_the_cache() {
    let seen = replacement_restores(true).await;
    let record_reads: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, path, _)| path.contains("/configmaps"))
        .cloned()
        .collect();
    assert!(record_reads.is_empty(), "{record_reads:#?}");
}

/// A replacement of a Deployment's pod whose lineage is orphaned is predicted to restore its
/// checkpoint; the records come from the replica's cache when `cached_records`.
async fn replacement_restores(cached_records: bool) -> crate::testing::Seen {
    let new_pod = json!({
        "metadata": {"generateName": "counter-7d9f8b6c5-", "labels": {"app": "counter", "pod-template-hash": "7d9f8b6c5"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-7d9f8b6c5", "uid": "rs", "controller": true}]},
        "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "stasis-counter:dev"}]}
    });
    let mut as_pod: Pod = serde_json::from_value(new_pod.clone()).unwrap();
    as_pod.metadata.namespace = Some("prod".into());
    let hash = podfacts::spec_hash(&as_pod).unwrap().0;
    // The source's lineage, orphaned (its pod is gone), with one checkpoint.
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let mut lineage = Lineage::start(&w, "old-token", &[]);
    let id = stasis_core::reference::CheckpointId::from_parts(1_700_000_000_000, 1);
    lineage
        .publish(stasis_core::lineage::LineageCheckpoint {
            id: id.clone(),
            generation: 1,
            created_unix_ms: 1_700_000_000_000,
            manifest_digest: None,
        })
        .unwrap();
    lineage.orphan();
    let mut record = Record::new(
        "prod",
        lineage.clone(),
        Some(Holder {
            token: "old-token".into(),
            claimed_unix_ms: 1,
            pod: Some("counter-7d9f8b6c5-old".into()),
            uid: Some("old-uid".into()),
            ..Default::default()
        }),
    );
    record.resource_version = Some("7".into());
    let cm_obj = record.to_config_map().unwrap();
    let cm = serde_json::to_value(&cm_obj).unwrap();
    let reference = format!("{}/{}", lineage.id, id);
    let checkpoint = json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "counter-7d9f8b6c5-old-1700000000", "namespace": "prod"},
        "spec": {"sourcePodName": "counter-7d9f8b6c5-old", "sourcePodUID": "old-uid", "reason": "Heartbeat"},
        "status": {"phase": "Succeeded", "node": "worker-1", "checkpointRef": reference,
                   "lineage": lineage.id.as_str(), "generation": 1, "specHash": hash}
    });
    let policy = json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": "counter", "namespace": "prod"},
        "spec": {"selector": {"matchLabels": {"app": "counter"}}, "interval": "10s"}
    });
    let node = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "worker-1", "labels": {names::node::CPU_ARCH: "amd64", names::node::READY: "true"}}});
    let (client, seen) = routed_client(vec![
        (
            "GET",
            "/apis/stasis.dev/v1alpha1/namespaces/prod/checkpointpolicies".into(),
            list("CheckpointPolicyList", vec![policy]),
        ),
        (
            "GET",
            if cached_records {
                "/not-asked".into()
            } else {
                "/api/v1/namespaces/stasis/configmaps".into()
            },
            list("ConfigMapList", vec![cm]),
        ),
        (
            "GET",
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints".into(),
            list("PodCheckpointList", vec![checkpoint]),
        ),
        (
            "GET",
            "/api/v1/namespaces/prod/pods".into(),
            list("PodList", vec![]),
        ),
        ("GET", "/api/v1/nodes/worker-1".into(), node),
        (
            "GET",
            "/apis/apps/v1/namespaces/prod/replicasets/counter-7d9f8b6c5".into(),
            replicaset("counter-7d9f8b6c5", "rs", Some(("counter", "dep"))),
        ),
        (
            "GET",
            "/apis/apps/v1/namespaces/prod/deployments/counter".into(),
            json!({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "counter", "namespace": "prod", "uid": "dep"}}),
        ),
    ]);
    let hook = Arc::new(Webhook {
        records: Records::new(client.clone(), "stasis"),
        // Not synced: the claim lists the namespace's checkpoints from the stand-in API server.
        checkpoints: crate::cache::Checkpoints::unsynced(),
        record_index: cached_records.then(|| crate::cache::RecordIndex::of(&[cm_obj])),
        policies: None,
        nodes: None,
        owners: None,
        client,
        metrics: Metrics::default(),
        cfg: offline_hook().cfg.clone(),
    });
    let out = review(
        hook.clone(),
        &admission_review(
            "system:serviceaccount:kube-system:replicaset-controller",
            new_pod.clone(),
            false,
        ),
        Duration::from_secs(1),
    )
    .await;
    let r = response(&out);
    assert_eq!(r["allowed"], true);
    let bytes: Vec<u8> = serde_json::from_value(r["patch"].clone()).expect("a patch");
    let ops: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let mut patched = new_pod.clone();
    json_patch::patch(
        &mut patched,
        &serde_json::from_value::<json_patch::Patch>(ops).unwrap(),
    )
    .unwrap();
    let ann = &patched["metadata"]["annotations"];
    assert_eq!(ann[names::DECISION], "Restore", "{ann}");
    assert_eq!(ann[names::RESTORE_FROM], reference.as_str());
    assert_eq!(ann[names::LINEAGE], lineage.id.as_str());
    assert_eq!(ann[names::GENERATION], "2");
    let token = ann[names::CLAIM_TOKEN].as_str().unwrap();
    assert_eq!(patched["metadata"]["labels"][names::CLAIM_TOKEN], token);
    assert_eq!(
        patched["spec"]["initContainers"][0]["name"],
        stasis_api::pod::RESTORE_WAIT_CONTAINER
    );
    let exprs = &patched["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        ["matchExpressions"];
    assert_eq!(exprs[0]["key"], names::node::READY);
    assert_eq!(exprs[1]["key"], names::node::CPU_ARCH);
    assert_eq!(exprs[1]["values"][0], "amd64");
    // Nothing written: the answer is a prediction, which the controller commits against the
    // real pod (`claim::tests`). Before, this review claimed the lineage in the record.
    let writes = crate::testing::writes(&seen);
    assert!(writes.is_empty(), "{writes:#?}");
    assert_eq!(record.lineage.generation, 1);
    assert!(hook.metrics.encode().contains("decision=\"Restore\""));
    seen
}

/// A ReplicaSet as the API server returns it, controlled by `deployment` (name, UID).
pub(crate) fn replicaset(
    name: &str,
    uid: &str,
    deployment: Option<(&str, &str)>,
) -> serde_json::Value {
    let owners: Vec<serde_json::Value> = deployment
        .map(|(n, u)| json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": n, "uid": u, "controller": true}))
        .into_iter()
        .collect();
    json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
           "metadata": {"name": name, "namespace": "prod", "uid": uid, "ownerReferences": owners},
           "spec": {"selector": {}}})
}

/// The patch of an answer applied to `pod`.
pub(crate) fn patched(out: &[u8], pod: &serde_json::Value) -> serde_json::Value {
    let r = response(out);
    assert_eq!(r["allowed"], true);
    let mut doc = pod.clone();
    if let Some(p) = r.get("patch") {
        let bytes: Vec<u8> = serde_json::from_value(p.clone()).unwrap();
        let ops: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut doc, &ops).unwrap();
    }
    doc
}

/// A pod of ReplicaSet `rs` (UID `uid`), as the M1 and H2 attacks write it.
pub(crate) fn rs_pod(rs: &str, uid: &str, hash: &str) -> serde_json::Value {
    json!({
        "metadata": {"generateName": format!("{rs}-"), "labels": {"app": "web", "pod-template-hash": hash},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs, "uid": uid, "controller": true}]},
        "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "web:1"}]}
    })
}

pub(crate) fn hook_with(client: Client) -> Arc<Webhook> {
    Arc::new(Webhook {
        records: Records::new(client.clone(), "stasis"),
        // Not synced: the claim lists the namespace's checkpoints from the stand-in API server.
        checkpoints: crate::cache::Checkpoints::unsynced(),
        record_index: None,
        policies: None,
        nodes: None,
        owners: None,
        client,
        metrics: Metrics::default(),
        cfg: offline_hook().cfg.clone(),
    })
}

pub(crate) const RS_CONTROLLER: &str = "system:serviceaccount:kube-system:replicaset-controller";

#[tokio::test]
async fn a_review_naming_owners_that_are_not_there_claims_nothing_and_names_no_lineage() {
    let policy = json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": "web", "namespace": "prod"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "interval": "10s"}
    });
    let routes = || {
        vec![
            (
                "GET",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/checkpointpolicies".to_owned(),
                list("CheckpointPolicyList", vec![policy.clone()]),
            ),
            (
                "GET",
                "/api/v1/namespaces/stasis/configmaps".to_owned(),
                list("ConfigMapList", vec![]),
            ),
            (
                "GET",
                "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints".to_owned(),
                list("PodCheckpointList", vec![]),
            ),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/replicasets/web-6d4f9".to_owned(),
                replicaset("web-6d4f9", "rs-real", Some(("web", "dep-real"))),
            ),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/replicasets/web-zz9".to_owned(),
                replicaset("web-zz9", "rs-user", None),
            ),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/replicasets/web-gone".to_owned(),
                replicaset("web-gone", "rs-gone", Some(("web", "dep-old"))),
            ),
            (
                "GET",
                "/apis/apps/v1/namespaces/prod/deployments/web".to_owned(),
                json!({"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": "web", "namespace": "prod", "uid": "dep-real"}}),
            ),
        ]
    };
    // A forged review (any user may claim to be the ReplicaSet controller): a ReplicaSet
    // that does not exist, one whose UID differs, one whose Deployment is another object
    // of the same name.
    for (rs, uid, hash, why) in [
        ("web-nope", "rs-x", "nope", "does not exist"),
        ("web-6d4f9", "rs-forged", "6d4f9", "another UID"),
        ("web-gone", "rs-gone", "gone", "another UID"),
    ] {
        let (client, writes) = routed_client(routes());
        let hook = hook_with(client);
        let pod = rs_pod(rs, uid, hash);
        let out = review(
            hook.clone(),
            &admission_review(RS_CONTROLLER, pod.clone(), false),
            Duration::from_secs(1),
        )
        .await;
        let doc = patched(&out, &pod);
        let ann = &doc["metadata"]["annotations"];
        assert_eq!(ann[names::DECISION], "ColdStart", "{rs}: {doc}");
        let reason = ann[names::DECISION_REASON].as_str().unwrap();
        assert!(reason.contains(why), "{rs}: {reason}");
        assert!(ann.get(names::LINEAGE).is_none(), "{rs}: {ann}");
        assert!(ann.get(names::CLAIM_TOKEN).is_none(), "{rs}: {ann}");
        assert!(
            crate::testing::writes(&writes).is_empty(),
            "{rs}: nothing written"
        );
        assert!(hook.metrics.encode().contains("UnverifiedOwner"));
    }
    // M1: a ReplicaSet `web-zz9` a user created, shaped like Deployment web's: it is its
    // own workload (keyed by its UID), never Deployment web's.
    let (client, writes) = routed_client(routes());
    let pod = rs_pod("web-zz9", "rs-user", "zz9");
    let out = review(
        hook_with(client),
        &admission_review(RS_CONTROLLER, pod.clone(), false),
        Duration::from_secs(1),
    )
    .await;
    let doc = patched(&out, &pod);
    let lineage = doc["metadata"]["annotations"][names::LINEAGE]
        .as_str()
        .unwrap();
    assert!(lineage.starts_with("prod_rs_web-zz9_"), "{lineage}");
    // The new lineage is only announced: no record is created at admission.
    assert!(crate::testing::writes(&writes).is_empty());
    // The real ReplicaSet of Deployment web, named by its UIDs: Deployment web's workload.
    let (client, _) = routed_client(routes());
    let pod = rs_pod("web-6d4f9", "rs-real", "6d4f9");
    let out = review(
        hook_with(client),
        &admission_review(RS_CONTROLLER, pod.clone(), false),
        Duration::from_secs(1),
    )
    .await;
    let doc = patched(&out, &pod);
    assert!(doc["metadata"]["annotations"][names::LINEAGE]
        .as_str()
        .unwrap()
        .starts_with("prod_deploy_web."));
}

#[tokio::test]
async fn user_supplied_stasis_keys_are_removed_even_when_nothing_can_be_decided() {
    // The H1 pod: a copied claim token and a Restore decision, the label that used to skip
    // the webhook; the API server cannot be reached (the decision fails).
    let pod = json!({
        "metadata": {"name": "evil",
            "labels": {"stasis.dev/system": "true", "stasis.dev/claim-token": "T"},
            "annotations": {"stasis.dev/decision": "Restore", "stasis.dev/cold-start": "false"}},
        "spec": {"runtimeClassName": "stasis", "containers": [{"name": "c", "image": "i"}]}
    });
    for dry_run in [false, true] {
        let out = review(
            offline_hook(),
            &admission_review("alice", pod.clone(), dry_run),
            Duration::from_secs(1),
        )
        .await;
        let doc = patched(&out, &pod);
        assert_eq!(doc["metadata"]["labels"], json!({}), "dry run {dry_run}");
        assert_eq!(
            doc["metadata"]["annotations"],
            json!({"stasis.dev/cold-start": "false"}),
            "dry run {dry_run}"
        );
    }
    // Not stasis's pod: untouched.
    let mut other = pod.clone();
    other["spec"]["runtimeClassName"] = json!("runc");
    let r = response(
        &review(
            offline_hook(),
            &admission_review("alice", other, false),
            Duration::from_secs(1),
        )
        .await,
    );
    assert!(r.get("patch").is_none());
}

#[test]
fn tokens_are_label_values() {
    let t = new_token();
    assert_eq!(t.len(), 32);
    assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(t, new_token());
}
