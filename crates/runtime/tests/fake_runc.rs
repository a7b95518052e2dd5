//! `stasis-runc` against a stand-in runc (a shell script that records its pid and arguments):
//! what the wrapper passes through, in which order it calls runc, and how long it can hold a
//! stop — without root, CRIU or containers. `runc.rs` runs the same paths with the real ones.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stasis_node_api::planfile::{self, PlanFile};
use stasis_node_api::server::TestServer;
use stasis_node_api::{
    ColdStartCause, Plan, ReportEvent, Request, RequestBody, ResponseBody, RootfsMethod,
    PROTOCOL_VERSION,
};

const WRAPPER: &str = env!("CARGO_BIN_EXE_stasis-runc");

/// Records `pid|arg1|arg2|...` per call; `restore` exits with `$FAKE_RESTORE_RC` (leaving two
/// mounts in its work path with `$FAKE_RESTORE_YARD`), everything else prints a line on stdout
/// and exits with `$FAKE_RC`.
const FAKE_RUNC: &str = r#"#!/bin/sh
(IFS='|'; echo "$$|$*") >> "$FAKE_RUNC_LOG"
restore=0 work=""
for a in "$@"; do
  [ "$prev" = --work-path ] && work=$a
  [ "$a" = restore ] && restore=1
  prev=$a
done
if [ $restore = 1 ]; then
  # as CRIU 4.2 leaves its cgroup yard when a restore fails
  if [ -n "$FAKE_RESTORE_YARD" ]; then
    mkdir -p "$work/.criu.cgyard.t" && mount -t tmpfs yard "$work/.criu.cgyard.t" &&
      mkdir "$work/.criu.cgyard.t/memory" && mount -t tmpfs cg "$work/.criu.cgyard.t/memory"
  fi
  exit "${FAKE_RESTORE_RC:-0}"
fi
echo "fake-runc-stdout"
exit "${FAKE_RC:-0}"
"#;

struct Fake {
    dir: tempfile::TempDir,
}

impl Fake {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let runc = dir.path().join("runc");
        std::fs::write(&runc, FAKE_RUNC).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&runc, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir }
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn run_dir(&self) -> PathBuf {
        self.p("run")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(WRAPPER);
        c.args(args)
            .env("STASIS_REAL_RUNC", self.p("runc"))
            .env("STASIS_RUN_DIR", self.run_dir())
            .env("FAKE_RUNC_LOG", self.p("calls"))
            .env_remove("STASIS_AGENT_SOCKET")
            .env_remove("STASIS_RUNC_PASSTHROUGH")
            .env_remove("STASIS_FINAL_CHECKPOINT_TIMEOUT_MS")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        c
    }

    /// Every runc call so far: (pid, args).
    fn calls(&self) -> Vec<(u32, Vec<String>)> {
        std::fs::read_to_string(self.p("calls"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let mut parts = l.split('|');
                let pid = parts.next().unwrap().parse().unwrap();
                (pid, parts.map(str::to_owned).collect())
            })
            .collect()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.p("log.json")).unwrap_or_default()
    }

    /// A bundle with a plain rootfs and the given annotations.
    fn bundle(&self, name: &str, annotations: serde_json::Value) -> PathBuf {
        let b = self.p(name);
        std::fs::create_dir_all(b.join("rootfs")).unwrap();
        let cfg = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["/app"]},
            "root": {"path": "rootfs"},
            "annotations": annotations,
        });
        std::fs::write(b.join("config.json"), cfg.to_string()).unwrap();
        b
    }

    /// A verified image dir (as the agent leaves it) and a plan file for `key`.
    fn plan(&self, plan_path: &Path, container_id: Option<&str>, checkpoint_ref: &str) -> PathBuf {
        let img = self.p("img");
        std::fs::create_dir_all(img.join("criu")).unwrap();
        std::fs::write(img.join("criu/inventory.img"), "x").unwrap();
        planfile::write_verified_stamp(&img, checkpoint_ref).unwrap();
        planfile::write(
            plan_path,
            &PlanFile {
                v: PROTOCOL_VERSION,
                container_id: container_id.map(str::to_owned),
                pod_uid: None,
                container_name: None,
                plan: Plan {
                    image_dir: img.clone(),
                    rootfs_method: None,
                    checkpoint_ref: checkpoint_ref.into(),
                    tcp_established: true,
                    lazy: false,
                    work_dir: None,
                },
                expires_at_unix_ms: None,
            },
        )
        .unwrap();
        img
    }

    /// A test agent on the run dir's socket, answering with `answer`.
    fn agent(
        &self,
        answer: impl Fn(&Request) -> Option<ResponseBody> + Send + Sync + 'static,
    ) -> TestServer {
        TestServer::start(self.run_dir().join("agent.sock"), answer).unwrap()
    }

    /// [`Fake::globals`] followed by `args`.
    fn with_globals(&self, args: &[&str]) -> Vec<String> {
        let mut all = self.globals();
        all.extend(args.iter().map(|a| a.to_string()));
        all
    }

    fn globals(&self) -> Vec<String> {
        vec![
            "--root".into(),
            "/run/r".into(),
            "--log".into(),
            self.p("log.json").display().to_string(),
            "--log-format".into(),
            "json".into(),
        ]
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn passthrough_is_an_exec_with_the_same_arguments_stdio_and_exit_code() {
    let f = Fake::new();
    let args = [
        "--root=/run/with space",
        "--debug",
        "--systemd-cgroup",
        "exec",
        "--process",
        "/tmp/p.json",
        "--detach",
        "id-1",
    ];
    let child = f
        .cmd(&args)
        .env("FAKE_RC", "3")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3), "runc's exit code");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "fake-runc-stdout\n");
    let calls = f.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, pid, "exec: the same pid");
    assert_eq!(strs(&calls[0].1), args);
    // Every other command likewise.
    for cmd in [
        "state",
        "ps",
        "events",
        "update",
        "pause",
        "resume",
        "checkpoint",
        "features",
    ] {
        let st = f.cmd(&["--root", "/r", cmd, "x"]).status().unwrap();
        assert!(st.success());
        assert_eq!(
            strs(&f.calls().last().unwrap().1),
            ["--root", "/r", cmd, "x"]
        );
    }
}

