//! Runs one of the shell tests against a real kube-apiserver (`tests/lib/apiserver.sh` starts
//! it) from a Rust integration test, so that `cargo test --test '*'` covers it: the script's
//! output is shown, exit 0 passes, exit 77 is a visible skip (the platform's binaries are not
//! built yet) except under `CI`, where the platform is built first and a skip would hide a
//! broken setup; anything else fails with the output. Included by each crate's runner with
//! `#[path = "../../../tests/lib/shell_test.rs"] mod shell_test;`.

use std::ffi::OsStr;
use std::process::Command;

/// Runs `bash <script> <args...>` as described above.
pub fn run<I, S>(script: &str, args: I)
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let name = std::path::Path::new(script)
        .file_name()
        .map_or_else(|| script.to_owned(), |n| n.to_string_lossy().into_owned());
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    match out.status.code() {
        Some(0) => {}
        Some(77) if std::env::var_os("CI").is_none() => eprintln!("skipped: {}", stdout.trim()),
        other => panic!("{name} failed ({other:?}):\n{stdout}\n{stderr}"),
    }
}
