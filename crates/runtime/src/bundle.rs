//! What the wrapper reads from an OCI bundle's `config.json`: the rootfs and the CRI annotations
//! that say which pod and container this is.
//!
//! Annotation names, from containerd's `internal/cri/annotations` (2.x; `pkg/cri/annotations` in
//! 1.7): `io.kubernetes.cri.container-type` (`sandbox` | `container`),
//! `io.kubernetes.cri.sandbox-id`, `io.kubernetes.cri.sandbox-uid`,
//! `io.kubernetes.cri.sandbox-namespace`, `io.kubernetes.cri.sandbox-name`,
//! `io.kubernetes.cri.container-name`. CRI-O's are `io.kubernetes.cri-o.ContainerType` and
//! the kubelet's `io.kubernetes.pod.uid` / `.pod.namespace` / `.pod.name` /
//! `io.kubernetes.container.name`, accepted as fallbacks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use stasis_node_api::cri::{
    classify, ContainerKind, CONTAINER_NAME, CONTAINER_TYPE, POD_NAME, POD_NAMESPACE, POD_UID,
};

/// The pod annotation that forces a cold start (containerd passes pod annotations into the
/// container's OCI annotations when the runtime handler lists them in `pod_annotations`; the
/// chart registers `stasis` with `pod_annotations = ["stasis.dev/*"]`).
pub use stasis_core::names::COLD_START;

#[derive(Debug, Deserialize)]
struct Config {
    root: Root,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    linux: Option<Linux>,
}

#[derive(Debug, Default, Deserialize)]
struct Linux {
    #[serde(default)]
    namespaces: Vec<Namespace>,
}

#[derive(Debug, Deserialize)]
struct Namespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Root {
    path: PathBuf,
}

/// The parts of a bundle the wrapper uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub dir: PathBuf,
    pub rootfs: PathBuf,
    pub annotations: BTreeMap<String, String>,
    /// The container gets a network namespace of its own (not joined by path): after a restore
    /// its loopback is down (DESIGN §8) and must be brought up.
    pub own_netns: bool,
    /// The network namespace the container joins by path (a pod's), if any.
    pub netns_path: Option<PathBuf>,
}

