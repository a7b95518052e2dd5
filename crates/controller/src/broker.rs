//! The key broker: the cluster key stays in stasis-controller, and a node's agent obtains a
//! namespace's data key only while a pod of that namespace that opted in is bound to its node
//! (review H4; docs/security.md, "A compromised node").
//!
//! `GET /v1/keys/<namespace>` on the broker's HTTPS port (the webhook's certificate), with the
//! agent pod's projected service-account token for the audience
//! [`stasis_api::keys::BROKER_AUDIENCE`] as bearer token. The broker asks the API server
//! (TokenReview, for that audience only) who presents it, and grants only when:
//!
//! 1. the token authenticates, as stasis-agent's service account;
//! 2. it is a bound token naming the node of the pod it was issued for (the extra
//!    [`stasis_api::keys::NODE_NAME_EXTRA`], which the API server fills from the token's own
//!    claims on Kubernetes ≥ 1.30): that node is the agent's, whatever else it says;
//! 3. a pod of the namespace with stasis's RuntimeClass, not finished, is bound to that node
//!    (read from the API server at the request, never from a cache).
//!
//! The data keys themselves do not change: each namespace's is the random key wrapped by the
//! cluster key in `stasis-key-<namespace>` (created here when absent), so every checkpoint
//! written before the broker stays readable and the cluster key rotates as before (its retired
//! keys still unwrap).

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use stasis_api::keys::{self, ClusterKey, BROKER_AUDIENCE, NODE_NAME_EXTRA};

/// Why a key request is refused. Each names its cause; the agent's error carries it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No token, or one the API server does not authenticate for the broker's audience (401).
    #[error("{0}")]
    Unauthenticated(String),
    /// Authenticated, but not allowed this key (403).
    #[error("{0}")]
    Forbidden(String),
    /// The API server or the key Secret could not be read (503): nothing was decided.
    #[error("{0}")]
    Unavailable(String),
}

impl Refusal {
    pub fn code(&self) -> u16 {
        match self {
            Refusal::Unauthenticated(_) => 401,
            Refusal::Forbidden(_) => 403,
            Refusal::Unavailable(_) => 503,
        }
    }

    /// The metric's reason.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Unauthenticated(_) => "KeyRequestUnauthenticated",
            Refusal::Forbidden(_) => "KeyRequestForbidden",
            Refusal::Unavailable(_) => "KeyRequestUnavailable",
        }
    }
}

/// The node of an agent from the API server's review of its token: the token must authenticate
/// as `agent_user` and name the node its pod is bound to.
pub fn node_of(review: Option<&TokenReviewStatus>, agent_user: &str) -> Result<String, Refusal> {
    let review = review.ok_or_else(|| Refusal::Unavailable("empty TokenReview".into()))?;
    if review.authenticated != Some(true) {
        return Err(Refusal::Unauthenticated(format!(
            "the token does not authenticate for audience {BROKER_AUDIENCE}{}",
            review
                .error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )));
    }
    let user = review.user.as_ref();
    let name = user.and_then(|u| u.username.as_deref()).unwrap_or_default();
    if name != agent_user {
        return Err(Refusal::Forbidden(format!(
            "{name} is not {agent_user}: only stasis's node agents get data keys"
        )));
    }
    user.and_then(|u| u.extra.as_ref())
        .and_then(|x| x.get(NODE_NAME_EXTRA))
        .and_then(|v| v.first())
        .filter(|n| !n.is_empty())
        .cloned()
        .ok_or_else(|| {
            Refusal::Forbidden(format!(
                "the token names no node ({NODE_NAME_EXTRA}): the agent must present a bound \
                 service-account token of its pod (projected volume), on Kubernetes 1.30 or newer"
            ))
        })
}

/// Whether `pods` holds a pod of `namespace` bound to `node` that opted in (`runtime_class`) and
/// has not finished (a terminating pod still counts: its final checkpoint needs the key).
pub fn holds_pod_of(pods: &[Pod], namespace: &str, node: &str, runtime_class: &str) -> bool {
    pods.iter().any(|p| {
        let spec = p.spec.as_ref();
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        p.metadata.namespace.as_deref() == Some(namespace)
            && spec.and_then(|s| s.node_name.as_deref()) == Some(node)
            && spec.and_then(|s| s.runtime_class_name.as_deref()) == Some(runtime_class)
            && !matches!(phase, Some("Succeeded" | "Failed"))
    })
}

/// A namespace name as a path segment: a DNS-1123 label.
pub fn valid_namespace(ns: &str) -> bool {
    !ns.is_empty()
        && ns.len() <= 63
        && ns
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !ns.starts_with('-')
        && !ns.ends_with('-')
}

/// The broker: the API client, stasis's namespace (the key Secrets), the agents' user name, the
/// RuntimeClass of opted-in pods, the cluster key ring, and the data keys unwrapped so far.
pub struct Broker {
    pub client: kube::Client,
    pub home: String,
    pub agent_user: String,
    pub runtime_class: String,
    ring: ClusterKey,
    cache: Mutex<HashMap<String, [u8; 32]>>,
}

