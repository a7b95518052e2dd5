//! The agent's work queues, fair across namespaces (review M7): one tenant's many or slow
//! `PodCheckpoint`s or `PodRestore`s cannot hold another's back.
//!
//! Each namespace has its own FIFO, bounded ([`FairQueue::push`] refuses past the bound, so one
//! namespace cannot fill the node's queue); namespaces take turns (round robin: a namespace whose
//! job finished goes to the back of the line); and at most one job of a namespace runs at a time,
//! so with two or more workers a namespace's long checkpoint (up to its `timeoutSeconds`) leaves
//! the other workers to the other namespaces.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex};

struct Inner<T> {
    queues: HashMap<String, VecDeque<T>>,
    /// Namespaces with a queued job and none running, in turn order.
    turns: VecDeque<String>,
    running: HashSet<String>,
}

pub struct FairQueue<T> {
    inner: Mutex<Inner<T>>,
    cond: Condvar,
    per_namespace: usize,
}

impl<T> FairQueue<T> {
    /// A queue holding at most `per_namespace` waiting jobs of each namespace.
    pub fn new(per_namespace: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                queues: HashMap::new(),
                turns: VecDeque::new(),
                running: HashSet::new(),
            }),
            cond: Condvar::new(),
            per_namespace: per_namespace.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job` of `namespace`; gives it back when the namespace already has
    /// `per_namespace` jobs waiting.
    pub fn push(&self, namespace: &str, job: T) -> Result<(), T> {
        let mut g = self.lock();
        let q = g.queues.entry(namespace.to_owned()).or_default();
        if q.len() >= self.per_namespace {
            return Err(job);
        }
        q.push_back(job);
        if !g.running.contains(namespace) && !g.turns.iter().any(|n| n == namespace) {
            g.turns.push_back(namespace.to_owned());
        }
        drop(g);
        self.cond.notify_one();
        Ok(())
    }

    /// The next job, of the namespace whose turn it is (blocks while there is none); the caller
    /// calls [`FairQueue::done`] with the namespace when it has run it.
    pub fn pop(&self) -> (String, T) {
        let mut g = self.lock();
        loop {
            if let Some(ns) = g.turns.pop_front() {
                if let Some(job) = g.queues.get_mut(&ns).and_then(VecDeque::pop_front) {
                    g.running.insert(ns.clone());
                    return (ns, job);
                }
                continue;
            }
            g = self.cond.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The job of `namespace` that [`FairQueue::pop`] gave has finished: the namespace's next
    /// job, if any, waits for its turn at the back of the line.
    pub fn done(&self, namespace: &str) {
        let mut g = self.lock();
        g.running.remove(namespace);
        if g.queues.get(namespace).is_some_and(|q| !q.is_empty()) {
            g.turns.push_back(namespace.to_owned());
            drop(g);
            self.cond.notify_one();
        } else {
            g.queues.remove(namespace);
        }
    }

    /// Jobs waiting (not running), all namespaces.
    pub fn waiting(&self) -> usize {
        self.lock().queues.values().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn namespaces_take_turns() {
        let q = FairQueue::new(10);
        for i in 0..4 {
            q.push("noisy", format!("noisy-{i}")).unwrap();
        }
        q.push("quiet", "quiet-0".to_owned()).unwrap();
        q.push("other", "other-0".to_owned()).unwrap();
        let mut order = Vec::new();
        while q.waiting() > 0 {
            let (ns, job) = q.pop();
            order.push(job);
            q.done(&ns);
        }
        // The quiet namespaces' jobs run second and third, not after all of noisy's.
        assert_eq!(
            order,
            ["noisy-0", "quiet-0", "other-0", "noisy-1", "noisy-2", "noisy-3"]
        );
    }

    #[test]
    fn one_namespace_cannot_fill_the_queue() {
        let q = FairQueue::new(2);
        q.push("noisy", 1).unwrap();
        q.push("noisy", 2).unwrap();
        assert_eq!(q.push("noisy", 3), Err(3));
        q.push("quiet", 4).unwrap();
    }

    /// Two workers: while one runs a namespace's long job, that namespace's next job waits and
    /// the other worker serves the other namespace at once.
    #[test]
    fn a_slow_namespace_holds_one_worker_at_most() {
        let q = Arc::new(FairQueue::new(10));
        q.push("slow", "slow-0").unwrap();
        q.push("slow", "slow-1").unwrap();
        let (ns, first) = q.pop();
        assert_eq!((ns.as_str(), first), ("slow", "slow-0"));
        q.push("quick", "quick-0").unwrap();
        // The second worker gets quick's job, not slow's second.
        let (tx, rx) = std::sync::mpsc::channel();
        let q2 = q.clone();
        std::thread::spawn(move || {
            let (ns, job) = q2.pop();
            tx.send(job).unwrap();
            q2.done(&ns);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok("quick-0"));
        // slow-1 waits for slow-0 to finish.
        let q3 = q.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (_, job) = q3.pop();
            tx.send(job).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        q.done("slow");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok("slow-1"));
    }
}
