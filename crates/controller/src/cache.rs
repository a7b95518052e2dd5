//! Watch caches with lookups by key instead of scans (docs/design.md §13.5b).
//!
//! A reflector's store answers by name only; the controller needs "the checkpoints of this
//! pod", "the checkpoints of these lineages" and "the record this pod holds". Scanning the
//! whole store for each made every heartbeat and every admission cost O(objects): at 10,000
//! pods the controller could not keep up. An [`Index`] is fed the same watch events as the
//! store, in the same task, so it says what the store holds (an object the store has just got
//! may be missing from the index for the instant between the two updates, the same lag any
//! reader of a watch cache has).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use futures::{Future, StreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use stasis_api::PodCheckpoint;

use crate::holder::checkpoint_pod_uid;
use crate::record::Record;
use stasis_core::reference::WorkloadName;

/// An object of a namespaced kind: (namespace, name).
pub type ObjKey = (String, String);

fn obj_key<K: Resource>(o: &K) -> ObjKey {
    (o.namespace().unwrap_or_default(), o.name_any())
}

/// A secondary index over the objects of one watch: each object has some keys and a value
/// derived from it once (parsed, so that readers do not parse again); [`Index::get`] answers
/// the objects with a key.
pub struct Index<V> {
    inner: Arc<RwLock<State<V>>>,
}

impl<V> Clone for Index<V> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<V> Default for Index<V> {
    fn default() -> Self {
        Self {
            inner: Arc::new(RwLock::new(State {
                entries: HashMap::new(),
                by_key: HashMap::new(),
                relist: None,
                ready: false,
            })),
        }
    }
}

struct State<V> {
    entries: HashMap<ObjKey, (Vec<String>, V)>,
    by_key: HashMap<String, BTreeSet<ObjKey>>,
    /// A relist in progress (the watch restarted): applied whole at its end, as the
    /// reflector's store does, so that readers never see a half list.
    relist: Option<HashMap<ObjKey, (Vec<String>, V)>>,
    ready: bool,
}

impl<V> State<V> {
    fn unlink(&mut self, k: &ObjKey) {
        if let Some((keys, _)) = self.entries.remove(k) {
            for key in keys {
                if let Some(set) = self.by_key.get_mut(&key) {
                    set.remove(k);
                    if set.is_empty() {
                        self.by_key.remove(&key);
                    }
                }
            }
        }
    }

    fn link(&mut self, k: ObjKey, keys: Vec<String>, v: V) {
        for key in &keys {
            self.by_key
                .entry(key.clone())
                .or_default()
                .insert(k.clone());
        }
        self.entries.insert(k, (keys, v));
    }
}

impl<V: Clone> Index<V> {
    /// Applies one watch event; `derive` gives an object's keys and value.
    pub fn apply<K: Resource>(
        &self,
        ev: &watcher::Event<K>,
        derive: impl Fn(&K) -> (Vec<String>, V),
    ) {
        let mut s = self.inner.write().unwrap_or_else(|e| e.into_inner());
        match ev {
            watcher::Event::Apply(o) => {
                let k = obj_key(o);
                s.unlink(&k);
                let (keys, v) = derive(o);
                s.link(k, keys, v);
            }
            watcher::Event::Delete(o) => s.unlink(&obj_key(o)),
            watcher::Event::Init => s.relist = Some(HashMap::new()),
            watcher::Event::InitApply(o) => {
                let d = derive(o);
                s.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(obj_key(o), d);
            }
            watcher::Event::InitDone => {
                let all = s.relist.take().unwrap_or_default();
                s.entries.clear();
                s.by_key.clear();
                for (k, (keys, v)) in all {
                    s.link(k, keys, v);
                }
                s.ready = true;
            }
        }
    }

    /// The objects with `key`, and their values.
    pub fn get(&self, key: &str) -> Vec<(ObjKey, V)> {
        let s = self.inner.read().unwrap_or_else(|e| e.into_inner());
        s.by_key
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|k| s.entries.get(k).map(|(_, v)| (k.clone(), v.clone())))
            .collect()
    }

    /// Every object's value.
    pub fn values(&self) -> Vec<V> {
        let s = self.inner.read().unwrap_or_else(|e| e.into_inner());
        s.entries.values().map(|(_, v)| v.clone()).collect()
    }

    /// Whether the first complete list has been applied.
    pub fn is_ready(&self) -> bool {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).ready
    }
}

