use super::*;

/// Review H1: pod B carries the claim token of record R, held by pod A's UID, and asks for
/// a restore: no PodRestore, R untouched (not orphaned), a Warning Event on B.
#[tokio::test]
async fn a_copied_claim_token_restores_nothing_and_orphans_nothing() {
    let (client, seen) = api_server(vec![]);
    let r = record_of_a("prod");
    let mut b = running_pod("2026-01-01T00:00:00Z");
    b.metadata.name = Some("evil".into());
    b.metadata.uid = Some("uid-b".into());
    b.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(names::DECISION.into(), "Restore".into());
    let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
    reconcile_pod(Arc::new(b), ctx.clone()).await.unwrap();
    let w = writes(&seen);
    assert!(
        !w.iter().any(|(_, p, _)| p.contains("podrestores")),
        "no PodRestore: {w:#?}"
    );
    assert!(
        !w.iter().any(|(_, p, _)| p.contains("configmaps")),
        "the holder's record is not written (not orphaned): {w:#?}"
    );
    let event = w
        .iter()
        .find(|(_, p, _)| p.ends_with("/events"))
        .expect("a Warning Event");
    assert_eq!(event.2["reason"], "ClaimRefused");
    assert_eq!(event.2["type"], "Warning");
    assert_eq!(event.2["regarding"]["name"], "evil");
    assert!(
        event.2["note"].as_str().unwrap().contains("counter-a"),
        "{event:?}"
    );
    // Marked handled (its wait container, if any, stops waiting), once.
    assert!(w.iter().any(|(m, p, b)| m == "PATCH"
        && p == "/api/v1/namespaces/prod/pods/evil"
        && b["metadata"]["annotations"][names::DECISION_REPORTED] == "true"));
    let text = ctx.metrics.encode();
    assert!(
        text.contains("stasis_controller_refused_total{reason=\"ClaimTokenCopied\"} 1"),
        "{text}"
    );
}

/// The same token in another namespace is not even looked at: a pod of namespace `dev`
/// with the token of a `prod` record gets nothing of it.
#[tokio::test]
async fn a_claim_token_counts_only_in_its_namespace() {
    let mut r = record_of_a("prod");
    r.holder.as_mut().unwrap().uid = None; // not registered yet: the token alone decides
                                           // The API server's list (the fallback when the cache lags) has the prod record too.
    let (client, seen) = api_server(vec![(
        "/api/v1/namespaces/stasis/configmaps".into(),
        json!({"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {},
               "items": [serde_json::to_value(r.to_config_map().unwrap()).unwrap()]}),
    )]);
    let mut b = running_pod("2026-01-01T00:00:00Z");
    b.metadata.namespace = Some("dev".into());
    b.metadata.uid = Some("uid-b".into());
    let ctx = context_with(client, vec![], vec![r], vec![], vec![]);
    reconcile_pod(Arc::new(b), ctx).await.unwrap();
    let w = writes(&seen);
    assert!(
        !w.iter()
            .any(|(_, p, _)| p.contains("configmaps") || p.contains("podrestores")),
        "{w:#?}"
    );
}

/// The first pod seen with an unregistered token becomes the holder (a write at the version
/// read, with its UID: the agents' stamp comes from that label).
#[tokio::test]
async fn the_first_pod_with_the_token_is_registered_as_holder() {
    let (client, seen) = api_server(vec![]);
    let mut r = record_of_a("prod");
    r.holder.as_mut().unwrap().uid = None;
    r.holder.as_mut().unwrap().restore = None;
    let a = running_pod("2026-01-01T00:00:00Z");
    let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
    reconcile_pod(Arc::new(a), ctx).await.unwrap();
    let w = writes(&seen);
    let put = w
        .iter()
        .find(|(m, p, _)| m == "PUT" && p.ends_with(&r.name()))
        .expect("registration");
    assert_eq!(put.2["metadata"]["resourceVersion"], "5");
    assert_eq!(put.2["metadata"]["labels"][names::HOLDER_UID], "uid-1");
    let saved = Record::from_config_map(&serde_json::from_value(put.2.clone()).unwrap()).unwrap();
    assert_eq!(saved.holder_uid(), Some("uid-1"));
    assert!(!saved.lineage.orphaned);
}

