//! Admission predicts, the controller commits: a review changes no record, and the real pod's
//! reconcile claims, against the stand-in API server with stateful lineage records
//! ([`crate::testing::api_server_with_records`]).

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::runtime::controller::Action;
use kube::ResourceExt;
use serde_json::json;
use stasis_api::names;
use stasis_core::lineage::{Lineage, LineageCheckpoint};
use stasis_core::reference::{CheckpointId, WorkloadName};

use crate::reconcile::reconcile_pod;
use crate::record::{Holder, Record};
use crate::testing::*;
use crate::webhook::tests::{
    admission_review, hook_with, patched, replicaset, rs_pod, RS_CONTROLLER,
};
use crate::webhook::{review, Webhook};

/// The checkpoint of web's orphaned lineage.
fn checkpoint_id() -> CheckpointId {
    CheckpointId::from_parts(1_700_000_000_000, 1)
}

/// Deployment web's lineage, orphaned (its pod is gone), with one checkpoint.
fn orphaned_lineage() -> Record {
    let w = WorkloadName::new("prod_deploy_web").unwrap();
    let mut lineage = Lineage::start(&w, "0ld70ken", &[]);
    lineage
        .publish(LineageCheckpoint {
            id: checkpoint_id(),
            generation: 1,
            created_unix_ms: 1_700_000_000_000,
            manifest_digest: None,
        })
        .unwrap();
    lineage.orphan();
    Record::new(
        "prod",
        lineage,
        Some(Holder {
            token: "0ld70ken".into(),
            claimed_unix_ms: 1,
            pod: Some("web-6d4f9-old".into()),
            uid: Some("uid-old".into()),
            ..Default::default()
        }),
    )
}

/// The pod web's ReplicaSet creates (as the review carries it).
fn web_pod() -> serde_json::Value {
    rs_pod("web-6d4f9", "rs-real", "6d4f9")
}

fn policy() -> stasis_api::CheckpointPolicy {
    serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": "web", "namespace": "prod"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "interval": "1h"}
    }))
    .unwrap()
}

/// The `PodCheckpoint` of the orphaned lineage's checkpoint, taken on worker-1 from a pod with
/// web's spec.
fn checkpoint_object() -> stasis_api::PodCheckpoint {
    let mut p: k8s_openapi::api::core::v1::Pod = serde_json::from_value(web_pod()).unwrap();
    p.metadata.namespace = Some("prod".into());
    let hash = stasis_api::pod::spec_hash(&p).unwrap().0;
    let lineage = orphaned_lineage().lineage.id;
    serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "web-6d4f9-old-1700000000", "namespace": "prod"},
        "spec": {"sourcePodName": "web-6d4f9-old", "sourcePodUID": "uid-old", "reason": "Heartbeat"},
        "status": {"phase": "Succeeded", "node": "worker-1",
                   "checkpointRef": format!("{lineage}/{}", checkpoint_id()),
                   "lineage": lineage.as_str(), "generation": 1, "specHash": hash}
    }))
    .unwrap()
}

