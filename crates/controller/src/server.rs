//! The controller's HTTP servers (`stasis_service::http`): the admin routes (`/metrics`,
//! `/livez`, `/readyz`) with the restore status endpoint (plain HTTP), the webhook's `/mutate`
//! and the key broker over HTTPS with the certificate and key the chart mounts (PEM files, read
//! at every start). All stop on the process's shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use stasis_service::admin::{self, Readiness};
use stasis_service::http::{not_found, reply, serve, Body};
use stasis_service::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::webhook::{final_wait_budget, review, Webhook};

/// `(<namespace>, <pod>, <uid>)` from `/v1/restores/<namespace>/<pod>/<uid>`, when all three are
/// plausible names (a UID is lowercase hex and dashes).
pub fn restore_path(path: &str) -> Option<(&str, &str, &str)> {
    let rest = path.strip_prefix("/v1/restores/")?;
    let mut parts = rest.split('/');
    let (ns, pod, uid) = (parts.next()?, parts.next()?, parts.next()?);
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    (parts.next().is_none() && ok(ns) && ok(pod) && ok(uid)).then_some((ns, pod, uid))
}

/// The answer of the status endpoint: the phase, and nothing else. The endpoint is reachable
/// from any pod without credentials (the wait container has no service-account token), so it
/// names no lineage, checkpoint or node.
pub fn phase_body(phase: Option<stasis_api::RestorePhase>) -> String {
    serde_json::json!({ "phase": phase }).to_string()
}

/// The answer for a pod the endpoint does not know, and for every question without the pod's
/// UID: the same status and body, so that the endpoint tells nothing about pods a caller cannot
/// read (a UID is 122 random bits that only those who may read the pod know).
fn unknown_pod() -> Response<Body> {
    reply(StatusCode::NOT_FOUND, "application/json", "{}")
}

/// The status a restoring pod's wait container asks for: `{"phase": ...}` of the `PodRestore`
/// made for the pod with this UID (404 while there is none; `ColdStart` when the controller has
/// handled the pod's decision and made none). A UID that is not the pod's is answered as an
/// unknown pod; so is a `PodRestore` of an earlier pod of the same name.
async fn restore_status(client: &kube::Client, ns: &str, pod: &str, uid: &str) -> Response<Body> {
    let unavailable = |e: kube::Error| {
        tracing::debug!(error = %e, "restore status");
        reply(StatusCode::SERVICE_UNAVAILABLE, "application/json", "{}")
    };
    let api = kube::Api::<stasis_api::PodRestore>::namespaced(client.clone(), ns);
    let restore = match api.get_opt(pod).await {
        Ok(r) => r,
        Err(e) => return unavailable(e),
    };
    let phase = |r: &stasis_api::PodRestore| {
        let phase = r.status.as_ref().and_then(|s| s.phase);
        reply(StatusCode::OK, "application/json", phase_body(phase))
    };
    if let Some(r) = restore
        .as_ref()
        .filter(|r| r.spec.target_pod_uid.as_deref() == Some(uid))
    {
        return phase(r);
    }
    let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns);
    let p = match pods.get_opt(pod).await {
        Ok(Some(p)) if p.metadata.uid.as_deref() == Some(uid) => p,
        Ok(_) => return unknown_pod(),
        Err(e) => return unavailable(e),
    };
    // A PodRestore without a target UID (made before they had one) is the pod's.
    if let Some(r) = restore.as_ref().filter(|r| r.spec.target_pod_uid.is_none()) {
        return phase(r);
    }
    // The controller creates the PodRestore before it marks the decision reported: a reported
    // pod without one will not get one (its decision could not be confirmed against the lineage
    // record), so it need not wait.
    let reported = p
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(stasis_api::names::DECISION_REPORTED));
    if reported {
        reply(
            StatusCode::OK,
            "application/json",
            phase_body(Some(stasis_api::RestorePhase::ColdStart)),
        )
    } else {
        unknown_pod()
    }
}

