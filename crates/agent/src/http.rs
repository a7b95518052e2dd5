//! A minimal HTTP/1.1 server for `/metrics` and `/healthz` (GET only, one response per
//! connection): no HTTP stack linked for two fixed pages.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// The response to a request head.
pub fn respond(head: &str, metrics: &Metrics) -> String {
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(),
        ),
        ("GET", "/healthz") | ("GET", "/readyz") => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".into()),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Serves forever.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let m = metrics.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            let n = match tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf))
                .await
            {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let head = String::from_utf8_lossy(&buf[..n]);
            let line = head.lines().next().unwrap_or("");
            let _ = s.write_all(respond(line, &m).as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let m = Metrics::default();
        let r = respond("GET /metrics HTTP/1.1", &m);
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(r.contains("stasis_agent_up 1"));
        assert!(respond("GET /healthz HTTP/1.1", &m).ends_with("\r\n\r\nok\n"));
        assert!(respond("GET /x HTTP/1.1", &m).contains("404"));
        assert!(respond("POST /metrics HTTP/1.1", &m).contains("405"));
    }
}
