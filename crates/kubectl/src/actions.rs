//! The commands that change something: `checkpoint` (a `PodCheckpoint`, followed until it
//! ends) and `restore` (a `PodRestore`, only for a user allowed to restore).

use std::io::{IsTerminal, Write as _};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client, ResourceExt};
use stasis_api::{
    CheckpointPhase, CheckpointReason, PodCheckpoint, PodCheckpointSpec, PodRestore, PodRestoreSpec,
};
use stasis_core::CheckpointRef;

use crate::table::bytes;

/// What the API server said, when it refused: its own message (which names the user, the verb
/// and the resource), so the user sees the reason rather than a code.
pub fn api_error(e: kube::Error, what: &str) -> anyhow::Error {
    match e {
        kube::Error::Api(s) if s.code == 403 => anyhow!("{what}: forbidden: {}", s.message),
        kube::Error::Api(s) if s.code == 404 => anyhow!("{what}: {}", s.message),
        other => anyhow!(other).context(what.to_owned()),
    }
}

/// An object name made of `base` and a suffix, within the 253 characters a name may have
/// (`generateName` adds five).
fn generate_name(base: &str, suffix: &str) -> String {
    let keep = 253 - 5 - suffix.len();
    let head: String = base.chars().take(keep).collect();
    format!("{}{suffix}", head.trim_end_matches(['-', '.']))
}

