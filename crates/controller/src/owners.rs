//! The metadata of pods' owners from watch caches: what every admission (and each pod's
//! registration) reads to verify a pod's workload (`webhook::verified_identity`).
//!
//! Verifying a ReplicaSet's pod read its ReplicaSet and then its Deployment from the API server:
//! two `GET`s per admission, at 50 creations/s a hundred reads a second, each waiting for an API
//! server that is busy with those same creations (docs/benchmarks.md, "Control plane at scale").
//! Every replica now watches the metadata (only: `PartialObjectMeta`, managedFields dropped) of
//! the ReplicaSets and Deployments of the cluster, and an owner is looked up there first.
//!
//! A cache entry is taken only when it names the UID the pod's (or the ReplicaSet's) owner
//! reference names: an object deleted and created again under the same name, which the cache
//! may not have seen yet, has another UID and is read from the API server, as is an owner the
//! cache does not hold yet (a ReplicaSet its Deployment created a moment ago) and any owner
//! while the cache has not listed. So a lookup answers what a `GET` answers, up to the watch's
//! lag for an object that changed its controller: the cache never vouches for an object the API
//! server has not shown it with that very UID.

use std::future::Future;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource};
use stasis_api::cache::watch_all;

/// The metadata watch caches of the owner kinds most pods have (a Deployment's pods name a
/// ReplicaSet, which names the Deployment).
#[derive(Clone)]
pub struct OwnerCache {
    replicasets: Store<PartialObjectMeta<ReplicaSet>>,
    deployments: Store<PartialObjectMeta<Deployment>>,
}

impl OwnerCache {
    /// The caches, and the future that runs their watches (spawn it).
    pub fn watch(client: Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        // (An `Api` of `PartialObjectMeta` asks for metadata only.)
        let (replicasets, rs_watch) =
            watch_all::<PartialObjectMeta<ReplicaSet>, _>(client.clone(), || {});
        let (deployments, deploy_watch) =
            watch_all::<PartialObjectMeta<Deployment>, _>(client, || {});
        let run = async move {
            futures::join!(rs_watch, deploy_watch);
        };
        (
            OwnerCache {
                replicasets,
                deployments,
            },
            run,
        )
    }

    /// Caches holding `replicasets` and `deployments` (tests).
    pub fn of(replicasets: Vec<ObjectMeta>, deployments: Vec<ObjectMeta>) -> Self {
        OwnerCache {
            replicasets: store_of(replicasets),
            deployments: store_of(deployments),
        }
    }

    /// The metadata of the owner `kind` `name` in `ns` of API group `group`, when the cache
    /// holds it with exactly `uid`; `None` otherwise (then the caller asks the API server).
    pub fn get(
        &self,
        group: &str,
        kind: &str,
        ns: &str,
        name: &str,
        uid: &str,
    ) -> Option<ObjectMeta> {
        let meta = match (group, kind) {
            ("apps", "ReplicaSet") => self
                .replicasets
                .get(&ObjectRef::new(name).within(ns))
                .map(|o| o.metadata.clone()),
            ("apps", "Deployment") => self
                .deployments
                .get(&ObjectRef::new(name).within(ns))
                .map(|o| o.metadata.clone()),
            _ => None,
        }?;
        (meta.uid.as_deref() == Some(uid)).then_some(meta)
    }
}

fn store_of<K>(metas: Vec<ObjectMeta>) -> Store<PartialObjectMeta<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = reflector::store();
    for metadata in metas {
        let o: PartialObjectMeta<K> = PartialObjectMeta {
            types: None,
            metadata,
            _phantom: std::marker::PhantomData,
        };
        writer.apply_watcher_event(&watcher::Event::Apply(o));
    }
    reader
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(ns: &str, name: &str, uid: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..ObjectMeta::default()
        }
    }

    /// An owner is answered only under its kind and group, in its namespace, with the UID the
    /// reference names.
    #[test]
    fn an_owner_is_taken_from_the_cache_only_with_the_uid_named() {
        let c = OwnerCache::of(
            vec![meta("prod", "web-7f", "rs-1")],
            vec![meta("prod", "web", "d-1")],
        );
        assert!(c
            .get("apps", "ReplicaSet", "prod", "web-7f", "rs-1")
            .is_some());
        assert!(c.get("apps", "Deployment", "prod", "web", "d-1").is_some());
        // Recreated under the same name (another UID), another namespace, kind or group: no.
        assert!(c
            .get("apps", "ReplicaSet", "prod", "web-7f", "rs-2")
            .is_none());
        assert!(c
            .get("apps", "ReplicaSet", "dev", "web-7f", "rs-1")
            .is_none());
        assert!(c
            .get("apps", "Deployment", "prod", "web-7f", "rs-1")
            .is_none());
        assert!(c
            .get("evil.io", "ReplicaSet", "prod", "web-7f", "rs-1")
            .is_none());
        assert!(c.get("apps", "StatefulSet", "prod", "web", "d-1").is_none());
    }
}
