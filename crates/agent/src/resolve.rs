//! Which runc containers belong to which pod, from runc's own state files
//! (`<root>/<id>/state.json`, whose `config.labels` keep `bundle=<dir>` and every OCI annotation
//! as `key=value`) and containerd's CRI annotations. No CRI gRPC, no fork of runc per container.
//!
//! Annotation names as in `crates/runtime`'s `bundle` module (containerd 1.7/2.x
//! `io.kubernetes.cri.*`, with the kubelet's `io.kubernetes.pod.*` / CRI-O's names as
//! fallbacks).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use stasis_node_api::PodRef;

use crate::error::{AgentError, Result};

pub use stasis_node_api::cri::ContainerKind as Kind;

/// What runc's state file says about one container (the fields the agent uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncContainer {
    pub id: String,
    pub init_pid: i32,
    /// RFC 3339 creation time, as runc wrote it.
    pub created: String,
    pub bundle: Option<PathBuf>,
    pub annotations: BTreeMap<String, String>,
}

impl RuncContainer {
    pub fn kind(&self) -> Kind {
        stasis_node_api::cri::classify(&self.annotations)
    }

    pub fn pod(&self) -> Option<PodRef> {
        match self.kind() {
            Kind::App(p) => Some(p),
            _ => None,
        }
    }
}

/// Parses runc's `state.json`.
pub fn parse_state(raw: &[u8]) -> Option<RuncContainer> {
    #[derive(Deserialize)]
    struct State {
        id: String,
        #[serde(default)]
        init_process_pid: i32,
        #[serde(default)]
        created: String,
        config: StateConfig,
    }
    #[derive(Deserialize)]
    struct StateConfig {
        #[serde(default)]
        labels: Vec<String>,
    }
    let s: State = serde_json::from_slice(raw).ok()?;
    let mut annotations = BTreeMap::new();
    let mut bundle = None;
    for l in &s.config.labels {
        if let Some((k, v)) = l.split_once('=') {
            if k == "bundle" {
                bundle = Some(PathBuf::from(v));
            } else {
                annotations.insert(k.to_owned(), v.to_owned());
            }
        }
    }
    Some(RuncContainer {
        id: s.id,
        init_pid: s.init_process_pid,
        created: s.created,
        bundle,
        annotations,
    })
}

/// Every container in a runc root (unreadable entries are skipped).
pub fn list(root: &Path) -> Vec<RuncContainer> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| std::fs::read(e.path().join("state.json")).ok())
        .filter_map(|raw| parse_state(&raw))
        .collect()
}

/// One container by id.
pub fn by_id(root: &Path, id: &str) -> Option<RuncContainer> {
    if id.is_empty() || id.contains('/') || id.starts_with('.') {
        return None;
    }
    parse_state(&std::fs::read(root.join(id).join("state.json")).ok()?)
}

