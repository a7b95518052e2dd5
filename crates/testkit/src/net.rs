//! The network side of a test: ports for the servers it starts (the counter workload, an S3
//! server), a line read from such a server, a container's network namespace, and a
//! slow link to a server ([`Throttle`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

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

/// A loopback TCP proxy to `127.0.0.1:upstream` whose connections share one link of at most
/// `bytes_per_s` in each direction: a slow network to a server (an S3 server whose uploads then
/// take seconds, long enough to act during one). Stopped on drop (its open connections end
/// with their peers).
pub struct Throttle {
    /// Its port on 127.0.0.1.
    pub port: u16,
    stop: Arc<AtomicBool>,
}

impl Throttle {
    pub fn start(upstream: u16, bytes_per_s: u64) -> Throttle {
        // Port 0 is safe here: the proxy keeps the listener it bound.
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind the proxy");
        let port = listener.local_addr().expect("its address").port();
        listener.set_nonblocking(true).expect("non-blocking accept");
        let stop = Arc::new(AtomicBool::new(false));
        let links = [Link::new(bytes_per_s), Link::new(bytes_per_s)];
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect((Ipv4Addr::LOCALHOST, upstream)) else {
                    continue;
                };
                for (from, to, link) in [
                    (client.try_clone(), server.try_clone(), links[0].clone()),
                    (server.try_clone(), client.try_clone(), links[1].clone()),
                ] {
                    if let (Ok(from), Ok(to)) = (from, to) {
                        std::thread::spawn(move || pump(from, to, &link));
                    }
                }
            }
        });
        Throttle { port, stop }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One direction of a [`Throttle`]: the instant it is free again, shared by its connections.
#[derive(Clone)]
struct Link {
    free_at: Arc<Mutex<Instant>>,
    bytes_per_s: u64,
}

impl Link {
    fn new(bytes_per_s: u64) -> Link {
        Link {
            free_at: Arc::new(Mutex::new(Instant::now())),
            bytes_per_s: bytes_per_s.max(1),
        }
    }

    /// Waits until `n` bytes have had their turn on the link.
    fn pass(&self, n: usize) {
        let took = Duration::from_secs_f64(n as f64 / self.bytes_per_s as f64);
        let until = {
            let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
            *free_at = (*free_at).max(Instant::now()) + took;
            *free_at
        };
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, link: &Link) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                link.pass(n);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 256 KiB through a 1 MiB/s link take about a quarter of a second, and arrive whole.
    #[test]
    fn a_throttle_passes_everything_at_its_rate() {
        let server = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let upstream = server.local_addr().unwrap().port();
        let echo = std::thread::spawn(move || {
            let (mut c, _) = server.accept().unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).unwrap();
            got.len()
        });
        let t = Throttle::start(upstream, 1024 * 1024);
        let mut c = TcpStream::connect((Ipv4Addr::LOCALHOST, t.port)).unwrap();
        let started = Instant::now();
        c.write_all(&vec![7u8; 256 * 1024]).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(echo.join().unwrap(), 256 * 1024);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }

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
