//! `stasis advise` hands its arguments to the kubectl plugin found on PATH, or says where to get
//! it. The plugin here is a stand-in script that records its arguments and exits 3 (the real
//! plugin's advice is tested against a real API server in crates/kubectl/tests).

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const STASIS: &str = env!("CARGO_BIN_EXE_stasis");

#[test]
fn advise_runs_the_kubectl_plugin_with_its_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("kubectl-stasis");
    let record = dir.path().join("args");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\nexit 3\n",
            record.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    println!("(kubectl-stasis is a stand-in script here: it records its arguments)");
    let out = Command::new(STASIS)
        .args(["advise", "-n", "prod", "-o", "yaml"])
        .env("PATH", format!("{}:/usr/bin:/bin", dir.path().display()))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "the plugin's exit status: {out:?}"
    );
    let args = std::fs::read_to_string(&record).unwrap();
    assert_eq!(
        args, "advise\n-n\nprod\n-o\nyaml\n",
        "passed through as given"
    );
}

#[test]
fn advise_without_the_plugin_says_where_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(STASIS)
        .args(["advise", "-A"])
        .env("PATH", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("kubectl-stasis is not on PATH"), "{err}");
    assert!(err.contains("kubectl stasis advise"), "{err}");
}
