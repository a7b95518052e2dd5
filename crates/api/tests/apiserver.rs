//! The committed CRDs against a real kube-apiserver (etcd + kube-apiserver from scripts/cluster's
//! cache, no kubelet): `tests/apiserver-crds.sh` does the work; this test runs it so the
//! integration tier (`cargo test --test '*'`) covers it. Skipped, visibly, when the binaries are
//! not built yet.

#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

#[test]
fn crds_against_a_real_apiserver() {
    shell_test::run(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/apiserver-crds.sh"),
        std::iter::empty::<&str>(),
    );
}
