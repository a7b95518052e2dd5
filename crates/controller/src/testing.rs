//! What the controller's unit tests share: ONE stand-in API server ([`api_server`], or
//! [`offline_client`] where nothing may be called), the caches and the fixtures (a running pod,
//! a lineage record, a reconciler context). The integration tests run a real kube-apiserver
//! (`tests/admission_policy.rs`); these stand in where a unit test needs answers it chooses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::Client;
use serde_json::json;
use stasis_api::{names, CheckpointPolicy, PodCheckpoint};
use stasis_core::lineage::Lineage;
use stasis_core::reference::{CheckpointId, WorkloadName};

use crate::metrics::Metrics;
use crate::reconcile::{Context, ControllerConfig, MANAGER};
use crate::record::{Holder, Record, Records};

/// An API server that cannot be reached: every request fails (the unit under test must not
/// call one).
pub fn offline_client() -> Client {
    let svc = tower::service_fn(|_req: http::Request<kube::client::Body>| async move {
        Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
            "no API server in unit tests",
        ))
    });
    Client::new(svc, "default")
}

/// A list object of `kind` with `items`, as the API server answers a list.
pub fn list(kind: &str, items: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"resourceVersion": "1"}, "items": items})
}

/// A pod from its JSON.
pub fn pod(v: serde_json::Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

pub type Seen = Arc<Mutex<Vec<(String, String, serde_json::Value)>>>;

pub fn store_of<K>(items: Vec<K>) -> Store<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, mut writer) = reflector::store();
    for i in items {
        writer.apply_watcher_event(&watcher::Event::Apply(i));
    }
    reader
}

pub fn running_pod(started: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {
            "name": "counter-7d9f8b6c5-abcde", "namespace": "prod", "uid": "uid-1",
            "labels": {"app": "counter", "pod-template-hash": "7d9f8b6c5", names::CLAIM_TOKEN: "tok"},
            "annotations": {names::LINEAGE: "prod_deploy_counter.aaaaaaaa", names::GENERATION: "2"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-7d9f8b6c5", "uid": "rs", "controller": true}]
        },
        "spec": {"runtimeClassName": "stasis", "nodeName": "worker-1", "containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running", "startTime": started,
                   "conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .unwrap()
}

pub fn test_context(client: Client, checkpoints: Vec<PodCheckpoint>) -> Arc<Context> {
    let policy: CheckpointPolicy = serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
        "metadata": {"name": "counter", "namespace": "prod"},
        "spec": {"selector": {"matchLabels": {"app": "counter"}}, "interval": "10s"}
    }))
    .unwrap();
    let w = WorkloadName::new("prod_deploy_counter").unwrap();
    let mut lineage = Lineage::start(&w, "aaaaaaaa", &[]);
    lineage.holder = Some("tok".into());
    lineage.generation = 2;
    let mut record = Record::new(
        "prod",
        lineage,
        Some(Holder {
            token: "tok".into(),
            claimed_unix_ms: 1,
            pod: Some("counter-7d9f8b6c5-abcde".into()),
            uid: Some("uid-1".into()),
            ..Default::default()
        }),
    );
    record.resource_version = Some("5".into());
    Caches {
        policies: vec![policy],
        checkpoints,
        records: vec![record],
        ..Default::default()
    }
    .context(client)
}

/// A context over the given records, pods and policies (every other cache empty).
pub fn context_with(
    client: Client,
    checkpoints: Vec<PodCheckpoint>,
    records: Vec<Record>,
    pods: Vec<Pod>,
    policies: Vec<CheckpointPolicy>,
) -> Arc<Context> {
    Caches {
        policies,
        checkpoints,
        records,
        pods,
        ..Default::default()
    }
    .context(client)
}

/// What the reconcilers' caches hold in a test (the restores cache is empty).
#[derive(Default)]
pub struct Caches {
    pub policies: Vec<CheckpointPolicy>,
    pub checkpoints: Vec<PodCheckpoint>,
    pub records: Vec<Record>,
    /// Lineage record ConfigMaps as they are stored (beside those of `records`).
    pub config_maps: Vec<ConfigMap>,
    pub pods: Vec<Pod>,
}