/// What the webhook and the reconciler read (everything but the records).
fn routes(pods: &[&str]) -> Vec<(String, serde_json::Value)> {
    let mut r = vec![
        (
            "/apis/stasis.dev/v1alpha1/namespaces/prod/checkpointpolicies".to_owned(),
            list(
                "CheckpointPolicyList",
                vec![serde_json::to_value(policy()).unwrap()],
            ),
        ),
        (
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints".to_owned(),
            list(
                "PodCheckpointList",
                vec![serde_json::to_value(checkpoint_object()).unwrap()],
            ),
        ),
        (
            "/api/v1/namespaces/prod/pods".to_owned(),
            list("PodList", vec![]),
        ),
        (
            "/apis/apps/v1/namespaces/prod/replicasets/web-6d4f9".to_owned(),
            replicaset("web-6d4f9", "rs-real", Some(("web", "dep-real"))),
        ),
        (
            "/apis/apps/v1/namespaces/prod/deployments/web".to_owned(),
            json!({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "web", "namespace": "prod", "uid": "dep-real"}}),
        ),
        (
            "/api/v1/nodes/worker-1".to_owned(),
            json!({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": "worker-1", "labels": {names::node::READY: "true"}}}),
        ),
    ];
    for p in pods {
        r.push((
            format!("/apis/stasis.dev/v1alpha1/namespaces/prod/podrestores/{p}/status"),
            json!({"apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                   "metadata": {"name": p, "namespace": "prod"},
                   "spec": {"checkpointRef": "x/y", "targetPodName": p}}),
        ));
    }
    r
}

/// The pod as the API server creates it from a review's answer: named, with a UID, pending.
async fn admit(hook: &Arc<Webhook>, name: &str, uid: &str) -> k8s_openapi::api::core::v1::Pod {
    let pod = web_pod();
    let out = review(
        hook.clone(),
        &admission_review(RS_CONTROLLER, pod.clone(), false),
        std::time::Duration::from_secs(1),
    )
    .await;
    let mut doc = patched(&out, &pod);
    doc["metadata"]["name"] = json!(name);
    doc["metadata"]["namespace"] = json!("prod");
    doc["metadata"]["uid"] = json!(uid);
    doc["metadata"]["creationTimestamp"] = json!(crate::k8s_time(crate::now_ms()).0.to_string());
    doc["status"] = json!({"phase": "Pending"});
    serde_json::from_value(doc).unwrap()
}

fn context(client: kube::Client) -> Arc<crate::reconcile::Context> {
    context_with_checkpoints(client, vec![checkpoint_object()])
}

/// The reconcilers' context, its checkpoint cache holding `checkpoints`.
fn context_with_checkpoints(
    client: kube::Client,
    checkpoints: Vec<stasis_api::PodCheckpoint>,
) -> Arc<crate::reconcile::Context> {
    Caches {
        policies: vec![policy()],
        checkpoints,
        ..Default::default()
    }
    .context(client)
}

/// The record whose registered holder is `uid`.
fn held_by<'a>(records: &'a [Record], uid: &str) -> &'a Record {
    records
        .iter()
        .find(|r| r.holder_uid() == Some(uid))
        .unwrap_or_else(|| panic!("a record held by {uid}: {records:#?}"))
}

/// Review H2: a forged AdmissionReview for a real workload (its owners' UIDs known) with an
/// orphaned lineage changes no record; the real replacement, reconciled after, restores from
/// that lineage. Before the prediction/commit split the review claimed the lineage (generation
/// 2, its own token) and the real replacement started cold.
#[tokio::test]
async fn a_forged_review_claims_nothing_and_the_real_replacement_restores() {
    let l = orphaned_lineage();
    let (client, seen, store) =
        api_server_with_records(routes(&["web-6d4f9-real"]), std::slice::from_ref(&l));
    let before = store.lock().unwrap().clone();
    let hook = hook_with(client.clone());
    let forged = admit(&hook, "never-created", "uid-forged").await;
    assert_eq!(
        forged.metadata.annotations.as_ref().unwrap()[names::DECISION],
        "Restore",
        "the answer is the prediction a real pod would get"
    );
    assert_eq!(*store.lock().unwrap(), before, "every record as it was");
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));

    let real = admit(&hook, "web-6d4f9-real", "uid-real").await;
    assert_eq!(*store.lock().unwrap(), before, "admission writes nothing");
    reconcile_pod(Arc::new(real), context(client))
        .await
        .unwrap();
    let records = stored_records(&store);
    assert_eq!(records.len(), 1, "{records:#?}");
    let r = &records[0];
    assert_eq!(r.lineage.id, l.lineage.id);
    assert_eq!(r.lineage.generation, 2);
    assert!(!r.lineage.orphaned);
    let h = r.holder.as_ref().unwrap();
    assert_eq!(h.uid.as_deref(), Some("uid-real"));
    assert_eq!(h.pod.as_deref(), Some("web-6d4f9-real"));
    let reference = format!("{}/{}", l.lineage.id, checkpoint_id());
    assert_eq!(h.restore.as_deref(), Some(reference.as_str()));
    let w = writes(&seen);
    let created = w
        .iter()
        .find(|(m, p, _)| m == "POST" && p.ends_with("/podrestores"))
        .expect("a PodRestore");
    assert_eq!(created.2["spec"]["checkpointRef"], reference.as_str());
    assert_eq!(created.2["spec"]["targetPodUID"], "uid-real");
}