/// Creates a `PodCheckpoint` of `pod` (reason `Manual`) and, with `follow`, shows its progress
/// on stderr until it ends. Returns it as last seen; a failed checkpoint is an error naming the
/// agent's reason.
pub async fn checkpoint(
    client: &Client,
    ns: &str,
    pod: &str,
    timeout_seconds: Option<i32>,
    follow: Option<Duration>,
    runtime_class: &str,
) -> Result<PodCheckpoint> {
    let p = Api::<Pod>::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .map_err(|e| api_error(e, &format!("pod {ns}/{pod}")))?;
    let rc = p
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    if rc != Some(runtime_class) {
        bail!(
            "pod {ns}/{pod} is not opted in (runtimeClassName {}, not {runtime_class}): stasis checkpoints only pods of its RuntimeClass",
            rc.unwrap_or("unset")
        );
    }
    let api = Api::<PodCheckpoint>::namespaced(client.clone(), ns);
    let obj = PodCheckpoint {
        metadata: ObjectMeta {
            generate_name: Some(generate_name(pod, "-manual-")),
            ..Default::default()
        },
        spec: PodCheckpointSpec {
            source_pod_name: pod.to_owned(),
            source_pod_uid: p.metadata.uid.clone(),
            reason: CheckpointReason::Manual,
            timeout_seconds,
        },
        status: None,
    };
    let created = api
        .create(&PostParams::default(), &obj)
        .await
        .map_err(|e| api_error(e, &format!("creating a PodCheckpoint of {ns}/{pod}")))?;
    let name = created.name_any();
    eprintln!("podcheckpoint.stasis.dev/{name} created");
    let Some(limit) = follow else {
        return Ok(created);
    };
    let start = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut last_line = String::new();
    loop {
        let c = api
            .get(&name)
            .await
            .map_err(|e| api_error(e, &format!("podcheckpoint {ns}/{name}")))?;
        let line = progress(&c, start.elapsed());
        if tty {
            eprint!("\r\x1b[2K{line}");
            let _ = std::io::stderr().flush();
        } else if strip_elapsed(&line) != strip_elapsed(&last_line) {
            eprintln!("{line}");
        }
        last_line = line;
        let phase = c.status.as_ref().and_then(|s| s.phase);
        match phase {
            Some(CheckpointPhase::Succeeded) | Some(CheckpointPhase::Failed) => {
                if tty {
                    eprintln!();
                }
                if phase == Some(CheckpointPhase::Failed) {
                    bail!("checkpoint {ns}/{name} failed: {}", ready_reason(&c));
                }
                return Ok(c);
            }
            _ if start.elapsed() >= limit => {
                if tty {
                    eprintln!();
                }
                bail!(
                    "checkpoint {ns}/{name} has not ended after {} s; it goes on without this command (kubectl stasis list)",
                    limit.as_secs()
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The `Ready` condition's reason and message (the agent's account of where it is or what
/// failed).
fn ready_reason(c: &PodCheckpoint) -> String {
    c.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|k| k.type_ == "Ready"))
        .map_or_else(
            || "no reason given".to_owned(),
            |k| format!("{}: {}", k.reason, k.message),
        )
}

/// One progress line: `web-manual-x7k2p: Running on node-1 (CheckpointInProgress) 2.5s`, or
/// with the figures once it succeeded.
pub fn progress(c: &PodCheckpoint, elapsed: Duration) -> String {
    let s = c.status.clone().unwrap_or_default();
    let phase = s.phase.map_or("Pending".to_owned(), |p| format!("{p:?}"));
    let mut line = format!("{}: {phase}", c.name_any());
    if let Some(n) = &s.node {
        line.push_str(&format!(" on {n}"));
    }
    if s.phase == Some(CheckpointPhase::Succeeded) {
        let figures: Vec<String> = [
            s.checkpoint_ref.clone(),
            s.size_bytes.map(bytes),
            s.freeze_millis.map(|m| format!("frozen {m} ms")),
            s.total_millis.map(|m| format!("total {m} ms")),
        ]
        .into_iter()
        .flatten()
        .collect();
        line.push_str(&format!(" ({})", figures.join(", ")));
    } else if let Some(k) = s.conditions.iter().find(|k| k.type_ == "Ready") {
        line.push_str(&format!(" ({})", k.reason));
    }
    line.push_str(&format!(" {:.1}s", elapsed.as_secs_f64()));
    line
}

fn strip_elapsed(line: &str) -> &str {
    line.rsplit_once(' ').map_or(line, |(head, _)| head)
}

/// Creates a `PodRestore`: `target` resumes from `from` (a checkpoint reference
/// `<lineage>/<id>`, or the name of a succeeded `PodCheckpoint`). Refused before anything is
/// created when the user may not create `podrestores` in the namespace (a
/// SelfSubjectAccessReview), with the reason; the API server's own refusal is passed on too.
pub async fn restore(
    client: &Client,
    ns: &str,
    target: &str,
    from: &str,
    dry_run: bool,
) -> Result<PodRestore> {
    let (reference, source_pod) = resolve_checkpoint(client, ns, from).await?;
    let lineage = reference
        .split_once('/')
        .map(|(l, _)| l.to_owned())
        .context("a checkpoint reference is <lineage>/<id>")?;
    if let Some(denied) = may_not_restore(client, ns).await? {
        bail!("{denied}");
    }
    let target_uid = match Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(target)
        .await
    {
        Ok(p) => p.and_then(|p| p.metadata.uid),
        Err(e) => return Err(api_error(e, &format!("pod {ns}/{target}"))),
    };
    // For a pod not created yet, the PodRestore is named as the pod: the admission webhook then
    // makes the pod wait for it (its container is created once the node's agent has fetched the
    // checkpoint), and the wait asks for the PodRestore of the pod's name. A pod that exists
    // already gets one of its own name's prefix (its containers may have started).
    let (name, generate_name) = match target_uid {
        None => (Some(target.to_owned()), None),
        Some(_) => (None, Some(generate_name(target, "-restore-"))),
    };
    let obj = PodRestore {
        metadata: ObjectMeta {
            name,
            generate_name,
            ..Default::default()
        },
        spec: PodRestoreSpec {
            checkpoint_ref: reference.clone(),
            target_pod_name: target.to_owned(),
            target_pod_uid: target_uid,
            source_pod_name: source_pod,
            lineage: Some(lineage),
            generation: None,
        },
        status: None,
    };
    let pp = PostParams {
        dry_run,
        ..Default::default()
    };
    Api::<PodRestore>::namespaced(client.clone(), ns)
        .create(&pp, &obj)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 409 => anyhow!(
                "podrestore {ns}/{target} exists already (an earlier restore into a pod of that name): delete it (kubectl -n {ns} delete podrestore {target}) and run this again before creating pod {target}"
            ),
            e => api_error(e, &format!("creating a PodRestore in {ns}")),
        })
}

/// The reason the current user may not create `podrestores` in `ns`, or none when allowed.
pub(crate) async fn may_not_restore(client: &Client, ns: &str) -> Result<Option<String>> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_owned()),
                verb: Some("create".into()),
                group: Some("stasis.dev".into()),
                resource: Some("podrestores".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = match Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
    {
        Ok(a) => a,
        // The review itself refused (a cluster that does not let users ask): the API server
        // decides at the create, and its refusal is passed on.
        Err(kube::Error::Api(s)) if s.code == 403 => return Ok(None),
        Err(e) => {
            return Err(api_error(
                e,
                "asking the API server whether you may restore",
            ))
        }
    };
    let status = answer.status.unwrap_or_default();
    if status.allowed {
        return Ok(None);
    }
    let why = [status.reason, status.evaluation_error]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    Ok(Some(format!(
        "you may not restore in namespace {ns}: creating podrestores.stasis.dev is not allowed{}. A checkpoint holds a pod's whole memory, secrets included, so restoring is a permission of its own: the ClusterRole stasis-restorer, bound in this namespace (kubectl -n {ns} create rolebinding <name> --clusterrole=stasis-restorer --user=<you>)",
        if why.is_empty() { String::new() } else { format!(" ({why})") }
    )))
}

