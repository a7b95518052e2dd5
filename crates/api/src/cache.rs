//! Watch caches the agent and the controller share: one way to build a kube-runtime reflector
//! of every namespace's objects of a kind, and a wait for its first complete list.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};

/// A watch cache of every namespace's `K`, with managedFields dropped (nobody here reads them,
/// and they are a good part of an object's size). `on_event` runs after every event the watch
/// delivers, an error included (logged at debug: the watch retries with backoff), so a caller
/// can wake whatever decides from the cache. The returned future runs the watch: spawn it.
pub fn watch_all<K, F>(
    client: Client,
    mut on_event: F,
) -> (Store<K>, impl Future<Output = ()> + Send + 'static)
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    F: FnMut() + Send + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher::watcher(Api::<K>::all(client), watcher::Config::default())
            .modify(|o| o.managed_fields_mut().clear()),
    )
    .default_backoff()
    .for_each(move |ev| {
        if let Err(e) = ev {
            tracing::debug!(kind = %K::kind(&()), error = %e, "watch");
        }
        on_event();
        futures::future::ready(())
    });
    (store, stream)
}

/// Returns once `store` holds its first complete list (or its writer is gone).
///
/// kube-runtime 5's `Store::wait_until_ready` parks on a oneshot channel that keeps only the
/// waker of the *last* future that polled it: with two tasks waiting on the same store, the
/// first is never woken and waits forever (seen in the cluster: the agent never took a
/// checkpoint). Polling a fresh future every 200 ms re-registers this task's waker, so any number
/// of tasks can wait on one store.
pub async fn wait_ready<K>(store: &Store<K>)
where
    K: Resource + Clone + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    loop {
        match tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready()).await {
            Ok(_) => return,
            Err(_elapsed) => continue,
        }
    }
}