impl Broker {
    pub fn new(
        client: kube::Client,
        home: &str,
        agent_user: &str,
        runtime_class: &str,
        ring: ClusterKey,
    ) -> Self {
        Self {
            client,
            home: home.to_owned(),
            agent_user: agent_user.to_owned(),
            runtime_class: runtime_class.to_owned(),
            ring,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The data key of `namespace` for the bearer of `token`, or why not.
    pub async fn grant(&self, token: &str, namespace: &str) -> Result<[u8; 32], Refusal> {
        if !valid_namespace(namespace) {
            return Err(Refusal::Forbidden(format!(
                "{namespace:?} is not a namespace name"
            )));
        }
        if token.is_empty() {
            return Err(Refusal::Unauthenticated("no bearer token".into()));
        }
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &TokenReview {
                    spec: TokenReviewSpec {
                        token: token.to_owned(),
                        audiences: Some(vec![BROKER_AUDIENCE.to_owned()]),
                    },
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Refusal::Unavailable(format!("TokenReview: {e}")))?;
        let node = node_of(review.status.as_ref(), &self.agent_user)?;
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|e| Refusal::Unavailable(format!("pods of {namespace}: {e}")))?;
        if !holds_pod_of(&pods.items, namespace, &node, &self.runtime_class) {
            return Err(Refusal::Forbidden(format!(
                "no pod of namespace {namespace} with RuntimeClass {} is bound to node {node}",
                self.runtime_class
            )));
        }
        if let Some(k) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(namespace)
        {
            return Ok(*k);
        }
        let k = keys::load_or_create(&self.client, &self.home, namespace, &self.ring)
            .await
            .map_err(|e| Refusal::Unavailable(format!("data key of {namespace}: {e}")))?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(namespace.to_owned(), k);
        tracing::info!(%namespace, %node, "data key handed to the node's agent");
        Ok(k)
    }
}

/// The cluster key ring from its Secret (`cluster.key` and, after rotations, `retired.keys`).
pub async fn load_ring(
    client: &kube::Client,
    home: &str,
    name: &str,
) -> anyhow::Result<ClusterKey> {
    let s = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), home)
        .get(name)
        .await?;
    Ok(ClusterKey::from_secret(&s)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const AGENT: &str = "system:serviceaccount:stasis-system:stasis-agent";

    fn review(v: serde_json::Value) -> TokenReviewStatus {
        serde_json::from_value(v).unwrap()
    }

    fn pod(ns: &str, node: &str, rc: Option<&str>, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": ns},
            "spec": {"nodeName": node, "runtimeClassName": rc, "containers": []},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    #[test]
    fn the_node_comes_from_the_agents_bound_token_only() {
        let ok = review(json!({"authenticated": true, "user": {"username": AGENT,
            "extra": {NODE_NAME_EXTRA: ["worker-1"], "authentication.kubernetes.io/pod-name": ["stasis-agent-x"]}}}));
        assert_eq!(node_of(Some(&ok), AGENT), Ok("worker-1".to_owned()));
        // Wrong or absent token: not authenticated (401), naming the API server's error.
        let bad = review(json!({"authenticated": false, "error": "token audiences mismatch"}));
        let e = node_of(Some(&bad), AGENT).unwrap_err();
        assert!(
            matches!(&e, Refusal::Unauthenticated(m) if m.contains("audiences")),
            "{e}"
        );
        assert_eq!(e.code(), 401);
        // Another service account, even with a node.
        let other = review(json!({"authenticated": true, "user": {
            "username": "system:serviceaccount:prod:default", "extra": {NODE_NAME_EXTRA: ["worker-1"]}}}));
        let e = node_of(Some(&other), AGENT).unwrap_err();
        assert!(e.to_string().contains("only stasis's node agents"), "{e}");
        assert_eq!(e.code(), 403);
        // The agent's account without the node claim (a legacy or unbound token): refused.
        for extra in [
            json!({}),
            json!({NODE_NAME_EXTRA: []}),
            json!({NODE_NAME_EXTRA: [""]}),
        ] {
            let r =
                review(json!({"authenticated": true, "user": {"username": AGENT, "extra": extra}}));
            let e = node_of(Some(&r), AGENT).unwrap_err();
            assert!(e.to_string().contains("names no node"), "{e}");
        }
        assert!(matches!(node_of(None, AGENT), Err(Refusal::Unavailable(_))));
    }

    #[test]
    fn a_key_only_for_a_namespace_with_an_opted_in_pod_on_the_node() {
        let on = |p: &[Pod]| holds_pod_of(p, "team-a", "worker-1", "stasis");
        assert!(on(&[pod("team-a", "worker-1", Some("stasis"), "Running")]));
        assert!(on(&[pod("team-a", "worker-1", Some("stasis"), "Pending")]));
        assert!(!on(&[]), "no pod on the node");
        assert!(
            !on(&[pod("team-a", "worker-2", Some("stasis"), "Running")]),
            "another node"
        );
        assert!(
            !on(&[pod("team-b", "worker-1", Some("stasis"), "Running")]),
            "another namespace"
        );
        assert!(
            !on(&[pod("team-a", "worker-1", None, "Running")]),
            "did not opt in"
        );
        assert!(
            !on(&[pod("team-a", "worker-1", Some("runc"), "Running")]),
            "other RuntimeClass"
        );
        assert!(
            !on(&[pod("team-a", "worker-1", Some("stasis"), "Succeeded")]),
            "finished"
        );
        assert!(
            !on(&[pod("team-a", "worker-1", Some("stasis"), "Failed")]),
            "finished"
        );
    }

    #[test]
    fn namespaces_are_dns_labels() {
        for ok in ["default", "team-a", "a1"] {
            assert!(valid_namespace(ok), "{ok}");
        }
        for bad in ["", "A", "a/b", "..", "-a", "a-", &"a".repeat(64)] {
            assert!(!valid_namespace(bad), "{bad}");
        }
    }
}
