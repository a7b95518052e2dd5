use super::*;

/// A restore failure reported by another node's agent (it wrote the status of a pending
/// `PodRestore` of a pod on worker-1 first) changes no record: no integrity alarm, no
/// failure against the checkpoint.
#[tokio::test]
async fn a_restore_reported_by_another_nodes_agent_is_not_counted() {
    let r = record_of_a("prod");
    let l = r.lineage.id.clone();
    let id = CheckpointId::from_parts(1_700_000_010_000, 1);
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let (client, seen) = api_server(vec![(
        cm_path,
        serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
    )]);
    let mut pod = running_pod("2026-01-01T00:00:00Z");
    pod.metadata.name = Some("t".into());
    let pr: PodRestore = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
        "metadata": {"name": "t", "namespace": "prod"},
        "spec": {"checkpointRef": format!("{l}/{id}"), "targetPodName": "t", "lineage": l.as_str()},
        "status": {"phase": "Failed", "node": "worker-2", "message": "cold start: store: manifest missing",
                   "conditions": [{"type": "Ready", "status": "False", "reason": reason::CHECKPOINT_DAMAGED,
                                   "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
    }))
    .unwrap();
    let ctx = context_with(client, vec![], vec![r.clone()], vec![pod.clone()], vec![]);
    reconcile_restore(Arc::new(pr.clone()), ctx).await.unwrap();
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
    let mut mine = pr;
    mine.status.as_mut().unwrap().node = Some("worker-1".into());
    assert_eq!(restore_from_other_node(&mine, &store_of(vec![pod])), None);
}

/// A restore outcome counts only for a lineage of the restore's namespace whose checkpoint
/// it restored; otherwise the record is untouched and a pending restore fails, saying why.
#[tokio::test]
async fn a_restore_naming_a_foreign_lineage_is_refused() {
    let r = record_of_a("prod");
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    let l = r.lineage.id.as_str().to_owned();
    for (ns, reference, phase, why) in [
        ("evil", format!("{l}/x"), "Failed", "another namespace"),
        (
            "prod",
            "prod_pod_other.bbbbbbbb/20261129T083000.123Z-1a2b3c4d".to_owned(),
            "Failed",
            "is not a checkpoint of lineage",
        ),
        (
            "prod",
            "prod_pod_other.bbbbbbbb/20261129T083000.123Z-1a2b3c4d".to_owned(),
            "Pending",
            "is not a checkpoint of lineage",
        ),
    ] {
        let (client, seen) = api_server(vec![(
            cm_path.clone(),
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let pr: PodRestore = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
            "metadata": {"name": "t", "namespace": ns},
            "spec": {"checkpointRef": reference, "targetPodName": "t", "lineage": l},
            "status": {"phase": phase, "message": "cold start: fetch failed: boom"}
        }))
        .unwrap();
        let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
        reconcile_restore(Arc::new(pr), ctx).await.unwrap();
        let w = writes(&seen);
        assert!(
            !w.iter().any(|(_, p, _)| p.contains("configmaps")),
            "{why}: {w:#?}"
        );
        if phase == "Pending" {
            assert_eq!(w.len(), 1, "{w:#?}");
            assert_eq!(w[0].2["status"]["phase"], "Failed");
            assert!(w[0].2["status"]["message"].as_str().unwrap().contains(why));
        }
    }
}