/// Review H2: a forged review for a workload without records creates none (it used to create a
/// lineage record per review, up to the namespace's cap).
#[tokio::test]
async fn a_forged_review_for_a_new_workload_creates_no_record() {
    let (client, seen, store) = api_server_with_records(routes(&[]), &[]);
    let hook = hook_with(client);
    for i in 0..3 {
        let forged = admit(&hook, "x", &format!("uid-{i}")).await;
        let ann = forged.metadata.annotations.unwrap();
        assert_eq!(ann[names::DECISION], "ColdStart");
        assert!(
            ann[names::LINEAGE].starts_with("prod_deploy_web."),
            "{ann:?}"
        );
    }
    assert!(store.lock().unwrap().is_empty());
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
}

/// Two real pods admitted for the same orphaned lineage, both prepared for its restore: the
/// first committed gets it; the other starts cold with a new lineage of its own, a Warning
/// Event that says why, and its decision reported (its wait container stops waiting).
#[tokio::test]
async fn of_two_pods_predicted_the_same_lineage_one_restores_and_the_other_starts_cold() {
    let l = orphaned_lineage();
    let (client, _, store) =
        api_server_with_records(routes(&["web-6d4f9-a"]), std::slice::from_ref(&l));
    let hook = hook_with(client.clone());
    let a = admit(&hook, "web-6d4f9-a", "uid-a").await;
    let b = admit(&hook, "web-6d4f9-b", "uid-b").await;
    for p in [&a, &b] {
        let ann = p.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann[names::DECISION], "Restore");
        assert_eq!(ann[names::LINEAGE], l.lineage.id.as_str());
    }
    reconcile_pod(Arc::new(a.clone()), context(client))
        .await
        .unwrap();
    // Pod a is there when b is reconciled.
    let mut with_a = routes(&["web-6d4f9-b"]);
    with_a.retain(|(p, _)| p != "/api/v1/namespaces/prod/pods");
    with_a.push((
        "/api/v1/namespaces/prod/pods".into(),
        list("PodList", vec![serde_json::to_value(&a).unwrap()]),
    ));
    let (client, seen) = api_server_over(with_a.clone(), &store);
    reconcile_pod(Arc::new(b.clone()), context(client))
        .await
        .unwrap();
    let records = stored_records(&store);
    assert_eq!(records.len(), 2, "{records:#?}");
    let of = |uid: &str| held_by(&records, uid);
    assert_eq!(of("uid-a").lineage.id, l.lineage.id);
    assert!(of("uid-a").holder.as_ref().unwrap().restore.is_some());
    let rb = of("uid-b");
    assert_ne!(rb.lineage.id, l.lineage.id);
    assert_eq!(rb.lineage.generation, 1);
    assert!(rb.holder.as_ref().unwrap().restore.is_none());
    let w = writes(&seen);
    assert!(
        !w.iter().any(|(_, p, _)| p.contains("podrestores")),
        "no PodRestore for b: {w:#?}"
    );
    let event = w
        .iter()
        .find(|(_, p, _)| p.ends_with("/events"))
        .expect("a Warning Event");
    assert_eq!(event.2["type"], "Warning");
    assert_eq!(event.2["regarding"]["name"], "web-6d4f9-b");
    let note = event.2["note"].as_str().unwrap();
    assert!(
        note.contains("taken by pod web-6d4f9-a") && note.contains("starts cold"),
        "{note}"
    );
    let patch = w
        .iter()
        .find(|(m, p, _)| m == "PATCH" && p == "/api/v1/namespaces/prod/pods/web-6d4f9-b")
        .expect("b's keys updated");
    let ann = &patch.2["metadata"]["annotations"];
    assert_eq!(ann[names::DECISION_REPORTED], "true");
    assert_eq!(ann[names::DECISION], "ColdStart");
    assert_eq!(ann[names::LINEAGE], rb.lineage.id.as_str());
    // Reconciled again before the caches caught up (the same old pod, no record cached): the
    // commit finds its own record and neither writes nor tells again.
    let mut told = b.clone();
    told.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(names::DECISION_REPORTED.into(), "true".into());
    with_a.push((
        "/api/v1/namespaces/prod/pods/web-6d4f9-b".into(),
        serde_json::to_value(&told).unwrap(),
    ));
    let (client, seen) = api_server_over(with_a, &store);
    let before = store.lock().unwrap().clone();
    reconcile_pod(Arc::new(b), context(client)).await.unwrap();
    assert_eq!(*store.lock().unwrap(), before);
    let w = writes(&seen);
    assert!(
        !w.iter()
            .any(|(m, p, _)| p.ends_with("/events") || m == "PUT"),
        "{w:#?}"
    );
}