/// The `PodCheckpoint`s of the cluster, kept by every replica (the webhook's claim reads them
/// at each admission; the leader's reconcilers read them for heartbeats, holders and
/// retention), looked up by source pod or by lineage.
#[derive(Clone)]
pub struct Checkpoints {
    store: Store<PodCheckpoint>,
    index: Index<()>,
}

fn pod_key(ns: &str, uid: &str) -> String {
    format!("pod\0{ns}\0{uid}")
}

fn lineage_key(ns: &str, lineage: &str) -> String {
    format!("lineage\0{ns}\0{lineage}")
}

/// A checkpoint's keys: its source pod's UID, and its lineage once it has a reference (its
/// status, the agent's; the lineage annotation is anyone's to set and is not read).
fn checkpoint_keys(c: &PodCheckpoint) -> (Vec<String>, ()) {
    let ns = c.namespace().unwrap_or_default();
    let mut keys = Vec::with_capacity(2);
    if let Some(uid) = checkpoint_pod_uid(c) {
        keys.push(pod_key(&ns, &uid));
    }
    let lineage = c
        .status
        .as_ref()
        .and_then(|s| s.checkpoint_ref.as_deref())
        .and_then(|r| r.split_once('/'))
        .map(|(l, _)| l);
    if let Some(l) = lineage {
        keys.push(lineage_key(&ns, l));
    }
    (keys, ())
}

impl Checkpoints {
    /// Starts watching every namespace's `PodCheckpoint`s; the returned future runs the watch
    /// (spawn it; it ends only with the process).
    pub fn watch(client: Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let (store, writer) = reflector::store();
        let index = Index::default();
        let feed = index.clone();
        let stream = reflector::reflector(
            writer,
            // managedFields are half of a checkpoint's size and nobody here reads them.
            watcher::watcher(
                Api::<PodCheckpoint>::all(client),
                watcher::Config::default(),
            )
            .modify(|c| c.managed_fields_mut().clear()),
        )
        .default_backoff()
        .for_each(move |ev| {
            match ev {
                Ok(ev) => feed.apply(&ev, checkpoint_keys),
                Err(e) => tracing::debug!(error = %e, "podcheckpoint watch"),
            }
            futures::future::ready(())
        });
        (Self { store, index }, stream)
    }

    /// A cache of `items`, complete (tests).
    #[cfg(test)]
    pub fn of(items: Vec<PodCheckpoint>) -> Self {
        let (store, mut writer) = reflector::store();
        let index = Index::default();
        let mut events = vec![watcher::Event::Init];
        events.extend(items.into_iter().map(watcher::Event::InitApply));
        events.push(watcher::Event::InitDone);
        for ev in &events {
            writer.apply_watcher_event(ev);
            index.apply(ev, checkpoint_keys);
        }
        Self { store, index }
    }

    /// A cache whose first list never completes: readers fall back to the API server (tests).
    #[cfg(test)]
    pub fn unsynced() -> Self {
        let (store, _writer) = reflector::store();
        Self {
            store,
            index: Index::default(),
        }
    }

    /// Whether the first complete list is in (before it, a lookup would miss what exists).
    pub fn is_ready(&self) -> bool {
        self.index.is_ready()
    }

    /// Waits for the first complete list.
    pub async fn wait_ready(&self) {
        stasis_api::cache::wait_ready(&self.store).await;
    }

    fn with_key(&self, key: &str) -> Vec<Arc<PodCheckpoint>> {
        self.index
            .get(key)
            .into_iter()
            .filter_map(|((ns, name), ())| self.store.get(&ObjectRef::new(&name).within(&ns)))
            .collect()
    }

    /// The checkpoints of the pod with UID `uid` in `ns`.
    pub fn of_pod(&self, ns: &str, uid: &str) -> Vec<Arc<PodCheckpoint>> {
        self.with_key(&pod_key(ns, uid))
            .into_iter()
            .filter(|c| checkpoint_pod_uid(c).as_deref() == Some(uid))
            .collect()
    }

