//! The chart's ValidatingAdmissionPolicies against a real kube-apiserver with RBAC:
//! `tests/admission-policy.sh` does the work (etcd + kube-apiserver from scripts/build-platform's
//! cache, `kubectl --as`); this test runs it so the integration tier covers it. Skipped,
//! visibly, when the binaries are not built yet.

#[path = "../../../tests/lib/shell_test.rs"]
mod shell_test;

#[test]
fn admission_policies_against_a_real_apiserver() {
    shell_test::run(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/admission-policy.sh"),
        [env!("CARGO_BIN_EXE_stasis-controller")],
    );
}

/// The policy exempts exactly the built-in controllers the webhook trusts
/// (`stasis_core::decision::WORKLOAD_CONTROLLERS`): one list, kept equal.
#[test]
fn the_policy_names_the_workload_controllers_the_webhook_trusts() {
    let vap = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/helm/stasis/templates/vap.yaml"
    ))
    .expect("read the chart's vap.yaml");
    let mut expected: Vec<String> = stasis_core::decision::WORKLOAD_CONTROLLERS
        .iter()
        .map(|(_, sa)| format!("'system:serviceaccount:kube-system:{sa}'"))
        .collect();
    expected.push(format!(
        "'{}'",
        stasis_core::decision::CONTROLLER_MANAGER_USER
    ));
    for user in &expected {
        assert!(vap.contains(user.as_str()), "vap.yaml lacks {user}");
    }
    let named = vap.matches("'system:serviceaccount:kube-system:").count();
    assert_eq!(
        named,
        stasis_core::decision::WORKLOAD_CONTROLLERS.len(),
        "vap.yaml names other kube-system accounts"
    );
}