/// Two pods admitted at once for a workload with two orphaned lineages are both predicted the
/// newest: the one committed second restores the other lineage (its checkpoint's node fits the
/// pod's node requirements), as when each admission claimed in turn; no Warning.
#[tokio::test]
async fn the_pod_committed_second_restores_another_orphaned_lineage_that_fits() {
    let l1 = orphaned_lineage();
    let w = WorkloadName::new("prod_deploy_web").unwrap();
    let mut lineage = Lineage::start(&w, "beef0002", &[]);
    let older = CheckpointId::from_parts(1_699_000_000_000, 2);
    lineage
        .publish(LineageCheckpoint {
            id: older.clone(),
            generation: 1,
            created_unix_ms: 1_699_000_000_000,
            manifest_digest: None,
        })
        .unwrap();
    lineage.orphan();
    let l2 = Record::new(
        "prod",
        lineage,
        Some(Holder {
            token: "beef0002".into(),
            claimed_unix_ms: 1,
            pod: Some("web-6d4f9-old2".into()),
            uid: Some("uid-old2".into()),
            ..Default::default()
        }),
    );
    let mut ck2 = serde_json::to_value(checkpoint_object()).unwrap();
    ck2["metadata"]["name"] = json!("web-6d4f9-old2-1699000000");
    ck2["status"]["checkpointRef"] = json!(format!("{}/{older}", l2.lineage.id));
    ck2["status"]["lineage"] = json!(l2.lineage.id.as_str());
    let mut routes = routes(&["web-6d4f9-a", "web-6d4f9-b"]);
    for (p, v) in routes.iter_mut() {
        if p.ends_with("/podcheckpoints") {
            v["items"].as_array_mut().unwrap().push(ck2.clone());
        }
    }
    let (client, _, store) = api_server_with_records(routes.clone(), &[l1.clone(), l2.clone()]);
    let hook = hook_with(client.clone());
    let a = admit(&hook, "web-6d4f9-a", "uid-a").await;
    let b = admit(&hook, "web-6d4f9-b", "uid-b").await;
    for p in [&a, &b] {
        assert_eq!(p.annotations()[names::LINEAGE], l1.lineage.id.as_str());
    }
    let ctx = Caches {
        policies: vec![policy()],
        checkpoints: vec![checkpoint_object(), serde_json::from_value(ck2).unwrap()],
        ..Default::default()
    };
    reconcile_pod(Arc::new(a.clone()), ctx.context(client))
        .await
        .unwrap();
    // Pod a is there when b is reconciled.
    for (p, v) in routes.iter_mut() {
        if p == "/api/v1/namespaces/prod/pods" {
            *v = list("PodList", vec![serde_json::to_value(&a).unwrap()]);
        }
    }
    let (client, seen) = api_server_over(routes, &store);
    let ctx = Caches {
        policies: vec![policy()],
        ..Default::default()
    };
    reconcile_pod(Arc::new(b), ctx.context(client))
        .await
        .unwrap();
    let records = stored_records(&store);
    assert_eq!(records.len(), 2, "{records:#?}");
    let of = |uid: &str| held_by(&records, uid);
    assert_eq!(of("uid-a").lineage.id, l1.lineage.id);
    assert_eq!(of("uid-b").lineage.id, l2.lineage.id);
    let restore_b = of("uid-b").holder.as_ref().unwrap().restore.clone();
    assert_eq!(restore_b, Some(format!("{}/{older}", l2.lineage.id)));
    let w = writes(&seen);
    assert!(
        !w.iter()
            .any(|(_, p, b)| p.ends_with("/events") && b["type"] == "Warning"),
        "{w:#?}"
    );
}

