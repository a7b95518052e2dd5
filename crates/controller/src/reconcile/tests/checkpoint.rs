use super::*;

/// Review H3: a checkpoint of namespace `a` naming a lineage of namespace `b` (or written by
/// a pod that is not the holder) changes no record and deletes nothing; it ends `Failed`.
#[tokio::test]
async fn a_checkpoint_into_a_foreign_lineage_changes_nothing() {
    let r = record_of_a("b");
    let l = r.lineage.id.as_str().to_owned();
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let id = CheckpointId::from_parts(1_700_000_100_000, 7);
    for (ns, uid, why) in [
        ("a", "uid-1", "another namespace"),
        ("b", "uid-evil", "not the holder"),
    ] {
        let (client, seen) = api_server(vec![(
            cm_path.clone(),
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let ck = succeeded_in(ns, "inject", &l, &id, uid);
        let ctx = context_with(client, vec![ck.clone()], vec![r.clone()], vec![], vec![]);
        reconcile_checkpoint(Arc::new(ck), ctx.clone())
            .await
            .unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "{why}: only the status: {w:#?}");
        assert_eq!(
            w[0].1,
            format!("/apis/stasis.dev/v1alpha1/namespaces/{ns}/podcheckpoints/inject/status")
        );
        assert_eq!(w[0].2["status"]["phase"], "Failed");
        let message = w[0].2["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.contains(why), "{message}");
    }
}

/// A published checkpoint reconciled again after its source pod was replaced as holder (a
/// controller restart relists every `PodCheckpoint`) is left alone: it stays `Succeeded` and
/// restorable, never marked fenced.
#[tokio::test]
async fn a_published_checkpoint_of_a_former_holder_is_left_alone() {
    let mut r = record_of_a("prod");
    let l = r.lineage.id.as_str().to_owned();
    let id = CheckpointId::from_parts(1_700_000_100_000, 7);
    r.lineage
        .publish(LineageCheckpoint {
            id: id.clone(),
            generation: 2,
            created_unix_ms: 1_700_000_100_000,
            manifest_digest: Some(digest_of(&id)),
        })
        .unwrap();
    // The lineage is held by another pod now.
    r.holder.as_mut().unwrap().uid = Some("uid-next".into());
    let (client, seen) = api_server(vec![(
        format!("/api/v1/namespaces/stasis/configmaps/{}", r.name()),
        serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
    )]);
    let ck = succeeded_in("prod", "final", &l, &id, "uid-1");
    let ctx = context_with(client, vec![ck.clone()], vec![r], vec![], vec![]);
    reconcile_checkpoint(Arc::new(ck), ctx).await.unwrap();
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
}

/// Review H4: a `PodCheckpoint` whose status another node's agent wrote (it claims the
/// holder's UID) is not published: the source pod is on another node.
#[tokio::test]
async fn a_checkpoint_written_by_another_nodes_agent_is_not_published() {
    let r = record_of_a("prod");
    let l = r.lineage.id.as_str().to_owned();
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let (client, seen) = api_server(vec![(
        cm_path,
        serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
    )]);
    let id = CheckpointId::from_parts(1_700_000_100_000, 7);
    let mut ck = succeeded_in("prod", "forged", &l, &id, "uid-1");
    ck.status.as_mut().unwrap().node = Some("worker-2".into());
    let pod = running_pod("2026-01-01T00:00:00Z");
    let ctx = context_with(
        client,
        vec![ck.clone()],
        vec![r.clone()],
        vec![pod.clone()],
        vec![],
    );
    reconcile_checkpoint(Arc::new(ck.clone()), ctx)
        .await
        .unwrap();
    let w = writes(&seen);
    assert_eq!(w.len(), 1, "only the status: {w:#?}");
    assert_eq!(w[0].2["status"]["phase"], "Failed");
    let message = w[0].2["status"]["conditions"][0]["message"].to_string();
    assert!(
        message.contains("node worker-2, but the source pod is on node worker-1"),
        "{message}"
    );
    // The pod's own node's agent passes; a pod gone from the cache leaves it to the API
    // server's policy.
    ck.status.as_mut().unwrap().node = Some("worker-1".into());
    assert_eq!(wrong_node(&ck, Some("uid-1"), &store_of(vec![pod])), None);
    assert_eq!(wrong_node(&ck, Some("uid-1"), &store_of(vec![])), None);
}

/// A termination checkpoint of another namespace's pod does not hold that lineage's claims
/// back.
#[tokio::test]
async fn a_foreign_termination_checkpoint_sets_no_final_wait() {
    let r = record_of_a("b");
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let (client, seen) = api_server(vec![(
        cm_path,
        serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
    )]);
    let fin: PodCheckpoint = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "p-final-1", "namespace": "a",
                     "creationTimestamp": crate::k8s_time(now_ms()).0.to_string()},
        "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Termination", "timeoutSeconds": 2000000000},
        "status": {"phase": "Running", "lineage": r.lineage.id.as_str(), "generation": 2}
    }))
    .unwrap();
    let ctx = context_with(client, vec![fin.clone()], vec![r], vec![], vec![]);
    reconcile_checkpoint(Arc::new(fin), ctx).await.unwrap();
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
}

