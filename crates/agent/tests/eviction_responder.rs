//! stasisd as an eviction responder (the EvictionRequest API, `lifecycle.k8s.io/v1alpha1`)
//! against a real kube-apiserver with the `EvictionRequestAPI` gate on: `tests/apiserver-eviction.sh`
//! does the work (see its header), with `tests/lib/evictor.sh` standing in for the
//! evictionrequest controller Kubernetes 1.37 does not ship. Skipped, visibly, when the
//! Kubernetes binaries are missing (`scripts/cluster up` or `scripts/build-platform` builds them).

#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

#[test]
fn stasisd_answers_evictions_against_a_real_apiserver() {
    shell_test::run(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/apiserver-eviction.sh"),
        [env!("CARGO_BIN_EXE_stasisd")],
    );
}
