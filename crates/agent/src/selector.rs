//! Label selector matching (`matchLabels` and `matchExpressions`: `In`, `NotIn`, `Exists`,
//! `DoesNotExist`), as the API server defines it: which `CheckpointPolicy` selects a pod.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// True when `sel` selects `labels`. An empty selector selects everything; an unknown operator
/// selects nothing.
pub fn matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let ml = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let me = sel.match_expressions.iter().flatten().all(|e| {
        let vals = e.values.as_deref().unwrap_or_default();
        let have = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => have.is_some_and(|h| vals.contains(h)),
            "NotIn" => have.is_none_or(|h| !vals.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    });
    ml && me
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