/// The controller records each published checkpoint's manifest digest (what the restoring
/// agent holds the manifest to), and publishes nothing without one: a `PodCheckpoint` that
/// names no digest, or a malformed one, ends `Failed` and the record is not written.
#[tokio::test]
async fn a_checkpoint_is_published_with_its_manifest_digest_and_never_without() {
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let lineage = Lineage::start(&w, "tok", &[]);
    let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
    record.resource_version = Some("9".into());
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
    let id = CheckpointId::from_parts(1_700_000_010_000, 1);
    let l = lineage.id.as_str();
    for digest in [None, Some("sha256:abc"), Some("md5:0")] {
        let (client, seen) = api_server(vec![(
            cm_path.clone(),
            serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
        )]);
        let mut ck = succeeded("ck-1", l, &id, 1);
        ck.status.as_mut().unwrap().manifest_digest = digest.map(str::to_owned);
        let ctx = test_context(client, vec![ck.clone()]);
        reconcile_checkpoint(Arc::new(ck), ctx.clone())
            .await
            .unwrap();
        let w = writes(&seen);
        assert_eq!(w.len(), 1, "{digest:?}: only the status: {w:#?}");
        assert!(w[0].1.ends_with("/podcheckpoints/ck-1/status"), "{w:#?}");
        assert_eq!(w[0].2["status"]["phase"], "Failed");
        let message = w[0].2["status"]["conditions"][0]["message"].to_string();
        assert!(message.contains("manifestDigest"), "{message}");
    }
    let (client, seen) = api_server(vec![(
        cm_path.clone(),
        serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
    )]);
    let ck = succeeded("ck-1", l, &id, 1);
    let ctx = test_context(client, vec![ck.clone()]);
    reconcile_checkpoint(Arc::new(ck), ctx.clone())
        .await
        .unwrap();
    let w = writes(&seen);
    let put = w
        .iter()
        .find(|(m, p, _)| m == "PUT" && p == &cm_path)
        .expect("the record written");
    let published =
        Record::from_config_map(&serde_json::from_value(put.2.clone()).unwrap()).unwrap();
    assert_eq!(
        published.lineage.checkpoints[0].manifest_digest.as_deref(),
        Some(digest_of(&id).as_str())
    );
}

#[tokio::test]
async fn a_succeeded_checkpoint_is_published_then_retention_deletes_the_oldest() {
    retention_deletes_the_oldest(false).await;
}

/// A delete the API server refuses (403) is not counted as deleted (review M7: it was).
#[tokio::test]
async fn a_refused_retention_delete_is_not_counted() {
    retention_deletes_the_oldest(true).await;
}

async fn retention_deletes_the_oldest(refused: bool) {
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let mut lineage = Lineage::start(&w, "tok", &[]);
    let ids: Vec<CheckpointId> = (1..=3u64)
        .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
        .collect();
    for id in &ids[..2] {
        lineage
            .publish(LineageCheckpoint {
                id: id.clone(),
                generation: 1,
                created_unix_ms: 1,
                manifest_digest: None,
            })
            .unwrap();
    }
    let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
    record.resource_version = Some("9".into());
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
    let mut routes = vec![(
        cm_path.clone(),
        serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
    )];
    if refused {
        routes.push((
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints/ck-1".to_owned(),
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "reason": "Forbidden", "code": 403, "message": "forbidden"}),
        ));
    }
    let (client, seen) = api_server(routes);
    let l = lineage.id.as_str();
    let cks = vec![
        succeeded("ck-1", l, &ids[0], 1),
        succeeded("ck-2", l, &ids[1], 1),
        succeeded("ck-3", l, &ids[2], 1),
    ];
    // Policy: keepLast 2 (the context's policy has the default 3: use a fresh one).
    let ctx = test_context(client, cks.clone());
    let policy: CheckpointPolicy = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": "counter", "namespace": "prod"},
        "spec": {"selector": {}, "interval": "10s", "retention": {"keepLast": 2}}
    }))
    .unwrap();
    let ctx = Caches {
        policies: vec![policy],
        checkpoints: cks.clone(),
        ..Default::default()
    }
    .context(ctx.client.clone());
    reconcile_checkpoint(Arc::new(cks[2].clone()), ctx.clone())
        .await
        .unwrap();
    let calls = seen.lock().unwrap().clone();
    let writes: Vec<_> = calls.iter().filter(|(m, _, _)| m != "GET").collect();
    assert_eq!(writes.len(), 3, "{calls:#?}");
    // 1. publish: the record replaced at the version read, with the third checkpoint.
    assert_eq!(
        (writes[0].0.as_str(), writes[0].1.as_str()),
        ("PUT", cm_path.as_str())
    );
    assert_eq!(writes[0].2["metadata"]["resourceVersion"], "9");
    let published =
        Record::from_config_map(&serde_json::from_value(writes[0].2.clone()).unwrap()).unwrap();
    assert_eq!(published.lineage.checkpoints.len(), 3);
    // 2. retention: the oldest leaves the record first (at the new version)...
    assert_eq!(writes[1].2["metadata"]["resourceVersion"], "101");
    let kept =
        Record::from_config_map(&serde_json::from_value(writes[1].2.clone()).unwrap()).unwrap();
    assert_eq!(
        kept.lineage
            .checkpoints
            .iter()
            .map(|c| c.id.clone())
            .collect::<Vec<_>>(),
        ids[1..].to_vec()
    );
    // 3. ...then its PodCheckpoint is deleted.
    assert_eq!(
        (writes[2].0.as_str(), writes[2].1.as_str()),
        (
            "DELETE",
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints/ck-1"
        )
    );
    assert_eq!(
        ctx.metrics.checkpoints_deleted.get(),
        if refused { 0 } else { 1 }
    );
}

