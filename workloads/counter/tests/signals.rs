//! The counter's signals, on the real binary: SIGUSR1 checks all of the state, SIGUSR2 rewrites
//! a range of blocks, SIGTERM and SIGINT end it with a last line and exit 0. (SIGRTMIN grows
//! memory until the OOM killer acts: not run here.)

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// The counter with 1 MiB of state, ticking every 20 ms; its stdout and stderr lines arrive on
/// the receiver.
fn counter() -> (Child, Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stasis-counter"))
        .env("STATE_MB", "1")
        .env("BLOCK_KB", "64")
        .env("INTERVAL_MS", "20")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start stasis-counter");
    let (tx, rx) = channel();
    let out = BufReader::new(child.stdout.take().unwrap());
    let err = BufReader::new(child.stderr.take().unwrap());
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        out.lines()
            .map_while(Result::ok)
            .for_each(|l| drop(tx.send(l)))
    });
    std::thread::spawn(move || {
        err.lines()
            .map_while(Result::ok)
            .for_each(|l| drop(tx2.send(l)))
    });
    (child, rx)
}

/// Waits (10 s at most) for a line containing `what`; returns it.
fn line_with(rx: &Receiver<String>, what: &str) -> String {
    let until = Instant::now() + Duration::from_secs(10);
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(what) => return l,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    panic!("no line with {what:?} within 10 s");
}

fn signal(child: &Child, name: &str) {
    let ok = Command::new("kill")
        .args(["-s", name, &child.id().to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -s {name}");
}

fn exit_code(mut child: Child) -> Option<i32> {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    panic!("stasis-counter did not exit within 10 s");
}

#[test]
fn usr1_checks_usr2_dirties_term_exits_cleanly() {
    let (child, rx) = counter();
    // The check every start does, then counting.
    assert!(line_with(&rx, "full-check count=").ends_with("state=ok"));
    line_with(&rx, "count=3 state=ok");
    signal(&child, "USR1");
    let check = line_with(&rx, "full-check count=");
    assert!(check.ends_with("state=ok"), "{check}");
    signal(&child, "USR2");
    let dirty = line_with(&rx, "dirty count=");
    assert!(
        dirty.contains("blocks=") && dirty.ends_with("5%)"),
        "{dirty}"
    );
    line_with(&rx, "state=ok");
    signal(&child, "TERM");
    line_with(&rx, "exiting on SIGTERM");
    assert_eq!(exit_code(child), Some(0), "SIGTERM ends it with 0");
}

#[test]
fn int_exits_cleanly() {
    let (child, rx) = counter();
    line_with(&rx, "count=1 state=ok");
    signal(&child, "INT");
    line_with(&rx, "exiting on SIGTERM");
    assert_eq!(exit_code(child), Some(0), "SIGINT ends it with 0");
}