#[test]
fn sigterm_asks_the_agent_for_a_final_checkpoint_then_forwards() {
    let f = Fake::new();
    let srv = f.agent(|r: &Request| match &r.body {
        RequestBody::FinalCheckpoint(c) => Some(ResponseBody::Done {
            checkpoint_ref: format!("final-{}", c.container_id),
            end_with_kill: false,
        }),
        _ => None,
    });
    let args = f.with_globals(&["kill", "c1", "15"]);
    let st = f.cmd(&strs(&args)).status().unwrap();
    assert!(st.success());
    let reqs = srv.requests();
    assert!(
        matches!(&reqs[..], [Request { body: RequestBody::FinalCheckpoint(c), .. }]
            if c.container_id == "c1" && c.deadline_ms == 20_000),
        "{reqs:?}"
    );
    assert_eq!(f.calls()[0].1, args, "the kill goes through unchanged");
    assert!(f
        .log()
        .contains("final checkpoint of c1 before SIGTERM: final-c1"));

    // Other signals never ask.
    let st = f.cmd(&["kill", "c1", "KILL"]).status().unwrap();
    assert!(st.success());
    let st = f.cmd(&["kill", "--all", "c1", "9"]).status().unwrap();
    assert!(st.success());
    assert_eq!(srv.requests().len(), 1);
    assert_eq!(f.calls().len(), 3);
}

#[test]
fn a_job_pod_ends_with_sigkill_after_its_final_checkpoint() {
    let f = Fake::new();
    let _srv = f.agent(|r: &Request| match &r.body {
        RequestBody::FinalCheckpoint(c) => Some(ResponseBody::Captured {
            checkpoint_ref: format!("final-{}", c.container_id),
            end_with_kill: true,
        }),
        _ => None,
    });
    let args = f.with_globals(&["kill", "c1", "TERM"]);
    let st = f.cmd(&strs(&args)).status().unwrap();
    assert!(st.success());
    let want = f.with_globals(&["kill", "c1", "KILL"]);
    assert_eq!(f.calls()[0].1, want, "the SIGTERM became a SIGKILL");
    assert!(f.log().contains("ends with SIGKILL"), "{}", f.log());
}

