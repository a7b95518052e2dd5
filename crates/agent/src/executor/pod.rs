//! Pods with several containers: which containers a pod checkpoint holds, which of them a
//! restore prepares, and which init containers a restored pod must not run again.
//!
//! The unit is the pod: its app containers and its native sidecars (init containers with
//! `restartPolicy: Always`, which the kubelet starts before the app containers and keeps
//! running beside them) are checkpointed at one instant and restored together from the same
//! checkpoint. Regular init containers ran to completion before the checkpoint; their work is
//! in the restored state, so a restored pod skips them (a skip note, `planfile::Skip`).

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use stasis_core::Manifest;

use super::label;
use crate::error::{AgentError, Result};

/// The containers of a pod by its spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodLayout {
    /// What a pod checkpoint captures and a restore restores: the native sidecars, then the
    /// app containers, each in spec order. Empty: unknown (no spec, e.g. the standalone agent).
    pub members: Vec<String>,
    /// The regular init containers, in spec order, without stasis's own restore wait (which must
    /// run: it holds the pod until its restore is ready).
    pub run_once: Vec<String>,
}

impl PodLayout {
    pub fn of(pod: &Pod) -> Self {
        let Some(spec) = pod.spec.as_ref() else {
            return Self::default();
        };
        let mut members = Vec::new();
        let mut run_once = Vec::new();
        for c in spec.init_containers.iter().flatten() {
            if c.restart_policy.as_deref() == Some("Always") {
                members.push(c.name.clone());
            } else if c.name != stasis_api::pod::RESTORE_WAIT_CONTAINER {
                run_once.push(c.name.clone());
            }
        }
        members.extend(spec.containers.iter().map(|c| c.name.clone()));
        Self { members, run_once }
    }