impl Bundle {
    /// Where a restore puts the container's sockets.
    pub fn tcp_target(&self) -> stasis_engine::sockets::Target {
        use stasis_engine::sockets::Target;
        match (&self.netns_path, self.own_netns) {
            (Some(p), _) => Target::Joined(p.clone()),
            (None, true) => Target::New,
            (None, false) => Target::Current,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not an OCI runtime config: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Reads `<dir>/config.json`.
pub fn read(dir: &Path) -> Result<Bundle, BundleError> {
    let path = dir.join("config.json");
    let raw = std::fs::read(&path).map_err(|source| BundleError::Read {
        path: path.clone(),
        source,
    })?;
    parse(dir, &raw).map_err(|source| BundleError::Parse { path, source })
}

/// Parses a `config.json`'s content; a relative `root.path` is relative to the bundle.
pub fn parse(dir: &Path, raw: &[u8]) -> Result<Bundle, serde_json::Error> {
    let c: Config = serde_json::from_slice(raw)?;
    let rootfs = if c.root.path.is_absolute() {
        c.root.path
    } else {
        dir.join(c.root.path)
    };
    let namespaces = c.linux.unwrap_or_default().namespaces;
    let net = namespaces.iter().find(|n| n.kind == "network");
    let netns_path = net
        .and_then(|n| n.path.as_deref())
        .filter(|p| !p.is_empty())
        .map(PathBuf::from);
    let own_netns = net.is_some() && netns_path.is_none();
    Ok(Bundle {
        dir: dir.to_path_buf(),
        rootfs,
        annotations: c.annotations,
        own_netns,
        netns_path,
    })
}

/// Whether the pod asks for a cold start.
pub fn forces_cold_start(a: &BTreeMap<String, String>) -> bool {
    a.get(COLD_START)
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

/// The annotations runc keeps in its state (`<root>/<id>/state.json`: `config.labels` holds
/// `bundle=<dir>` and every annotation as `key=value`), so `kill` can tell a sandbox from an app
/// container without the bundle.
pub fn annotations_from_runc_state(raw: &[u8]) -> Option<BTreeMap<String, String>> {
    #[derive(Deserialize)]
    struct State {
        config: StateConfig,
    }
    #[derive(Deserialize)]
    struct StateConfig {
        #[serde(default)]
        labels: Vec<String>,
    }
    let s: State = serde_json::from_slice(raw).ok()?;
    Some(
        s.config
            .labels
            .iter()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

/// Whether the kernel's OOM killer killed a process of the container whose runc state this is:
/// its memory cgroup's `oom_kill` count (cgroup v1 `memory.oom_control`, v2 `memory.events`),
/// read while runc still has the cgroup (before `runc delete` removes it).
pub fn oom_killed_from_runc_state(raw: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct State {
        #[serde(default)]
        cgroup_paths: BTreeMap<String, String>,
    }
    let Ok(s) = serde_json::from_slice::<State>(raw) else {
        return false;
    };
    let files = [
        s.cgroup_paths
            .get("memory")
            .map(|d| Path::new(d).join("memory.oom_control")),
        s.cgroup_paths
            .get("")
            .map(|d| Path::new(d).join("memory.events")),
    ];
    files
        .into_iter()
        .flatten()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .any(|text| oom_kills(&text) > 0)
}

/// The `oom_kill <n>` line of a memory cgroup's `memory.oom_control` or `memory.events`.
pub fn oom_kills(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn oom_kill_counts_of_both_cgroup_versions() {
        assert_eq!(
            super::oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
            2
        );
        assert_eq!(
            super::oom_kills("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n"),
            1
        );
        assert_eq!(
            super::oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"),
            0
        );
        assert_eq!(super::oom_kills(""), 0);
        assert!(!super::oom_killed_from_runc_state(
            b"{\"cgroup_paths\":{\"memory\":\"/nonexistent\"}}"
        ));
        assert!(!super::oom_killed_from_runc_state(b"not json"));
    }

    use super::*;
    use stasis_node_api::PodRef;

    const CRI_APP: &str = r#"{"ociVersion":"1.2.0","process":{"args":["/app"]},
      "root":{"path":"rootfs"},
      "annotations":{
        "io.kubernetes.cri.container-type":"container",
        "io.kubernetes.cri.sandbox-id":"5f0d",
        "io.kubernetes.cri.sandbox-uid":"0b5c7e1a-1111-2222-3333-444455556666",
        "io.kubernetes.cri.sandbox-namespace":"default",
        "io.kubernetes.cri.sandbox-name":"counter-7d9f-x2",
        "io.kubernetes.cri.container-name":"counter",
        "io.kubernetes.cri.image-name":"stasis-counter:dev"}}"#;

    #[test]
    fn cri_app_container() {
        let b = parse(Path::new("/b"), CRI_APP.as_bytes()).unwrap();
        assert_eq!(b.rootfs, Path::new("/b/rootfs"));
        assert_eq!(
            classify(&b.annotations),
            ContainerKind::App(PodRef {
                pod_uid: "0b5c7e1a-1111-2222-3333-444455556666".into(),
                pod_namespace: "default".into(),
                pod_name: "counter-7d9f-x2".into(),
                container_name: "counter".into(),
            })
        );
        assert!(!forces_cold_start(&b.annotations));
        assert!(!b.own_netns);
    }

    #[test]
    fn network_namespaces() {
        let own =
            br#"{"root":{"path":"r"},"linux":{"namespaces":[{"type":"pid"},{"type":"network"}]}}"#;
        assert!(parse(Path::new("/b"), own).unwrap().own_netns);
        let joined = br#"{"root":{"path":"r"},"linux":{"namespaces":[{"type":"network","path":"/var/run/netns/cni-1"}]}}"#;
        assert!(!parse(Path::new("/b"), joined).unwrap().own_netns);
        let host = br#"{"root":{"path":"r"},"linux":{"namespaces":[{"type":"mount"}]}}"#;
        assert!(!parse(Path::new("/b"), host).unwrap().own_netns);
        // Where a restore puts the sockets (DESIGN §9.8).
        use stasis_engine::sockets::Target;
        assert_eq!(
            parse(Path::new("/b"), own).unwrap().tcp_target(),
            Target::New
        );
        assert_eq!(
            parse(Path::new("/b"), joined).unwrap().tcp_target(),
            Target::Joined("/var/run/netns/cni-1".into())
        );
        assert_eq!(
            parse(Path::new("/b"), host).unwrap().tcp_target(),
            Target::Current
        );
    }

    #[test]
    fn sandbox_plain_crio_and_forced_cold() {
        let sb = r#"{"root":{"path":"/abs/rootfs"},"annotations":{"io.kubernetes.cri.container-type":"sandbox"}}"#;
        let b = parse(Path::new("/b"), sb.as_bytes()).unwrap();
        assert_eq!(b.rootfs, Path::new("/abs/rootfs"));
        assert_eq!(classify(&b.annotations), ContainerKind::Sandbox);
        let plain = parse(Path::new("/b"), br#"{"root":{"path":"rootfs"}}"#).unwrap();
        assert_eq!(classify(&plain.annotations), ContainerKind::Plain);
        let crio = r#"{"root":{"path":"r"},"annotations":{"io.kubernetes.cri-o.ContainerType":"container",
          "io.kubernetes.pod.uid":"u1","io.kubernetes.pod.namespace":"ns","io.kubernetes.pod.name":"p",
          "io.kubernetes.container.name":"c","stasis.dev/cold-start":"True"}}"#;
        let b = parse(Path::new("/b"), crio.as_bytes()).unwrap();
        let ContainerKind::App(pod) = classify(&b.annotations) else {
            panic!()
        };
        assert_eq!(
            (
                pod.pod_uid.as_str(),
                pod.pod_namespace.as_str(),
                pod.pod_name.as_str(),
                pod.container_name.as_str()
            ),
            ("u1", "ns", "p", "c")
        );
        assert!(forces_cold_start(&b.annotations));
        assert!(parse(Path::new("/b"), b"{}").is_err());
    }

    #[test]
    fn runc_state_labels() {
        let raw = br#"{"id":"x","config":{"labels":["bundle=/b","io.kubernetes.cri.container-type=sandbox","k=a=b"]}}"#;
        let a = annotations_from_runc_state(raw).unwrap();
        assert_eq!(a["bundle"], "/b");
        assert_eq!(classify(&a), ContainerKind::Sandbox);
        assert_eq!(a["k"], "a=b");
        assert!(annotations_from_runc_state(b"nope").is_none());
    }
}
