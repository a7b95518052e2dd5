//! The normalised pod spec hash (DESIGN §5), and the volume facts the restore decision needs.
//!
//! A checkpoint holds a pod's whole memory, so it is only ever restored into a pod whose
//! security-relevant spec is the source's. The hash is taken over a normalised spec (the pod's
//! `spec` as Kubernetes JSON, camelCase), built by these rules:
//!
//! **Kept** (an allow-list: a field not listed cannot make two equal pods differ, and a field
//! that matters for security is listed):
//! - pod level: `serviceAccountName` (falling back to the deprecated `serviceAccount`, then
//!   `default`), `automountServiceAccountToken`, `securityContext`, `hostNetwork`, `hostPID`,
//!   `hostIPC`, `hostUsers`, `shareProcessNamespace`, `runtimeClassName`, `volumes`;
//! - per container (`containers` sorted by name; `initContainers` in their order, since order is
//!   meaningful there; `ephemeralContainers` in their order): `name`, `image`,
//!   `imagePullPolicy` (with a mutable tag it decides which code runs), `command`, `args`,
//!   `workingDir`, `securityContext`, `restartPolicy` (sidecars), `env` (in order: names,
//!   literal values and `valueFrom` references), `envFrom`, `lifecycle` (hooks run code in the
//!   container), the handlers of `livenessProbe`, `readinessProbe` and `startupProbe` (`exec`,
//!   `httpGet`, `tcpSocket`, `grpc`: an exec probe runs code in the restored container and its
//!   output reaches Events; the timing fields are left out) and `volumeMounts` (sorted by
//!   `mountPath`).
//!
//! Whoever creates the pod a checkpoint is restored into must not be able to run code in it
//! that the checkpointed pod did not run: every field through which the pod spec runs code in a
//! container or feeds it input is kept.
//!
//! **Left out**: everything generated or placed per instance (node name, pod name and UID,
//! hostname, status, scheduler and priority fields, tolerations the API server adds),
//! resources, probe timings, and the service-account token volume the API server adds, only
//! in its exact generated shape ([`generated_token_volumes`]: a projected volume named
//! `kube-api-access-*` whose sources are exactly the token, `kube-root-ca.crt` and the
//! namespace, mounted read-only at [`SERVICE_ACCOUNT_PATH`] and nowhere else), together with
//! its mounts (its suffix is random per pod). A volume of that name in any other shape is
//! hashed like every other volume.
//!
//! **Normalised**: `null`, `{}` and `[]` values are dropped (absent and empty mean the same to
//! Kubernetes), `false` booleans are dropped for the pod-level host flags (their default), object
//! keys are sorted. The canonical JSON (sorted keys, no whitespace) is hashed with BLAKE3 and
//! written `blake3:<hex>`.
//!
//! A rollout that changes only resources keeps the hash; a workload that needs such a change to
//! refuse old checkpoints declares a version label, which the compatibility rule compares.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Prefix of the projected service-account token volume the API server adds to every pod.
pub const KUBE_API_ACCESS_PREFIX: &str = "kube-api-access-";
/// Where the API server mounts the service-account token volume.
pub const SERVICE_ACCOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

const POD_KEYS: &[&str] = &[
    "automountServiceAccountToken",
    "securityContext",
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "hostUsers",
    "shareProcessNamespace",
    "runtimeClassName",
];
const HOST_FLAGS: &[&str] = &["hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"];
const CONTAINER_KEYS: &[&str] = &[
    "name",
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "workingDir",
    "securityContext",
    "restartPolicy",
    "env",
    "envFrom",
    "lifecycle",
];
const PROBES: &[&str] = &["livenessProbe", "readinessProbe", "startupProbe"];
/// The parts of a probe that say what runs (its timings are left out).
const PROBE_HANDLERS: &[&str] = &["exec", "httpGet", "tcpSocket", "grpc"];

/// `blake3:<64 hex>`: the hash of a normalised pod spec.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SpecHash(pub String);

