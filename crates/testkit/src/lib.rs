//! The integration tests' kit: what every test against real CRIU, runc and the counter
//! workload needs, in one place.
//!
//! - [`Requirements`]: whether root, CRIU, runc, the counter image and the binaries under test
//!   are here; a test that cannot run prints why (`SKIPPED ...`), and fails instead when `CI`
//!   is set, so a broken CI machine never passes by skipping.
//! - [`World`]: a temporary directory, a runc root, and every container and overlay mount a test
//!   made, all removed on drop.
//! - [`bundle`]: counter bundles from `scripts/make-bundle`, shaped the way containerd shapes a
//!   pod's (an overlay rootfs, CRI annotations, a network namespace joined by path).
//! - [`counter`]: reading the counter workload's `count=<n> state=ok` lines.
//! - [`net`]: a TCP port for a server the test starts, which the kernel does not hand out to
//!   anyone else meanwhile; a line from such a server; a container's network namespace.
//! - [`s3`]: a real S3-compatible server (s3s-fs) on such a port.
//!
//! [`Requirements`] and [`World`] need the engine (its runc and CRIU checks): feature
//! `containers`, on by default. The store's tests take the kit without it, since the engine
//! depends on the store.

pub mod bundle;
pub mod counter;
pub mod net;
#[cfg(feature = "containers")]
mod ready;
pub mod s3;
#[cfg(feature = "containers")]
mod world;

pub use bundle::Overlay;
pub use net::free_port;
#[cfg(feature = "containers")]
pub use ready::Requirements;
#[cfg(feature = "containers")]
pub use world::{Lines, RuncRoot, World};

use std::path::{Path, PathBuf};

/// The repository's root directory.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// The rootfs of the counter image (`scripts/build-counter-image`).
pub fn counter_rootfs() -> PathBuf {
    repo().join("target/images/counter/rootfs")
}

/// A binary of the workspace under test that the test's own crate does not build:
/// `$<env_var>` when set, else `<name>` in the target directory the test binary runs from
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`).
pub fn workspace_binary(name: &str, env_var: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join(name);
    p.exists().then_some(p)
}

/// What a test that cannot run here does: under `CI` it panics (a CI machine must run every
/// test), else it prints `SKIPPED <test>: needs <needs>: <why>` and the test returns.
pub fn cannot_run(test: &str, needs: &str, why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{test} cannot run in CI: {why}");
    }
    eprintln!("SKIPPED {test}: needs {needs}: {why}");
}
