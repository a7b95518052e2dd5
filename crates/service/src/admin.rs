//! The admin routes every daemon serves on its metrics port:
//!
//! - `GET /metrics`: the Prometheus registry ([`Exposition`]), OpenMetrics text;
//! - `GET /livez` (and `/healthz`, the older name): the process answers;
//! - `GET /readyz`: ok once the daemon said it is ready ([`Readiness`]: its caches synced),
//!   503 before.
//!
//! [`serve`] serves them alone; a daemon with more routes on the same port answers
//! [`route`]'s answer first and its own otherwise.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::http::{not_found, reply, Body};

/// The content type of `/metrics`.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What `/metrics` shows.
pub trait Exposition: Send + Sync + 'static {
    /// The text exposition.
    fn encode(&self) -> String;
}

impl Exposition for Registry {
    fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, self);
        out
    }
}

/// Whether the daemon is ready (`/readyz`); cloned freely, false until [`Readiness::set`].
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Ready from the start (a daemon with nothing to wait for).
    pub fn ready() -> Self {
        let r = Self::default();
        r.set(true);
        r
    }

    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The admin answer to a request, `None` when the path is not an admin route.
pub fn route(
    method: &Method,
    path: &str,
    metrics: &dyn Exposition,
    ready: &Readiness,
) -> Option<Response<Body>> {
    let r = match path {
        "/metrics" | "/livez" | "/healthz" | "/readyz" if method != Method::GET => {
            reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n")
        }
        "/metrics" => reply(StatusCode::OK, OPENMETRICS, metrics.encode()),
        "/livez" | "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" if ready.is_ready() => reply(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready: the caches have not synced yet\n",
        ),
        _ => return None,
    };
    Some(r)
}

/// Binds `addr` (a clear error naming it when it cannot).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
}

/// Serves the admin routes alone on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<dyn Exposition>,
    ready: Readiness,
    shutdown: impl Future<Output = ()>,
) {
    crate::http::serve(
        listener,
        None,
        move |req: Request<Incoming>| {
            let (metrics, ready) = (metrics.clone(), ready.clone());
            async move {
                route(req.method(), req.uri().path(), &*metrics, &ready).unwrap_or_else(not_found)
            }
        },
        shutdown,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// A real server on a free port: the routes, readiness turning on, the stop.
    #[tokio::test]
    async fn routes_readiness_and_shutdown() {
        let mut registry = Registry::default();
        let c: Counter = Counter::default();
        registry.register("stasis_test_things", "Things", c.clone());
        c.inc();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Readiness::default();
        let stop = crate::shutdown::Shutdown::new();
        let server = tokio::spawn(serve(listener, Arc::new(registry), ready.clone(), {
            let stop = stop.clone();
            async move { stop.wait().await }
        }));
        let m = get(addr, "/metrics").await;
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains("stasis_test_things_total 1"), "{m}");
        assert!(m.contains("# EOF"), "{m}");
        assert!(get(addr, "/livez").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        ready.set(true);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/nothing").await.starts_with("HTTP/1.1 404"));
        stop.trigger();
        tokio::time::timeout(std::time::Duration::from_secs(5), server)
            .await
            .expect("the server stops on shutdown")
            .unwrap();
    }
}
