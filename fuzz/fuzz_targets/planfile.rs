//! Plan files and the verified stamp, read by the runtime wrapper through the real entry points
//! (`planfile::read`, `read_verified_stamp`: size limit, JSON, version) from a private directory;
//! and the plan-file names built from untrusted pod fields (`path_for_pod`, `path_for_container`).
#![no_main]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stasis_node_api::planfile;

fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
        let d = base.join(format!("stasis-fuzz-planfile-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch directory");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    let plan = d.join("plan.json");
    std::fs::write(&plan, data).expect("write plan");
    if let Ok(Some(p)) = planfile::read(&plan) {
        assert_eq!(p.v, stasis_node_api::PROTOCOL_VERSION);
    }
    std::fs::write(d.join(planfile::VERIFIED_STAMP), data).expect("write stamp");
    let _ = planfile::read_verified_stamp(d);

    let (a, b) = stasis_fuzz::split2(data);
    let (a, b) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    for p in [
        planfile::path_for_container(d, &a),
        planfile::path_for_pod(d, &a, &b),
    ]
    .into_iter()
    .flatten()
    {
        // A name built from pod fields stays a plain file in the plans directory.
        assert_eq!(p.parent(), Some(d), "{p:?}");
    }
});
