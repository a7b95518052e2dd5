//! An HTTP/1.1 server (hyper) for one handler, over plain TCP or TLS, until a shutdown future
//! completes. The handler sees each request whole and answers a [`Response`] of bytes.

use std::convert::Infallible;
use std::future::Future;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// The body every handler answers with.
pub type Body = Full<Bytes>;

/// A response with a status, a content type and a body.
pub fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

/// `404 not found` (plain text).
pub fn not_found() -> Response<Body> {
    reply(StatusCode::NOT_FOUND, "text/plain", "not found\n")
}

/// Serves `handler` on every connection `listener` accepts (over TLS when `tls` is given) until
/// `shutdown` completes; connections in progress end on their own.
pub async fn serve<H, F>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept");
                    continue;
                }
            },
        };
        let handler = handler.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(req).await) }
            });
            let http = hyper::server::conn::http1::Builder::new();
            let res = match tls {
                Some(tls) => match tls.accept(stream).await {
                    Ok(s) => http.serve_connection(TokioIo::new(s), svc).await,
                    Err(e) => {
                        tracing::debug!(error = %e, %peer, "tls handshake");
                        return;
                    }
                },
                None => http.serve_connection(TokioIo::new(stream), svc).await,
            };
            if let Err(e) = res {
                tracing::debug!(error = %e, %peer, "connection");
            }
        });
    }
}
