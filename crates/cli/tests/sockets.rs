//! Servers across checkpoints (issue 10, item 2): a counter container with a network namespace
//! of its own, clients holding connections to it and new connections arriving all the time,
//! checkpointed while it serves, killed, and restored into a new container (a new network
//! namespace): its held connections come back closed, its listening sockets answer, and clients
//! that reconnect get the restored process (DESIGN §9.8).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const LINE_PORT: u16 = 9001;
const STREAM_PORT: u16 = 9002;

/// A bundle whose container gets a network namespace of its own.
fn netns_bundle(w: &World, name: &str) -> PathBuf {
    bundle::make_bundle_with(
        &["--netns"],
        &w.path(name),
        &[
            "STATE_MB=16",
            &format!("LISTEN_PORT={LINE_PORT}"),
            &format!("STREAM_PORT={STREAM_PORT}"),
        ],
    )
}

/// A client holding a connection to the stream port: the counts it received, and whether the
/// connection ended.
struct Held {
    counts: Arc<Mutex<Vec<u64>>>,
    ended: Arc<AtomicBool>,
}

fn hold(pid: i32) -> Held {
    let counts: Arc<Mutex<Vec<u64>>> = Arc::default();
    let ended: Arc<AtomicBool> = Arc::default();
    let (c, e) = (counts.clone(), ended.clone());
    let s = in_netns(pid, move || TcpStream::connect(("127.0.0.1", STREAM_PORT)))
        .join()
        .unwrap()
        .expect("connecting a held client");
    std::thread::spawn(move || {
        for line in BufReader::new(s).lines() {
            match line {
                Ok(l) => {
                    if let Some(n) = count_of(&l) {
                        c.lock().unwrap().push(n);
                    }
                }
                Err(_) => break,
            }
        }
        e.store(true, SeqCst);
    });
    Held { counts, ended }
}

