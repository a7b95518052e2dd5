//! `stasis-controller wait-restore`: the injected init container of a restoring pod. It asks
//! the controller, `GET $STASIS_STATUS_URL/v1/restores/<namespace>/<pod>/<uid>` (the `PodRestore`'s
//! phase, which the node's agent sets), every half second until the phase is final for the wait
//! (`Ready`, `Restored`, `Failed`, `ColdStart`), the controller stays unreachable for
//! `unreachable_seconds`, or `timeout_seconds` pass. It always exits 0: whatever happened, the
//! app containers start (`stasis-runc create` restores when the agent's plan is there, and
//! starts cold otherwise).

use std::time::{Duration, Instant};

/// What one answer means for the wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// Stop waiting; the phase the agent gave.
    Done(String),
    /// Ask again.
    Wait,
}

/// Reads the agent's answer: HTTP status and JSON body `{"phase": "..."}`. 404 means the agent
/// has not seen the restore yet; any other non-200 answer, or a phase that is not final, waits.
pub fn poll_answer(status: u16, body: &str) -> Poll {
    if status != 200 {
        return Poll::Wait;
    }
    let phase = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("phase").and_then(|p| p.as_str()).map(str::to_owned));
    match phase.as_deref() {
        Some(p @ ("Ready" | "Restored" | "Failed" | "ColdStart")) => Poll::Done(p.to_owned()),
        _ => Poll::Wait,
    }
}

/// The URL of a pod's restore status under the controller's status endpoint `base`
/// (`http://host[:port][/path]`); `None` when `base` is not a plain-HTTP URL.
/// The pod's UID is part of the path: the endpoint answers only to those who know it
/// (docs/design.md §13.4).
pub fn status_url(base: &str, namespace: &str, pod: &str, uid: &str) -> Option<reqwest::Url> {
    let base = reqwest::Url::parse(base).ok()?;
    if base.scheme() != "http" || base.host_str().is_none_or(str::is_empty) {
        return None;
    }
    let path = format!(
        "{}/v1/restores/{namespace}/{pod}/{uid}",
        base.path().trim_end_matches('/')
    );
    let mut url = base;
    url.set_path(&path);
    Some(url)
}

/// One `GET` with short timeouts; (status, body).
fn get(client: &reqwest::blocking::Client, url: &reqwest::Url) -> reqwest::Result<(u16, String)> {
    let r = client
        .get(url.clone())
        .header(reqwest::header::ACCEPT, "application/json")
        .send()?;
    let status = r.status().as_u16();
    Ok((status, r.text()?))
}

/// Parameters of the wait (from the environment the webhook injects).
#[derive(Debug, Clone)]
pub struct WaitArgs {
    /// The controller's status endpoint, `http://host:port`.
    pub url: String,
    pub namespace: String,
    pub pod: String,
    /// The pod's UID (downward API).
    pub uid: String,
    pub timeout: Duration,
    pub unreachable: Duration,
}

/// Runs the wait; returns why it ended (printed by `main`).
pub fn run(a: &WaitArgs) -> String {
    if a.uid.is_empty() {
        // Injected by a webhook older than the UID-bound endpoint: nothing to ask with.
        return "no pod UID (STASIS_POD_UID): not waiting".into();
    }
    let Some(url) = status_url(&a.url, &a.namespace, &a.pod, &a.uid) else {
        return format!("no usable status URL {:?}: not waiting", a.url);
    };
    let authority = format!(
        "{}:{}",
        url.host_str().unwrap_or_default(),
        url.port_or_known_default().unwrap_or(80)
    );
    // The controller is in the cluster: no proxy, as before; a blocking client, since the wait
    // container does nothing else.
    let client = match reqwest::blocking::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(3))
        .no_proxy()
        .build()
    {
        Ok(c) => c,
        Err(e) => return format!("no HTTP client ({e}): not waiting"),
    };
    let start = Instant::now();
    let mut last_reached = Instant::now();
    loop {
        match get(&client, &url) {
            Ok((status, body)) => {
                last_reached = Instant::now();
                if let Poll::Done(phase) = poll_answer(status, &body) {
                    return format!(
                        "restore {phase} after {:.1}s",
                        start.elapsed().as_secs_f64()
                    );
                }
            }
            Err(e) if last_reached.elapsed() >= a.unreachable => {
                return format!(
                    "controller at {authority} unreachable ({e}): starting without waiting further"
                );
            }
            Err(_) => {}
        }
        if start.elapsed() >= a.timeout {
            return format!(
                "restore not ready after {}s: starting (the runtime restores if the archive is ready, else starts cold)",
                a.timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn urls() {
        let u = |base: &str| status_url(base, "prod", "p", "u-1").map(|u| u.to_string());
        assert_eq!(
            u("http://stasis-controller.stasis-system.svc:8080").as_deref(),
            Some("http://stasis-controller.stasis-system.svc:8080/v1/restores/prod/p/u-1")
        );
        assert_eq!(
            u("http://h/base/").as_deref(),
            Some("http://h/base/v1/restores/prod/p/u-1")
        );
        assert_eq!(u("https://h"), None);
        assert_eq!(u("http://"), None);
    }

    #[test]
    fn answers() {
        assert_eq!(poll_answer(404, ""), Poll::Wait);
        assert_eq!(poll_answer(200, r#"{"phase":"Fetching"}"#), Poll::Wait);
        assert_eq!(poll_answer(200, "garbage"), Poll::Wait);
        for p in ["Ready", "Restored", "Failed", "ColdStart"] {
            assert_eq!(
                poll_answer(200, &format!(r#"{{"phase":"{p}"}}"#)),
                Poll::Done(p.into())
            );
        }
    }

    #[test]
    fn waits_for_a_stand_in_agent() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for (i, s) in l.incoming().enumerate() {
                let mut s = s.unwrap();
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut buf).unwrap();
                    req.extend_from_slice(&buf[..n]);
                }
                assert!(String::from_utf8_lossy(&req).starts_with("GET /v1/restores/prod/p/u-1 "));
                let body = if i < 2 {
                    r#"{"phase":"Fetching"}"#
                } else {
                    r#"{"phase":"Ready"}"#
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let why = run(&WaitArgs {
            url: format!("http://127.0.0.1:{port}"),
            namespace: "prod".into(),
            pod: "p".into(),
            uid: "u-1".into(),
            timeout: Duration::from_secs(20),
            unreachable: Duration::from_secs(5),
        });
        assert!(why.starts_with("restore Ready"), "{why}");
    }

    #[test]
    fn gives_up_when_the_agent_is_unreachable() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let why = run(&WaitArgs {
            url: format!("http://127.0.0.1:{port}"),
            namespace: "prod".into(),
            pod: "p".into(),
            uid: "u-1".into(),
            timeout: Duration::from_secs(20),
            unreachable: Duration::from_millis(10),
        });
        assert!(why.contains("unreachable"), "{why}");
    }
}
