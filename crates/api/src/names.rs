//! Every name stasis reads or writes on Kubernetes objects: the `stasis.dev/*` keys and the
//! condition reasons of [`stasis_core::names`] (re-exported here: stasis-runc, which does not
//! link this crate, reads some of them), plus the keys only the Kubernetes side uses.

pub use stasis_core::names::*;

/// Prefix of the labels and annotations that declare engine and model versions:
/// `declare.stasis.dev/engine: vllm-0.9` declares `engine=vllm-0.9` (the user's keys).
pub const DECLARE_PREFIX: &str = "declare.stasis.dev/";

/// Label on the objects the controller creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "stasis-controller");

/// The label (and its value, as the chart sets it) of the agent's own pods: an agent finds the
/// agent that takes over its node's work with it.
pub const AGENT_COMPONENT: (&str, &str) = ("app.kubernetes.io/component", "agent");