impl Held {
    fn received(&self) -> usize {
        self.counts.lock().unwrap().len()
    }
    fn last(&self) -> u64 {
        self.counts.lock().unwrap().last().copied().unwrap_or(0)
    }
    fn wait_lines(&self, n: usize) {
        let start = self.received();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.received() < start + n {
            assert!(
                Instant::now() < deadline && !self.ended.load(SeqCst),
                "held connection got no new lines (ended: {})",
                self.ended.load(SeqCst)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Opens connections to the line port as fast as it can until `stop`, each read once and
/// closed (clients, health checks, probes); counts the answered ones.
fn churn(pid: i32, stop: Arc<AtomicBool>, answered: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    in_netns(pid, move || {
        while !stop.load(SeqCst) {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", LINE_PORT)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut b = [0u8; 64];
                if s.read(&mut b).is_ok_and(|n| n > 0) {
                    answered.fetch_add(1, SeqCst);
                }
            }
        }
    })
}

fn restore(w: &mut World, id: &str, extra: &[&str]) -> (Run, Container) {
    let bundle = netns_bundle(w, &format!("bundle-{id}"));
    w.restore_into("server/latest", id, bundle, extra)
}

#[test]
fn a_busy_server_checkpoints_and_restores_into_a_new_netns_and_clients_reconnect() {
    if !ready("a_busy_server_checkpoints_and_restores_into_a_new_netns_and_clients_reconnect") {
        return;
    }
    let mut w = World::new();
    let bundle = netns_bundle(&w, "bundle-srv-a");
    let c = w.start_bundle("srv-a", &bundle);
    let pid = w.pid("srv-a");
    loopback_up(pid);
    let held: Vec<Held> = (0..3).map(|_| hold(pid)).collect();
    held[0].wait_lines(2);
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let churners: Vec<_> = (0..2)
        .map(|_| churn(pid, stop.clone(), answered.clone()))
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    // Heartbeats while clients hold connections and new ones keep arriving: every one succeeds
    // (before: "In-flight connection (l) ... --skip-in-flight", B5).
    let mut at_last = 0;
    let rounds = 5;
    for i in 0..rounds {
        let a0 = answered.load(SeqCst);
        at_last = c.last_count();
        let t = Instant::now();
        checkpoint_as(&w, "server", "srv-a", &[])
            .expect_ok(&format!("checkpoint {i} of a busy server"));
        let busy = answered.load(SeqCst) - a0;
        eprintln!(
            "checkpoint {i}: {} ms, {busy} connections answered meanwhile",
            t.elapsed().as_millis()
        );
    }
    let total = answered.load(SeqCst);
    assert!(total > 50, "the churn hardly ran: {total} connections");
    // The held connections lived through the leave-running checkpoints.
    for h in &held {
        h.wait_lines(3);
    }
    stop.store(true, SeqCst);
    for t in churners {
        t.join().unwrap();
    }
    w.kill("srv-a");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !held.iter().all(|h| h.ended.load(SeqCst)) {
        assert!(
            Instant::now() < deadline,
            "the clients never saw the server die"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Restore into a new container, a new network namespace: the held connections cannot come
    // back there; they are closed, the listening sockets restored (before: "Can't connect inet
    // socket back: Network is unreachable", B4).
    let (run, r) = restore(&mut w, "srv-b", &["-o", "json"]);
    let out = run.expect_ok("restore into a new network namespace");
    eprintln!("restore: {out}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["tcp"]["tcp"], "close", "{report}");
    // The three held ones, and any churn connection the server was answering at the dump.
    assert!(report["tcp"]["connections"].as_u64() >= Some(3), "{report}");
    r.wait_count(3);
    let first = r.counts()[0];
    assert!(
        first >= at_last,
        "restored count {first} is older than the last checkpoint's {at_last}"
    );
    assert!(!r.corrupt(), "restored state is corrupt: {:?}", r.lines());
    let rpid = w.pid("srv-b");
    // None of the checkpoint's connections is alive in the restored process.
    let s = stasis_engine::sockets::scan(&[rpid]);
    assert!(s.connections.is_empty(), "restored connections: {s:?}");
    assert_eq!(s.listening.len(), 2, "listening sockets: {s:?}");
    // Clients reconnect and get the restored process: the line port answers, a new held
    // connection streams counts that continue from the checkpoint.
    let answer = ask_line_in(rpid, LINE_PORT).expect("restored line port does not answer");
    assert!(answer.ends_with("state=ok"), "{answer}");
    assert!(count_of(&answer).unwrap() >= first, "{answer}");
    let again = hold(rpid);
    again.wait_lines(3);
    assert!(
        again.last() >= first,
        "reconnected client got {}",
        again.last()
    );
}

#[test]
fn no_tcp_established_closes_connections_at_checkpoint_and_at_restore() {
    if !ready("no_tcp_established_closes_connections_at_checkpoint_and_at_restore") {
        return;
    }
    let mut w = World::new();
    let bundle = netns_bundle(&w, "bundle-nt-a");
    w.start_bundle("nt-a", &bundle);
    let pid = w.pid("nt-a");
    loopback_up(pid);
    let h = hold(pid);
    h.wait_lines(2);

    // --no-tcp-established at checkpoint: the connection is neither dumped nor disturbed (before:
    // "Connected TCP socket, consider using --tcp-established option", B4).
    checkpoint_as(&w, "server", "nt-a", &["--no-tcp-established"])
        .expect_ok("checkpoint --no-tcp-established with a held connection");
    h.wait_lines(3);
    let (run, r) = restore(&mut w, "nt-b", &["-o", "json"]);
    let out = run.expect_ok("restore of a checkpoint without connection state");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["tcp"]["tcp"], "close", "{report}");
    r.wait_count(2);
    assert!(ask_line_in(w.pid("nt-b"), LINE_PORT).is_some_and(|l| l.ends_with("state=ok")));

    // A checkpoint with the state dumped, restored with --no-tcp-established (before:
    // "Connected TCP socket in image").
    checkpoint_as(&w, "server", "nt-a", &[]).expect_ok("checkpoint with the connection dumped");
    let (run, r) = restore(&mut w, "nt-c", &["--no-tcp-established", "-o", "json"]);
    let out = run.expect_ok("restore --no-tcp-established");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["tcp"]["tcp"], "close", "{report}");
    r.wait_count(2);
    assert!(ask_line_in(w.pid("nt-c"), LINE_PORT).is_some_and(|l| l.ends_with("state=ok")));
    // The original never noticed.
    h.wait_lines(2);
}

/// A process tree (CRIU's RPC, where `tcp-close` goes through a wrapper around `criu`): a
/// connection held across a leave-running checkpoint comes back closed after a restore (its peer
/// went on with the original), and `--no-tcp-established` at the checkpoint works too.
#[test]
fn a_process_tree_with_a_held_connection_restores_with_it_closed() {
    if !ready("a_process_tree_with_a_held_connection_restores_with_it_closed") {
        return;
    }
    let w = World::new();
    let (line, stream) = (free_port(), free_port());
    let counter = repo().join("target/images/counter/rootfs/stasis-counter");
    for (round, extra) in [(0, &[][..]), (1, &["--no-tcp-established"][..])] {
        let mut child = Command::new("setsid")
            .arg(&counter)
            .env("STATE_MB", "8")
            .env("LISTEN_PORT", line.to_string())
            .env("STREAM_PORT", stream.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while ask_line(line).is_none() {
            assert!(Instant::now() < deadline, "the counter does not answer");
            std::thread::sleep(Duration::from_millis(50));
        }
        let s = TcpStream::connect(("127.0.0.1", stream)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut held = BufReader::new(s);
        let mut l = String::new();
        held.read_line(&mut l).unwrap();
        let mut args = vec!["checkpoint", "process", "--workload", "proc"];
        let pid_s = pid.to_string();
        args.insert(2, &pid_s);
        args.extend_from_slice(extra);
        w.stasis(&args).expect_ok(&format!(
            "checkpoint process {extra:?} with a held connection"
        ));
        l.clear();
        held.read_line(&mut l)
            .expect("the held connection survives the checkpoint");
        child.kill().unwrap();
        child.wait().unwrap();

        let log = w.path(&format!("after-{round}.log"));
        let run = w.stasis(&[
            "restore",
            "proc/latest",
            "--process",
            "--log",
            log.to_str().unwrap(),
            "-o",
            "json",
        ]);
        let out = run.expect_ok("restore --process");
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["tcp"]["tcp"], "close", "{report}");
        assert_eq!(report["tcp"]["connections"], 1, "{report}");
        let s = stasis_engine::sockets::scan(&[pid as i32]);
        assert!(s.connections.is_empty(), "restored connections: {s:?}");
        let answer = ask_line(line).expect("the restored process does not answer");
        assert!(answer.ends_with("state=ok"), "{answer}");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::SIGKILL,
        );
        // Reaped by tini (the tree was re-parented to it after the restore): wait for the pid.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < deadline, "pid {pid} is not reaped");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
