//! Shutdown on SIGTERM (what the kubelet sends) or SIGINT, handled in one place.
//!
//! A daemon runs as its container's PID 1, where a signal without a handler is ignored: without
//! one, every stop waits for the grace period's SIGKILL. [`Shutdown::on_signal`] installs the
//! handlers once; every part that stops on it holds a clone and awaits [`Shutdown::wait`], and
//! tests trigger it themselves.

use tokio::sync::watch;

/// A stop that many tasks can await; cloned freely.
#[derive(Debug, Clone)]
pub struct Shutdown {
    tx: std::sync::Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A stop that only [`Shutdown::trigger`] sets off.
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Self {
            tx: std::sync::Arc::new(tx),
            rx,
        }
    }

    /// A stop set off by the first SIGTERM or SIGINT (call inside the runtime).
    pub fn on_signal() -> Self {
        let s = Self::new();
        let t = s.clone();
        tokio::spawn(async move {
            signal().await;
            tracing::info!("termination signal: stopping");
            t.trigger();
        });
        s
    }

    /// Sets it off.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    /// Whether it was set off.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Returns once it is set off.
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        // Err: every sender is gone, which cannot happen while `self` holds one.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// [`Shutdown::wait`] as an owned future, for APIs that keep it (kube-runtime's
    /// `Controller::graceful_shutdown_on`).
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let s = self.clone();
        async move { s.wait().await }
    }
}

/// The first SIGTERM or SIGINT (ctrl-c alone where SIGTERM cannot be handled).
pub async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_clone_sees_the_stop() {
        let s = Shutdown::new();
        let (a, b) = (s.clone(), s.clone());
        let waiting = tokio::spawn(async move { a.wait().await });
        assert!(!b.is_triggered());
        s.trigger();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the waiter is woken")
            .unwrap();
        assert!(b.is_triggered());
        // Awaiting after the stop returns at once.
        b.wait().await;
        b.stopped().await;
    }
}
