//! kubectl-stasis against a real kube-apiserver with RBAC (etcd + kube-apiserver from
//! scripts/cluster's cache, no kubelet): `tests/apiserver-kubectl.sh` does the work with the
//! binary cargo built; this test runs it so the integration tier (`cargo test --test '*'`) covers
//! it. Skipped, visibly, when the binaries are not built yet.

#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

#[test]
fn the_plugin_against_a_real_apiserver() {
    shell_test::run(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/apiserver-kubectl.sh"),
        [env!("CARGO_BIN_EXE_kubectl-stasis")],
    );
}
