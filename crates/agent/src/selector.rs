//! Label selector matching (`matchLabels` and `matchExpressions`), as the API server defines
//! it: which `CheckpointPolicy` selects a pod. kube's `Selector` does the matching, the same
//! rule the controller applies.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};

/// True when `sel` selects `labels`. An empty selector selects everything; an invalid one (an
/// unknown operator) selects nothing.
pub fn matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    Selector::try_from(sel.clone()).is_ok_and(|s| s.matches(labels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn req(key: &str, op: &str, vals: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(vals.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn selector_semantics() {
        let labels = BTreeMap::from([
            ("app".to_owned(), "counter".to_owned()),
            ("tier".to_owned(), "gpu".to_owned()),
        ]);
        assert!(matches(&LabelSelector::default(), &labels));
        let ml = |k: &str, v: &str| LabelSelector {
            match_labels: Some(BTreeMap::from([(k.to_owned(), v.to_owned())])),
            ..Default::default()
        };
        assert!(matches(&ml("app", "counter"), &labels));
        assert!(!matches(&ml("app", "other"), &labels));
        let me = |r: Vec<LabelSelectorRequirement>| LabelSelector {
            match_expressions: Some(r),
            ..Default::default()
        };
        assert!(matches(
            &me(vec![req("tier", "In", &["gpu", "cpu"])]),
            &labels
        ));
        assert!(!matches(&me(vec![req("tier", "NotIn", &["gpu"])]), &labels));
        assert!(matches(&me(vec![req("zone", "NotIn", &["a"])]), &labels));
        assert!(matches(&me(vec![req("app", "Exists", &[])]), &labels));
        assert!(!matches(
            &me(vec![req("app", "DoesNotExist", &[])]),
            &labels
        ));
        assert!(!matches(&me(vec![req("app", "Gt", &["1"])]), &labels));
    }
}