impl fmt::Display for SpecHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The normalised form of a pod spec (the module documentation lists the rules). Input is the
/// pod's `spec` object; anything that is not an object normalises to an empty object.
pub fn normalise(spec: &Value) -> Value {
    let empty = Map::new();
    let spec = spec.as_object().unwrap_or(&empty);
    let mut out = Map::new();
    for key in POD_KEYS {
        if let Some(v) = spec.get(*key) {
            if HOST_FLAGS.contains(key) && v == &Value::Bool(false) {
                continue;
            }
            out.insert((*key).to_owned(), v.clone());
        }
    }
    let sa = spec
        .get("serviceAccountName")
        .or_else(|| spec.get("serviceAccount"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or("default");
    out.insert("serviceAccountName".into(), Value::String(sa.into()));

    let token = generated_token_volumes(spec);
    if let Some(vols) = spec.get("volumes").and_then(Value::as_array) {
        let mut vols: Vec<Value> = vols
            .iter()
            .filter(|v| !token.contains(name_of(v)))
            .cloned()
            .collect();
        vols.sort_by(|a, b| name_of(a).cmp(name_of(b)));
        out.insert("volumes".into(), Value::Array(vols));
    }
    let mut containers = containers_of(spec, "containers", &token);
    containers.sort_by(|a, b| name_of(a).cmp(name_of(b)));
    out.insert("containers".into(), Value::Array(containers));
    for key in ["initContainers", "ephemeralContainers"] {
        out.insert(key.into(), Value::Array(containers_of(spec, key, &token)));
    }
    prune(Value::Object(out)).unwrap_or_else(|| Value::Object(Map::new()))
}

/// The hash of [`normalise`]`(spec)`. Two pods with different hashes are never restored into
/// each other.
pub fn spec_hash(spec: &Value) -> SpecHash {
    let mut canonical = String::new();
    write_canonical(&normalise(spec), &mut canonical);
    SpecHash(format!(
        "blake3:{}",
        blake3::hash(canonical.as_bytes()).to_hex()
    ))
}

fn containers_of(spec: &Map<String, Value>, key: &str, token: &BTreeSet<String>) -> Vec<Value> {
    let Some(list) = spec.get(key).and_then(Value::as_array) else {
        return Vec::new();
    };
    list.iter()
        .map(|c| {
            let mut out = Map::new();
            for k in CONTAINER_KEYS {
                if let Some(v) = c.get(*k) {
                    out.insert((*k).to_owned(), v.clone());
                }
            }
            for probe in PROBES {
                let Some(p) = c.get(*probe).and_then(Value::as_object) else {
                    continue;
                };
                let handler: Map<String, Value> = p
                    .iter()
                    .filter(|(k, _)| PROBE_HANDLERS.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                out.insert((*probe).to_owned(), Value::Object(handler));
            }
            if let Some(mounts) = c.get("volumeMounts").and_then(Value::as_array) {
                let mut mounts: Vec<Value> = mounts
                    .iter()
                    .filter(|m| !token.contains(name_of(m)))
                    .cloned()
                    .collect();
                mounts.sort_by(|a, b| {
                    let p = |m: &Value| {
                        m.get("mountPath")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned()
                    };
                    p(a).cmp(&p(b))
                });
                out.insert("volumeMounts".into(), Value::Array(mounts));
            }
            Value::Object(out)
        })
        .collect()
}

fn name_of(v: &Value) -> &str {
    v.get("name").and_then(Value::as_str).unwrap_or("")
}

/// Names of the service-account token volumes the API server generated, recognised only in
/// their exact shape: named `kube-api-access-*`; a projected volume of exactly the token (path
/// `token`), the `ca.crt` of ConfigMap `kube-root-ca.crt` and the pod's namespace, file mode
/// 0644 or unset; mounted only read-only at [`SERVICE_ACCOUNT_PATH`], without a sub-path. Any
/// other volume of that name can put files the checkpointed pod did not see into the restored
/// one, so it is hashed.
pub fn generated_token_volumes(spec: &Map<String, Value>) -> BTreeSet<String> {
    let mounts: Vec<&Value> = ["containers", "initContainers", "ephemeralContainers"]
        .iter()
        .filter_map(|k| spec.get(*k).and_then(Value::as_array))
        .flatten()
        .filter_map(|c| c.get("volumeMounts").and_then(Value::as_array))
        .flatten()
        .collect();
    let standard_mount = |m: &Value| {
        only_keys(m, &["name", "mountPath", "readOnly"])
            && m.get("mountPath").and_then(Value::as_str) == Some(SERVICE_ACCOUNT_PATH)
            && ro_flag(m)
    };
    spec.get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|v| name_of(v).starts_with(KUBE_API_ACCESS_PREFIX) && is_generated_token_source(v))
        .filter(|v| {
            mounts
                .iter()
                .filter(|m| name_of(m) == name_of(v))
                .all(|m| standard_mount(m))
        })
        .map(|v| name_of(v).to_owned())
        .collect()
}

/// The projected source of the generated token volume (see [`generated_token_volumes`]).
fn is_generated_token_source(v: &Value) -> bool {
    let Some(p) = v.get("projected") else {
        return false;
    };
    let mode_ok = p.get("defaultMode").is_none_or(|m| m == &Value::from(420));
    let Some(sources) = p.get("sources").and_then(Value::as_array) else {
        return false;
    };
    let [token, ca, ns] = sources.as_slice() else {
        return false;
    };
    let token_ok = only_keys(token, &["serviceAccountToken"])
        && token.get("serviceAccountToken").is_some_and(|t| {
            only_keys(t, &["path", "expirationSeconds"])
                && t.get("path").and_then(Value::as_str) == Some("token")
        });
    let ca_ok = ca
        == &serde_json::json!({"configMap": {"name": "kube-root-ca.crt",
        "items": [{"key": "ca.crt", "path": "ca.crt"}]}});
    let ns_ok = ns.get("downwardAPI").is_some_and(|d| {
        let item = d
            .get("items")
            .and_then(Value::as_array)
            .and_then(|i| match i.as_slice() {
                [one] => Some(one),
                _ => None,
            });
        only_keys(ns, &["downwardAPI"])
            && only_keys(d, &["items"])
            && item.is_some_and(|i| {
                only_keys(i, &["path", "fieldRef"])
                    && i.get("path").and_then(Value::as_str) == Some("namespace")
                    && i.get("fieldRef").is_some_and(|f| {
                        only_keys(f, &["apiVersion", "fieldPath"])
                            && f.get("fieldPath").and_then(Value::as_str)
                                == Some("metadata.namespace")
                            && f.get("apiVersion").is_none_or(|a| a == "v1")
                    })
            })
    });
    only_keys(v, &["name", "projected"])
        && only_keys(p, &["sources", "defaultMode"])
        && mode_ok
        && token_ok
        && ca_ok
        && ns_ok
}

/// `v` is an object whose non-null members are all among `keys`.
fn only_keys(v: &Value, keys: &[&str]) -> bool {
    v.as_object().is_some_and(|m| {
        m.iter()
            .all(|(k, v)| v.is_null() || keys.contains(&k.as_str()))
    })
}

/// Drops nulls, empty objects and empty arrays, recursively; `None` when nothing is left.
fn prune(v: Value) -> Option<Value> {
    match v {
        Value::Null => None,
        Value::Object(m) => {
            let m: Map<String, Value> = m
                .into_iter()
                .filter_map(|(k, v)| prune(v).map(|v| (k, v)))
                .collect();
            (!m.is_empty()).then_some(Value::Object(m))
        }
        Value::Array(a) => {
            let a: Vec<Value> = a.into_iter().filter_map(prune).collect();
            (!a.is_empty()).then_some(Value::Array(a))
        }
        other => Some(other),
    }
}

/// Canonical JSON: keys sorted (independently of serde_json's `preserve_order` feature), no
/// whitespace.
fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let sorted: BTreeMap<&String, &Value> = m.iter().collect();
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// What kind of storage a pod volume is, for the restore decision (DESIGN §5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumeKind {
    /// Contents captured with the checkpoint (`emptyDir`).
    Captured,
    /// Contents provided again, read-only, by Kubernetes (`configMap`, `secret`, `downwardAPI`,
    /// `projected`, `image`).
    Provided,
    /// A PersistentVolumeClaim: outlives the pod, not captured.
    PersistentClaim,
    /// A hostPath: outlives the pod, not captured.
    HostPath,
    /// A generic ephemeral volume: a fresh, empty claim per pod, not captured.
    Ephemeral,
    /// Any other source (nfs, csi, iscsi, ...), named: treated like a persistent volume.
    Other(String),
}

/// One pod volume as the restore decision sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeFacts {
    pub name: String,
    pub kind: VolumeKind,
    /// Read-only for the pod: the source says so, or every container mounts it read-only.
    pub read_only: bool,
}