#[tokio::test]
async fn a_checkpoint_from_a_fenced_generation_is_marked_failed() {
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let mut lineage = Lineage::start(&w, "tok", &[]);
    lineage.generation = 3;
    let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
    record.resource_version = Some("9".into());
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
    let (client, seen) = api_server(vec![(
        cm_path,
        serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
    )]);
    let id = CheckpointId::from_parts(1_700_000_000_000, 1);
    let late = succeeded("late", lineage.id.as_str(), &id, 2);
    let ctx = test_context(client, vec![late.clone()]);
    reconcile_checkpoint(Arc::new(late), ctx.clone())
        .await
        .unwrap();
    let calls = seen.lock().unwrap().clone();
    let writes: Vec<_> = calls.iter().filter(|(m, _, _)| m != "GET").collect();
    assert_eq!(writes.len(), 1, "{calls:#?}");
    assert_eq!(
        (writes[0].0.as_str(), writes[0].1.as_str()),
        (
            "PATCH",
            "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints/late/status"
        )
    );
    let status = &writes[0].2["status"];
    assert_eq!(status["phase"], "Failed");
    assert_eq!(status["conditions"][0]["reason"], "Fenced");
    assert_eq!(ctx.metrics.checkpoints_fenced.get(), 1);
}

#[tokio::test]
async fn a_running_termination_checkpoint_holds_claims_back() {
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let lineage = Lineage::start(&w, "tok", &[]);
    let mut record = Record::new("prod", lineage.clone(), holder_uid_1());
    record.resource_version = Some("9".into());
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", record.name());
    let (client, seen) = api_server(vec![(
        cm_path.clone(),
        serde_json::to_value(record.to_config_map().unwrap()).unwrap(),
    )]);
    let created = now_ms();
    let fin: PodCheckpoint = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "p-final-1", "namespace": "prod",
                     "creationTimestamp": crate::k8s_time(created).0.to_string()},
        "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Termination", "timeoutSeconds": 20},
        "status": {"phase": "Running", "lineage": lineage.id.as_str(), "generation": 1}
    }))
    .unwrap();
    let ctx = test_context(client, vec![fin.clone()]);
    reconcile_checkpoint(Arc::new(fin), ctx).await.unwrap();
    let calls = seen.lock().unwrap().clone();
    let puts: Vec<_> = calls.iter().filter(|(m, _, _)| m == "PUT").collect();
    assert_eq!(puts.len(), 1, "{calls:#?}");
    let saved =
        Record::from_config_map(&serde_json::from_value(puts[0].2.clone()).unwrap()).unwrap();
    let deadline = saved.lineage.final_deadline_unix_ms.unwrap();
    // Creation time has second precision.
    assert!(
        deadline + 1_000 >= created + 25_000 && deadline <= created + 25_000,
        "{deadline} vs {created}"
    );
}