/// The admin routes (`stasis_service::admin`: `/metrics`, `/livez`, `/readyz`) and
/// `/v1/restores/<namespace>/<pod>/<uid>` (for the wait containers of restoring pods) on `listener`,
/// until `shutdown`.
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Metrics,
    ready: Readiness,
    client: kube::Client,
    shutdown: Shutdown,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics, health and restore status");
    }
    let registry = metrics.registry.clone();
    let handler = move |req: Request<Incoming>| {
        let (registry, ready, client) = (registry.clone(), ready.clone(), client.clone());
        async move {
            let path = req.uri().path().to_owned();
            if let Some(r) = admin::route(req.method(), &path, &*registry, &ready) {
                return r;
            }
            match (req.method(), restore_path(&path)) {
                (&Method::GET, Some((ns, pod, uid))) => restore_status(&client, ns, pod, uid).await,
                // Without the UID (a wait container of an older release), the same answer as
                // for an unknown pod: that container waits out its timeout, then the pod starts
                // (restored if the node's agent has the restore ready, cold otherwise).
                (&Method::GET, None) if path.starts_with("/v1/restores/") => unknown_pod(),
                _ => not_found(),
            }
        }
    };
    serve(
        listener,
        None,
        handler,
        async move { shutdown.wait().await },
    )
    .await
}