#[test]
fn a_late_agent_holds_a_stop_at_most_the_deadline() {
    let f = Fake::new();
    let _srv = f.agent(|_: &Request| {
        std::thread::sleep(Duration::from_secs(5));
        Some(ResponseBody::Done {
            checkpoint_ref: "too late".into(),
            end_with_kill: false,
        })
    });
    let t = Instant::now();
    let st = f
        .cmd(&["--log", f.p("log.json").to_str().unwrap(), "kill", "c1"])
        .env("STASIS_FINAL_CHECKPOINT_TIMEOUT_MS", "300")
        .status()
        .unwrap();
    let took = t.elapsed();
    assert!(st.success());
    assert!(took < Duration::from_millis(2000), "{took:?}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert_eq!(
        strs(&f.calls()[0].1),
        ["--log", f.p("log.json").to_str().unwrap(), "kill", "c1"]
    );
    assert!(f.log().contains("no answer from the agent"), "{}", f.log());
}

#[test]
fn no_agent_costs_a_stop_nothing() {
    let f = Fake::new();
    let t = Instant::now();
    let st = f.cmd(&["kill", "c1", "TERM"]).status().unwrap();
    assert!(st.success());
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(strs(&f.calls()[0].1), ["kill", "c1", "TERM"]);
}

/// A failed restore can leave CRIU's cgroup yard mounted in its work dir, on the host: the
/// wrapper, in that mount namespace, unmounts it (the agent, in another, could not remove the
/// dir). Mounting needs root: without it the test says so and checks nothing.
#[test]
fn a_failed_restore_leaves_nothing_mounted_in_its_work_dir() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "a_failed_restore_leaves_nothing_mounted_in_its_work_dir: not run: mounting needs root"
        );
        assert!(std::env::var_os("CI").is_none(), "CI runs as root");
        return;
    }
    let f = Fake::new();
    let plans = f.run_dir().join("plans");
    let _srv = f.agent(|_: &Request| None);
    let b = f.bundle("b", serde_json::json!({}));
    f.plan(
        &planfile::path_for_container(&plans, "c8").unwrap(),
        Some("c8"),
        "ref-8",
    );
    let args = f.with_globals(&["create", "--bundle", b.to_str().unwrap(), "c8"]);
    let st = f
        .cmd(&strs(&args))
        .env("FAKE_RESTORE_RC", "1")
        .env("FAKE_RESTORE_YARD", "1")
        .status()
        .unwrap();
    let left = stasis_engine::mounts::mounts_under(f.dir.path());
    for m in &left {
        let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
    }
    assert!(st.success());
    assert!(
        f.calls().iter().any(|c| c.1.iter().any(|a| a == "restore")),
        "{:?}",
        f.calls()
    );
    assert!(left.is_empty(), "left mounted: {left:?}\n{}", f.log());
    assert!(
        f.log().contains("unmounted what the restore left mounted"),
        "{}",
        f.log()
    );
}

#[test]
fn a_restore_that_fails_falls_back_to_the_original_create() {
    let f = Fake::new();
    let plans = f.run_dir().join("plans");
    let report_file = planfile::path_for_report(&plans, "c9").unwrap();
    // Whether the report's file was there when the report arrived.
    let file_when_sent = Arc::new(Mutex::new(None));
    let srv = {
        let (file, seen) = (report_file.clone(), file_when_sent.clone());
        f.agent(move |r: &Request| {
            if matches!(r.body, RequestBody::Report(_)) {
                *seen.lock().unwrap() = Some(file.exists());
            }
            None
        })
    };
    let b = f.bundle("b", serde_json::json!({}));
    f.plan(
        &planfile::path_for_container(&plans, "c9").unwrap(),
        Some("c9"),
        "ref-9",
    );
    let args = f.with_globals(&[
        "create",
        "--bundle",
        b.to_str().unwrap(),
        "--pid-file",
        "/x/init.pid",
        "c9",
    ]);
    let st = f
        .cmd(&strs(&args))
        .env("FAKE_RESTORE_RC", "1")
        .status()
        .unwrap();
    assert!(st.success());
    let calls: Vec<Vec<String>> = f.calls().into_iter().map(|c| c.1).collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert_eq!(calls[0][6..8], ["restore", "--detach"]);
    assert_eq!(calls[1][6..], ["delete", "--force", "c9"]);
    assert_eq!(calls[2], args, "then the shim's create, unchanged");
    assert!(
        f.log().contains("cold start of c9: runc restore failed"),
        "{}",
        f.log()
    );
    assert!(!f.run_dir().join("restored/c9").exists());
    assert!(plans.join("c9.json.consumed").exists());
    let r = srv.wait_for(1, Duration::from_secs(2));
    assert!(
        matches!(&r[..], [Request { body: RequestBody::Report(rep), .. }]
            if rep.container_id == "c9"
            && matches!(&rep.event, ReportEvent::ColdStart { cause: ColdStartCause::RestoreFailed, checkpoint_ref: Some(c), .. } if c == "ref-9")),
        "{r:?}"
    );
    // An agent listened, and the report was still written, before it was sent: an agent killed
    // before it handled the report leaves it to the next one. Removing the file is the agent's,
    // once it has handled the report; this stand-in does not, so the wrapper's file is there.
    let until = Instant::now() + Duration::from_secs(2);
    while file_when_sent.lock().unwrap().is_none() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(*file_when_sent.lock().unwrap(), Some(true), "written first");
    let RequestBody::Report(sent) = &r[0].body else {
        unreachable!()
    };
    let left = planfile::read_report(&report_file)
        .unwrap()
        .expect("the report's file");
    assert_eq!(&left, sent);
}

