//! What the safety tests share: restores into a given bundle, what a failure may leave behind
//! (mounts, scratch directories), and containers the tests start themselves.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Run, World};

pub fn restore_into(w: &World, bundle: &Path, id: &str, extra: &[&str]) -> Run {
    let mut args = vec![
        "restore",
        "counter/latest",
        "--bundle",
        bundle.to_str().unwrap(),
        "--container-id",
        id,
    ];
    args.extend_from_slice(extra);
    w.stasis(&args)
}

/// Mount points at or under `dir` (host mount namespace).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
        .filter(|m| Path::new(m).starts_with(dir))
        .collect()
}

/// Entries of the work directory that are stasis scratch directories (`checkpoint-*`,
/// `restore-*`): left behind, they hold plaintext images.
pub fn scratch_left(w: &World) -> Vec<String> {
    std::fs::read_dir(w.path("work"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("checkpoint-") || n.starts_with("restore-"))
                .collect()
        })
        .unwrap_or_default()
}

/// A container started by the test itself (not through `World`), deleted at the end.
pub struct Own<'a>(pub &'a World, pub &'a str);

impl Drop for Own<'_> {
    fn drop(&mut self) {
        self.0.runc_output(&["delete", "--force", self.1]);
    }
}

pub fn run_detached(w: &World, id: &str, bundle: &Path, stdout: Stdio) {
    let st = Command::new("runc")
        .arg("--root")
        .arg(&w.runc_root)
        .args(["run", "--detach", "--bundle"])
        .arg(bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "runc run {id} failed");
}

pub fn wait_running(w: &World, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.status(id).as_deref() != Some("running") {
        assert!(Instant::now() < deadline, "{id} is {:?}", w.status(id));
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn is_live(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let st = s.rsplit(')').next().unwrap_or("").trim_start();
            !st.starts_with('Z') && !st.starts_with('X')
        })
        .unwrap_or(false)
}
