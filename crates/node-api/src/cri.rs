//! Which pod and container an OCI bundle or a runc container belongs to, from the CRI
//! annotations containerd writes into the container's config (`internal/cri/annotations` in 2.x,
//! `pkg/cri/annotations` in 1.7): `io.kubernetes.cri.container-type` (`sandbox` | `container`),
//! `io.kubernetes.cri.sandbox-uid`, `-namespace`, `-name`, `io.kubernetes.cri.container-name`.
//! CRI-O's `io.kubernetes.cri-o.ContainerType` and the kubelet's `io.kubernetes.pod.*` /
//! `io.kubernetes.container.name` are accepted as fallbacks. Shared by the wrapper (which reads a
//! bundle) and the agent (which reads runc's state), so both classify a container the same way.

use std::collections::BTreeMap;

use crate::PodRef;

pub use stasis_core::names::cri::{
    CONTAINER_NAME, CONTAINER_TYPE, POD_NAME, POD_NAMESPACE, POD_UID,
};

/// What kind of container the annotations describe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerKind {
    /// A pod sandbox (the pause container): never restored, never checkpointed on its own.
    Sandbox,
    /// An application container of a pod.
    App(PodRef),
    /// No CRI annotations (plain runc use, tests): a container known only by its id.
    Plain,
}

fn first<'a>(a: &'a BTreeMap<String, String>, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| a.get(*k)).map(String::as_str)
}

/// Classifies a container by its annotations.
pub fn classify(a: &BTreeMap<String, String>) -> ContainerKind {
    match first(a, CONTAINER_TYPE) {
        Some("sandbox") => ContainerKind::Sandbox,
        Some(_) => ContainerKind::App(PodRef {
            pod_uid: first(a, POD_UID).unwrap_or_default().to_owned(),
            pod_namespace: first(a, POD_NAMESPACE).unwrap_or_default().to_owned(),
            pod_name: first(a, POD_NAME).unwrap_or_default().to_owned(),
            container_name: first(a, CONTAINER_NAME).unwrap_or_default().to_owned(),
        }),
        None => ContainerKind::Plain,
    }
}