#[test]
fn a_restore_makes_start_a_no_op_once() {
    let f = Fake::new();
    let b = f.bundle(
        "b",
        serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-uid": "uid-1",
            "io.kubernetes.cri.sandbox-namespace": "ns",
            "io.kubernetes.cri.sandbox-name": "pod-1",
            "io.kubernetes.cri.container-name": "app",
        }),
    );
    let plans = f.run_dir().join("plans");
    let img = f.plan(
        &planfile::path_for_pod(&plans, "uid-1", "app").unwrap(),
        None,
        "ref-1",
    );
    let args = f.with_globals(&[
        "create",
        "--bundle",
        b.to_str().unwrap(),
        "--pid-file",
        "/x/init.pid",
        "--console-socket",
        "/x/console.sock",
        "c1",
    ]);
    let st = f.cmd(&strs(&args)).status().unwrap();
    assert!(st.success(), "{}", f.log());
    let work = f.run_dir().join("work/c1");
    let mut want = f.globals();
    want.extend([
        "restore".into(),
        "--detach".into(),
        "--image-path".into(),
        img.join("criu").display().to_string(),
        "--work-path".into(),
        work.display().to_string(),
        "--bundle".into(),
        b.display().to_string(),
        "--pid-file".into(),
        "/x/init.pid".into(),
        "--console-socket".into(),
        "/x/console.sock".into(),
        "--file-locks".into(),
        "--tcp-established".into(),
        "c1".into(),
    ]);
    assert_eq!(f.calls().len(), 1);
    assert_eq!(f.calls()[0].1, want);
    assert!(
        f.log().contains("restored c1 from checkpoint ref-1"),
        "{}",
        f.log()
    );
    // No agent listened: the report, written before it was sent, is left for it.
    let left = planfile::read_report(&planfile::path_for_report(&plans, "c1").unwrap())
        .unwrap()
        .expect("the report left for the agent");
    assert!(
        matches!(&left.event, ReportEvent::Restored { checkpoint_ref, .. } if checkpoint_ref == "ref-1")
            && left.pod.pod_uid == "uid-1",
        "{left:?}"
    );

    let start = f.with_globals(&["start", "c1"]);
    assert!(f.cmd(&strs(&start)).status().unwrap().success());
    assert_eq!(
        f.calls().len(),
        1,
        "start of a restored container does not call runc"
    );
    // Only once: a second start (or a start from another runc root) is runc's.
    assert!(f.cmd(&strs(&start)).status().unwrap().success());
    assert_eq!(f.calls().len(), 2);

    // The plan was for this pod's container, and is used up.
    assert!(!plans.join("pod_uid-1_app.json").exists());
    let st = f.cmd(&strs(&args)).status().unwrap();
    assert!(st.success());
    assert_eq!(f.calls()[2].1, args, "no plan left: cold start");
}

