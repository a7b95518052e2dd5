//! What the controller (and its webhook) and the node agents share about lineages, beyond the
//! CRDs (docs/design.md §12.4):
//!
//! - on a pod, the webhook writes the lineage it claimed and the generation of the claim
//!   ([`names::LINEAGE`], [`names::GENERATION`]), for people to read: nothing trusts them, a
//!   pod's user can write them too;
//! - the controller persists each lineage record (`stasis_core::lineage::Lineage`, JSON under
//!   [`RECORD_KEY`]) in a ConfigMap named [`record_name`] in stasis's own namespace, labelled
//!   [`names::LINEAGE_RECORD`]`=true`, [`names::NAMESPACE`] and, once it has seen the holder
//!   pod, [`names::HOLDER_UID`] (the agent stamps a pod's checkpoints with the lineage and
//!   generation of the record carrying the pod's UID there, never with anything the pod itself
//!   says); updated with resourceVersion preconditions. The agent only reads
//!   records: it stamps a pod's checkpoints (`PodCheckpoint.status.lineage`/`generation`,
//!   manifest labels) with the record naming the pod's UID, and fences
//!   (`stasis_core::lineage::may_publish`) before a checkpoint becomes visible;
//! - engine/model versions a workload declares are pod labels (or annotations) with the prefix
//!   [`names::DECLARE_PREFIX`]: `declare.stasis.dev/engine: vllm-0.9` declares `engine=vllm-0.9`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use stasis_core::fingerprint::Mismatch;

use crate::names::{self, DECLARE_PREFIX, GENERATION, LINEAGE};

/// Data key of the lineage record in its ConfigMap.
pub const RECORD_KEY: &str = "lineage.json";
/// [`names::HOLDER_UID`], under the name the agent used before [`names`] existed.
pub use names::HOLDER_UID as HOLDER_UID_LABEL;
/// [`names::NAMESPACE`], under the name the agent used before [`names`] existed.
pub use names::NAMESPACE as RECORD_NAMESPACE_LABEL;

/// Name of the ConfigMap holding a lineage's record: `lineage-` + 32 hex digits of BLAKE3 of
/// the lineage id (lineage ids may hold `_` and exceed what an object name allows).
pub fn record_name(lineage: &str) -> String {
    let h = blake3::hash(lineage.as_bytes()).to_hex();
    format!("lineage-{}", &h[..32])
}

/// The lineage and generation a pod's annotations name, when both are present and valid.
pub fn pod_lineage(annotations: &BTreeMap<String, String>) -> Option<(String, u64)> {
    let l = annotations.get(LINEAGE)?.trim();
    let g = annotations.get(GENERATION)?.trim().parse().ok()?;
    (!l.is_empty()).then(|| (l.to_owned(), g))
}

/// Declared versions from labels and annotations (labels win).
pub fn declared(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for m in [annotations, labels] {
        for (k, v) in m {
            if let Some(name) = k.strip_prefix(DECLARE_PREFIX).filter(|n| !n.is_empty()) {
                out.insert(name.to_owned(), v.clone());
            }
        }
    }
    out
}

/// The declared versions (`declare.stasis.dev/*`, [`declared`]) that differ between the source
/// pod of a checkpoint and the pod that would restore it: a restore across them would resume
/// memory of one engine or model version under another.
pub fn declared_mismatches(source: &Pod, pod: &Pod) -> Vec<Mismatch> {
    let a = declared(source.labels(), source.annotations());
    let b = declared(pod.labels(), pod.annotations());
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| Mismatch {
            field: format!("declared.{k}"),
            recorded: a.get(k).cloned().unwrap_or_else(|| "(none)".into()),
            found: b.get(k).cloned().unwrap_or_else(|| "(none)".into()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_are_valid_and_distinct() {
        let a = record_name("default_deployment_counter.3f2a9c10");
        assert!(a.starts_with("lineage-") && a.len() == 40, "{a}");
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
        assert_ne!(a, record_name("default_deployment_counter.3f2a9c11"));
    }

    #[test]
    fn pod_lineage_and_declared() {
        let mut ann = BTreeMap::new();
        assert_eq!(pod_lineage(&ann), None);
        ann.insert(LINEAGE.into(), "l.1".into());
        ann.insert(GENERATION.into(), "x".into());
        assert_eq!(pod_lineage(&ann), None);
        ann.insert(GENERATION.into(), "3".into());
        assert_eq!(pod_lineage(&ann), Some(("l.1".into(), 3)));
        ann.insert("declare.stasis.dev/engine".into(), "v1".into());
        ann.insert("declare.stasis.dev/model".into(), "m".into());
        let labels = BTreeMap::from([
            ("declare.stasis.dev/engine".to_owned(), "v2".to_owned()),
            ("app".to_owned(), "x".to_owned()),
        ]);
        let d = declared(&labels, &ann);
        assert_eq!(d.len(), 2);
        assert_eq!(d["engine"], "v2");
        assert_eq!(d["model"], "m");
    }

    #[test]
    fn declared_version_mismatches() {
        let pod = |labels: &[(&str, &str)]| Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        let a = pod(&[("declare.stasis.dev/engine", "v1"), ("app", "x")]);
        let b = pod(&[("declare.stasis.dev/engine", "v2"), ("app", "x")]);
        let m = declared_mismatches(&a, &b);
        assert_eq!(m.len(), 1);
        assert_eq!(
            (
                m[0].field.as_str(),
                m[0].recorded.as_str(),
                m[0].found.as_str()
            ),
            ("declared.engine", "v1", "v2")
        );
        assert!(declared_mismatches(&a, &a).is_empty());
    }
}