/// A pod prepared for a restore whose checkpoint is no longer restorable when the controller
/// commits (retention, or it was marked bad): the lineage is still continued, the pod starts
/// cold, and the Warning Event says why.
#[tokio::test]
async fn a_checkpoint_gone_before_the_commit_means_a_cold_start_with_the_reason() {
    let l = orphaned_lineage();
    let (client, seen, store) =
        api_server_with_records(routes(&["web-6d4f9-a"]), std::slice::from_ref(&l));
    let a = admit(&hook_with(client.clone()), "web-6d4f9-a", "uid-a").await;
    assert_eq!(
        a.metadata.annotations.as_ref().unwrap()[names::DECISION],
        "Restore"
    );
    // Retention deletes the checkpoint before the controller sees the pod.
    {
        let mut cms = store.lock().unwrap();
        let cm = cms.get_mut(&l.name()).unwrap();
        let mut r = l.clone();
        r.lineage.checkpoints.clear();
        let data = r.to_config_map().unwrap().data.unwrap();
        cm["data"] = serde_json::to_value(data).unwrap();
    }
    reconcile_pod(Arc::new(a), context(client)).await.unwrap();
    let records = stored_records(&store);
    let r = &records[0];
    assert_eq!(r.holder_uid(), Some("uid-a"));
    assert_eq!(r.lineage.generation, 2, "the lineage is continued");
    assert!(r.holder.as_ref().unwrap().restore.is_none());
    let w = writes(&seen);
    assert!(
        !w.iter().any(|(_, p, _)| p.contains("podrestores")),
        "{w:#?}"
    );
    let event = w
        .iter()
        .find(|(_, p, _)| p.ends_with("/events"))
        .expect("a Warning Event");
    let note = event.2["note"].as_str().unwrap();
    assert!(
        note.contains("no longer holds") && note.contains("starts cold"),
        "{note}"
    );
}

