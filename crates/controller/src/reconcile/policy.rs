//! `CheckpointPolicy` status: `Ready` (`Active`) or refused (`InvalidSpec`).

use super::*;

/// `CheckpointPolicy` status: `Ready` (`Active`) or refused (`InvalidSpec`), with the number of
/// selected stasis pods.
#[tracing::instrument(name = "reconcile_policy", skip_all, fields(namespace = %p.namespace().unwrap_or_default(), name = %p.name_any()))]
pub async fn reconcile_policy(p: Arc<CheckpointPolicy>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled("policies");
    let ns = p.namespace().unwrap_or_default();
    let mut status: CheckpointPolicyStatus = p.status.clone().unwrap_or_default();
    let generation = p.metadata.generation;
    let now = k8s_time(now_ms());
    let problem = p.spec.interval().err().map(|e| e.to_string()).or_else(|| {
        let max_age = p.spec.retention.max_age.as_deref()?;
        parse_duration(max_age)
            .err()
            .map(|e| format!("retention.maxAge: {e}"))
    });
    match &problem {
        Some(why) => set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            reason::INVALID_SPEC,
            why.clone(),
            generation,
            now,
        ),
        None => set_condition(
            &mut status.conditions,
            condition::READY,
            true,
            reason::ACTIVE,
            if p.spec.interval == "auto" {
                "heartbeat interval chosen per pod (status.autoIntervals)".to_owned()
            } else {
                format!("heartbeat every {}", p.spec.interval)
            },
            generation,
            now,
        ),
    }
    let selected = ctx
        .pods
        .state()
        .iter()
        .filter(|pod| {
            pod.namespace().as_deref() == Some(&ns)
                && pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.runtime_class_name.as_deref())
                    == Some(ctx.cfg.runtime_class.as_str())
                && crate::schedule::selects(&p.spec.selector, pod.labels())
        })
        .count();
    status.selected_pods = Some(selected as i32);
    // `interval: auto`: each pod's interval and its inputs, refreshed every 15 s.
    let auto = matches!(p.spec.interval(), Ok(stasis_core::policy::Interval::Auto));
    status.auto_intervals = if auto {
        let (pods, checkpoints) = (ctx.pods.state(), ctx.checkpoints.state());
        let checkpoints: Vec<&PodCheckpoint> = checkpoints.iter().map(|c| c.as_ref()).collect();
        let log = ctx.evictions.lock().unwrap_or_else(|e| e.into_inner());
        stasis_api::policy::auto_statuses(
            &p,
            pods.iter().map(|x| x.as_ref()),
            &checkpoints,
            &ctx.cfg.runtime_class,
            &log,
            now_ms(),
        )
    } else {
        Vec::new()
    };
    status.observed_generation = generation;
    if Some(&status) != p.status.as_ref() {
        // The controller is the only writer of a policy's status: it applies all of it.
        apply_status::<CheckpointPolicy>(
            &ctx.client,
            &ns,
            &p.name_any(),
            serde_json::to_value(&status)?,
        )
        .await?;
    }
    Ok(Action::requeue(Duration::from_secs(if auto {
        15
    } else {
        60
    })))
}
