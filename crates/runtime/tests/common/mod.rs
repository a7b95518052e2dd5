//! What the tests of `stasis-runc` against real runc and CRIU share: the wrapper run the way
//! containerd's runc shim runs it, on a kit [`World`], and a test agent on the node socket.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stasis_node_api::server::TestServer;
use stasis_node_api::{ReportEvent, Request, RequestBody, ResponseBody};
use stasis_testkit::counter::count_of;
use stasis_testkit::{Lines, Requirements, World};

pub const WRAPPER: &str = env!("CARGO_BIN_EXE_stasis-runc");

pub fn ready(test: &str) -> bool {
    Requirements::containers(test).met()
}

/// What these tests add to a [`World`]: the wrapper run the way the shim runs it.
pub trait Wrapper {
    fn wrapper(&self) -> Command;
    fn globals(&self) -> Vec<String>;
    fn log(&self) -> String;
    fn state(&self, id: &str) -> String;
    fn create(
        &mut self,
        bundle: &Path,
        id: &str,
    ) -> (std::process::ExitStatus, mpsc::Receiver<String>);
    fn wrap(&self, args: &[&str]) -> Output;
}

impl Wrapper for World {
    /// The wrapper with this world's settings.
    fn wrapper(&self) -> Command {
        // STASIS_RUNC_UNDER_TEST: another build of the wrapper (e.g. target/release/stasis-runc).
        let mut c =
            Command::new(std::env::var_os("STASIS_RUNC_UNDER_TEST").unwrap_or(WRAPPER.into()));
        c.env("STASIS_RUN_DIR", self.run_dir())
            .env_remove("STASIS_REAL_RUNC")
            .env_remove("STASIS_AGENT_SOCKET")
            .env_remove("STASIS_RUNC_PASSTHROUGH")
            .env("STASIS_FINAL_CHECKPOINT_TIMEOUT_MS", "3000");
        c
    }

    /// `--root R --log L --log-format json`, as the shim passes them.
    fn globals(&self) -> Vec<String> {
        vec![
            "--root".into(),
            self.runc_root.display().to_string(),
            "--log".into(),
            self.path("log.json").display().to_string(),
            "--log-format".into(),
            "json".into(),
        ]
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("log.json")).unwrap_or_default()
    }

    fn state(&self, id: &str) -> String {
        self.runc().state(id).map(|s| s.status).unwrap_or_default()
    }

    /// `stasis-runc <globals> create --bundle B --pid-file P <id>` with stdout on a pipe (as the
    /// shim gives it), returning the exit output and a channel of the container's stdout lines.
    fn create(
        &mut self,
        bundle: &Path,
        id: &str,
    ) -> (std::process::ExitStatus, mpsc::Receiver<String>) {
        self.track(id);
        let mut child = self
            .wrapper()
            .args(self.globals())
            .arg("create")
            .arg("--bundle")
            .arg(bundle)
            .arg("--pid-file")
            .arg(self.path(&format!("{id}.pid")))
            .arg(id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(self.path(&format!("{id}.stderr"))).unwrap())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let st = child.wait().unwrap();
        (st, rx)
    }

    fn wrap(&self, args: &[&str]) -> Output {
        self.wrapper()
            .args(self.globals())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

pub fn text(o: &Output) -> String {
    format!(
        "{}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn next_count(rx: &mpsc::Receiver<String>) -> (u64, String) {
    loop {
        let l = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("no line from the container within 10 s");
        if let Some(c) = count_of(&l) {
            return (c, l);
        }
    }
}

/// A test agent: no plans over the socket, final checkpoints "done", reports recorded.
pub fn agent(path: &Path) -> TestServer {
    TestServer::start(path, |req: &Request| match &req.body {
        RequestBody::Ping => Some(ResponseBody::Pong {
            agent: "test".into(),
        }),
        RequestBody::RestorePlan(_) => Some(ResponseBody::NoPlan {
            reason: "no PodRestore for this pod".into(),
        }),
        RequestBody::FinalCheckpoint(f) => Some(ResponseBody::Done {
            checkpoint_ref: format!("final-of-{}", f.container_id),
            end_with_kill: false,
        }),
        RequestBody::ContainerExited(_) => Some(ResponseBody::NoPlan {
            reason: "test agent".into(),
        }),
        RequestBody::Report(_) => None,
    })
    .unwrap()
}

pub fn reports(srv: &TestServer, n: usize) -> Vec<(String, ReportEvent)> {
    srv.wait_for(n, Duration::from_secs(3))
        .into_iter()
        .filter_map(|r| match r.body {
            RequestBody::Report(r) => Some((r.container_id, r.event)),
            _ => None,
        })
        .collect()
}

/// Waits (10 s at most) until the container has printed `n` lines.
pub fn wait_lines(lines: &Lines, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    while lines.lock().unwrap().len() < n {
        assert!(Instant::now() < until, "the container prints nothing");
        std::thread::sleep(Duration::from_millis(50));
    }
}