    /// The one member's name, when the pod has exactly one.
    pub fn single(&self) -> Option<&str> {
        match self.members.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

/// Why two sets of container names differ, for a user: what one has and the other lacks.
fn difference(checkpoint: &[&str], pod: &[String]) -> Option<String> {
    let a: BTreeSet<&str> = checkpoint.iter().copied().collect();
    let b: BTreeSet<&str> = pod.iter().map(String::as_str).collect();
    if a == b {
        return None;
    }
    let list = |s: Vec<&&str>| {
        s.iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let added = list(b.difference(&a).collect());
    let removed = list(a.difference(&b).collect());
    let mut why = Vec::new();
    if !added.is_empty() {
        why.push(format!(
            "the pod has {added}, which the checkpoint does not hold"
        ));
    }
    if !removed.is_empty() {
        why.push(format!(
            "the checkpoint holds {removed}, which the pod does not have"
        ));
    }
    Some(why.join("; "))
}

/// The containers a restore of `manifest` prepares: every container of a pod checkpoint (the
/// pod's members must be exactly the checkpoint's: a container added or removed is a cold start,
/// never a partial restore), or the one container of a one-container checkpoint.
///
/// `container_name`: the one container to restore (a restart in place restores the container
/// the OOM killer ended, from its part of the checkpoint). `layout`: the target pod's.
pub fn restore_set(
    manifest: &Manifest,
    container_name: Option<&str>,
    layout: Option<&PodLayout>,
) -> Result<Vec<String>> {
    let exact = manifest.reference();
    let names = manifest
        .pod_containers()
        .map_err(|e| AgentError::Invalid(format!("{exact}: {e}")))?;
    let pod = layout.filter(|l| !l.members.is_empty());
    match (names, container_name) {
        // A restart in place: one container, from its part of the checkpoint.
        (Some(names), Some(one)) if pod.is_none() => {
            if names.contains(&one) {
                Ok(vec![one.to_owned()])
            } else {
                Err(AgentError::ContainersDiffer(format!(
                    "the checkpoint holds {}, not container {one}",
                    names.join(", ")
                )))
            }
        }
        (Some(names), _) => {
            if let Some(why) = pod.and_then(|l| difference(&names, &l.members)) {
                return Err(AgentError::ContainersDiffer(why));
            }
            Ok(names.iter().map(|n| n.to_string()).collect())
        }
        (None, _) => {
            let one = container_name
                .or_else(|| pod.and_then(PodLayout::single))
                .or_else(|| {
                    manifest
                        .labels
                        .get(label::CONTAINER_NAME)
                        .map(String::as_str)
                })
                .filter(|n| super::safe_component(n))
                .ok_or_else(|| {
                    AgentError::Invalid(format!(
                        "{exact}: no (valid) container name to restore into"
                    ))
                })?;
            if let Some(why) = pod.and_then(|l| difference(&[one], &l.members)) {
                return Err(AgentError::ContainersDiffer(why));
            }
            Ok(vec![one.to_owned()])
        }
    }
}

/// The living containers of a pod against the pod's members: a pod checkpoint holds every one
/// of them or is not taken (`expected` empty: not known, nothing to check).
pub fn check_complete(found: &[&str], expected: &[String]) -> Result<()> {
    if expected.is_empty() {
        return Ok(());
    }
    let running: BTreeSet<&str> = found.iter().copied().collect();
    let missing: Vec<&str> = expected
        .iter()
        .map(String::as_str)
        .filter(|n| !running.contains(n))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(AgentError::PodIncomplete(missing.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::prepare::tests::manifest;
    use stasis_core::manifest::POD_CONTAINERS_LABEL;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn sidecars_are_members_and_init_containers_run_once() {
        let p = pod(serde_json::json!({
            "initContainers": [
                {"name": "stasis-restore-wait", "image": "w"},
                {"name": "migrate", "image": "m"},
                {"name": "proxy", "image": "p", "restartPolicy": "Always"},
                {"name": "warm", "image": "x"},
            ],
            "containers": [{"name": "app", "image": "a"}, {"name": "worker", "image": "b"}],
        }));
        let l = PodLayout::of(&p);
        assert_eq!(l.members, ["proxy", "app", "worker"]);
        assert_eq!(l.run_once, ["migrate", "warm"]);
        assert_eq!(l.single(), None);
        let one = PodLayout::of(&pod(serde_json::json!({"containers": [{"name": "app"}]})));
        assert_eq!(one.single(), Some("app"));
        assert!(one.run_once.is_empty());
        assert_eq!(PodLayout::of(&Pod::default()), PodLayout::default());
    }

    fn layout(members: &[&str]) -> PodLayout {
        PodLayout {
            members: members.iter().map(|s| s.to_string()).collect(),
            run_once: vec![],
        }
    }

    #[test]
    fn a_restore_takes_every_container_or_none() {
        let pod_ckpt = manifest(&[(POD_CONTAINERS_LABEL, "proxy,app")], &[]);
        // The pod's members, in any order: every container of the checkpoint.
        assert_eq!(
            restore_set(&pod_ckpt, None, Some(&layout(&["app", "proxy"]))).unwrap(),
            ["proxy", "app"]
        );
        // A container added or removed: a cold start naming it.
        let e = restore_set(&pod_ckpt, None, Some(&layout(&["app", "proxy", "new"]))).unwrap_err();
        assert!(matches!(e, AgentError::ContainersDiffer(_)), "{e}");
        assert!(e.to_string().contains("the pod has new"), "{e}");
        let e = restore_set(&pod_ckpt, None, Some(&layout(&["app"]))).unwrap_err();
        assert!(e.to_string().contains("the checkpoint holds proxy"), "{e}");
        assert_eq!(
            e.restore_failure(),
            stasis_api::RestoreFailure::Incompatible
        );
        // A restart in place: the one container, from its part.
        assert_eq!(restore_set(&pod_ckpt, Some("app"), None).unwrap(), ["app"]);
        assert!(restore_set(&pod_ckpt, Some("other"), None).is_err());

        // One-container checkpoints, as stored before pod checkpoints: restored as before.
        let single = manifest(&[(label::CONTAINER_NAME, "app")], &[]);
        assert_eq!(restore_set(&single, None, None).unwrap(), ["app"]);
        assert_eq!(
            restore_set(&single, None, Some(&layout(&["app"]))).unwrap(),
            ["app"]
        );
        // ...but not into a pod that has grown a sidecar.
        let e = restore_set(&single, None, Some(&layout(&["app", "proxy"]))).unwrap_err();
        assert!(e.to_string().contains("the pod has proxy"), "{e}");
        // A renamed container (the only one): the pod's name wins, as before.
        assert_eq!(
            restore_set(&manifest(&[], &[]), None, Some(&layout(&["main"]))).unwrap(),
            ["main"]
        );
        assert!(restore_set(&manifest(&[], &[]), None, None).is_err());
    }

    #[test]
    fn a_termination_capture_covers_the_pods_other_containers() {
        let t = tempfile::tempdir().unwrap();
        let rt = crate::executor::test_runtime();
        let exec = crate::executor::test_executor(t.path(), &rt, None, stasis_store::Key::random());
        assert_eq!(exec.final_covering("u", "c1"), None);
        let cover = |r: &str, ahead_of_stop| super::super::FinalCover {
            reference: r.into(),
            ahead_of_stop,
        };
        exec.record_final("u", cover("l/1", true), vec!["c1".into(), "c2".into()]);
        assert_eq!(exec.final_covering("u", "c2"), Some(cover("l/1", true)));
        // The stop's own checkpoint replaces the one taken ahead of it.
        exec.record_final("u", cover("l/2", false), vec!["c1".into(), "c2".into()]);
        assert_eq!(exec.final_covering("u", "c1"), Some(cover("l/2", false)));
        // A container restarted since has another id; another pod is another pod.
        assert_eq!(exec.final_covering("u", "c3"), None);
        assert_eq!(exec.final_covering("v", "c1"), None);
    }

    #[test]
    fn a_pod_checkpoint_needs_every_member_running() {
        let want = vec!["proxy".to_string(), "app".to_string()];
        check_complete(&["app", "proxy"], &want).unwrap();
        check_complete(&["app"], &[]).unwrap();
        let e = check_complete(&["app"], &want).unwrap_err();
        assert!(
            matches!(&e, AgentError::PodIncomplete(m) if m == "proxy"),
            "{e}"
        );
    }
}