impl VolumeFacts {
    /// True when restoring would pair memory from the checkpoint's instant with this volume's
    /// contents at a later instant (or with an empty volume): a writable volume whose contents
    /// are not captured.
    pub fn is_unsafe(&self) -> bool {
        match self.kind {
            VolumeKind::Captured | VolumeKind::Provided => false,
            VolumeKind::Ephemeral => true,
            VolumeKind::PersistentClaim | VolumeKind::HostPath | VolumeKind::Other(_) => {
                !self.read_only
            }
        }
    }
}

/// Classifies the volumes of a pod spec (Kubernetes JSON). The token volume is left out.
pub fn volume_facts(spec: &Value) -> Vec<VolumeFacts> {
    let Some(vols) = spec.get("volumes").and_then(Value::as_array) else {
        return Vec::new();
    };
    let mounts: Vec<&Value> = ["containers", "initContainers"]
        .iter()
        .filter_map(|k| spec.get(*k).and_then(Value::as_array))
        .flatten()
        .filter_map(|c| c.get("volumeMounts").and_then(Value::as_array))
        .flatten()
        .collect();
    let token = spec
        .as_object()
        .map(generated_token_volumes)
        .unwrap_or_default();
    vols.iter()
        .filter(|v| !token.contains(name_of(v)))
        .map(|v| {
            let name = name_of(v).to_owned();
            let (kind, source_ro) = if v.get("emptyDir").is_some() {
                (VolumeKind::Captured, false)
            } else if ["configMap", "secret", "downwardAPI", "projected", "image"]
                .iter()
                .any(|k| v.get(*k).is_some())
            {
                (VolumeKind::Provided, true)
            } else if let Some(pvc) = v.get("persistentVolumeClaim") {
                (VolumeKind::PersistentClaim, ro_flag(pvc))
            } else if v.get("hostPath").is_some() {
                (VolumeKind::HostPath, false)
            } else if v.get("ephemeral").is_some() {
                (VolumeKind::Ephemeral, false)
            } else {
                let source = v
                    .as_object()
                    .and_then(|m| m.iter().find(|(k, _)| k.as_str() != "name"))
                    .map(|(k, s)| (k.clone(), ro_flag(s)))
                    .unwrap_or_else(|| ("unknown".into(), false));
                (VolumeKind::Other(source.0), source.1)
            };
            let mine: Vec<&&Value> = mounts.iter().filter(|m| name_of(m) == name).collect();
            let mounts_ro = !mine.is_empty() && mine.iter().all(|m| ro_flag(m));
            VolumeFacts {
                name,
                kind,
                read_only: source_ro || mounts_ro,
            }
        })
        .collect()
}

fn ro_flag(v: &Value) -> bool {
    v.get("readOnly").and_then(Value::as_bool).unwrap_or(false)
}

/// Names of the unsafe volumes ([`VolumeFacts::is_unsafe`]) not declared safe by the policy.
pub fn unsafe_volumes(volumes: &[VolumeFacts], declared_safe: &[String]) -> Vec<String> {
    volumes
        .iter()
        .filter(|v| v.is_unsafe() && !declared_safe.contains(&v.name))
        .map(|v| v.name.clone())
        .collect()
}

#[cfg(test)]
mod tests;