fn alive(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The app containers of a pod, newest first, living ones only (a container restarted in place
/// may leave its dead predecessor in the root until the shim deletes it).
pub fn pod_containers(all: &[RuncContainer], pod_uid: &str) -> Vec<RuncContainer> {
    let mut v: Vec<RuncContainer> = all
        .iter()
        .filter(|c| matches!(c.kind(), Kind::App(p) if p.pod_uid == pod_uid))
        .filter(|c| alive(c.init_pid))
        .cloned()
        .collect();
    v.sort_by(|a, b| b.created.cmp(&a.created));
    v
}

/// The containers of a pod to checkpoint together: of each name the newest living one, in name
/// order; only the named one when `container_name` is given.
pub fn members(
    all: &[RuncContainer],
    root: &Path,
    pod_uid: &str,
    container_name: Option<&str>,
) -> Result<Vec<RuncContainer>> {
    let name_of = |c: &RuncContainer| c.pod().map(|p| p.container_name).unwrap_or_default();
    let mut by_name: BTreeMap<String, RuncContainer> = BTreeMap::new();
    // Newest first: the first of each name is kept.
    for c in pod_containers(all, pod_uid) {
        by_name.entry(name_of(&c)).or_insert(c);
    }
    if let Some(n) = container_name.filter(|n| !n.is_empty()) {
        by_name.retain(|k, _| k == n);
    }
    if by_name.is_empty() {
        return Err(AgentError::NoContainer {
            pod_uid: pod_uid.into(),
            root: root.into(),
        });
    }
    Ok(by_name.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(id: &str, pid: i32, created: &str, labels: &[&str]) -> Vec<u8> {
        serde_json::json!({
            "id": id, "init_process_pid": pid, "created": created,
            "config": {"rootfs": "/x", "labels": labels}
        })
        .to_string()
        .into_bytes()
    }

    fn app(id: &str, uid: &str, name: &str, created: &str) -> RuncContainer {
        let me = std::process::id() as i32;
        parse_state(&state(
            id,
            me,
            created,
            &[
                "bundle=/run/containerd/io.containerd.runtime.v2.task/k8s.io/x",
                "io.kubernetes.cri.container-type=container",
                &format!("io.kubernetes.cri.sandbox-uid={uid}"),
                "io.kubernetes.cri.sandbox-namespace=default",
                "io.kubernetes.cri.sandbox-name=counter-0",
                &format!("io.kubernetes.cri.container-name={name}"),
            ],
        ))
        .unwrap()
    }

    #[test]
    fn parses_runc_state_labels() {
        let c = app("c1", "u1", "counter", "2026-11-29T09:00:00.1Z");
        assert_eq!(c.id, "c1");
        assert_eq!(
            c.bundle.as_deref(),
            Some(Path::new(
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/x"
            ))
        );
        assert_eq!(
            c.kind(),
            Kind::App(PodRef {
                pod_uid: "u1".into(),
                pod_namespace: "default".into(),
                pod_name: "counter-0".into(),
                container_name: "counter".into()
            })
        );
        let s = parse_state(&state(
            "s",
            1,
            "",
            &["io.kubernetes.cri.container-type=sandbox"],
        ))
        .unwrap();
        assert_eq!(s.kind(), Kind::Sandbox);
        let p = parse_state(&state("p", 1, "", &["bundle=/b"])).unwrap();
        assert_eq!(p.kind(), Kind::Plain);
        // kubelet/CRI-O fallbacks.
        let k = parse_state(&state(
            "k",
            1,
            "",
            &[
                "io.kubernetes.cri-o.ContainerType=container",
                "io.kubernetes.pod.uid=u9",
                "io.kubernetes.container.name=app",
            ],
        ))
        .unwrap();
        assert_eq!(k.pod().unwrap().pod_uid, "u9");
        assert_eq!(k.pod().unwrap().container_name, "app");
        assert!(parse_state(b"{}").is_none());
    }

    #[test]
    fn picks_the_pods_containers() {
        let all = vec![
            app("old", "u1", "counter", "2026-11-29T09:00:00Z"),
            app("new", "u1", "counter", "2026-11-29T09:05:00Z"),
            app("other", "u2", "counter", "2026-11-29T09:05:00Z"),
            parse_state(&state(
                "sb",
                std::process::id() as i32,
                "",
                &[
                    "io.kubernetes.cri.container-type=sandbox",
                    "io.kubernetes.cri.sandbox-uid=u1",
                ],
            ))
            .unwrap(),
        ];
        let root = Path::new("/r");
        let ids = |v: Result<Vec<RuncContainer>>| -> Vec<String> {
            v.unwrap().into_iter().map(|c| c.id).collect()
        };
        assert_eq!(ids(members(&all, root, "u1", None)), ["new"]);
        assert_eq!(ids(members(&all, root, "u1", Some("counter"))), ["new"]);
        assert!(matches!(
            members(&all, root, "u1", Some("sidecar")),
            Err(AgentError::NoContainer { .. })
        ));
        assert!(matches!(
            members(&all, root, "u3", None),
            Err(AgentError::NoContainer { .. })
        ));
        // Several containers: every one, the newest of each name, in name order.
        let mut two = all.clone();
        two.push(app("side", "u1", "sidecar", "2026-11-29T09:06:00Z"));
        two.push(app("aux", "u1", "aux", "2026-11-29T09:01:00Z"));
        assert_eq!(ids(members(&two, root, "u1", None)), ["aux", "new", "side"]);
        assert_eq!(ids(members(&two, root, "u1", Some("sidecar"))), ["side"]);
        // Dead containers are ignored.
        let mut dead = app("dead", "u4", "c", "2026-11-29T09:00:00Z");
        dead.init_pid = i32::MAX - 1;
        assert!(pod_containers(&[dead], "u4").is_empty());
    }

    #[test]
    fn lists_a_root_directory() {
        let t = tempfile::tempdir().unwrap();
        for id in ["a", "b"] {
            std::fs::create_dir(t.path().join(id)).unwrap();
            std::fs::write(
                t.path().join(id).join("state.json"),
                state(id, 1, "", &["bundle=/b"]),
            )
            .unwrap();
        }
        std::fs::create_dir(t.path().join("junk")).unwrap();
        let mut ids: Vec<String> = list(t.path()).into_iter().map(|c| c.id).collect();
        ids.sort();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(by_id(t.path(), "a").unwrap().id, "a");
        assert!(by_id(t.path(), "../a").is_none());
        assert!(list(&t.path().join("absent")).is_empty());
    }
}
