//! Waiting for a kube-runtime reflector's first complete list.

use std::time::Duration;

use kube::runtime::reflector::Store;
use kube::Resource;

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