impl Caches {
    /// A reconciler context over these caches, writing through `client` (no store).
    pub fn context(self, client: Client) -> Arc<Context> {
        let maps: Vec<ConfigMap> = self
            .records
            .iter()
            .map(|r| r.to_config_map().unwrap())
            .chain(self.config_maps)
            .collect();
        Arc::new(Context {
            records: Records::new(client.clone(), "stasis"),
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: MANAGER.into(),
                    instance: None,
                },
            ),
            client,
            metrics: Metrics::default(),
            cfg: ControllerConfig {
                runtime_class: "stasis".into(),
                in_flight_timeout: Duration::from_secs(900),
                phantom_after: Duration::from_secs(120),
                final_wait: Duration::from_secs(20),
                sweep_every: Duration::from_secs(15),
                collect_records_after: Duration::from_secs(600),
                max_records_per_namespace: 1000,
            },
            policies: store_of(self.policies),
            checkpoints: crate::cache::Checkpoints::of(self.checkpoints),
            restores: store_of(vec![]),
            record_index: crate::cache::RecordIndex::of(&maps),
            record_maps: store_of(maps),
            pods: store_of(self.pods),
            skips: Mutex::new(HashMap::new()),
            evictions: Mutex::new(stasis_core::interval::EvictionLog::new(
                stasis_core::time::now_ms(),
            )),
            store: None,
            owners: None,
        })
    }
}

/// Record `R` of namespace `ns`, lineage `<ns>_deploy_counter.aaaaaaaa` at generation 2,
/// held by pod `counter-a` (UID `uid-1`, token `tok`), with a restore decided for it.
pub fn record_of_a(ns: &str) -> Record {
    let w = WorkloadName::new(format!("{ns}_deploy_counter")).unwrap();
    let mut lineage = Lineage::start(&w, "aaaaaaaa", &[]);
    lineage.holder = Some("tok".into());
    lineage.generation = 2;
    let mut r = Record::new(
        ns,
        lineage,
        Some(Holder {
            token: "tok".into(),
            claimed_unix_ms: 1,
            pod: Some("counter-a".into()),
            uid: Some("uid-1".into()),
            restore: Some(format!(
                "{ns}_deploy_counter.aaaaaaaa/{}",
                CheckpointId::from_parts(1_700_000_000_000, 1)
            )),
            source_pod: Some("counter-old".into()),
        }),
    );
    r.resource_version = Some("5".into());
    r
}

pub fn writes(seen: &Seen) -> Vec<(String, String, serde_json::Value)> {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(m, _, _)| m != "GET")
        .cloned()
        .collect()
}

/// The stand-in API server of every controller unit test: answers `GET`s from `gets` (by
/// path; 404 otherwise), `DELETE`s with success, and echoes every other write (a `PATCH` as the
/// patched kind, a create or replace with a new resourceVersion); records every request
/// (method, path, JSON body) in the returned [`Seen`].
///
/// A `gets` entry whose value is a failed `Status` (code ≥ 400) answers every method on its
/// path with that failure. A `PATCH` by another field manager than `stasis-controller`, or
/// neither a forced server-side apply nor a merge patch of labels and annotations alone, is
/// refused with 415: every controller write must be one of those.
pub fn api_server(gets: Vec<(String, serde_json::Value)>) -> (Client, Seen) {
    let (client, seen, _) = serve(gets, None);
    (client, seen)
}

/// The lineage record ConfigMaps of [`api_server_with_records`], by name.
pub type RecordStore = Arc<Mutex<std::collections::BTreeMap<String, serde_json::Value>>>;

/// [`api_server`], with the lineage record ConfigMaps of namespace `stasis` kept as a real API
/// server keeps them: listed (every record, whatever the label selector), read, created (409 when
/// the name exists), replaced only at their current resourceVersion (409 otherwise; each write a
/// new version) and deleted. Seeded with `records`.
pub fn api_server_with_records(
    gets: Vec<(String, serde_json::Value)>,
    records: &[Record],
) -> (Client, Seen, RecordStore) {
    let store: RecordStore = Arc::default();
    for r in records {
        let mut cm = serde_json::to_value(r.to_config_map().unwrap()).unwrap();
        if cm["metadata"]["resourceVersion"].is_null() {
            cm["metadata"]["resourceVersion"] = json!("1");
        }
        store.lock().unwrap().insert(r.name(), cm);
    }
    let (client, seen) = api_server_over(gets, &store);
    (client, seen, store)
}

