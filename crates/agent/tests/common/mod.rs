//! The agent's integration-test kit, shared by every test file of the crate: what a test
//! needs of the machine ([`ready`]), the `stasis-runc` under test, one test's [`World`] (runc
//! root, bundles, containers removed on drop, an executor over a `file://` store), the counter's
//! output, a runtime.
#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stasis_agent::executor::{Executor, ExecutorConfig, StaticKey};
use stasis_agent::metrics::Metrics;
use stasis_engine::runc::Runc;
use stasis_store::{Key, Store};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// `stasis-runc`: `$STASIS_RUNC_UNDER_TEST`, else next to this test's binary's directory.
pub fn wrapper_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("STASIS_RUNC_UNDER_TEST") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("stasis-runc");
    p.exists().then_some(p)
}

pub fn ready(test: &str) -> bool {
    let is_root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    let rootfs = repo().join("target/images/counter/rootfs/stasis-counter");
    let why = if !is_root {
        Some("not running as root".to_owned())
    } else if let Err(e) = stasis_engine::tools::criu_checked() {
        Some(e.to_string())
    } else if stasis_engine::tools::which("runc").is_none() {
        Some("runc is not installed (scripts/setup)".to_owned())
    } else if !rootfs.exists() {
        Some(format!(
            "{} is missing (scripts/build-counter-image)",
            rootfs.display()
        ))
    } else if wrapper_binary().is_none() {
        Some("stasis-runc is not built (cargo build -p stasis-runtime)".to_owned())
    } else {
        None
    };
    match why {
        None => true,
        Some(w) if std::env::var_os("CI").is_some() => panic!("{test} cannot run in CI: {w}"),
        Some(w) => {
            eprintln!("SKIPPED {test}: needs root, CRIU >= 4.2, runc, the counter image and stasis-runc: {w}");
            false
        }
    }
}

/// One test's world: a temp dir (bundles, store, images, run dir), its own runc root under
/// /run, and every container it made, removed on drop.
pub struct World {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub containers: Vec<String>,
}

impl World {
    pub fn new(name: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("stasis-agent-it-")
            .tempdir_in("/tmp")
            .unwrap();
        let root = PathBuf::from(format!(
            "/run/stasis-agent-test-{name}-{}",
            std::process::id()
        ));
        Self {
            dir,
            root,
            containers: Vec::new(),
        }
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn run_dir(&self) -> PathBuf {
        self.p("run")
    }

    pub fn runc(&self) -> Runc {
        Runc::new(Some(&self.root)).unwrap()
    }

    /// A counter bundle with the CRI annotations containerd gives a pod's app container.
    pub fn cri_bundle(&self, name: &str, env: &[&str], pod_uid: &str, pod_name: &str) -> PathBuf {
        let b = self.p(name);
        let out = Command::new(repo().join("scripts/make-bundle"))
            .arg(&b)
            .args(env)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "make-bundle: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cfg_path = b.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
        for (k, v) in [
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.sandbox-uid", pod_uid),
            ("io.kubernetes.cri.sandbox-namespace", "default"),
            ("io.kubernetes.cri.sandbox-name", pod_name),
            ("io.kubernetes.cri.container-name", "counter"),
        ] {
            cfg["annotations"][k] = serde_json::json!(v);
        }
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        b
    }

    /// `runc run -d` with stdout/stderr on pipes (as a shim gives them); stdout lines collect.
    pub fn run_piped(&mut self, bundle: &Path, id: &str) -> Arc<Mutex<Vec<String>>> {
        self.containers.push(id.to_owned());
        let mut child = Command::new("runc")
            .arg("--root")
            .arg(&self.root)
            .args(["run", "-d", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let l2 = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                l2.lock().unwrap().push(l);
            }
        });
        std::thread::spawn(move || for _ in BufReader::new(err).lines().map_while(Result::ok) {});
        let st = child.wait().unwrap();
        assert!(st.success(), "runc run {id}: {st}");
        lines
    }

    pub fn executor(&self, rt: &tokio::runtime::Runtime) -> Arc<Executor> {
        let store = Store::open(&format!("file://{}", self.p("store").display())).unwrap();
        Arc::new(Executor::new(
            ExecutorConfig {
                runc_root: self.root.clone(),
                work_dir: self.p("work"),
                images_dir: self.p("images"),
                plans_dir: self.run_dir().join("plans"),
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
}

impl Drop for World {
    fn drop(&mut self) {
        let r = self.runc();
        for id in self.containers.iter().rev() {
            let _ = r.delete_force(id);
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

pub fn count_of(line: &str) -> Option<u64> {
    line.strip_prefix("count=")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn last_count(lines: &Mutex<Vec<String>>) -> Option<u64> {
    lines.lock().unwrap().iter().rev().find_map(|l| count_of(l))
}

pub fn wait_counts(lines: &Mutex<Vec<String>>, n: u64) {
    let until = Instant::now() + Duration::from_secs(30);
    while last_count(lines).unwrap_or(0) < n {
        assert!(Instant::now() < until, "the counter does not count");
        std::thread::sleep(Duration::from_millis(50));
    }
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