/// The registered holder still gets its restore from the record.
#[tokio::test]
async fn the_holder_gets_the_restore_its_record_says() {
    let (client, seen) = api_server(vec![(
        "/apis/stasis.dev/v1alpha1/namespaces/prod/podrestores/counter-a/status".into(),
        json!({"apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
               "metadata": {"name": "counter-a", "namespace": "prod"},
               "spec": {"checkpointRef": "x/y", "targetPodName": "counter-a"}}),
    )]);
    let r = record_of_a("prod");
    let mut a = running_pod("2026-01-01T00:00:00Z");
    a.metadata.name = Some("counter-a".into());
    let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
    reconcile_pod(Arc::new(a), ctx).await.unwrap();
    let w = writes(&seen);
    let created = w
        .iter()
        .find(|(m, p, _)| m == "POST" && p.ends_with("/podrestores"))
        .expect("a PodRestore");
    assert_eq!(
        created.2["spec"]["checkpointRef"],
        r.holder.as_ref().unwrap().restore.clone().unwrap()
    );
    assert_eq!(created.2["spec"]["targetPodUID"], "uid-1");
}

/// A namespace at its cap of records gets no new one: the create is refused before it is
/// sent, naming the namespace and the cap.
#[tokio::test]
async fn records_are_capped_per_namespace() {
    let items: Vec<serde_json::Value> = (0..2)
        .map(|i| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("lineage-{i}")}}))
        .collect();
    let (client, seen) = api_server(vec![(
        "/api/v1/namespaces/stasis/configmaps".into(),
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": items}),
    )]);
    let records = Records::new(client, "stasis").with_cap(2);
    let w = WorkloadName::new("prod_pod_x").unwrap();
    let r = Record::new("prod", Lineage::start(&w, "aaaaaaaa", &[]), None);
    let err = records.save(&r).await.unwrap_err();
    assert!(matches!(&err, Error::RecordCap { namespace, cap: 2 } if namespace == "prod"));
    assert!(err
        .to_string()
        .contains("namespace prod has 2 lineage records"));
    assert!(writes(&seen).is_empty());
    // Under the cap, the create goes out.
    let (client, seen) = api_server(vec![(
        "/api/v1/namespaces/stasis/configmaps".into(),
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": []}),
    )]);
    Records::new(client, "stasis")
        .with_cap(2)
        .save(&r)
        .await
        .unwrap();
    assert_eq!(writes(&seen).len(), 1);
}

#[tokio::test]
async fn a_due_heartbeat_creates_one_checkpoint_and_waits_while_it_is_in_flight() {
    let (client, seen) = api_server(vec![]);
    let pod = Arc::new(running_pod("2026-01-01T00:00:00Z"));
    let ctx = test_context(client, vec![]);
    let action = reconcile_pod(pod.clone(), ctx.clone()).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(10)));
    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "{calls:#?}");
    let (method, path, body) = &calls[0];
    assert_eq!(method, "POST");
    assert_eq!(
        path,
        "/apis/stasis.dev/v1alpha1/namespaces/prod/podcheckpoints"
    );
    assert_eq!(body["spec"]["reason"], "Heartbeat");
    assert_eq!(body["spec"]["sourcePodUID"], "uid-1");
    assert_eq!(body["metadata"]["labels"][names::NODE], "worker-1");
    assert_eq!(
        body["metadata"]["annotations"][names::LINEAGE],
        "prod_deploy_counter.aaaaaaaa"
    );
    assert_eq!(body["metadata"]["annotations"][names::GENERATION], "2");
    assert_eq!(ctx.metrics.checkpoints_scheduled.get(), 1);
    // No checkpoint yet: its age counts from the pod's start, against a 10 s interval.
    let text = ctx.metrics.encode();
    for line in [
        "stasis_controller_last_checkpoint_timestamp_seconds{namespace=\"prod\",pod=\"counter-7d9f8b6c5-abcde\"} 1767225600.0",
        "stasis_controller_checkpoint_interval_seconds{namespace=\"prod\",pod=\"counter-7d9f8b6c5-abcde\"} 10.0",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }

    // With that checkpoint pending, the next reconcile asks nothing of the API server.
    let created: PodCheckpoint = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": body["metadata"]["name"], "namespace": "prod",
                     "creationTimestamp": crate::k8s_time(now_ms()).0.to_string()},
        "spec": body["spec"].clone()
    }))
    .unwrap();
    let (client, seen) = api_server(vec![]);
    let ctx = test_context(client, vec![created]);
    reconcile_pod(pod, ctx).await.unwrap();
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn pods_of_other_runtime_classes_are_left_alone() {
    let (client, seen) = api_server(vec![]);
    let mut pod = running_pod("2026-01-01T00:00:00Z");
    pod.spec.as_mut().unwrap().runtime_class_name = None;
    let action = reconcile_pod(Arc::new(pod), test_context(client, vec![]))
        .await
        .unwrap();
    assert_eq!(action, Action::await_change());
    assert!(seen.lock().unwrap().is_empty());
}
