//! What the fuzz targets and the seed generator share: the fixed key and checkpoint a manifest
//! envelope is opened for, so that seeds made by the real store pass the MAC and the fuzzer
//! reaches the manifest parser behind it.

use stasis_core::{CheckpointId, WorkloadName};
use stasis_store::Key;

/// The key seeds are written with and targets open with (a fixed test key, not a secret).
pub fn key() -> Key {
    Key::from_secret(&[7u8; 32])
}

/// The checkpoint the seed manifest describes.
pub fn checkpoint() -> (WorkloadName, CheckpointId) {
    (
        WorkloadName::new("fuzz").expect("valid workload name"),
        CheckpointId::from_parts(1_795_000_000_000, 7),
    )
}

/// Splits an input at the first 0xff byte (never in UTF-8): lets one input carry two fields.
pub fn split2(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// A scratch directory `stasis-fuzz-<name>-<pid>` for targets that write files, made after
/// dropping root to uid/gid 65534 (fuzz/run.sh gives such targets their directories): a
/// confinement bug found by fuzzing must not be able to touch the machine's files.
pub fn unprivileged_scratch(name: &str) -> &'static std::path::Path {
    use std::path::PathBuf;
    use std::sync::OnceLock;
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // SAFETY: plain syscalls before any other thread of ours touches credentials.
        unsafe {
            if libc::geteuid() == 0 {
                assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
                assert_eq!(libc::setgid(65534), 0, "setgid");
                assert_eq!(libc::setuid(65534), 0, "setuid");
            }
        }
        let base =
            std::env::var_os("STASIS_FUZZ_SCRATCH").map_or_else(std::env::temp_dir, PathBuf::from);
        let d = base.join(format!("stasis-fuzz-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch directory");
        d
    })
}

/// A fresh directory under `base` for each input: what one input leaves behind (modes,
/// names) never becomes the next one's problem.
pub fn fresh_dir(base: &std::path::Path) -> std::path::PathBuf {
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    base.join(format!(
        "run-{}",
        RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ))
}
