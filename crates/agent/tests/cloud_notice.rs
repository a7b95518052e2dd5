//! The agent's cloud notice watcher against tests/cloud/metadata-standin.py: a STAND-IN for the
//! AWS, GCP and Azure instance metadata services (no cloud is reachable from this machine or
//! CI) that speaks each provider's documented requests and answers and refuses requests without
//! the headers the real services require (IMDSv2 token, Metadata-Flavor, Metadata).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stasis_agent::notice::MetadataClient;
use stasis_core::notice::{NoticeKind, Provider};

mod common;
use common::current_thread_runtime as rt;

struct StandIn {
    child: Child,
    port: u16,
}

impl StandIn {
    fn start() -> Self {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/cloud/metadata-standin.py"
        );
        let mut child = Command::new("python3")
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the metadata stand-in");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("stand-in said {line:?}"));
        eprintln!(
            "STAND-IN cloud metadata service on 127.0.0.1:{port} (no cloud is reachable here)"
        );
        Self { child, port }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A GET on the stand-in's control path; the body.
    fn control(&self, path_and_query: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            s,
            "GET {path_and_query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{path_and_query}: {out}");
        out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn aws_imdsv2_spot_rebalance_and_scheduled_events() {
    let s = StandIn::start();
    let rt = rt();
    let mut mc = MetadataClient::new(Provider::Aws, Some(&s.base()));
    assert_eq!(rt.block_on(mc.poll()).unwrap(), vec![], "nothing announced");

    s.control("/_standin/arm?kind=aws-rebalance");
    let n = rt.block_on(mc.poll()).unwrap();
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].kind, NoticeKind::RebalanceRecommendation);

    s.control("/_standin/arm?kind=aws-spot&seconds=120");
    s.control("/_standin/arm?kind=aws-scheduled&seconds=600");
    let n = rt.block_on(mc.poll()).unwrap();
    let spot = n
        .iter()
        .find(|n| n.kind == NoticeKind::Reclaim)
        .expect("spot notice");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let left = spot.deadline_unix_ms.unwrap() - now;
    assert!(
        (100_000..=121_000).contains(&left),
        "two minutes ahead: {left} ms"
    );
    let sched = n
        .iter()
        .find(|n| n.kind == NoticeKind::Maintenance)
        .expect("scheduled event");
    assert!(sched.id.starts_with("scheduled/instance-event-"));
    assert!(sched.deadline_unix_ms.unwrap() - now > 500_000);
}

#[test]
fn gcp_long_poll_answers_when_the_vm_is_preempted() {
    let s = StandIn::start();
    let rt = rt();
    let mut mc = MetadataClient::new(Provider::Gcp, Some(&s.base()));
    // The first answers are immediate (no ETag yet): nothing announced.
    for _ in 0..2 {
        assert_eq!(rt.block_on(mc.poll()).unwrap(), vec![]);
    }
    // The next polls wait for a change; the preemption arrives a second into them.
    let arm = {
        let base = s.port;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            let mut c = TcpStream::connect(("127.0.0.1", base)).unwrap();
            write!(
                c,
                "GET /_standin/arm?kind=gcp-preempted HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
        })
    };
    let t = Instant::now();
    let mut n = Vec::new();
    while n.is_empty() && t.elapsed() < Duration::from_secs(60) {
        n = rt.block_on(mc.poll()).unwrap();
    }

    arm.join().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the long poll answered on the change, not at its timeout: {:?}",
        t.elapsed()
    );
    assert_eq!(n.len(), 1);
    assert_eq!(
        (n[0].kind, n[0].provider),
        (NoticeKind::Reclaim, Provider::Gcp)
    );
}

#[test]
fn azure_scheduled_events_for_this_vm_and_their_acknowledgement() {
    let s = StandIn::start();
    let rt = rt();
    // Two VMs of one scale set, each asking its own (the stand-in's /<machine>/ prefix).
    let mut mc = MetadataClient::new(Provider::Azure, Some(&format!("{}/vm-a", s.base())));
    let mut other = MetadataClient::new(Provider::Azure, Some(&format!("{}/vm-b", s.base())));
    assert_eq!(rt.block_on(mc.poll()).unwrap(), vec![]);
    s.control("/vm-a/_standin/arm?kind=azure-preempt&seconds=30");
    let n = rt.block_on(mc.poll()).unwrap();
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].kind, NoticeKind::Reclaim);
    assert_eq!(
        rt.block_on(other.poll()).unwrap(),
        vec![],
        "another VM's event"
    );
    assert_eq!(
        s.control("/vm-a/_standin/acks"),
        "[]",
        "not acknowledged before"
    );
    rt.block_on(mc.acknowledge(&n[0])).unwrap();
    let acks: Vec<String> = serde_json::from_str(&s.control("/vm-a/_standin/acks")).unwrap();
    assert_eq!(acks, vec![n[0].id.clone()]);
    assert_eq!(
        rt.block_on(mc.poll()).unwrap(),
        vec![],
        "an acknowledged event is gone"
    );
}

#[test]
fn a_service_that_is_not_there_is_an_error_naming_it() {
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let rt = rt();
    let mut mc = MetadataClient::new(Provider::Aws, Some(&format!("http://127.0.0.1:{port}")));
    let e = rt.block_on(mc.poll()).unwrap_err().to_string();
    assert!(
        e.contains("aws metadata service at http://127.0.0.1"),
        "{e}"
    );
}
