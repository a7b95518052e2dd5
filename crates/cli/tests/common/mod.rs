//! Shared harness of the CLI's integration tests: real runc containers of the `stasis-counter`
//! image, a real CRIU, a `file://` store in a temporary directory, and the `stasis` binary.
//!
//! Needs root, CRIU >= 4.2, runc and the counter image (`make test` provides all of them via
//! `scripts/setup` and `scripts/build-counter-image`). Without them a test prints why it did not
//! run; in CI (`CI` set) that is a failure instead.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

// (each test binary includes this module and uses some of it)
#[allow(unused_imports)]
pub use stasis_testkit::net::{ask_line, ask_line_in, free_port, in_netns, loopback_up};
#[allow(unused_imports)]
pub use stasis_testkit::{bundle, bundle::edit_config, counter::count_of, repo, Overlay};
use stasis_testkit::{Requirements, RuncRoot};

pub mod safety;

pub const STASIS: &str = env!("CARGO_BIN_EXE_stasis");

/// Whether the real tools are here; prints the reason (and fails in CI) when not.
pub fn ready(test: &str) -> bool {
    Requirements::containers(test).met()
}

/// One test's world (the kit's [`stasis_testkit::World`], its runc root inside it) with a
/// store, a key and a work dir for `stasis`.
pub struct World {
    base: stasis_testkit::World,
    pub store: String,
    pub key: PathBuf,
    /// Extra environment for `stasis` (e.g. S3 credentials).
    pub env: Vec<(String, String)>,
}

impl Deref for World {
    type Target = stasis_testkit::World;
    fn deref(&self) -> &Self::Target {
        &self.base
    }
}

impl DerefMut for World {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.base
    }
}

impl World {
    pub fn new() -> Self {
        let base = stasis_testkit::World::with_root("cli", RuncRoot::InWorld);
        let store = format!("file://{}", base.path("store").display());
        let key = base.path("key");
        let w = Self {
            base,
            store,
            key,
            env: Vec::new(),
        };
        w.stasis(&["key", "generate", w.key.to_str().unwrap()]).ok();
        // The store exists (readers never create one).
        std::fs::create_dir_all(w.path("store")).unwrap();
        w
    }

    /// Runs `stasis` with this world's store, key, runc root and work dir.
    pub fn stasis(&self, args: &[&str]) -> Run {
        Run(self.command(args).output().unwrap())
    }

    /// The `stasis` command [`World::stasis`] runs, to spawn it instead.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(STASIS);
        c.args(args)
            .env("STASIS_STORE", &self.store)
            .env("STASIS_KEY_FILE", &self.key)
            .env("STASIS_RUNC_ROOT", &self.runc_root)
            .env("STASIS_WORK_DIR", self.path("work"))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        c
    }

    /// Starts a counter container; its stdout is read by a thread into `<id>.log`.
    pub fn start(&mut self, id: &str, env: &[&str]) -> Container {
        let bundle = self.bundle(&format!("bundle-{id}"), env);
        self.start_bundle(id, &bundle)
    }

    /// Starts a container from an existing bundle.
    pub fn start_bundle(&mut self, id: &str, bundle: &Path) -> Container {
        let bundle = bundle.to_path_buf();
        let log = self.path(&format!("{id}.log"));
        let mut child = Command::new("runc")
            .arg("--root")
            .arg(&self.runc_root)
            .args(["run", "--detach", "--bundle"])
            .arg(&bundle)
            .arg(id)
            .stdin(Stdio::null())
            // Both through pipes, as containerd's shim does: CRIU cannot dump a container whose
            // stdio is a file of the host's filesystem (in CI the harness's stderr is a file).
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        copy_to_file(child.stdout.take().unwrap(), log.clone());
        copy_to_file(
            child.stderr.take().unwrap(),
            self.path(&format!("{id}.stderr")),
        );
        assert!(child.wait().unwrap().success(), "runc run failed");
        self.track(id);
        let c = Container {
            id: id.to_owned(),
            log,
            bundle,
        };
        c.wait_count(3);
        c
    }

    /// Restores `reference` into a new container from a fresh bundle.
    pub fn restore(
        &mut self,
        reference: &str,
        id: &str,
        env: &[&str],
        extra: &[&str],
    ) -> (Run, Container) {
        let bundle = self.bundle(&format!("bundle-{id}"), env);
        self.restore_into(reference, id, bundle, extra)
    }

    /// Restores `reference` into a new container `id` from the fresh bundle `bundle`.
    pub fn restore_into(
        &mut self,
        reference: &str,
        id: &str,
        bundle: PathBuf,
        extra: &[&str],
    ) -> (Run, Container) {
        let log = self.path(&format!("{id}.log"));
        let mut args = vec![
            "restore",
            reference,
            "--bundle",
            bundle.to_str().unwrap(),
            "--container-id",
            id,
            "--log",
            log.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let run = self.stasis(&args);
        self.track(id);
        (
            run,
            Container {
                id: id.to_owned(),
                log,
                bundle,
            },
        )
    }

    pub fn status(&self, id: &str) -> Option<String> {
        let out = self.runc_output(&["state", id]);
        if !out.status.success() {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        v["status"].as_str().map(str::to_owned)
    }

    pub fn kill(&self, id: &str) {
        self.runc_output(&["kill", id, "KILL"]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.status(id).as_deref() == Some("running") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.runc_output(&["delete", "--force", id]);
    }
}

/// Copies everything read from `pipe` into a new file at `path`, on a thread.
fn copy_to_file(mut pipe: impl Read + Send + 'static, path: PathBuf) {
    std::thread::spawn(move || {
        let mut f = std::fs::File::create(&path).unwrap();
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            let _ = f.write_all(&buf[..n]);
        }
    });
}

pub struct Container {
    pub id: String,
    pub log: PathBuf,
    pub bundle: PathBuf,
}

impl Container {
    pub fn lines(&self) -> Vec<String> {
        std::fs::File::open(&self.log)
            .map(|f| BufReader::new(f).lines().map_while(Result::ok).collect())
            .unwrap_or_default()
    }

    /// Counts printed so far, in order.
    pub fn counts(&self) -> Vec<u64> {
        stasis_testkit::counter::counts(&self.lines())
    }

    pub fn last_count(&self) -> u64 {
        self.counts().last().copied().unwrap_or(0)
    }

    pub fn corrupt(&self) -> bool {
        self.lines().iter().any(|l| l.contains("state=CORRUPT"))
    }

    /// Waits until the counter has printed at least `n` more lines than now.
    pub fn wait_count(&self, n: usize) {
        let start = self.counts().len();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.counts().len() < start + n {
            assert!(
                Instant::now() < deadline,
                "{} printed no new counts; log: {:?}",
                self.id,
                self.lines()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A finished `stasis` run.
pub struct Run(pub Output);

impl Run {
    pub fn ok(&self) -> bool {
        self.0.status.success()
    }
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.0.stdout).trim().to_owned()
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.0.stderr).into_owned()
    }
    /// Asserts success and returns stdout.
    pub fn expect_ok(&self, what: &str) -> String {
        assert!(
            self.ok(),
            "{what} failed: {}\n{}",
            self.stderr(),
            self.stdout()
        );
        self.stdout()
    }
    /// Asserts failure and returns stderr.
    pub fn expect_err(&self, what: &str) -> String {
        assert!(
            !self.ok(),
            "{what} unexpectedly succeeded: {}",
            self.stdout()
        );
        self.stderr()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.0.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout()))
    }
}