/// Another stand-in API server over the same records (other answers to `GET`s).
pub fn api_server_over(
    gets: Vec<(String, serde_json::Value)>,
    store: &RecordStore,
) -> (Client, Seen) {
    let (client, seen, _) = serve(gets, Some(store.clone()));
    (client, seen)
}

/// The records a [`RecordStore`] holds now.
pub fn stored_records(store: &RecordStore) -> Vec<Record> {
    store
        .lock()
        .unwrap()
        .values()
        .map(|cm| Record::from_config_map(&serde_json::from_value(cm.clone()).unwrap()).unwrap())
        .collect()
}

const RECORDS_PATH: &str = "/api/v1/namespaces/stasis/configmaps";

/// A request on the records of a [`RecordStore`]: (status, body).
fn on_records(
    store: &RecordStore,
    method: &str,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let mut cms = store.lock().unwrap();
    let conflict = |name: &str| {
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "reason": "Conflict", "message": format!("configmap {name} changed"), "code": 409})
    };
    let name = path
        .strip_prefix(RECORDS_PATH)
        .unwrap_or_default()
        .trim_start_matches('/');
    let next = |cms: &std::collections::BTreeMap<String, serde_json::Value>| {
        let max = cms
            .values()
            .filter_map(|c| {
                c["metadata"]["resourceVersion"]
                    .as_str()?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap_or(100);
        json!((max + 1).to_string())
    };
    match (method, name) {
        ("GET", "") => (200, list("ConfigMapList", cms.values().cloned().collect())),
        ("GET", n) => match cms.get(n) {
            Some(cm) => (200, cm.clone()),
            None => (
                404,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404}),
            ),
        },
        ("POST", "") => {
            let n = body["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if cms.contains_key(&n) {
                return (409, conflict(&n));
            }
            let mut cm = body;
            cm["metadata"]["resourceVersion"] = next(&cms);
            cms.insert(n, cm.clone());
            (200, cm)
        }
        ("PUT", n) => {
            let current = cms.get(n).map(|c| c["metadata"]["resourceVersion"].clone());
            if current.is_none() || current.as_ref() != Some(&body["metadata"]["resourceVersion"]) {
                return (409, conflict(n));
            }
            let mut cm = body;
            cm["metadata"]["resourceVersion"] = next(&cms);
            cms.insert(n.to_owned(), cm.clone());
            (200, cm)
        }
        ("DELETE", n) => {
            cms.remove(n);
            (
                200,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
            )
        }
        _ => (
            405,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "code": 405}),
        ),
    }
}

