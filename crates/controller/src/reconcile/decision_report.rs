//! The admission decision, made into a `PodRestore` (a restore) or a `ColdStart` Event once the
//! controller sees the pod.

use super::*;

/// Turns the webhook's decision into a `PodRestore` or a `ColdStart` Event, once.
pub(super) async fn report_decision(
    pod: &Pod,
    record: Option<&Record>,
    ctx: &Context,
) -> Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let oref = pod.object_ref(&());
    let annotations = pod.annotations();
    // Only what the record says counts: annotations can be copied, the record cannot. The
    // caller passes only a record this pod is the registered holder of.
    let restore = record
        .and_then(|r| r.holder.as_ref())
        .is_some_and(|h| h.restore.is_some());
    let decision = if restore {
        "Restore"
    } else {
        annotations
            .get(names::DECISION)
            .map_or("ColdStart", String::as_str)
    };
    match decision {
        "Restore" => {
            let holder = record.and_then(|r| r.holder.as_ref().map(|h| (r, h)));
            match holder.and_then(|(r, h)| h.restore.clone().map(|c| (r, h, c))) {
                Some((r, h, checkpoint_ref)) => {
                    let restore = PodRestore {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            namespace: Some(ns.clone()),
                            labels: Some(BTreeMap::from([
                                (names::POD_UID.to_owned(), pod_uid(pod)),
                                (
                                    names::MANAGED_BY.0.to_owned(),
                                    names::MANAGED_BY.1.to_owned(),
                                ),
                            ])),
                            ..Default::default()
                        },
                        spec: PodRestoreSpec {
                            checkpoint_ref: checkpoint_ref.clone(),
                            target_pod_name: name.clone(),
                            target_pod_uid: pod.metadata.uid.clone(),
                            source_pod_name: h.source_pod.clone(),
                            lineage: Some(r.lineage.id.as_str().to_owned()),
                            generation: Some(r.lineage.generation as i64),
                        },
                        status: None,
                    };
                    let api = Api::<PodRestore>::namespaced(ctx.client.clone(), &ns);
                    match api.create(&PostParams::default(), &restore).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 409 => {}
                        Err(e) => return Err(e.into()),
                    }
                    let mut status = PodRestoreStatus {
                        phase: Some(RestorePhase::Pending),
                        ..Default::default()
                    };
                    set_condition(
                        &mut status.conditions,
                        condition::READY,
                        false,
                        reason::PENDING,
                        format!("restore of {checkpoint_ref} decided at admission"),
                        None,
                        k8s_time(now_ms()),
                    );
                    // Only when the agent has not written a status yet.
                    let current = api.get_status(&name).await?;
                    if current.status.as_ref().and_then(|s| s.phase).is_none() {
                        apply_status::<PodRestore>(
                            &ctx.client,
                            &ns,
                            &name,
                            json!({"phase": status.phase, "conditions": status.conditions}),
                        )
                        .await?;
                    }
                    ctx.event(
                        &oref,
                        EventType::Normal,
                        names::event::RESTORE_DECIDED,
                        format!("restoring checkpoint {checkpoint_ref} (PodRestore {name})"),
                    )
                    .await;
                }
                None => {
                    ctx.event(
                        &oref,
                        EventType::Warning,
                        reason::COLD_START,
                        "restore annotation without a matching lineage record: not restoring"
                            .into(),
                    )
                    .await;
                }
            }
        }
        _ => {
            let why = annotations
                .get(names::DECISION_REASON)
                .cloned()
                .unwrap_or_else(|| "no restore".into());
            ctx.event(&oref, EventType::Normal, reason::COLD_START, why)
                .await;
        }
    }
    let patch = json!({"metadata": {"annotations": {names::DECISION_REPORTED: "true"}}});
    add_metadata::<Pod>(&ctx.client, &ns, &name, patch["metadata"].clone()).await?;
    Ok(())
}