/// `stasis checkpoint container <id> --workload counter <extra>`.
pub fn checkpoint(w: &World, id: &str, extra: &[&str]) -> Run {
    checkpoint_as(w, "counter", id, extra)
}

/// `stasis checkpoint container <id> --workload <workload> <extra>`.
pub fn checkpoint_as(w: &World, workload: &str, id: &str, extra: &[&str]) -> Run {
    let mut args = vec!["checkpoint", "container", id, "--workload", workload];
    args.extend_from_slice(extra);
    w.stasis(&args)
}

/// Every file below `dir` (none when it does not exist).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// The kit's overlay rootfs over a counter bundle, its "image" with a directory with content
/// (`olddir/old-file`), to be replaced by an opaque one.
pub fn image_overlay(bundle: &Path) -> Overlay {
    Overlay::over_with(bundle, |lower| {
        std::fs::create_dir_all(lower.join("olddir")).unwrap();
        std::fs::write(lower.join("olddir/old-file"), "from the image").unwrap();
    })
}

pub fn xattr(path: &std::path::Path, name: &str) -> Option<String> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())",
        ])
        .arg(path)
        .arg(name)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Filesystem changes a workload makes, through `root` (the view the container has): a new
/// file `data/new.txt`, `etc/passwd` deleted (a whiteout on an overlay), `olddir` removed and
/// made again with one file (an opaque directory).
pub fn change_rootfs(root: &Path) {
    std::fs::create_dir_all(root.join("data")).unwrap();
    std::fs::write(root.join("data/new.txt"), "written by the workload").unwrap();
    std::fs::remove_file(root.join("etc/passwd")).unwrap();
    std::fs::remove_dir_all(root.join("olddir")).unwrap();
    std::fs::create_dir(root.join("olddir")).unwrap();
    std::fs::write(root.join("olddir/only-this"), "x").unwrap();
}

/// The changes of [`change_rootfs`] are there in the restored container's `root`.
pub fn assert_rootfs_changes(root: &Path) {
    assert_eq!(
        std::fs::read_to_string(root.join("data/new.txt")).unwrap(),
        "written by the workload"
    );
    assert!(
        !root.join("etc/passwd").exists(),
        "a deleted file came back"
    );
    let entries: Vec<_> = std::fs::read_dir(root.join("olddir"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        entries,
        vec![std::ffi::OsString::from("only-this")],
        "opaque directory not honoured"
    );
}