/// Retention follows the policy that selects the holder pod, not a label on the checkpoint.
#[tokio::test]
async fn retention_ignores_a_policy_label_set_by_the_user() {
    let mut r = record_of_a("prod");
    let l = r.lineage.id.clone();
    let ids: Vec<CheckpointId> = (1..=3u64)
        .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
        .collect();
    for id in &ids[..2] {
        r.lineage
            .publish(LineageCheckpoint {
                id: id.clone(),
                generation: 2,
                created_unix_ms: 1,
                manifest_digest: None,
            })
            .unwrap();
    }
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let (client, seen) = api_server(vec![(
        cm_path,
        serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
    )]);
    let policy = |name: &str, app: &str, keep: u32| -> CheckpointPolicy {
        serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": name, "namespace": "prod"},
            "spec": {"selector": {"matchLabels": {"app": app}}, "interval": "10s",
                     "retention": {"keepLast": keep}}
        }))
        .unwrap()
    };
    let mut ck = succeeded_in("prod", "ck-3", l.as_str(), &ids[2], "uid-1");
    ck.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(names::POLICY.into(), "aaa-keep-one".into());
    let mut holder = running_pod("2026-01-01T00:00:00Z");
    // The pod the record names (by name and UID).
    holder.metadata.name = Some("counter-a".into());
    let ctx = context_with(
        client,
        vec![ck.clone()],
        vec![r],
        vec![holder],
        vec![
            policy("aaa-keep-one", "other", 1),
            policy("counter", "counter", 3),
        ],
    );
    reconcile_checkpoint(Arc::new(ck), ctx.clone())
        .await
        .unwrap();
    let w = writes(&seen);
    assert_eq!(w.len(), 1, "published, nothing deleted: {w:#?}");
    assert_eq!(ctx.metrics.checkpoints_deleted.get(), 0);
}

#[test]
fn checkpoint_lineage_from_status_only() {
    let mut c: PodCheckpoint = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": "c", "namespace": "n",
                     "annotations": {names::LINEAGE: "l.1", names::GENERATION: "2"}},
        "spec": {"sourcePodName": "p"}
    }))
    .unwrap();
    // Annotations are anyone's to set: never read.
    assert_eq!(checkpoint_lineage(&c), None);
    c.status = Some(PodCheckpointStatus {
        lineage: Some("l.2".into()),
        generation: Some(5),
        ..Default::default()
    });
    assert_eq!(checkpoint_lineage(&c), Some(("l.2".into(), 5)));
}

/// Retention's policy comes from the holder pod, found by the name and UID the record keeps
/// (a lookup in the pod cache, not a scan of every pod per publish); a pod of that name with
/// another UID is another pod, and a record naming no pod is looked up by UID.
#[tokio::test]
async fn the_holder_pod_is_found_by_name_and_uid() {
    let r = record_of_a("prod");
    let mut holder = running_pod("2026-01-01T00:00:00Z");
    holder.metadata.name = Some("counter-a".into());
    let mut other = holder.clone();
    other.metadata.uid = Some("uid-2".into());
    let ctx = context_with(offline_client(), vec![], vec![], vec![holder], vec![]);
    let found = holder_pod(&r, &ctx).expect("the holder");
    assert_eq!(found.metadata.uid.as_deref(), Some("uid-1"));
    let ctx = context_with(
        offline_client(),
        vec![],
        vec![],
        vec![other.clone()],
        vec![],
    );
    assert!(holder_pod(&r, &ctx).is_none(), "same name, another UID");
    let mut unnamed = r.clone();
    unnamed.holder.as_mut().unwrap().pod = None;
    let mut renamed = other;
    renamed.metadata.uid = Some("uid-1".into());
    renamed.metadata.name = Some("elsewhere".into());
    let ctx = context_with(offline_client(), vec![], vec![], vec![renamed], vec![]);
    assert!(
        holder_pod(&unnamed, &ctx).is_some(),
        "by UID when no name is kept"
    );
}

/// A heartbeat in flight does not reconcile its pod again (the reconcile that created it
/// requeued itself); its end does, and so does any change of another checkpoint.
#[test]
fn only_a_finished_heartbeat_reconciles_its_pod() {
    let ck = |reason: &str, phase: Option<&str>| -> PodCheckpoint {
        let mut v = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "c", "namespace": "prod"},
            "spec": {"sourcePodName": "p", "sourcePodUID": "u", "reason": reason}
        });
        if let Some(p) = phase {
            v["status"] = json!({"phase": p});
        }
        serde_json::from_value(v).unwrap()
    };
    for phase in [None, Some("Pending"), Some("Running")] {
        assert_eq!(pod_to_reconcile(ck("Heartbeat", phase)), None, "{phase:?}");
    }
    let pod = Some(ObjectRef::<Pod>::new("p").within("prod"));
    for phase in ["Succeeded", "Failed"] {
        assert_eq!(
            pod_to_reconcile(ck("Heartbeat", Some(phase))),
            pod,
            "{phase}"
        );
    }
    for reason in ["Manual", "Termination"] {
        for phase in [None, Some("Running"), Some("Succeeded")] {
            assert_eq!(
                pod_to_reconcile(ck(reason, phase)),
                pod,
                "{reason} {phase:?}"
            );
        }
    }
}