/// `from` as a checkpoint reference and the pod it was taken from: a reference as given, or a
/// succeeded `PodCheckpoint`'s.
pub(crate) async fn resolve_checkpoint(
    client: &Client,
    ns: &str,
    from: &str,
) -> Result<(String, Option<String>)> {
    if from.contains('/') {
        from.parse::<CheckpointRef>()
            .map_err(|e| anyhow!("--from {from}: {e} (a reference is <lineage>/<id>, as `kubectl stasis list` shows)"))?;
        return Ok((from.to_owned(), None));
    }
    let c = Api::<PodCheckpoint>::namespaced(client.clone(), ns)
        .get(from)
        .await
        .map_err(|e| api_error(e, &format!("podcheckpoint {ns}/{from}")))?;
    let s = c.status.unwrap_or_default();
    if s.phase != Some(CheckpointPhase::Succeeded) {
        bail!(
            "podcheckpoint {ns}/{from} is {}, not Succeeded: only a complete checkpoint can be restored",
            s.phase.map_or("Pending".to_owned(), |p| format!("{p:?}"))
        );
    }
    let reference = s
        .checkpoint_ref
        .with_context(|| format!("podcheckpoint {ns}/{from} names no checkpointRef"))?;
    Ok((reference, Some(c.spec.source_pod_name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn progress_lines_say_where_the_checkpoint_is() {
        let mut c: PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "web-manual-x"}, "spec": {"sourcePodName": "web"},
        }))
        .unwrap();
        assert_eq!(
            progress(&c, Duration::from_millis(300)),
            "web-manual-x: Pending 0.3s"
        );
        c.status = serde_json::from_value(json!({"phase": "Running", "node": "node-1",
            "conditions": [{"type": "Ready", "status": "False", "reason": "CheckpointInProgress",
                            "message": "", "lastTransitionTime": "2026-12-01T10:00:00Z"}]}))
        .unwrap();
        let running = progress(&c, Duration::from_millis(2500));
        assert_eq!(
            running,
            "web-manual-x: Running on node-1 (CheckpointInProgress) 2.5s"
        );
        assert_eq!(
            strip_elapsed(&running),
            strip_elapsed(&progress(&c, Duration::from_secs(9)))
        );
        c.status = serde_json::from_value(json!({"phase": "Succeeded", "node": "node-1",
            "checkpointRef": "L/1", "sizeBytes": 3 << 20, "freezeMillis": 41, "totalMillis": 900}))
        .unwrap();
        assert_eq!(
            progress(&c, Duration::from_secs(1)),
            "web-manual-x: Succeeded on node-1 (L/1, 3.0Mi, frozen 41 ms, total 900 ms) 1.0s"
        );
    }

    #[test]
    fn generated_names_fit() {
        assert_eq!(generate_name("web-1", "-manual-"), "web-1-manual-");
        let long = "a".repeat(300);
        assert_eq!(generate_name(&long, "-restore-").len() + 5, 253);
    }
}
