//! The network side of a test: ports for the servers it starts (the counter workload, an S3
//! server), a line read from such a server, and a container's network namespace.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The ports handed out: from here up to the kernel's ephemeral range.
const FIRST: u32 = 20_000;

/// A TCP port that is free now, for a server that binds it itself (and binds it again after a
/// restore, so it cannot take port 0 and report what it got).
///
/// Binding port 0 and passing the number on leaves a window in which the kernel may hand the
/// released port to any other port-0 bind or outgoing connection (an S3 client, another test)
/// before the server binds it. So the port comes from below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), which the kernel never picks by itself; each is handed out
/// once per test process, the first one depending on the pid so that test processes running at
/// the same time start far apart; and only a port that can be bound on every address right now
/// is returned.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static SPAN: OnceLock<u32> = OnceLock::new();
    let span = *SPAN.get_or_init(|| {
        let span = ephemeral_start().saturating_sub(FIRST);
        NEXT.store(std::process::id().wrapping_mul(7_919), Ordering::Relaxed);
        span
    });
    if span < 1_000 {
        // The ephemeral range starts low (a tuned host): any port may be handed out by the
        // kernel, so take one it chose.
        return TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("bind a loopback port")
            .port();
    }
    for _ in 0..span {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % span) as u16;
        if TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port in {FIRST}..{}", FIRST + span);
}

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// One line from `127.0.0.1:port` (the counter's `LISTEN_PORT` answers with its current line),
/// trimmed; `None` when nothing answers within 3 s.
pub fn ask_line(port: u16) -> Option<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line).ok()?;
    Some(line.trim().to_owned())
}

/// Runs `f` on a thread inside the network namespace of `pid` (sockets it makes stay there).
pub fn in_netns<T: Send + 'static>(
    pid: i32,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).expect("open the netns of pid");
    std::thread::spawn(move || {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
}

/// [`ask_line`] inside the network namespace of `pid`.
pub fn ask_line_in(pid: i32, port: u16) -> Option<String> {
    in_netns(pid, move || ask_line(port)).join().unwrap()
}

/// Brings up the loopback of the network namespace of `pid` (runc leaves a new one down).
pub fn loopback_up(pid: i32) {
    let up = in_netns(pid, || {
        Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
    });
    let st = up.join().unwrap().expect("run ip");
    assert!(st.success(), "lo up in the netns of {pid}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        let start = ephemeral_start();
        for p in ports {
            if start >= FIRST + 1_000 {
                assert!((FIRST..start).contains(&u32::from(p)), "{p}");
            }
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, p)).expect("the port is free");
        }
    }
}
