//! One test's world of runc containers.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use stasis_engine::runc::Runc;

use crate::bundle::{self, Overlay};

/// Lines a container printed on stdout, collected as they come.
pub type Lines = Arc<Mutex<Vec<String>>>;

/// Where a world keeps its runc root.
pub enum RuncRoot {
    /// `/run/stasis-test-<name>-<pid>` (on tmpfs, as containerd's is), removed on drop.
    UnderRun,
    /// `runc/` inside the world's temporary directory.
    InWorld,
}

/// One test's world: a temporary directory (bundles, stores, images, a run dir), its own runc
/// root, and every container and overlay it made; containers are force-deleted, overlays
/// unmounted and the runc root removed on drop, also when the test panics.
pub struct World {
    /// The temporary directory.
    pub dir: tempfile::TempDir,
    /// The runc root of this world's containers.
    pub runc_root: PathBuf,
    containers: Vec<String>,
    overlays: Vec<Overlay>,
    remove_root: bool,
}

impl World {
    /// A world named `name` (part of its directory names), its runc root under `/run`.
    pub fn new(name: &str) -> Self {
        Self::with_root(name, RuncRoot::UnderRun)
    }

    /// A world named `name` with its runc root where `root` says.
    pub fn with_root(name: &str, root: RuncRoot) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("stasis-it-{name}-"))
            .tempdir_in("/tmp")
            .expect("a temporary directory in /tmp");
        let (runc_root, remove_root) = match root {
            RuncRoot::UnderRun => (
                PathBuf::from(format!("/run/stasis-test-{name}-{}", std::process::id())),
                true,
            ),
            RuncRoot::InWorld => (dir.path().join("runc"), false),
        };
        Self {
            dir,
            runc_root,
            containers: Vec::new(),
            overlays: Vec::new(),
            remove_root,
        }
    }

    /// `rel` inside the world's directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// The run directory (`STASIS_RUN_DIR` of the agent and the wrapper): `run/`.
    pub fn run_dir(&self) -> PathBuf {
        self.path("run")
    }

    /// The engine's runc client on this world's root.
    pub fn runc(&self) -> Runc {
        Runc::new(Some(&self.runc_root)).expect("runc")
    }

    /// `runc --root <root> args...`, its output.
    pub fn runc_output(&self, args: &[&str]) -> Output {
        Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(args)
            .output()
            .expect("run runc")
    }

    /// The pid of container `id`.
    pub fn pid(&self, id: &str) -> i32 {
        self.runc().state(id).expect("runc state").pid
    }

    /// Deletes container `id` when the world goes.
    pub fn track(&mut self, id: &str) {
        self.containers.push(id.to_owned());
    }

    /// A fresh counter bundle `name` in the world (see [`bundle::make_bundle`]).
    pub fn bundle(&self, name: &str, env: &[&str]) -> PathBuf {
        bundle::make_bundle(&self.path(name), env)
    }

    /// A bundle the way containerd makes one for a pod's container: the rootfs an overlay
    /// mount (the image as the lower layer, unmounted when the world goes), CRI `annotations`,
    /// and the network namespace joined by path (`None`: its own).
    pub fn cri_bundle(
        &mut self,
        name: &str,
        env: &[&str],
        annotations: &serde_json::Value,
        netns: Option<&Path>,
    ) -> PathBuf {
        let b = self.bundle(name, env);
        self.overlays.push(Overlay::over(&b));
        bundle::join_netns(&b, netns);
        bundle::annotate(&b, annotations);
        b
    }

    /// `runc run -d` with stdout and stderr on pipes (as a shim gives them); the stdout lines
    /// collect in the returned [`Lines`]. The container is deleted when the world goes.
    pub fn run_piped(&mut self, bundle: &Path, id: &str) -> Lines {
        self.track(id);
        let mut child = Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(["run", "-d", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run runc");
        let lines: Lines = Arc::default();
        let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let collected = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                collected.lock().unwrap().push(l);
            }
        });
        std::thread::spawn(move || for _ in BufReader::new(err).lines().map_while(Result::ok) {});
        let st = child.wait().expect("wait for runc run");
        assert!(st.success(), "runc run {id}: {st}");
        lines
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for id in self.containers.iter().rev() {
            let _ = self.runc_output(&["delete", "--force", id]);
        }
        // (the overlays unmount as they drop, after the containers that used them are gone)
        self.overlays.clear();
        if self.remove_root {
            let _ = std::fs::remove_dir_all(&self.runc_root);
        }
    }
}