/// While the source's final checkpoint is in flight, the commit waits (a requeue, nothing
/// written), as the admission did.
#[tokio::test]
async fn the_commit_waits_for_an_in_flight_final_checkpoint() {
    let mut l = orphaned_lineage();
    l.lineage
        .begin_final(crate::now_ms() + 30_000, crate::now_ms());
    // The source's termination checkpoint is still running.
    let mut routes = routes(&["web-6d4f9-a"]);
    let fin = json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "web-6d4f9-old-final", "namespace": "prod"},
        "spec": {"sourcePodName": "web-6d4f9-old", "sourcePodUID": "uid-old", "reason": "Termination"},
        "status": {"phase": "Running"}
    });
    for (p, v) in routes.iter_mut() {
        if p.ends_with("/podcheckpoints") {
            v["items"].as_array_mut().unwrap().push(fin.clone());
        }
    }
    let (client, _, store) = api_server_with_records(routes, std::slice::from_ref(&l));
    let hook = Arc::new(Webhook {
        cfg: crate::webhook::WebhookConfig {
            final_wait: std::time::Duration::ZERO,
            ..hook_with(client.clone()).cfg.clone()
        },
        ..Arc::into_inner(hook_with(client.clone())).unwrap()
    });
    let a = admit(&hook, "web-6d4f9-a", "uid-a").await;
    let before = store.lock().unwrap().clone();
    let cks = vec![checkpoint_object(), serde_json::from_value(fin).unwrap()];
    let action = reconcile_pod(Arc::new(a), context_with_checkpoints(client, cks))
        .await
        .unwrap();
    assert_eq!(
        action,
        Action::requeue(std::time::Duration::from_millis(500))
    );
    assert_eq!(*store.lock().unwrap(), before);
}

/// The API calls of one admission, by method and path (the records' own list included).
fn calls(seen: &Seen) -> Vec<String> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|(m, p, _)| format!("{m} {p}"))
        .collect()
}

/// The claim reads the process's checkpoint cache, not a list of the namespace's
/// `PodCheckpoint`s per admission (which grew with every checkpoint there): with the cache
/// synced and the stand-in API server answering no checkpoint list at all, the restore is
/// still decided, with the checkpoint's spec hash and node from the cache. Before, every
/// admission listed them (here a 404: the review failed open, a cold start).
#[tokio::test]
async fn an_admission_reads_checkpoints_from_the_cache() {
    let l = orphaned_lineage();
    let routes: Vec<_> = routes(&[])
        .into_iter()
        .filter(|(p, _)| !p.ends_with("/podcheckpoints"))
        .collect();
    let (client, seen, _store) = api_server_with_records(routes, std::slice::from_ref(&l));
    let hook = Arc::new(Webhook {
        checkpoints: crate::cache::Checkpoints::of(vec![checkpoint_object()]),
        ..Arc::into_inner(hook_with(client)).unwrap()
    });
    let pod = admit(&hook, "web-6d4f9-a", "uid-a").await;
    let ann = pod.metadata.annotations.unwrap();
    assert_eq!(ann[names::DECISION], "Restore", "{ann:?}");
    let calls = calls(&seen);
    assert!(
        !calls.iter().any(|c| c.contains("/podcheckpoints")),
        "{calls:#?}"
    );
    // What one admission of a ReplicaSet's pod asks the API server: its owners, the
    // namespace's policies, the workload's records, the node of the checkpoint (affinity).
    assert!(calls.len() <= 6, "{calls:#?}");
}

/// A record naming a checkpoint the cache does not have (the watch lags behind the API
/// server): the namespace's checkpoints are listed, and the restore is decided as before.
#[tokio::test]
async fn a_checkpoint_missing_from_the_cache_is_listed() {
    let l = orphaned_lineage();
    let (client, seen, _store) = api_server_with_records(routes(&[]), std::slice::from_ref(&l));
    let hook = Arc::new(Webhook {
        checkpoints: crate::cache::Checkpoints::of(vec![]),
        ..Arc::into_inner(hook_with(client)).unwrap()
    });
    let pod = admit(&hook, "web-6d4f9-a", "uid-a").await;
    assert_eq!(
        pod.metadata.annotations.unwrap()[names::DECISION],
        "Restore"
    );
    let lists = calls(&seen)
        .into_iter()
        .filter(|c| c.ends_with("/podcheckpoints"))
        .count();
    assert_eq!(lists, 1);
}

