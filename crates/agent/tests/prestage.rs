//! Pre-staging between two `stasisd` agents against a real kube-apiserver (no kubelet), a real
//! S3 server (s3s-fs) and real runc and CRIU: `tests/prestage-agent.sh` does the work (see its
//! header): another node cordoned → this agent, holding no data key (its key broker answers
//! nothing), pre-stages the pod's latest checkpoint into its chunk cache; a later checkpoint
//! moves only its new chunks; an uncordon stops it; restarted with the key, a restore here reads
//! every chunk from the cache. Skipped, visibly, when something it needs is missing
//! (fails under `CI`, see `shell_test`).

mod common;
#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

use std::ffi::OsStr;

#[test]
fn another_node_at_risk_prestages_its_pods_checkpoints_here() {
    let wrapper = common::wrapper_binary();
    let needs = stasis_testkit::Requirements::new("prestage").criu().binary(
        "stasis-runc",
        wrapper.as_deref(),
        "cargo build -p stasis-runtime",
    );
    if !needs.met() {
        return;
    }
    let lineage = "default_pod_counter-a.0000cafe";
    let record = stasis_api::lineage::record_name(lineage);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/prestage-agent.sh");
    let args = [
        OsStr::new(env!("CARGO_BIN_EXE_stasisd")),
        wrapper.as_deref().unwrap().as_os_str(),
        OsStr::new(lineage),
        OsStr::new(&record),
    ];
    shell_test::run(script, args);
}
