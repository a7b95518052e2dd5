//! The controller's writes to objects that others write too: server-side apply with the field
//! manager [`MANAGER`]. Each writer then owns the fields it sets (the agent what it reports, the
//! controller what it decides: a stuck checkpoint's failure, a refused restore, an accounted
//! outcome), instead of the last whole-status merge patch silently replacing the other's
//! conditions. `force`: what the controller decides wins over an earlier value of the agent's.

use k8s_openapi::NamespaceResourceScope;
use serde::de::DeserializeOwned;

use super::*;

fn params() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

/// The object's identity, as a server-side apply body must carry it.
fn body<K: Resource<DynamicType = ()>>(
    name: &str,
    mut fields: serde_json::Value,
) -> serde_json::Value {
    fields["apiVersion"] = json!(K::api_version(&()));
    fields["kind"] = json!(K::kind(&()));
    fields["metadata"]["name"] = json!(name);
    fields
}

/// Applies `status` (only the fields the controller sets) to the status of `name`.
pub(crate) async fn apply_status<K>(
    client: &Client,
    ns: &str,
    name: &str,
    status: serde_json::Value,
) -> Result<()>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), ns)
        .patch_status(
            name,
            &params(),
            &Patch::Apply(body::<K>(name, json!({ "status": status }))),
        )
        .await?;
    Ok(())
}

/// Adds the labels and annotations in `metadata` to `name` (a JSON merge patch under the field
/// manager [`MANAGER`]): keys are added or replaced, never removed. Not a server-side apply:
/// labels and annotations are maps many writers add to, and the controller sets its keys in
/// separate writes (the committed lineage, later "decision reported"); under apply, each write
/// removed the keys the previous one had set, and a pod lost its lineage annotation.
pub(crate) async fn add_metadata<K>(
    client: &Client,
    ns: &str,
    name: &str,
    metadata: serde_json::Value,
) -> Result<()>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let params = PatchParams {
        field_manager: Some(MANAGER.to_owned()),
        ..Default::default()
    };
    Api::<K>::namespaced(client.clone(), ns)
        .patch(
            name,
            &params,
            &Patch::Merge(json!({ "metadata": metadata })),
        )
        .await?;
    Ok(())
}

/// The `Ready` condition of `conditions` alone: the one condition the controller owns.
pub(crate) fn ready_only(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    condition::find(conditions, condition::READY)
        .cloned()
        .into_iter()
        .collect()
}
