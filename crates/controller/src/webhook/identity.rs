//! The pod's workload identity, verified against the owners the API server holds: a forged
//! review cannot name a workload that does not exist.

use super::*;
use crate::owners::OwnerCache;

/// The workload of a pod at admission, its owners read from the API server: the controlling
/// owner must exist with the UID its reference names, and a ReplicaSet's own controlling
/// Deployment too (`stasis_core::workload::check_owner`); the Deployment of a ReplicaSet is the
/// one the ReplicaSet names, never one guessed from names (docs/design.md §10.2). `Err` with a
/// metric label and the reason when the pod has no identity, or names owners that are not
/// there (a forged request, a stale reference).
///
/// `owners`: the process's owner metadata cache ([`crate::owners`]), asked first; `None` reads
/// every owner from the API server.
pub async fn verified_identity(
    client: &Client,
    owners: Option<&OwnerCache>,
    ns: &str,
    pod: &Pod,
) -> Result<std::result::Result<WorkloadIdentity, (&'static str, String)>> {
    let mut facts = podfacts::pod_facts(pod);
    if let Some(owner) = facts.controller.clone() {
        let api_version = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| o.api_version.clone())
            .unwrap_or_default();
        let found = cached_owner_meta(client, owners, ns, &api_version, &owner).await?;
        if let Err(e) = check_owner(&owner, found.as_ref().and_then(|m| m.uid.as_deref())) {
            return Ok(Err(("UnverifiedOwner", e.to_string())));
        }
        if owner.kind == "ReplicaSet" {
            let rs_owner = found
                .as_ref()
                .and_then(|m| m.owner_references.as_ref())
                .and_then(|refs| refs.iter().find(|o| o.controller == Some(true)))
                .map(|o| {
                    (
                        o.api_version.clone(),
                        OwnerFacts {
                            kind: o.kind.clone(),
                            name: o.name.clone(),
                            uid: o.uid.clone(),
                        },
                    )
                });
            if let Some((api_version, d)) =
                rs_owner.as_ref().filter(|(_, d)| d.kind == "Deployment")
            {
                let found = cached_owner_meta(client, owners, ns, api_version, d).await?;
                if let Err(e) = check_owner(d, found.as_ref().and_then(|m| m.uid.as_deref())) {
                    return Ok(Err((
                        "UnverifiedOwner",
                        format!("its ReplicaSet {:?}: {e}", owner.name),
                    )));
                }
            }
            facts.replicaset_owner = ReplicaSetOwner::Verified(rs_owner.map(|(_, d)| d));
        }
    }
    Ok(WorkloadIdentity::of(&facts).map_err(|e| ("NoIdentity", e.to_string())))
}

/// The metadata of `owner` from the cache when it holds it with the UID the reference names,
/// else from the API server ([`owner_meta`]).
async fn cached_owner_meta(
    client: &Client,
    owners: Option<&OwnerCache>,
    ns: &str,
    api_version: &str,
    owner: &OwnerFacts,
) -> Result<Option<ObjectMeta>> {
    let group = api_version.split_once('/').map_or("", |(g, _)| g);
    if let Some(meta) = owners.and_then(|c| c.get(group, &owner.kind, ns, &owner.name, &owner.uid))
    {
        return Ok(Some(meta));
    }
    owner_meta(client, ns, api_version, &owner.kind, &owner.name).await
}

/// The metadata of a pod's owner object, `None` when there is no such object. The built-in
/// workload kinds are read only in their own API group (an owner reference to a `ReplicaSet` of
/// another group is no ReplicaSet controller's); other kinds through their group and version
/// (the controller needs `get` on them).
pub(crate) async fn owner_meta(
    client: &Client,
    ns: &str,
    api_version: &str,
    kind: &str,
    name: &str,
) -> Result<Option<ObjectMeta>> {
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let c = client.clone();
    let meta = match (group, kind) {
        ("apps", "ReplicaSet") => meta_of(Api::<ReplicaSet>::namespaced(c, ns), name).await?,
        ("apps", "Deployment") => meta_of(Api::<Deployment>::namespaced(c, ns), name).await?,
        ("apps", "StatefulSet") => meta_of(Api::<StatefulSet>::namespaced(c, ns), name).await?,
        ("apps", "DaemonSet") => meta_of(Api::<DaemonSet>::namespaced(c, ns), name).await?,
        ("batch", "Job") => meta_of(Api::<Job>::namespaced(c, ns), name).await?,
        (_, "ReplicaSet" | "Deployment" | "StatefulSet" | "DaemonSet" | "Job") => None,
        _ => {
            let gvk = GroupVersionKind::gvk(group, version, kind);
            let api = Api::<DynamicObject>::namespaced_with(c, ns, &ApiResource::from_gvk(&gvk));
            meta_of(api, name).await?
        }
    };
    Ok(meta)
}

/// The metadata of object `name`, `None` when there is none.
pub(crate) async fn meta_of<K>(api: Api<K>, name: &str) -> Result<Option<ObjectMeta>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api.get_opt(name).await?.map(|o| o.meta().clone()))
}