#[test]
fn sandboxes_and_forced_cold_starts_are_left_alone() {
    let f = Fake::new();
    let plans = f.run_dir().join("plans");
    let sb = f.bundle(
        "sb",
        serde_json::json!({"io.kubernetes.cri.container-type": "sandbox"}),
    );
    f.plan(
        &planfile::path_for_container(&plans, "s1").unwrap(),
        Some("s1"),
        "r",
    );
    let args = ["create", "--bundle", sb.to_str().unwrap(), "s1"];
    assert!(f.cmd(&args).status().unwrap().success());
    assert_eq!(strs(&f.calls()[0].1), args);
    assert!(
        plans.join("s1.json").exists(),
        "a sandbox never takes a plan"
    );

    let app = f.bundle(
        "app",
        serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "stasis.dev/cold-start": "true",
        }),
    );
    f.plan(
        &planfile::path_for_container(&plans, "a1").unwrap(),
        Some("a1"),
        "r",
    );
    let log = f.p("log.json");
    let args = [
        "--log",
        log.to_str().unwrap(),
        "create",
        "--bundle",
        app.to_str().unwrap(),
        "a1",
    ];
    assert!(f.cmd(&args).status().unwrap().success());
    assert_eq!(strs(&f.calls()[1].1), args);
    assert!(
        f.log().contains("the pod asks for a cold start"),
        "{}",
        f.log()
    );
}

#[test]
fn plans_that_do_not_fit_are_refused() {
    let f = Fake::new();
    let plans = f.run_dir().join("plans");
    let b = f.bundle(
        "b",
        serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-uid": "uid-2",
            "io.kubernetes.cri.container-name": "app",
        }),
    );
    // A plan for another pod, filed under this container's id.
    let p = planfile::path_for_container(&plans, "c1").unwrap();
    let img = f.plan(&p, Some("c1"), "ref-1");
    let mut pf = planfile::read(&p).unwrap().unwrap();
    pf.pod_uid = Some("uid-1".into());
    pf.plan.rootfs_method = Some(RootfsMethod::OverlayUpper);
    planfile::write(&p, &pf).unwrap();
    let log = f.p("log.json");
    let args = [
        "--log",
        log.to_str().unwrap(),
        "create",
        "--bundle",
        b.to_str().unwrap(),
        "c1",
    ];
    assert!(f.cmd(&args).status().unwrap().success());
    assert_eq!(strs(&f.calls()[0].1), args);
    assert!(
        f.log().contains("the plan is for pod uid uid-1"),
        "{}",
        f.log()
    );
    assert!(img.exists());
}

fn median_ms(mut f: impl FnMut(), n: usize) -> f64 {
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[n / 2]
}

/// What the wrapper itself adds to a `create` without a plan (bundle read, plan files, agent
/// socket, log line, exec), with `/bin/true` standing in for runc so that runc's own time does not
/// drown it. `runc.rs` measures the same against real runc creates.
#[test]
fn the_wrapper_adds_about_a_millisecond_to_create() {
    let f = Fake::new();
    let b = f.bundle(
        "b",
        serde_json::json!({"io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-uid": "u", "io.kubernetes.cri.container-name": "app"}),
    );
    let args = f.with_globals(&[
        "create",
        "--bundle",
        b.to_str().unwrap(),
        "--pid-file",
        "/x/p",
        "c1",
    ]);
    let run = |c: &mut Command| assert!(c.stdout(Stdio::null()).status().unwrap().success());
    const N: usize = 50;
    let direct = median_ms(|| run(Command::new("/bin/true").args(&args)), N);
    let wrapped = median_ms(
        || run(f.cmd(&strs(&args)).env("STASIS_REAL_RUNC", "/bin/true")),
        N,
    );
    let srv = f.agent(|_: &Request| {
        Some(ResponseBody::NoPlan {
            reason: "none".into(),
        })
    });
    let with_agent = median_ms(
        || run(f.cmd(&strs(&args)).env("STASIS_REAL_RUNC", "/bin/true")),
        N,
    );
    assert_eq!(srv.requests().len(), N);
    eprintln!(
        "stasis-runc create without a plan, {N} runs, median: exec of the stand-in alone {direct:.2} ms; \
         through the wrapper, no agent {wrapped:.2} ms (+{:.2}); agent answering no_plan {with_agent:.2} ms (+{:.2})",
        wrapped - direct,
        with_agent - direct
    );
    assert!(wrapped - direct < 20.0 && with_agent - direct < 20.0);
}

