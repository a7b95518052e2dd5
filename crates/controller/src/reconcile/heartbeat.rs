//! Heartbeat checkpoints: when a pod's next `PodCheckpoint` is due (the pure plan is in
//! [`crate::schedule`]) and creating it.

use super::*;

/// The heartbeat of one running pod under its policy.
pub(super) async fn heartbeat(
    pod: &Pod,
    policy: &CheckpointPolicy,
    record: &Record,
    ctx: &Context,
) -> Result<Action> {
    let interval = match policy.spec.interval() {
        Ok(stasis_core::policy::Interval::Fixed(d)) => d,
        Ok(stasis_core::policy::Interval::Auto) => auto_interval(pod, policy, ctx).await,
        // The policy's status says why; look again when it changes.
        Err(_) => return Ok(Action::requeue(Duration::from_secs(60))),
    };
    let ns = pod.namespace().unwrap_or_default();
    let uid = pod_uid(pod);
    // The pod's own checkpoints, by the cache's index (a scan of every checkpoint per
    // heartbeat made the controller's work grow with pods × checkpoints).
    let mine: Vec<CheckpointView> = ctx
        .checkpoints
        .of_pod(&ns, &uid)
        .iter()
        .map(|c| CheckpointView::of(c))
        .collect();
    let now = now_ms();
    let started = pod
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .or(pod.metadata.creation_timestamp.as_ref())
        .map_or(now, time_ms);
    ctx.metrics.checkpoint_freshness(
        &ns,
        &pod.name_any(),
        protected_since(&mine, started),
        interval,
    );
    let probes = podfacts::liveness_probes(pod);
    let last_skip = ctx.skips.lock().ok().and_then(|s| s.get(&uid).copied());
    let inputs = HeartbeatInputs {
        interval,
        pod_started_unix_ms: started,
        checkpoints: &mine,
        last_skip_unix_ms: last_skip,
        jitter_ms: jitter_ms(&uid, interval),
        probes: &probes,
        max_freeze_fraction: policy.spec.freeze_fraction(),
        in_flight_timeout: ctx.cfg.in_flight_timeout,
        now_unix_ms: now,
    };
    match next_heartbeat(&inputs) {
        Next::InFlight => Ok(Action::requeue(interval.min(Duration::from_secs(60)))),
        Next::NotDue { at_unix_ms } => Ok(Action::requeue(Duration::from_millis(at_unix_ms - now))),
        Next::Skip { reason } => {
            if let Ok(mut s) = ctx.skips.lock() {
                s.insert(uid, now);
            }
            ctx.metrics
                .checkpoints_skipped
                .get_or_create(&crate::metrics::ReasonLabel {
                    reason: reason::FREEZE_BUDGET_EXCEEDED.to_owned(),
                })
                .inc();
            ctx.event(
                &pod.object_ref(&()),
                EventType::Warning,
                names::event::CHECKPOINT_SKIPPED,
                reason,
            )
            .await;
            Ok(Action::requeue(interval))
        }
        Next::Create { due_unix_ms } => {
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let name = heartbeat_name(&pod.name_any(), due_unix_ms);
            let mut labels = BTreeMap::from([
                (names::POD_UID.to_owned(), uid.clone()),
                (names::POLICY.to_owned(), policy.name_any()),
                (
                    names::MANAGED_BY.0.to_owned(),
                    names::MANAGED_BY.1.to_owned(),
                ),
            ]);
            if node.len() <= 63 {
                labels.insert(names::NODE.to_owned(), node.clone());
            }
            let ck = PodCheckpoint {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    labels: Some(labels),
                    annotations: Some(BTreeMap::from([
                        (
                            names::LINEAGE.to_owned(),
                            record.lineage.id.as_str().to_owned(),
                        ),
                        (
                            names::GENERATION.to_owned(),
                            record.lineage.generation.to_string(),
                        ),
                    ])),
                    ..Default::default()
                },
                spec: PodCheckpointSpec {
                    source_pod_name: pod.name_any(),
                    source_pod_uid: Some(uid),
                    reason: CheckpointReason::Heartbeat,
                    timeout_seconds: None,
                },
                status: None,
            };
            let api = Api::<PodCheckpoint>::namespaced(ctx.client.clone(), &ns);
            match api.create(&PostParams::default(), &ck).await {
                Ok(_) => {
                    ctx.metrics.checkpoints_scheduled.inc();
                    tracing::info!(pod = %pod.name_any(), namespace = %ns, checkpoint = %name, node = %node, "heartbeat checkpoint requested");
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            Ok(Action::requeue(interval.min(Duration::from_secs(60))))
        }
    }
}

/// `interval: auto`: this pod's interval from its checkpoints' cost and its node pool's
/// interruptions (`stasis_core::interval`, docs/design.md §10.5a). The node's pool is read once
/// per node (the default pool when the Node cannot be read); the pod is noted on its node, so
/// that its end counts in that pool.
async fn auto_interval(pod: &Pod, policy: &CheckpointPolicy, ctx: &Context) -> Duration {
    let log = || ctx.evictions.lock().unwrap_or_else(|e| e.into_inner());
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    if !node.is_empty() && log().pool_of(&node).is_none() {
        let api = Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone());
        let pool = match api.get_opt(&node).await {
            Ok(Some(n)) => stasis_api::policy::node_pool(&n),
            other => {
                if let Err(e) = other {
                    tracing::warn!(node = %node, error = %e, "cannot read the node's pool labels: its pods count in the default pool");
                }
                stasis_core::interval::NodePool::of_labels([])
            }
        };
        log().note_node(&node, pool);
    }
    let checkpoints = ctx.checkpoints.state();
    stasis_api::policy::choose_auto(
        pod,
        checkpoints.iter().map(|c| c.as_ref()),
        &mut log(),
        policy.spec.freeze_fraction(),
        now_ms(),
    )
    .map_or(stasis_core::interval::AUTO_MAX, |c| c.auto.interval)
}

/// A holder pod stopped or vanished and its lineage was orphaned: an interruption of its node's
/// pool (`interval: auto`).
pub(super) fn note_end(ctx: &Context, pod_uid: &str) {
    ctx.evictions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .record_end(pod_uid, now_ms());
}