/// The holders of a workload's lineages are looked for with one list of pods (a set selector
/// of their claim tokens), not one list per lineage.
#[tokio::test]
async fn the_holders_of_several_lineages_are_one_pod_list() {
    let w = WorkloadName::new("prod_deploy_web").unwrap();
    let mut recs = Vec::new();
    for i in 0..5 {
        let token = format!("70ken{i}");
        let mut lineage = Lineage::start(&w, &token, &[]);
        lineage.holder = Some(token.clone());
        recs.push(Record::new(
            "prod",
            lineage,
            Some(Holder {
                token,
                claimed_unix_ms: crate::now_ms(),
                pod: Some(format!("web-6d4f9-{i}")),
                uid: Some(format!("uid-{i}")),
                ..Default::default()
            }),
        ));
    }
    let (client, seen, _store) = api_server_with_records(routes(&[]), &recs);
    let hook = Arc::new(Webhook {
        checkpoints: crate::cache::Checkpoints::of(vec![]),
        ..Arc::into_inner(hook_with(client)).unwrap()
    });
    admit(&hook, "web-6d4f9-new", "uid-new").await;
    let lists: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, p, _)| m == "GET" && p == "/api/v1/namespaces/prod/pods")
        .map(|(_, p, _)| p.clone())
        .collect();
    assert_eq!(lists.len(), 1, "{lists:#?}");
}

fn owner_meta(name: &str, uid: &str, controller: Option<(&str, &str)>) -> ObjectMeta {
    ObjectMeta {
        namespace: Some("prod".into()),
        name: Some(name.into()),
        uid: Some(uid.into()),
        owner_references: controller.map(|(n, u)| {
            vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                name: n.into(),
                uid: u.into(),
                controller: Some(true),
                ..OwnerReference::default()
            }]
        }),
        ..ObjectMeta::default()
    }
}

/// An admission of the orphaned lineage's ReplicaSet pod with the owners' cache holding the
/// ReplicaSet and Deployment under `rs_uid` and `deploy_uid`: its decision and the API calls.
async fn admit_with_owners(rs_uid: &str, deploy_uid: &str) -> (String, Vec<String>) {
    let l = orphaned_lineage();
    let (client, seen, _store) = api_server_with_records(routes(&[]), std::slice::from_ref(&l));
    let hook = Arc::new(Webhook {
        checkpoints: crate::cache::Checkpoints::of(vec![checkpoint_object()]),
        owners: Some(crate::owners::OwnerCache::of(
            vec![owner_meta("web-6d4f9", rs_uid, Some(("web", deploy_uid)))],
            vec![owner_meta("web", deploy_uid, None)],
        )),
        ..Arc::into_inner(hook_with(client)).unwrap()
    });
    let pod = admit(&hook, "web-6d4f9-a", "uid-a").await;
    let decision = pod.metadata.annotations.unwrap()[names::DECISION].clone();
    (decision, calls(&seen))
}

/// With the owners' metadata cached (`crate::owners`), an admission of a ReplicaSet's pod reads
/// neither its ReplicaSet nor its Deployment from the API server, and decides as before.
#[tokio::test]
async fn an_admission_reads_its_owners_from_the_cache() {
    let (decision, calls) = admit_with_owners("rs-real", "dep-real").await;
    assert_eq!(decision, "Restore");
    assert!(
        !calls
            .iter()
            .any(|c| c.contains("/replicasets/") || c.contains("/deployments/")),
        "{calls:#?}"
    );
}

/// A cached owner whose UID is not the one the reference names (deleted and created again
/// under the same name, and the cache behind) is read from the API server: the answer is the
/// API server's, here the real ReplicaSet, and the restore is decided.
#[tokio::test]
async fn an_owner_cached_under_another_uid_is_read_from_the_api_server() {
    let (decision, calls) = admit_with_owners("rs-old", "dep-old").await;
    assert_eq!(decision, "Restore");
    for owner in ["/replicasets/web-6d4f9", "/deployments/web"] {
        assert!(
            calls.iter().any(|c| c.ends_with(owner)),
            "{owner}: {calls:#?}"
        );
    }
}
