//! The committed CRDs against a real kube-apiserver (etcd + kube-apiserver from scripts/cluster's
//! cache, no kubelet): `tests/apiserver-crds.sh` does the work; this test runs it so the
//! integration tier (`cargo test --test '*'`) covers it. Skipped, visibly, when the binaries are
//! not built yet.

use std::process::Command;

#[test]
fn crds_against_a_real_apiserver() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/apiserver-crds.sh");
    let out = Command::new("bash")
        .arg(script)
        .output()
        .expect("run tests/apiserver-crds.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    match out.status.code() {
        Some(0) => {}
        // CI builds the platform first (make integration): a skip there hides a broken setup.
        Some(77) if std::env::var_os("CI").is_none() => eprintln!("skipped: {}", stdout.trim()),
        other => panic!("apiserver-crds.sh failed ({other:?}):\n{stdout}\n{stderr}"),
    }
}
