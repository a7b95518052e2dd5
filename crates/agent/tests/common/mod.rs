//! The agent's integration-test kit: the workspace's (`stasis_testkit`: what a test needs of
//! the machine, one test's [`World`], bundles, the counter's output) and what only the agent's
//! tests add: the `stasis-runc` under test, a pod's bundle, an executor over a `file://` store,
//! runtimes.
#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use std::collections::BTreeMap;

use stasis_agent::executor::{
    CheckpointJob, CheckpointOutcome, Executor, ExecutorConfig, PrepareJob, StaticKey, Target,
};
use stasis_agent::fence::{self, Verdict};
use stasis_agent::metrics::Metrics;
use stasis_agent::node::{Agent, Busy, Standalone};
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

/// The final checkpoint (`Termination`, the container stopped) of container `id`, the app of
/// pod `default/<pod_name>` (uid `pod_uid`), taken as an agent outside a cluster takes it.
pub fn checkpoint_stopped(
    exec: &Executor,
    id: &str,
    pod_name: &str,
    pod_uid: &str,
) -> CheckpointOutcome {
    let lineage = stasis_core::WorkloadName::new(format!("default_pod_{pod_name}")).unwrap();
    exec.checkpoint(
        &CheckpointJob {
            target: Target::ContainerId(id.into()),
            namespace: "default".into(),
            pod_name: pod_name.into(),
            stamp: fence::standalone_stamp(&lineage, "default", pod_uid),
            spec_hash: None,
            declared: BTreeMap::new(),
            reason: "Termination".into(),
            leave_running: false,
            deadline: None,
            on_captured: None,
            expected: Vec::new(),
            hold: None,
            upload_stop: None,
            ahead_of_stop: false,
        },
        &|| Verdict::NoRecord,
    )
    .expect("checkpoint")
}

/// The final-checkpoint request a stopping container's runtime sends for container `id`: 30 s
/// to answer, answered after the upload, not held. Tests change the fields they need.
pub fn stop_request(id: &str) -> stasis_node_api::FinalCheckpointRequest {
    stasis_node_api::FinalCheckpointRequest {
        container_id: id.into(),
        pod: stasis_node_api::PodRef::default(),
        deadline_ms: 30_000,
        answer_when_captured: false,
        hold_until_stopped: false,
    }
}

/// The preparation of checkpoint `reference` for the app container of pod `pod_uid`, whose
/// bundle `b` carries the image digest the checkpoint recorded.
pub fn prepare_job(reference: &str, pod_uid: &str, b: &Path) -> PrepareJob {
    PrepareJob {
        reference: reference.parse().unwrap(),
        namespace: "default".into(),
        pod_uid: pod_uid.into(),
        container_name: None,
        layout: None,
        spec_hash: None,
        image_digest: stasis_engine::restore::bundle_image_digest(b).unwrap(),
        declared: BTreeMap::new(),
        manifest_digest: None,
    }
}

/// An executor on the world's runc root, over a `file://` store in it.
pub fn executor(w: &World, rt: &tokio::runtime::Runtime) -> Arc<Executor> {
    let store = Store::open(&format!("file://{}", w.path("store").display())).unwrap();
    executor_on(w, rt, store, Key::random())
}

/// An executor on the world's runc root, over `store` with the data key `key`.
pub fn executor_on(
    w: &World,
    rt: &tokio::runtime::Runtime,
    store: Store,
    key: Key,
) -> Arc<Executor> {
    executor_with_images(w, rt, store, key, w.path("images"))
}

/// [`executor_on`], its restores staged under `images_dir`.
pub fn executor_with_images(
    w: &World,
    rt: &tokio::runtime::Runtime,
    store: Store,
    key: Key,
    images_dir: PathBuf,
) -> Arc<Executor> {
    executor_in(w.dir.path(), &w.runc_root, rt, store, key, images_dir)
}

