//! The agent's job pools, fair across namespaces: one tenant's many or slow `PodCheckpoint`s or
//! `PodRestore`s cannot hold another's back.
//!
//! [`FairQueue`]: each namespace has its own FIFO, bounded ([`FairQueue::push`] refuses past the
//! bound, so one namespace cannot fill the node's queue); namespaces take turns (round robin: a
//! namespace whose job finished goes to the back of the line); and at most one job of a
//! namespace runs at a time, so with two or more workers a namespace's long checkpoint (up to its
//! `timeoutSeconds`) leaves the other workers to the other namespaces.
//!
//! [`JobPool`]: a fixed number of plain threads draining a [`FairQueue`], awaited from async
//! code. The jobs fork and enter namespaces (the engine), which must not happen on an async
//! runtime's threads; they reach the API server through `Handle::block_on`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};

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

/// A job as the pool's threads run it.
type Task = Box<dyn FnOnce() + Send>;

/// Why a job did not run or gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "namespace {namespace} already has {waiting} jobs waiting on this node; retried later"
    )]
    Full { namespace: String, waiting: usize },
    #[error("the job ended without an answer (it panicked; its log says why)")]
    Lost,
}

/// A bounded pool of plain threads running blocking jobs in [`FairQueue`] order.
pub struct JobPool {
    queue: Arc<FairQueue<Task>>,
    per_namespace: usize,
}

impl JobPool {
    /// `workers` threads named `<name>-<i>`, at most `per_namespace` jobs of a namespace waiting.
    pub fn new(name: &str, workers: usize, per_namespace: usize) -> std::io::Result<Self> {
        let queue = Arc::new(FairQueue::<Task>::new(per_namespace));
        for i in 0..workers.max(1) {
            let q = queue.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || loop {
                    let (ns, task) = q.pop();
                    // A panicking job must not take its worker, or its namespace's turn, with
                    // it: the caller sees `PoolError::Lost`.
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(task));
                    q.done(&ns);
                })?;
        }
        Ok(Self {
            queue,
            per_namespace: per_namespace.max(1),
        })
    }

    /// Runs `job` on one of the pool's threads when it is `namespace`'s turn, and returns what it
    /// returned. The caller's tracing span goes with it.
    pub async fn run<T: Send + 'static>(
        &self,
        namespace: &str,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let span = tracing::Span::current();
        let task: Task = Box::new(move || {
            let _in_span = span.enter();
            // (the caller may have stopped waiting: nobody to tell then)
            let _ = tx.send(job());
        });
        self.queue
            .push(namespace, task)
            .map_err(|_| PoolError::Full {
                namespace: namespace.to_owned(),
                waiting: self.per_namespace,
            })?;
        rx.await.map_err(|_| PoolError::Lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Jobs run on the pool's own threads, outside any async runtime (the engine forks there),
    /// and their answers come back to the awaiting task.
    #[tokio::test]
    async fn a_job_runs_on_a_plain_thread_and_answers() {
        let pool = JobPool::new("test-pool", 2, 4).unwrap();
        let (thread, in_runtime) = pool
            .run("ns", || {
                (
                    std::thread::current().name().map(str::to_owned),
                    tokio::runtime::Handle::try_current().is_ok(),
                )
            })
            .await
            .unwrap();
        assert!(thread.unwrap().starts_with("test-pool-"));
        assert!(!in_runtime, "no async runtime on the job's thread");
        // A job that panics gives `Lost`, and the pool still serves that namespace.
        let lost = pool.run("ns", || -> u8 { panic!("a job's bug") }).await;
        assert!(matches!(lost, Err(PoolError::Lost)), "{lost:?}");
        assert_eq!(pool.run("ns", || 7).await.unwrap(), 7);
    }

    /// One worker busy with a namespace's job, one more of it waiting: the next is refused
    /// (the reconciler retries it later), another namespace's is taken.
    #[tokio::test]
    async fn a_namespace_past_its_bound_is_refused() {
        let pool = Arc::new(JobPool::new("test-bound", 1, 1).unwrap());
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        let running = tokio::spawn(async move { p.run("busy", move || hold.recv().ok()).await });
        // (until the first job is on the worker, a second would wait instead of being refused)
        while pool.queue.waiting() > 0 || pool.queue.lock().running.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let p = pool.clone();
        let waiting = tokio::spawn(async move { p.run("busy", || 2).await });
        while pool.queue.waiting() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let refused = pool.run("busy", || 3).await;
        assert!(
            matches!(&refused, Err(PoolError::Full { namespace, waiting: 1 }) if namespace == "busy"),
            "{refused:?}"
        );
        let p = pool.clone();
        let other = tokio::spawn(async move { p.run("other", || 4).await });
        release.send(()).unwrap();
        assert!(running.await.unwrap().is_ok());
        assert_eq!(waiting.await.unwrap().unwrap(), 2);
        assert_eq!(other.await.unwrap().unwrap(), 4);
    }

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
