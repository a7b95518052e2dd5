//! stasisd against a real kube-apiserver (no kubelet) with real runc and CRIU:
//! `tests/apiserver-agent.sh` does the work (see its header); this test runs it so the
//! integration tier (`cargo test --test '*'`) covers it. Skipped, visibly, when the binaries,
//! root, CRIU or the counter image are missing (fails under `CI` unless only the Kubernetes
//! binaries are missing, which `scripts/cluster up` builds).

mod common;
#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

#[test]
fn stasisd_against_a_real_apiserver() {
    // (root, runc and the counter image: the script checks them)
    let wrapper = common::wrapper_binary();
    if !stasis_testkit::Requirements::new("stasisd_against_a_real_apiserver")
        .criu()
        .binary(
            "stasis-runc",
            wrapper.as_deref(),
            "cargo build -p stasis-runtime",
        )
        .met()
    {
        return;
    }
    let wrapper = wrapper.unwrap();
    let lineage = "default_pod_counter-a.0000beef";
    shell_test::run(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/apiserver-agent.sh"),
        [
            std::ffi::OsStr::new(env!("CARGO_BIN_EXE_stasisd")),
            wrapper.as_os_str(),
            std::ffi::OsStr::new(lineage),
            std::ffi::OsStr::new(&stasis_api::lineage::record_name(lineage)),
        ],
    );
}
