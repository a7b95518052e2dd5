//! The cluster key is made once, by the controller, never by the chart.
//!
//! A key rendered by the chart would be made anew by every `helm template` (GitOps tools render
//! without a cluster, so `lookup` finds nothing): every existing checkpoint would become
//! unreadable at the next sync. Instead the controller creates the Secret when it is absent
//! (create-only: among several replicas the first create wins, the others get 409 and use it)
//! and never changes it afterwards. The agents mount it; until it exists their pods wait in
//! `ContainerCreating`. An operator who brings their own key names an existing Secret
//! (`keys.clusterKeySecret`): the controller then only checks it.
//!
//! The Secret is not owned by the Helm release, so an uninstall leaves it and a reinstall reads
//! the same checkpoints (docs/security.md, "Keys").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, PostParams};
use kube::Api;
use stasis_api::keys::CLUSTER_KEY_FIELD;

#[derive(Debug, thiserror::Error)]
pub enum ClusterKeyError {
    #[error("cluster key Secret {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "cluster key Secret {namespace}/{name} does not exist; it was named as an existing Secret \
         (keys.clusterKeySecret): create it with a field {CLUSTER_KEY_FIELD} of 64 hex digits \
         (e.g. `openssl rand -hex 32`)"
    )]
    Missing { namespace: String, name: String },
    #[error("cluster key Secret {namespace}/{name}: field {CLUSTER_KEY_FIELD} {why}")]
    Malformed {
        namespace: String,
        name: String,
        why: String,
    },
}

/// What [`ensure`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Created,
    Existing,
}

/// Checks that a Secret's cluster key is 64 hex digits (what the agents accept).
pub fn check(secret: &Secret) -> Result<(), String> {
    let raw = secret
        .data
        .as_ref()
        .and_then(|d| d.get(CLUSTER_KEY_FIELD))
        .ok_or("is missing")?;
    let text = std::str::from_utf8(&raw.0).map_err(|_| "is not text")?;
    let hexed = text.trim();
    if hexed.len() != 64 || !hexed.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("is not 64 hex digits ({} characters)", hexed.len()));
    }
    Ok(())
}

/// A new Secret holding a fresh random cluster key.
pub fn new_secret(namespace: &str, name: &str) -> Secret {
    let key = hex::encode(rand::random::<[u8; 32]>());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                stasis_api::names::MANAGED_BY.0.to_owned(),
                stasis_api::names::MANAGED_BY.1.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([(
                stasis_api::names::NOTE.to_owned(),
                "made once by stasis-controller; every checkpoint's data key is wrapped with it: \
                 never delete it while checkpoints should stay readable"
                    .to_owned(),
            )])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            CLUSTER_KEY_FIELD.to_owned(),
            ByteString(key.into_bytes()),
        )])),
        ..Default::default()
    }
}

/// Makes sure the cluster key Secret `namespace/name` exists and is well formed; creates it when
/// absent and `create` is set. Never overwrites it.
pub async fn ensure(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    create: bool,
) -> Result<Outcome, ClusterKeyError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let api_err = |source| ClusterKeyError::Api {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let malformed = |why| ClusterKeyError::Malformed {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        why,
    };
    if let Some(existing) = api.get_opt(name).await.map_err(api_err)? {
        check(&existing).map_err(malformed)?;
        return Ok(Outcome::Existing);
    }
    if !create {
        return Err(ClusterKeyError::Missing {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
    }
    match api
        .create(&PostParams::default(), &new_secret(namespace, name))
        .await
    {
        Ok(_) => Ok(Outcome::Created),
        // Another replica made it first: use theirs.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let theirs = api.get(name).await.map_err(api_err)?;
            check(&theirs).map_err(malformed)?;
            Ok(Outcome::Existing)
        }
        Err(e) => Err(api_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_keys_are_random_and_well_formed() {
        let a = new_secret("stasis-system", "stasis-cluster-key");
        let b = new_secret("stasis-system", "stasis-cluster-key");
        assert_eq!(check(&a), Ok(()));
        assert_ne!(a.data, b.data, "every new Secret holds a fresh key");
        assert_eq!(a.metadata.namespace.as_deref(), Some("stasis-system"));
    }

    #[test]
    fn malformed_keys_are_named() {
        let mut s = new_secret("n", "k");
        s.data = Some(BTreeMap::from([(
            CLUSTER_KEY_FIELD.to_owned(),
            ByteString(b"abc".to_vec()),
        )]));
        assert!(check(&s).unwrap_err().contains("not 64 hex digits"));
        s.data = None;
        assert_eq!(check(&s).unwrap_err(), "is missing");
        // Whitespace around the digits is accepted, as the agents accept it.
        s.data = Some(BTreeMap::from([(
            CLUSTER_KEY_FIELD.to_owned(),
            ByteString(format!("{}\n", "ab".repeat(32)).into_bytes()),
        )]));
        assert_eq!(check(&s), Ok(()));
    }
}
