//! Namespace data keys: unwrapped here with the cluster key, or asked of the controller's key
//! broker; cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Client;
use stasis_store::Key;
use tokio::runtime::Handle;

use crate::error::{AgentError, Result};
use crate::executor::KeySource;
use crate::keys::{self, ClusterKey};

/// Where the data keys come from.
pub enum KeyOrigin {
    /// The Secrets in stasis's namespace, unwrapped here with the cluster key (every agent holds
    /// it: the chart's default until the key broker is on).
    ClusterKey {
        client: Client,
        namespace: String,
        ring: Arc<ClusterKey>,
    },
    /// stasis-controller's key broker, which hands this node a namespace's key only while a pod
    /// of that namespace is bound to it ([`BrokerClient`]).
    Broker(BrokerClient),
}

/// How long a key the broker handed out is used before it is asked for again (the broker then
/// refuses once no pod of the namespace is bound to this node any more).
pub const BROKER_KEY_TTL: Duration = Duration::from_secs(300);

/// Namespace data keys (see [`crate::keys`]), cached.
pub struct SecretKeys {
    pub rt: Handle,
    pub origin: KeyOrigin,
    cache: Mutex<HashMap<String, (Key, Instant)>>,
}

impl SecretKeys {
    pub fn new(rt: Handle, origin: KeyOrigin) -> Self {
        Self {
            rt,
            origin,
            cache: Mutex::new(HashMap::new()),
        }
    }

    async fn load(&self, ns: &str) -> Result<Key> {
        let secret = match &self.origin {
            KeyOrigin::ClusterKey {
                client,
                namespace,
                ring,
            } => keys::load_or_create(client, namespace, ns, ring)
                .await
                .map_err(|e| match e {
                    keys::DataKeyError::Key(k) => AgentError::Key(k),
                    keys::DataKeyError::Kube(m) => AgentError::KeyUnavailable(m),
                })?,
            KeyOrigin::Broker(b) => b.key(ns).await?,
        };
        Ok(Key::from_secret(&secret))
    }
}

impl KeySource for SecretKeys {
    fn key(&self, namespace: &str) -> Result<Key> {
        let ttl = match self.origin {
            KeyOrigin::ClusterKey { .. } => None,
            KeyOrigin::Broker(_) => Some(BROKER_KEY_TTL),
        };
        if let Some((k, at)) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(namespace)
        {
            if ttl.is_none_or(|t| at.elapsed() < t) {
                return Ok(k.clone());
            }
        }
        let k = self.rt.block_on(self.load(namespace))?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(namespace.to_owned(), (k.clone(), Instant::now()));
        Ok(k)
    }
}

/// The agent's side of stasis-controller's key broker: `GET /v1/keys/<namespace>` over HTTPS
/// (the controller's certificate checked against the CA the chart gives), authenticated by the
/// agent pod's projected service-account token for the broker's audience (re-read from its file
/// as the kubelet renews it).
pub struct BrokerClient {
    client: Client,
}

impl BrokerClient {
    /// A client of the broker at `url` (`https://<service>.<namespace>.svc:<port>`), trusting
    /// the PEM CA in `ca`, presenting the token in `token_file`.
    pub fn new(url: &str, ca: &std::path::Path, token_file: &std::path::Path) -> Result<Self> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::CertificateDer;
        let bad = |what: String| AgentError::Invalid(format!("key broker: {what}"));
        let roots = CertificateDer::pem_file_iter(ca)
            .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| bad(format!("CA {}: {e}", ca.display())))?
            .into_iter()
            .map(|c| c.as_ref().to_vec())
            .collect::<Vec<_>>();
        if roots.is_empty() {
            return Err(bad(format!("CA {} holds no certificate", ca.display())));
        }
        let mut cfg = kube::Config::new(url.parse().map_err(|e| bad(format!("URL {url}: {e}")))?);
        cfg.root_cert = Some(roots);
        // Re-read as the CA rotates, like the token.
        cfg.root_cert_file = Some(ca.to_owned());
        cfg.auth_info.token_file = Some(token_file.display().to_string());
        let client = Client::try_from(cfg).map_err(|e| bad(e.to_string()))?;
        Ok(Self { client })
    }

    async fn key(&self, ns: &str) -> Result<[u8; 32]> {
        let req = http::Request::get(format!("{}{ns}", keys::BROKER_PATH))
            .body(Vec::new())
            .map_err(|e| AgentError::Invalid(e.to_string()))?;
        let grant: keys::KeyGrant = self.client.request(req).await.map_err(|e| {
            AgentError::KeyUnavailable(format!(
                "the key broker gave no data key for namespace {ns}: {e}"
            ))
        })?;
        grant.secret().map_err(|why| {
            AgentError::KeyUnavailable(format!("the key broker's answer for namespace {ns}: {why}"))
        })
    }
}
