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

/// `stasis ARGS` with a PATH that has no plugin: exit 1 and the pointer to it.
fn without_plugin(args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(STASIS)
        .args(args)
        .env("PATH", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("kubectl-stasis is not on PATH"), "{err}");
    assert!(err.contains("kubectl stasis advise"), "{err}");
}

#[test]
fn advise_without_the_plugin_says_where_to_get_it() {
    without_plugin(&["advise", "-A"]);
}

#[test]
fn advise_is_listed_in_the_help_and_global_flags_before_it_still_forward() {
    let out = Command::new(STASIS).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.lines().any(|l| l.trim_start().starts_with("advise ")),
        "{help}"
    );
    // `stasis -q advise ...` is parsed (not handed over first) and still runs the plugin
    without_plugin(&["-q", "advise", "-n", "x"]);
}