#[test]
fn a_slow_agent_costs_create_at_most_the_plan_timeout() {
    let f = Fake::new();
    let _srv = f.agent(|_: &Request| {
        std::thread::sleep(Duration::from_secs(3));
        Some(ResponseBody::NoPlan {
            reason: "late".into(),
        })
    });
    let b = f.bundle("b", serde_json::json!({}));
    let args = f.with_globals(&["create", "--bundle", b.to_str().unwrap(), "c1"]);
    let t = Instant::now();
    // Asking for more than the 200 ms ceiling gets the ceiling.
    let st = f
        .cmd(&strs(&args))
        .env("STASIS_PLAN_TIMEOUT_MS", "10000")
        .status()
        .unwrap();
    let took = t.elapsed();
    assert!(st.success());
    assert!(took >= Duration::from_millis(200), "{took:?}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert_eq!(f.calls()[0].1, args, "cold start");
    assert!(
        f.log().contains("the agent did not answer in time"),
        "{}",
        f.log()
    );
}

#[test]
fn an_untrusted_plan_file_is_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let f = Fake::new();
    let srv = f.agent(|_: &Request| None);
    let plans = f.run_dir().join("plans");
    let p = planfile::path_for_container(&plans, "c1").unwrap();
    f.plan(&p, Some("c1"), "ref-1");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
    let b = f.bundle("b", serde_json::json!({}));
    let args = f.with_globals(&["create", "--bundle", b.to_str().unwrap(), "c1"]);
    assert!(f.cmd(&strs(&args)).status().unwrap().success());
    assert_eq!(f.calls().len(), 1);
    assert_eq!(f.calls()[0].1, args, "cold start");
    assert!(f.log().contains("unusable plan file"), "{}", f.log());
    assert!(f.log().contains("writable by others"), "{}", f.log());
    let r = srv.wait_for(1, Duration::from_secs(2));
    assert!(
        matches!(&r[..], [Request { body: RequestBody::Report(rep), .. }]
            if matches!(rep.event, ReportEvent::ColdStart { cause: ColdStartCause::PlanRefused, .. })),
        "{r:?}"
    );
}

#[test]
fn delete_of_a_container_that_never_started_tells_the_agent_its_restore_was_lost() {
    let f = Fake::new();
    let srv = f.agent(|r: &Request| match &r.body {
        RequestBody::ContainerExited(_) => Some(ResponseBody::NoPlan {
            reason: "test".into(),
        }),
        _ => None,
    });
    // The marker its create wrote before the restore; runc has no state of the container (the
    // create was stopped before runc made it, and the fake runc keeps none anyway).
    let restored = f.run_dir().join("restored");
    std::fs::create_dir_all(&restored).unwrap();
    let marker = |id: &str, pod: serde_json::Value| {
        let m = serde_json::json!({
            "v": stasis_node_api::PROTOCOL_VERSION, "checkpoint_ref": "ref-5", "root": "/run/r",
            "restored_at_unix_ms": 1, "pod": pod,
        });
        std::fs::write(restored.join(id), m.to_string()).unwrap();
    };
    marker(
        "c5",
        serde_json::json!({"pod_uid": "uid-5", "pod_namespace": "ns", "pod_name": "pod-5", "container_name": "app"}),
    );
    let args = f.with_globals(&["delete", "--force", "c5"]);
    assert!(f.cmd(&strs(&args)).status().unwrap().success());
    let reqs = srv.wait_for(1, Duration::from_secs(2));
    assert!(
        matches!(&reqs[..], [Request { body: RequestBody::ContainerExited(c), .. }]
            if c.container_id == "c5" && c.restore_lost.as_deref() == Some("ref-5")
            && c.pod.pod_uid == "uid-5" && c.pod.container_name == "app" && !c.oom_killed),
        "{reqs:?}"
    );
    assert!(!restored.join("c5").exists());
    assert_eq!(f.calls().last().unwrap().1, args, "then runc's delete");
    assert!(
        f.log().contains("c5 was deleted before it started, losing its restore from ref-5; its restart starts cold: test"),
        "{}",
        f.log()
    );

    // Without a marker (a container that started, or was never restored), nothing is said.
    let args = f.with_globals(&["delete", "--force", "c6"]);
    assert!(f.cmd(&strs(&args)).status().unwrap().success());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(srv.requests().len(), 1);
}
