use super::*;

/// The sweep deletes an orphaned, empty record whose pod is gone, once the grace period
/// has passed since it was orphaned, at the version it read; never one with checkpoints,
/// one whose pod is still there, or one orphaned recently.
#[tokio::test]
async fn the_sweep_collects_empty_orphaned_records_of_gone_pods() {
    let now = now_ms();
    let mk = |token: &str, orphaned_ago_s: u64, with_checkpoint: bool| {
        let w = WorkloadName::new(format!("prod_pod_{token}")).unwrap();
        let mut l = Lineage::start(&w, token, &[]);
        if with_checkpoint {
            l.publish(LineageCheckpoint {
                id: CheckpointId::from_parts(1_700_000_000_000, 1),
                generation: 1,
                created_unix_ms: 1,
                manifest_digest: None,
            })
            .unwrap();
        }
        l.orphan();
        let mut r = Record::new(
            "prod",
            l,
            Some(Holder {
                token: token.into(),
                claimed_unix_ms: 1,
                uid: Some(format!("uid-{token}")),
                ..Default::default()
            }),
        );
        r.orphaned_unix_ms = Some(now - orphaned_ago_s * 1000);
        r.resource_version = Some("7".into());
        r
    };
    let gone = mk("aaaaaaaa", 3600, false);
    let kept = mk("bbbbbbbb", 3600, true);
    let recent = mk("cccccccc", 60, false);
    let alive = mk("dddddddd", 3600, false);
    let mut pod = running_pod("2026-01-01T00:00:00Z");
    pod.metadata.uid = Some("uid-dddddddd".into());
    pod.status.as_mut().unwrap().phase = Some("Failed".into());
    let (client, seen) = api_server(vec![]);
    let ctx = context_with(
        client,
        vec![],
        vec![gone.clone(), kept, recent, alive],
        vec![pod],
        vec![],
    );
    sweep(&ctx).await.unwrap();
    let w = writes(&seen);
    assert_eq!(w.len(), 1, "{w:#?}");
    assert_eq!(w[0].0, "DELETE");
    assert_eq!(
        w[0].1,
        format!("/api/v1/namespaces/stasis/configmaps/{}", gone.name())
    );
    assert_eq!(w[0].2["preconditions"]["resourceVersion"], "7");
    assert_eq!(ctx.metrics.records_collected.get(), 1);
}

#[tokio::test]
async fn the_sweep_drops_the_checkpoint_age_of_pods_no_longer_checkpointed() {
    let pod = running_pod("2026-01-01T00:00:00Z");
    let policies = test_context(api_server(vec![]).0, vec![]).policies.state();
    let policy = (*policies[0]).clone();
    let (client, _) = api_server(vec![]);
    let ctx = context_with(client, vec![], vec![], vec![pod.clone()], vec![policy]);
    let ten = Duration::from_secs(10);
    ctx.metrics
        .checkpoint_freshness("prod", "counter-7d9f8b6c5-abcde", 1_000, ten);
    ctx.metrics.checkpoint_freshness("prod", "gone", 1_000, ten);
    sweep(&ctx).await.unwrap();
    let text = ctx.metrics.encode();
    assert!(
        text.contains("pod=\"counter-7d9f8b6c5-abcde\"} 1.0"),
        "{text}"
    );
    assert!(!text.contains("pod=\"gone\""), "{text}");
    // Its policy deleted: the running pod is no longer checkpointed either.
    let (client, _) = api_server(vec![]);
    let ctx2 = context_with(client, vec![], vec![], vec![pod], vec![]);
    ctx2.metrics
        .checkpoint_freshness("prod", "counter-7d9f8b6c5-abcde", 1_000, ten);
    sweep(&ctx2).await.unwrap();
    assert!(!ctx2.metrics.encode().contains("counter-7d9f8b6c5-abcde"));
}

/// A record written before the holder-UID label existed is written again with it (the
/// agents stamp only from labelled records); a labelled one is left alone.
#[tokio::test]
async fn the_sweep_labels_records_of_an_older_version() {
    let r = record_of_a("prod");
    let mut old = r.to_config_map().unwrap();
    old.metadata
        .labels
        .as_mut()
        .unwrap()
        .remove(names::HOLDER_UID);
    let (client, seen) = api_server(vec![]);
    let ctx = Caches {
        config_maps: vec![old],
        pods: vec![running_pod("2026-01-01T00:00:00Z")],
        ..Default::default()
    }
    .context(client);
    sweep(&ctx).await.unwrap();
    let w = writes(&seen);
    assert_eq!(w.len(), 1, "{w:#?}");
    assert_eq!(w[0].0, "PUT");
    assert_eq!(w[0].2["metadata"]["labels"][names::HOLDER_UID], "uid-1");
    // Labelled: nothing to write.
    let (client, seen) = api_server(vec![]);
    let ctx = context_with(
        client,
        vec![],
        vec![r],
        vec![running_pod("2026-01-01T00:00:00Z")],
        vec![],
    );
    sweep(&ctx).await.unwrap();
    assert!(writes(&seen).is_empty(), "{:#?}", writes(&seen));
}
