//! The agent's integration-test kit: the workspace's (`stasis_testkit`: what a test needs of
//! the machine, one test's [`World`], bundles, the counter's output) and what only the agent's
//! tests add: the `stasis-runc` under test, a pod's bundle, an executor over a `file://` store,
//! runtimes.
#![allow(dead_code)] // each test file uses part of it

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use stasis_agent::executor::{Executor, ExecutorConfig, StaticKey};
use stasis_agent::metrics::Metrics;
use stasis_store::{Key, Store};
use stasis_testkit::{bundle, workspace_binary, Requirements};

// (each test file uses part of it)
#[allow(unused_imports)]
pub use stasis_testkit::counter::{count_of, last_count, wait_counts};
pub use stasis_testkit::World;

/// `stasis-runc`: `$STASIS_RUNC_UNDER_TEST`, else next to this test's binary's directory.
pub fn wrapper_binary() -> Option<PathBuf> {
    workspace_binary("stasis-runc", "STASIS_RUNC_UNDER_TEST")
}

/// Root, CRIU, runc, the counter image and `stasis-runc`; prints why not (fails in CI).
pub fn ready(test: &str) -> bool {
    Requirements::containers(test)
        .binary(
            "stasis-runc",
            wrapper_binary().as_deref(),
            "cargo build -p stasis-runtime",
        )
        .met()
}

/// A counter bundle (host network) with the CRI annotations containerd gives the app container
/// `counter` of pod `pod_name` in namespace `default`.
pub fn pod_bundle(w: &World, name: &str, env: &[&str], pod_uid: &str, pod_name: &str) -> PathBuf {
    let b = w.bundle(name, env);
    bundle::annotate(&b, &bundle::cri_app_annotations(pod_uid, pod_name));
    b
}

/// An executor on the world's runc root, over a `file://` store in it.
pub fn executor(w: &World, rt: &tokio::runtime::Runtime) -> Arc<Executor> {
    let store = Store::open(&format!("file://{}", w.path("store").display())).unwrap();
    Arc::new(Executor::new(
        ExecutorConfig {
            runc_root: w.runc_root.clone(),
            work_dir: w.path("work"),
            images_dir: w.path("images"),
            plans_dir: w.run_dir().join("plans"),
            node_name: "test-node".into(),
            plan_ttl: Duration::from_secs(600),
            tcp_established: true,
            keep_latest: true,
        },
        Arc::new(store),
        Arc::new(StaticKey(Key::random())),
        rt.handle().clone(),
        Arc::new(Metrics::default()),
    ))
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A single-threaded runtime (the metadata clients' tests).
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