    /// The checkpoints of lineage `lineage` in `ns` that have a reference (the agent's status).
    pub fn of_lineage(&self, ns: &str, lineage: &str) -> Vec<Arc<PodCheckpoint>> {
        self.with_key(&lineage_key(ns, lineage))
    }

    /// Every checkpoint (for what must see them all: a policy's status, `interval: auto`).
    pub fn state(&self) -> Vec<Arc<PodCheckpoint>> {
        self.store.state()
    }
}

/// The lineage records (ConfigMaps in stasis's namespace) parsed once per change, looked up
/// by holder UID, by claim token and by workload: a pod's reconcile parsed every record twice
/// before, and each admission listed its workload's records from the API server.
pub type RecordIndex = Index<Option<Arc<Record>>>;

/// The lineage records as every replica keeps them: the ConfigMaps (the sweep reads them
/// whole) and their [`RecordIndex`], fed by one watch of stasis's namespace.
#[derive(Clone)]
pub struct RecordCache {
    pub maps: Store<ConfigMap>,
    pub index: RecordIndex,
}

impl RecordCache {
    /// Starts watching the lineage records in `namespace`; `on_error` is told of each record
    /// that cannot be read. The returned future runs the watch (spawn it; it ends only with the
    /// process).
    pub fn watch(
        client: Client,
        namespace: &str,
        on_error: impl Fn(&crate::Error) + Send + Sync + 'static,
    ) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let (maps, writer) = reflector::store();
        let index = RecordIndex::default();
        let feed = index.clone();
        let stream = reflector::reflector(
            writer,
            watcher::watcher(
                Api::<ConfigMap>::namespaced(client, namespace),
                watcher::Config::default()
                    .labels(&format!("{}=true", stasis_api::names::LINEAGE_RECORD)),
            ),
        )
        .default_backoff()
        .for_each(move |ev| {
            match ev {
                Ok(ev) => feed.apply(&ev, |cm| record_entry(cm, &on_error)),
                Err(e) => tracing::debug!(error = %e, "lineage record watch"),
            }
            futures::future::ready(())
        });
        (Self { maps, index }, stream)
    }
}

fn holder_key(ns: &str, uid: &str) -> String {
    format!("holder\0{ns}\0{uid}")
}

fn workload_key(workload: &str) -> String {
    format!("workload\0{workload}")
}

fn token_key(ns: &str, token: &str) -> String {
    format!("token\0{ns}\0{token}")
}

/// A record's keys and the record (`None`, with a warning, for one that cannot be read: it is
/// skipped, never silently, until someone repairs or deletes it).
pub fn record_entry(
    cm: &ConfigMap,
    on_error: &dyn Fn(&crate::Error),
) -> (Vec<String>, Option<Arc<Record>>) {
    match Record::from_config_map(cm) {
        Ok(r) => {
            let mut keys = Vec::with_capacity(3);
            keys.push(workload_key(r.lineage.workload.as_str()));
            if let Some(uid) = r.holder_uid() {
                keys.push(holder_key(&r.namespace, uid));
            }
            if let Some(t) = r.lineage.holder.as_deref() {
                keys.push(token_key(&r.namespace, t));
            }
            (keys, Some(Arc::new(r)))
        }
        Err(e) => {
            on_error(&e);
            tracing::warn!(error = %e, configmap = %cm.name_any(), "lineage record unreadable: skipped; repair or delete it");
            (Vec::new(), None)
        }
    }
}

impl RecordIndex {
    /// An index of `maps`, complete (tests).
    #[cfg(test)]
    pub fn of(maps: &[ConfigMap]) -> Self {
        let index = Self::default();
        let entry = |cm: &ConfigMap| record_entry(cm, &|_| {});
        index.apply::<ConfigMap>(&watcher::Event::Init, entry);
        for cm in maps {
            index.apply(&watcher::Event::InitApply(cm.clone()), entry);
        }
        index.apply::<ConfigMap>(&watcher::Event::InitDone, entry);
        index
    }

    /// Every readable record.
    pub fn records(&self) -> Vec<Record> {
        self.values()
            .into_iter()
            .flatten()
            .map(|r| (*r).clone())
            .collect()
    }