/// A restore that found its checkpoint damaged in the store (the agent's typed reason)
/// raises the lineage's integrity alarm: the next choice is a cold start, never the older
/// checkpoint the restore-loop guard would fall back to for an ordinary failure.
#[tokio::test]
async fn a_damaged_checkpoint_raises_an_alarm_instead_of_a_rollback() {
    let mut r = record_of_a("prod");
    let l = r.lineage.id.clone();
    let ids: Vec<CheckpointId> = (1..=2u64)
        .map(|i| CheckpointId::from_parts(1_700_000_000_000 + i * 10_000, i as u32))
        .collect();
    for id in &ids {
        r.lineage
            .publish(LineageCheckpoint {
                id: id.clone(),
                generation: r.lineage.generation,
                created_unix_ms: 1,
                manifest_digest: None,
            })
            .unwrap();
    }
    let cm_path = format!("/api/v1/namespaces/stasis/configmaps/{}", r.name());
    // The typed `failure`, or (an older agent) the condition's reason, raises the alarm.
    for (reason, failure, alarm) in [
        (reason::CHECKPOINT_DAMAGED, None, true),
        (reason::RESTORE_FAILED, None, false),
        (reason::RESTORE_FAILED, Some("RestoreFailed"), false),
        (reason::RESTORE_FAILED, Some("CheckpointDamaged"), true),
    ] {
        let (client, seen) = api_server(vec![(
            cm_path.clone(),
            serde_json::to_value(r.to_config_map().unwrap()).unwrap(),
        )]);
        let pr: PodRestore = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
            "metadata": {"name": "t", "namespace": "prod"},
            "spec": {"checkpointRef": format!("{l}/{}", ids[1]), "targetPodName": "t", "lineage": l.as_str()},
            "status": {"phase": "Failed", "message": "cold start: store: manifest missing",
                       "failure": failure,
                       "conditions": [{"type": "Ready", "status": "False", "reason": reason,
                                       "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
        }))
        .unwrap();
        let ctx = context_with(client, vec![], vec![r.clone()], vec![], vec![]);
        reconcile_restore(Arc::new(pr), ctx).await.unwrap();
        let w = writes(&seen);
        let saved = w
            .iter()
            .find(|(_, p, _)| p.contains("configmaps"))
            .unwrap_or_else(|| panic!("record not saved: {w:#?}"));
        let saved =
            Record::from_config_map(&serde_json::from_value(saved.2.clone()).unwrap()).unwrap();
        assert_eq!(saved.lineage.integrity_alarm.is_some(), alarm, "{reason}");
        let choice = saved.lineage.restore_choice();
        if alarm {
            assert!(
                matches!(choice, RestoreChoice::ColdStart(ref why) if why.contains("damaged")),
                "{choice:?}"
            );
        } else {
            // One ordinary failure: the same checkpoint may still be tried.
            assert!(
                matches!(choice, RestoreChoice::Checkpoint { .. }),
                "{choice:?}"
            );
        }
    }
}

/// The loop guard keys on the typed cause: two failures of one cause with different
/// wording mark the checkpoint bad; two causes with the same wording do not; statuses of an
/// agent without `failure` share one signature.
#[test]
fn failure_signatures_come_from_the_typed_cause() {
    let status = |failure: Option<RestoreFailure>, message: &str| PodRestoreStatus {
        phase: Some(RestorePhase::Failed),
        message: Some(message.into()),
        failure,
        ..Default::default()
    };
    let fetch_a = status(
        Some(RestoreFailure::FetchFailed),
        "cold start: store: timeout",
    );
    let fetch_b = status(
        Some(RestoreFailure::FetchFailed),
        "cold start: s3: 503 slow down",
    );
    let key = status(
        Some(RestoreFailure::KeyUnavailable),
        "cold start: store: timeout",
    );
    assert_eq!(failure_signature(Some(&fetch_a)), "restore: FetchFailed");
    assert_eq!(
        failure_signature(Some(&fetch_a)),
        failure_signature(Some(&fetch_b))
    );
    assert_ne!(
        failure_signature(Some(&fetch_a)),
        failure_signature(Some(&key))
    );
    let old_a = status(None, "cold start: fetch failed: boom");
    let old_b = status(None, "incompatible checkpoint: declared.engine: v1 vs v2");
    assert_eq!(failure_signature(Some(&old_a)), "restore: Unknown");
    assert_eq!(
        failure_signature(Some(&old_a)),
        failure_signature(Some(&old_b))
    );
    assert_eq!(failure_signature(None), "restore: Unknown");

    let id = CheckpointId::from_parts(1_700_000_000_000, 1);
    let mut l = record_of_a("prod").lineage;
    l.record_restore_failure(&id, &failure_signature(Some(&fetch_a)));
    l.record_restore_failure(&id, &failure_signature(Some(&key)));
    assert!(!l.bad.contains(&id), "two different causes");
    l.record_restore_failure(&id, &failure_signature(Some(&fetch_b)));
    assert!(
        l.bad.contains(&id),
        "the same cause twice, worded differently"
    );
}