fn serve(
    gets: Vec<(String, serde_json::Value)>,
    records: Option<RecordStore>,
) -> (Client, Seen, Option<RecordStore>) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let gets = Arc::new(gets);
    let store = records.clone();
    let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let (log, gets, store) = (log.clone(), gets.clone(), store.clone());
        async move {
            let (parts, body) = req.into_parts();
            let bytes = http_body_util::BodyExt::collect(body)
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            let (method, path) = (parts.method.to_string(), parts.uri.path().to_owned());
            log.lock()
                .unwrap()
                .push((method.clone(), path.clone(), v.clone()));
            let failure = gets.iter().find(|(p, v)| {
                *p == path && v["kind"] == "Status" && v["code"].as_u64().unwrap_or(0) >= 400
            });
            let query = parts.uri.query().unwrap_or_default();
            let content_type = |t: &str| parts.headers.get("content-type").is_some_and(|c| c == t);
            let by_us = query.contains("fieldManager=stasis-controller");
            // A forced server-side apply, or a merge patch that only adds labels and
            // annotations (`add_metadata`).
            let metadata_only = v
                .as_object()
                .is_some_and(|o| o.keys().all(|k| k == "metadata"));
            let apply = by_us
                && ((content_type("application/apply-patch+yaml") && query.contains("force=true"))
                    || (content_type("application/merge-patch+json") && metadata_only));
            let (status, out) = match method.as_str() {
                _ if store.is_some() && path.starts_with(RECORDS_PATH) => {
                    on_records(store.as_ref().unwrap(), &method, &path, v)
                }
                _ if failure.is_some() => {
                    let v = failure.unwrap().1.clone();
                    (v["code"].as_u64().unwrap() as u16, v)
                }
                "PATCH" if !apply => (
                    415,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": format!("not a server-side apply or a metadata merge patch by stasis-controller: {query}"), "code": 415}),
                ),
                "GET" => match gets.iter().find(|(p, _)| *p == path) {
                    Some((_, v)) => (200, v.clone()),
                    None => (
                        404,
                        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404}),
                    ),
                },
                "DELETE" => (
                    200,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
                ),
                "PATCH" => {
                    // A patch answers with the whole object; these tests only need it to
                    // parse as the patched kind.
                    let mut v = v;
                    v["metadata"] = json!({"name": "x", "namespace": "prod"});
                    if path.contains("/podrestores/") {
                        v["apiVersion"] = json!("stasis.dev/v1alpha1");
                        v["kind"] = json!("PodRestore");
                        v["spec"] = json!({"checkpointRef": "x/y", "targetPodName": "x"});
                    } else if path.contains("/pods/") {
                        v["apiVersion"] = json!("v1");
                        v["kind"] = json!("Pod");
                    } else {
                        v["apiVersion"] = json!("stasis.dev/v1alpha1");
                        v["kind"] = json!("PodCheckpoint");
                        v["spec"] = json!({"sourcePodName": "p"});
                    }
                    (200, v)
                }
                _ => {
                    let mut v = v;
                    v["metadata"]["resourceVersion"] = json!("101");
                    (200, v)
                }
            };
            Ok::<_, std::convert::Infallible>(
                http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(out.to_string().into_bytes()))
                    .unwrap(),
            )
        }
    });
    (Client::new(svc, "default"), seen, records)
}

/// The holder of the stand-in records: pod `p` (UID `uid-1`) registered by the controller.
pub fn holder_uid_1() -> Option<Holder> {
    Some(Holder {
        token: "tok".into(),
        claimed_unix_ms: 1,
        pod: Some("p".into()),
        uid: Some("uid-1".into()),
        ..Default::default()
    })
}

pub fn succeeded(name: &str, lineage: &str, id: &CheckpointId, generation: u64) -> PodCheckpoint {
    serde_json::from_value(json!({
        "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
        "metadata": {"name": name, "namespace": "prod", "labels": {"stasis.dev/policy": "counter"}},
        "spec": {"sourcePodName": "p", "sourcePodUID": "uid-1", "reason": "Heartbeat"},
        "status": {"phase": "Succeeded", "checkpointRef": format!("{lineage}/{id}"),
                   "lineage": lineage, "generation": generation, "specHash": "blake3:x",
                   "manifestDigest": digest_of(id)}
    }))
    .unwrap()
}

/// A well-formed manifest digest, distinct per checkpoint.
pub fn digest_of(id: &CheckpointId) -> String {
    format!(
        "sha256:{}",
        blake3::hash(id.to_string().as_bytes()).to_hex()
    )
}

pub fn succeeded_in(
    ns: &str,
    name: &str,
    lineage: &str,
    id: &CheckpointId,
    source_uid: &str,
) -> PodCheckpoint {
    let mut c = succeeded(name, lineage, id, 2);
    c.metadata.namespace = Some(ns.into());
    c.spec.source_pod_uid = Some(source_uid.into());
    c.status.as_mut().unwrap().source_pod_uid = Some(source_uid.into());
    c
}

/// A lineage record of `prod_deploy_c` held by `token` (and the pod `c-1` with `uid`, once seen).
pub fn record_held_by(token: &str, uid: Option<&str>) -> Record {
    let w = WorkloadName::new("prod_deploy_c").unwrap();
    Record::new(
        "prod",
        Lineage::start(&w, token, &[]),
        Some(Holder {
            token: token.into(),
            claimed_unix_ms: 0,
            uid: uid.map(str::to_owned),
            pod: uid.map(|_| "c-1".to_owned()),
            ..Default::default()
        }),
    )
}