    /// The records of `namespace` that name `uid` as holder.
    pub fn by_holder(&self, namespace: &str, uid: &str) -> Vec<Record> {
        self.found(&holder_key(namespace, uid))
    }

    /// The records of `namespace` whose holder token is `token`.
    pub fn by_token(&self, namespace: &str, token: &str) -> Vec<Record> {
        self.found(&token_key(namespace, token))
    }

    /// The records of `workload` (its lineages, in whichever namespace the workload is).
    pub fn of_workload(&self, workload: &WorkloadName) -> Vec<Record> {
        self.found(&workload_key(workload.as_str()))
    }

    fn found(&self, key: &str) -> Vec<Record> {
        self.get(key)
            .into_iter()
            .filter_map(|(_, r)| r.map(|r| (*r).clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use stasis_api::names;

    fn ck(name: &str, uid: &str, lineage: Option<&str>, reference: Option<&str>) -> PodCheckpoint {
        let mut v = json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": name, "namespace": "prod", "labels": {names::POD_UID: uid}},
            "spec": {"sourcePodName": "p", "sourcePodUID": uid, "reason": "Heartbeat"}
        });
        if let Some(l) = lineage {
            v["metadata"]["annotations"] = json!({names::LINEAGE: l});
        }
        if let Some(r) = reference {
            v["status"] = json!({"phase": "Succeeded", "checkpointRef": r});
        }
        serde_json::from_value(v).unwrap()
    }

    fn names_of(v: Vec<Arc<PodCheckpoint>>) -> BTreeSet<String> {
        v.iter().map(|c| c.name_any()).collect()
    }

    #[test]
    fn lookups_follow_the_watch() {
        let (store, mut writer) = reflector::store::<PodCheckpoint>();
        let index = Index::default();
        let cache = Checkpoints {
            store,
            index: index.clone(),
        };
        let mut feed = |ev: watcher::Event<PodCheckpoint>| {
            writer.apply_watcher_event(&ev);
            index.apply(&ev, checkpoint_keys);
        };
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(ck(
            "a",
            "u1",
            None,
            Some("l1/0000"),
        )));
        assert!(!cache.is_ready(), "not ready before the list is complete");
        assert!(
            cache.of_pod("prod", "u1").is_empty(),
            "a half list is not shown"
        );
        feed(watcher::Event::InitApply(ck(
            "b",
            "u2",
            None,
            Some("l1/0001"),
        )));
        feed(watcher::Event::InitApply(ck("d", "u3", Some("l1"), None)));
        feed(watcher::Event::InitDone);
        assert!(cache.is_ready());
        assert_eq!(
            names_of(cache.of_pod("prod", "u1")),
            ["a".to_owned()].into()
        );
        assert_eq!(
            names_of(cache.of_lineage("prod", "l1")),
            ["a".to_owned(), "b".to_owned()].into()
        );
        assert!(
            cache.of_lineage("other", "l1").is_empty(),
            "keys are per namespace"
        );
        // An annotation names no lineage (anyone may set it); the pod's UID still finds it.
        assert_eq!(
            names_of(cache.of_pod("prod", "u3")),
            ["d".to_owned()].into()
        );
        // A status that names another lineage moves it; a delete removes it.
        feed(watcher::Event::Apply(ck("a", "u1", None, Some("l2/0002"))));
        assert_eq!(
            names_of(cache.of_lineage("prod", "l1")),
            ["b".to_owned()].into()
        );
        assert_eq!(
            names_of(cache.of_lineage("prod", "l2")),
            ["a".to_owned()].into()
        );
        feed(watcher::Event::Delete(ck("b", "u2", None, Some("l1/0001"))));
        assert!(cache.of_lineage("prod", "l1").is_empty());
        assert!(cache.of_pod("prod", "u2").is_empty());
        // A relist replaces everything at its end.
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(ck("c", "u1", None, None)));
        assert_eq!(
            names_of(cache.of_pod("prod", "u1")),
            ["a".to_owned()].into()
        );
        feed(watcher::Event::InitDone);
        assert_eq!(
            names_of(cache.of_pod("prod", "u1")),
            ["c".to_owned()].into()
        );
        assert!(cache.of_lineage("prod", "l2").is_empty());
    }
}