/// [`executor_with_images`] on the directories of the world in `dir` whose runc root is
/// `runc_root` (from another process than the world's).
pub fn executor_in(
    dir: &Path,
    runc_root: &Path,
    rt: &tokio::runtime::Runtime,
    store: Store,
    key: Key,
    images_dir: PathBuf,
) -> Arc<Executor> {
    Arc::new(Executor::new(
        ExecutorConfig {
            runc_root: runc_root.to_path_buf(),
            work_dir: dir.join("work"),
            images_dir,
            plans_dir: dir.join("run/plans"),
            node_name: "test-node".into(),
            plan_ttl: Duration::from_secs(600),
            tcp_established: true,
            keep_latest: true,
        },
        Arc::new(store),
        Arc::new(StaticKey(key)),
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

/// The shim's calls through `stasis-runc` for container `id` of `bundle`: `create` (a restore
/// when a plan is there for it), then `start`; the container's stdout lines. Panics with runc's
/// log when either fails.
pub fn wrapper_create_start(w: &mut World, bundle: &Path, id: &str) -> mpsc::Receiver<String> {
    let rx = wrapper_create(w, bundle, id);
    let st = wrapper(w, &["start", id]);
    assert!(st.success(), "start");
    rx
}

/// The shim's `create` through `stasis-runc` alone (a restore when a plan is there for it):
/// the container's stdout lines. Panics with runc's log when it fails.
pub fn wrapper_create(w: &mut World, bundle: &Path, id: &str) -> mpsc::Receiver<String> {
    w.track(id);
    let mut child = wrapper_command(w)
        .arg("create")
        .arg("--bundle")
        .arg(bundle)
        .arg("--pid-file")
        .arg(w.path(&format!("{id}.pid")))
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(w.path(&format!("{id}.stderr"))).unwrap())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let st = child.wait().unwrap();
    assert!(
        st.success(),
        "create: {st}; log: {}",
        std::fs::read_to_string(w.path("log.json")).unwrap_or_default()
    );
    rx
}

/// Another of the shim's calls through `stasis-runc` (`start ID`, `delete --force ID`).
pub fn wrapper(w: &World, args: &[&str]) -> std::process::ExitStatus {
    wrapper_command(w).args(args).status().unwrap()
}

/// `stasis-runc` with the shim's global flags, on the world's run directory and runc root.
/// Set in a test's process: the real runc of the `stasis-runc` it runs (otherwise runc on
/// `PATH`).
pub const WRAPPER_REAL_RUNC_ENV: &str = "STASIS_IT_WRAPPER_REAL_RUNC";

fn wrapper_command(w: &World) -> Command {
    let mut c = Command::new(wrapper_binary().unwrap());
    match std::env::var_os(WRAPPER_REAL_RUNC_ENV) {
        Some(r) => c.env("STASIS_REAL_RUNC", r),
        None => c.env_remove("STASIS_REAL_RUNC"),
    };
    c.env("STASIS_RUN_DIR", w.run_dir())
        .env_remove("STASIS_AGENT_SOCKET")
        .env_remove("STASIS_RUNC_PASSTHROUGH")
        .arg("--root")
        .arg(&w.runc_root)
        .arg("--log")
        .arg(w.path("log.json"))
        .args(["--log-format", "json"]);
    c
}

/// Waits, at most `secs`, until `f` holds (polling every 50 ms).
pub fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asks the counter of container `id` (started by [`wrapper_create_start`]) to check all of its
/// state (SIGUSR1; its answer on its stderr, the file `create` was given): it must be intact.
pub fn assert_full_check(w: &World, id: &str) {
    let pid = w.pid(id);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGUSR1).unwrap();
    let stderr = w.path(&format!("{id}.stderr"));
    let full_check = || {
        std::fs::read_to_string(&stderr)
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains("full-check"))
            .map(str::to_owned)
    };
    wait_for("the full check", 30, || full_check().is_some());
    let check = full_check().unwrap();
    assert!(check.ends_with("state=ok"), "{id}: {check}");
}

/// The first count a (restored) container prints, which must say `state=ok`.
pub fn first_count(rx: &mpsc::Receiver<String>) -> u64 {
    loop {
        let l = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("no line from the restored container");
        if let Some(c) = count_of(&l) {
            assert!(l.contains("state=ok"), "{l}");
            return c;
        }
    }
}

/// The agent's node-api server (standalone cluster) on `<run dir>/agent.sock`, where
/// `stasis-runc` reaches it.
pub struct AgentServer {
    pub sock: PathBuf,
    server: Option<stasis_agent::server::Server>,
}

impl AgentServer {
    pub fn start(w: &World, exec: &Arc<Executor>) -> Self {
        Self::start_at(w.run_dir().join("agent.sock"), exec)
    }

    /// The server on `sock`.
    pub fn start_at(sock: PathBuf, exec: &Arc<Executor>) -> Self {
        let listener = stasis_node_api::server::bind(&sock).unwrap();
        let agent = Arc::new(Agent {
            exec: exec.clone(),
            cluster: Arc::new(Standalone),
            busy: Arc::new(Busy::default()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let server = stasis_agent::server::serve(listener, agent, stop).unwrap();
        Self {
            sock,
            server: Some(server),
        }
    }
}

impl Drop for AgentServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}