/// The TLS settings from a PEM certificate chain and key. With `client_ca` (PEM), only clients
/// presenting a certificate signed by it are served: the API server, given that certificate
/// through its `AdmissionConfiguration` kubeconfig for this webhook, and nobody else can send
/// admission reviews (docs/design.md §13.3).
pub fn tls_acceptor(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<TlsAcceptor, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let pem_certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>, String> {
        CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    let certs = pem_certs(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in pem_certs(ca)? {
                roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| format!("client CA {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key: {e}"))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The webhook (`POST /mutate`) on `addr`; HTTPS when `tls` is given (the API server requires
/// it; plain HTTP only for tests).
pub async fn serve_webhook(
    addr: SocketAddr,
    tls: Option<TlsAcceptor>,
    hook: Arc<Webhook>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let listener = admin::bind(addr).await?;
    tracing::info!(%addr, https = tls.is_some(), "admission webhook");
    let handler = move |req: Request<Incoming>| {
        let hook = hook.clone();
        async move {
            match (req.method(), req.uri().path()) {
                (&Method::POST, "/mutate") => {
                    let wait = final_wait_budget(hook.cfg.final_wait, req.uri().query());
                    tracing::debug!(query = ?req.uri().query(), ?wait, "admission review");
                    // AdmissionReviews of pods are small; 4 MiB is the API server's own bound.
                    match Limited::new(req.into_body(), 4 << 20).collect().await {
                        Ok(body) => {
                            let t = std::time::Instant::now();
                            let out = review(hook, &body.to_bytes(), wait).await;
                            tracing::debug!(
                                ms = t.elapsed().as_secs_f64() * 1000.0,
                                "admission review answered"
                            );
                            reply(StatusCode::OK, "application/json", out)
                        }
                        Err(_) => reply(StatusCode::PAYLOAD_TOO_LARGE, "text/plain", "body\n"),
                    }
                }
                (&Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
                _ => not_found(),
            }
        }
    };
    serve(listener, tls, handler, async move { shutdown.wait().await }).await;
    Ok(())
}

/// The key broker (`GET /v1/keys/<namespace>`, bearer token) on `addr` over HTTPS
/// (`crate::broker`). Answers the data key as [`stasis_api::keys::KeyGrant`] JSON, or a
/// Kubernetes `Status` naming why not (401, 403, 503).
pub async fn serve_broker(
    addr: SocketAddr,
    tls: TlsAcceptor,
    broker: Arc<crate::broker::Broker>,
    metrics: Metrics,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let listener = admin::bind(addr).await?;
    tracing::info!(%addr, "key broker");
    let handler = move |req: Request<Incoming>| {
        let broker = broker.clone();
        let metrics = metrics.clone();
        async move {
            let path = req.uri().path().to_owned();
            let Some(ns) = path.strip_prefix(stasis_api::keys::BROKER_PATH) else {
                return not_found();
            };
            if req.method() != Method::GET {
                return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET\n");
            }
            let token = req
                .headers()
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or_default()
                .trim()
                .to_owned();
            match broker.grant(&token, ns).await {
                Ok(k) => reply(
                    StatusCode::OK,
                    "application/json",
                    serde_json::to_string(&stasis_api::keys::KeyGrant::new(ns, &k))
                        .unwrap_or_default(),
                ),
                Err(r) => {
                    metrics.refused(r.label());
                    tracing::warn!(namespace = %ns, refusal = %r, "key request refused");
                    let code = r.code();
                    let status = serde_json::json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "code": code, "message": r.to_string(),
                        "reason": match code { 401 => "Unauthorized", 403 => "Forbidden", _ => "ServiceUnavailable" },
                    });
                    reply(
                        StatusCode::from_u16(code).unwrap_or(StatusCode::FORBIDDEN),
                        "application/json",
                        status.to_string(),
                    )
                }
            }
        }
    };
    serve(listener, Some(tls), handler, async move {
        shutdown.wait().await
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openssl` in `dir`: a CA, the webhook's certificate signed by it, a client certificate
    /// signed by it (the API server's) and one self-signed (anyone's).
    fn certificates(dir: &Path) {
        let script = r#"set -e
            o() { openssl "$@" 2>/dev/null; }
            o req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=webhook-client-ca
            o req -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj /CN=localhost
            printf 'subjectAltName=DNS:localhost' >san
            o x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 1 -extfile san
            o req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=kube-apiserver
            printf 'extendedKeyUsage=clientAuth' >usage
            o x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out client.crt -days 1 -extfile usage
            o req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.crt -days 1 -subj /CN=kube-apiserver"#;
        let ok = std::process::Command::new("bash")
            .args(["-c", script])
            .current_dir(dir)
            .status()
            .expect("run openssl")
            .success();
        assert!(ok, "openssl failed");
    }

    /// Handshakes with the webhook's listener, presenting `client` (certificate, key) or no
    /// certificate; true when the server accepted the connection.
    async fn server_accepts(acceptor: TlsAcceptor, dir: &Path, client: Option<&str>) -> bool {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            acceptor.accept(stream).await.is_ok()
        });
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap())
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some(name) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_file(dir.join(format!("{name}.crt"))).unwrap()],
                    PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap(),
                )
                .unwrap(),
        };
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").unwrap(), stream)
            .await;
        server.await.unwrap()
    }

    /// With a client CA, only a client certificate it signed gets through the handshake: a
    /// forged AdmissionReview from anywhere else never reaches `/mutate`.
    #[tokio::test]
    async fn with_a_client_ca_only_its_clients_are_served() {
        let dir = std::env::temp_dir().join(format!("stasis-webhook-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.as_path();
        certificates(d);
        let (crt, key, ca) = (d.join("tls.crt"), d.join("tls.key"), d.join("ca.crt"));
        let open = || tls_acceptor(&crt, &key, None).unwrap();
        let closed = || tls_acceptor(&crt, &key, Some(&ca)).unwrap();
        assert!(server_accepts(open(), d, None).await);
        assert!(!server_accepts(closed(), d, None).await, "no certificate");
        assert!(
            !server_accepts(closed(), d, Some("other")).await,
            "a certificate the CA did not sign"
        );
        assert!(server_accepts(closed(), d, Some("client")).await);
        let e = tls_acceptor(&crt, &key, Some(&d.join("missing.crt")))
            .err()
            .unwrap();
        assert!(e.contains("missing.crt"), "{e}");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn restore_paths() {
        assert_eq!(
            restore_path("/v1/restores/prod/counter-abc/0b7e-42"),
            Some(("prod", "counter-abc", "0b7e-42"))
        );
        assert_eq!(restore_path("/v1/restores/prod/counter-abc"), None);
        assert_eq!(restore_path("/v1/restores/prod/a/"), None);
        assert_eq!(restore_path("/v1/restores/prod/a/u/x"), None);
        assert_eq!(restore_path("/v1/restores/Prod/x/u"), None);
        assert_eq!(restore_path("/metrics"), None);
    }

    /// The body and status of an answer.
    async fn answer(resp: Response<Body>) -> (StatusCode, serde_json::Value) {
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    /// The endpoint answers only the pod's UID, and then only the phase, never the lineage or
    /// checkpoint; a wrong UID gets exactly the answer of a pod that does not exist.
    #[tokio::test]
    async fn restore_status_says_only_the_phase_and_only_to_the_pods_uid() {
        use crate::testing::api_server;
        let restore = |target: Option<&str>| {
            serde_json::json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodRestore",
                "metadata": {"name": "web-1", "namespace": "prod"},
                "spec": {"checkpointRef": "prod_deploy_web.0a1b2c3d/20261129T083000.123Z-1a2b3c4d",
                         "targetPodName": "web-1", "targetPodUID": target, "lineage": "prod_deploy_web.0a1b2c3d"},
                "status": {"phase": "Ready", "node": "worker-2"}
            })
        };
        let pod = |reported: bool| {
            let ann = if reported {
                serde_json::json!({stasis_api::names::DECISION_REPORTED: "true"})
            } else {
                serde_json::json!({})
            };
            serde_json::json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "web-1", "namespace": "prod", "uid": "uid-web-1", "annotations": ann}})
        };
        const PR: &str = "/apis/stasis.dev/v1alpha1/namespaces/prod/podrestores/web-1";
        const POD: &str = "/api/v1/namespaces/prod/pods/web-1";
        let ask = |routes: Vec<(&str, serde_json::Value)>, uid: &'static str| {
            let (client, _) =
                api_server(routes.into_iter().map(|(p, v)| (p.to_owned(), v)).collect());
            async move { answer(restore_status(&client, "prod", "web-1", uid).await).await }
        };
        let unknown = ask(vec![], "uid-web-1").await;
        assert_eq!(unknown, (StatusCode::NOT_FOUND, serde_json::json!({})));
        let ready = (StatusCode::OK, serde_json::json!({"phase": "Ready"}));
        // The pod's own UID: the phase, nothing else.
        let routes = || vec![(PR, restore(Some("uid-web-1"))), (POD, pod(false))];
        assert_eq!(ask(routes(), "uid-web-1").await, ready);
        // Another UID, with the PodRestore and the pod there: as if neither existed.
        assert_eq!(ask(routes(), "uid-guessed").await, unknown);
        // A reported cold start is told to its pod only.
        let cold = vec![(POD, pod(true))];
        assert_eq!(
            ask(cold.clone(), "uid-web-1").await,
            (StatusCode::OK, serde_json::json!({"phase": "ColdStart"}))
        );
        assert_eq!(ask(cold, "uid-guessed").await, unknown);
        // The PodRestore of an earlier pod of the same name (a StatefulSet's) is not this pod's.
        let earlier = vec![(PR, restore(Some("uid-earlier"))), (POD, pod(false))];
        assert_eq!(ask(earlier, "uid-web-1").await, unknown);
        // One made before PodRestores named their target's UID counts for the pod of that name.
        let legacy = vec![(PR, restore(None)), (POD, pod(false))];
        assert_eq!(ask(legacy.clone(), "uid-web-1").await, ready);
        assert_eq!(ask(legacy, "uid-guessed").await, unknown);
    }
}
