//! Fields users write into the CRDs and pod metadata, as the controller parses them: a
//! `CheckpointPolicy` spec (JSON as the API server sends it: selector, interval, freeze
//! fraction), durations and intervals, checkpoint references, workload names and checkpoint
//! ids, and the lineage/declare annotations of a pod.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use stasis_api::policy::CheckpointPolicySpec;
use stasis_core::policy::{parse_duration, parse_interval, MIN_INTERVAL};
use stasis_core::{CheckpointId, CheckpointRef, WorkloadName};

fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<CheckpointPolicySpec>(data) {
        if let Ok(d) = spec.heartbeat() {
            assert!(d >= MIN_INTERVAL);
        }
        let _ = spec.freeze_fraction();
    }
    let (a, b) = stasis_fuzz::split2(data);
    let (a, b) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    let _ = parse_duration(&a);
    if let Ok(d) = parse_interval(&a) {
        assert!(d >= MIN_INTERVAL);
    }
    if let Ok(r) = a.parse::<CheckpointRef>() {
        // A reference that parses prints as something that parses to it again.
        assert_eq!(r.to_string().parse::<CheckpointRef>().ok(), Some(r));
    }
    if let Ok(w) = WorkloadName::new(a.as_ref()) {
        assert_eq!(WorkloadName::new(w.to_string()).ok(), Some(w));
    }
    if let Ok(id) = CheckpointId::parse(&a) {
        assert_eq!(CheckpointId::parse(&id.to_string()).ok(), Some(id));
    }
    let mut ann = BTreeMap::new();
    ann.insert(stasis_api::names::LINEAGE.to_owned(), a.to_string());
    ann.insert(stasis_api::names::GENERATION.to_owned(), b.to_string());
    ann.insert(
        format!("{}{a}", stasis_api::names::DECLARE_PREFIX),
        b.to_string(),
    );
    let _ = stasis_api::lineage::pod_lineage(&ann);
    let _ = stasis_api::lineage::declared(&ann, &ann);
});
