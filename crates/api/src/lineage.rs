//! What the controller (and its webhook) and the node agents share about lineages, beyond the
//! CRDs (docs/design.md §12.4):
//!
//! - on a pod, the webhook writes the lineage it claimed and the generation of the claim
//!   ([`LINEAGE_ANNOTATION`], [`GENERATION_ANNOTATION`]), for people to read: nothing trusts
//!   them, a pod's user can write them too;
//! - the controller persists each lineage record (`stasis_core::lineage::Lineage`, JSON under
//!   [`RECORD_KEY`]) in a ConfigMap named [`record_name`] in stasis's own namespace, labelled
//!   [`RECORD_LABEL`]`=true`, [`RECORD_NAMESPACE_LABEL`] and, once it has seen the holder pod,
//!   [`HOLDER_UID_LABEL`]; updated with resourceVersion preconditions. The agent only reads
//!   records: it stamps a pod's checkpoints (`PodCheckpoint.status.lineage`/`generation`,
//!   manifest labels) with the record naming the pod's UID, and fences
//!   (`stasis_core::lineage::may_publish`) before a checkpoint becomes visible;
//! - engine/model versions a workload declares are pod labels (or annotations) with the prefix
//!   [`DECLARE_PREFIX`]: `declare.stasis.dev/engine: vllm-0.9` declares `engine=vllm-0.9`.

use std::collections::BTreeMap;

/// Pod annotation: the lineage the pod holds.
pub const LINEAGE_ANNOTATION: &str = "stasis.dev/lineage";
/// Pod annotation: the lineage generation the pod's claim holds (decimal).
pub const GENERATION_ANNOTATION: &str = "stasis.dev/generation";
/// Data key of the lineage record in its ConfigMap.
pub const RECORD_KEY: &str = "lineage.json";
/// Label on every lineage record ConfigMap.
pub const RECORD_LABEL: &str = "stasis.dev/lineage-record";
/// Annotation on a lineage record ConfigMap holding the lineage id (readable).
pub const RECORD_ID_ANNOTATION: &str = "stasis.dev/lineage";
/// Label on a lineage record ConfigMap: the UID of the pod that holds the lineage, set by the
/// controller when it registers the pod (its first sight of it). The agent stamps a pod's
/// checkpoints with the lineage and generation of the record carrying the pod's UID here (and the
/// pod's namespace in [`RECORD_NAMESPACE_LABEL`]), never with anything the pod itself says.
pub const HOLDER_UID_LABEL: &str = "stasis.dev/holder-uid";
/// Label on a lineage record ConfigMap: the namespace of its workload (records of one namespace
/// are counted and listed with it).
pub const RECORD_NAMESPACE_LABEL: &str = "stasis.dev/namespace";
/// Label on `PodCheckpoint`s and `PodRestore`s: the node of the pod they are about, whose agent
/// alone may write them (the chart's ValidatingAdmissionPolicy holds an agent to the node its
/// token names). Set by the controller on the checkpoints it creates and by the agent on the
/// objects it creates.
pub const NODE_LABEL: &str = "stasis.dev/node";
/// Prefix of the labels/annotations that declare engine and model versions.
pub const DECLARE_PREFIX: &str = "declare.stasis.dev/";

/// Name of the ConfigMap holding a lineage's record: `lineage-` + 32 hex digits of BLAKE3 of
/// the lineage id (lineage ids may hold `_` and exceed what an object name allows).
pub fn record_name(lineage: &str) -> String {
    let h = blake3::hash(lineage.as_bytes()).to_hex();
    format!("lineage-{}", &h[..32])
}

/// The lineage and generation a pod's annotations name, when both are present and valid.
pub fn pod_lineage(annotations: &BTreeMap<String, String>) -> Option<(String, u64)> {
    let l = annotations.get(LINEAGE_ANNOTATION)?.trim();
    let g = annotations
        .get(GENERATION_ANNOTATION)?
        .trim()
        .parse()
        .ok()?;
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
        ann.insert(LINEAGE_ANNOTATION.into(), "l.1".into());
        ann.insert(GENERATION_ANNOTATION.into(), "x".into());
        assert_eq!(pod_lineage(&ann), None);
        ann.insert(GENERATION_ANNOTATION.into(), "3".into());
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
}
