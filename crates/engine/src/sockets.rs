//! TCP connections across a checkpoint: what a checkpoint records about them, and whether a
//! restore keeps them or closes them (DESIGN §9.8).
//!
//! CRIU restores an established connection by re-creating the socket in repair mode, bound to
//! its old local address, with its old sequence numbers and queues. That only makes sense where
//! the address exists and the peer is in step with the image: the connection was frozen by the
//! dump (stop mode: CRIU's network lock kept the peer from seeing a close) or its peer was
//! dumped with it. Everywhere else (a new network namespace, another node, a leave-running
//! checkpoint whose original went on talking) a restored connection fails the restore or comes
//! back out of step, so the restore closes it instead (CRIU `tcp-close`: the process gets its
//! socket back shut down, reads end-of-file, and its clients reconnect). Listening sockets are
//! restored either way.
//!
//! runc 1.1 has no flag for `tcp-close` or `skip-in-flight`; CRIU reads a configuration file
//! named by `CRIU_CONFIG_FILE` before it applies the RPC options (`criu swrk` parses the default
//! configuration files at start), and runc sets neither option over RPC, so [`CriuConf`] writes
//! one and its environment goes to `runc` (or to a small wrapper around `criu` for the RPC path).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

/// The record, next to CRIU's images in `<image>/criu/`.
pub const SOCKETS_FILE: &str = "stasis-sockets.json";

/// One connected TCP socket of the checkpointed tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connection {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The other end belongs to the checkpointed tree too (both ends are in the images).
    pub peer_in_dump: bool,
}

/// What a checkpoint recorded about the tree's TCP sockets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketRecord {
    /// Connected TCP sockets (established, half-closed, connecting).
    pub connections: Vec<Connection>,
    /// Listening TCP sockets (restored as they were, in every case).
    pub listening: Vec<SocketAddr>,
    /// CRIU dumped the connections' state (`tcp-established`); false: `tcp-close` at the dump,
    /// the images hold no state, and a restore can only close them.
    pub state_dumped: bool,
    /// The workload ran on after the dump (leave-running): its connections moved on.
    pub leave_running: bool,
    /// The tree had a network namespace of its own that CRIU dumped and a restore recreates
    /// (process checkpoints; for containers the bundle of the restore says).
    #[serde(default)]
    pub own_netns: bool,
}

/// The network namespace a restore puts the sockets in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The namespace of this process (a host-network container, a process tree).
    Current,
    /// An existing namespace joined by path (a Kubernetes pod's, another container's).
    Joined(PathBuf),
    /// A namespace the restore creates (a container with a network namespace of its own).
    New,
}

/// What a restore does with the checkpoint's connections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "tcp", rename_all = "snake_case")]
pub enum Decision {
    /// Restored as they were (`--tcp-established`).
    Keep { connections: usize },
    /// Restored closed (`tcp-close`): the workload reads end-of-file on them.
    Close { connections: usize, why: String },
}

impl Decision {
    pub fn keeps(&self) -> bool {
        matches!(self, Self::Keep { .. })
    }

    /// One line for the user.
    pub fn describe(&self) -> String {
        match self {
            Self::Keep { connections: 0 } | Self::Close { connections: 0, .. } => {
                "no established TCP connections".into()
            }
            Self::Keep { connections } => {
                format!("{connections} established TCP connection(s) restored")
            }
            Self::Close { connections, why } => {
                format!("{connections} established TCP connection(s) closed: {why}")
            }
        }
    }
}

/// Decides whether a restore into `target` keeps the recorded connections.
///
/// `record`: `None` for a checkpoint made before stasis recorded its sockets (they were dumped
/// with `tcp-established`): kept where the old code kept them (the same network namespace),
/// closed elsewhere. `close`: the user asked for the connections to be closed.
/// `bindable`: whether a local address can be bound in the target namespace.
pub fn decide(
    record: Option<&SocketRecord>,
    target: &Target,
    close: bool,
    bindable: &dyn Fn(IpAddr) -> bool,
) -> Decision {
    let Some(r) = record else {
        return if close || *target != Target::Current {
            Decision::Close {
                connections: 0,
                why: "checkpoint without a socket record, restored outside its network namespace"
                    .into(),
            }
        } else {
            Decision::Keep { connections: 0 }
        };
    };
    let n = r.connections.len();
    let close_because = |why: &str| Decision::Close {
        connections: n,
        why: why.into(),
    };
    if n == 0 {
        // Nothing to keep; closing is the option that can never fail.
        return close_because("none");
    }
    if close {
        return close_because("asked for (--no-tcp-established)");
    }
    if !r.state_dumped {
        return close_because("the checkpoint did not dump them (--no-tcp-established)");
    }
    if *target == Target::New || r.own_netns {
        return close_because("restored into a new network namespace");
    }
    if r.leave_running && r.connections.iter().any(|c| !c.peer_in_dump) {
        return close_because(
            "the workload ran on after the checkpoint, so its peers are past the checkpoint's state",
        );
    }
    if let Some(c) = r.connections.iter().find(|c| !bindable(c.local.ip())) {
        return Decision::Close {
            connections: n,
            why: format!(
                "their local address {} does not exist in the target network namespace",
                c.local.ip()
            ),
        };
    }
    Decision::Keep { connections: n }
}

/// Whether `ip` can be bound (port 0) in the current thread's network namespace: the test CRIU's
/// restore of a connection would pass.
pub fn bindable_here(ip: IpAddr) -> bool {
    std::net::TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Which of `ips` can be bound in the network namespace at `netns` (a thread joins it; the
/// process's own namespace is untouched).
pub fn bindable_in(netns: &Path, ips: &[IpAddr]) -> Result<BTreeSet<IpAddr>, EngineError> {
    let f = std::fs::File::open(netns).map_err(EngineError::io(netns))?;
    let ips = ips.to_vec();
    let path = netns.to_path_buf();
    std::thread::spawn(move || {
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
            EngineError::Io {
                path,
                source: e.into(),
            }
        })?;
        Ok(ips.into_iter().filter(|ip| bindable_here(*ip)).collect())
    })
    .join()
    .unwrap_or_else(|_| Ok(BTreeSet::new()))
}

/// Decides for a restore, looking at the target namespace where needed.
pub fn decide_for(record: Option<&SocketRecord>, target: &Target, close: bool) -> Decision {
    match target {
        Target::Joined(p) => {
            let ips: Vec<IpAddr> = record
                .map(|r| r.connections.iter().map(|c| c.local.ip()).collect())
                .unwrap_or_default();
            let ok = bindable_in(p, &ips).unwrap_or_default();
            decide(record, target, close, &|ip| ok.contains(&ip))
        }
        _ => decide(record, target, close, &bindable_here),
    }
}

/// Reads the record of an image's `criu/` directory (`None`: none, or unreadable).
pub fn read_record(criu_dir: &Path) -> Option<SocketRecord> {
    let raw = std::fs::read(criu_dir.join(SOCKETS_FILE)).ok()?;
    serde_json::from_slice(&raw).ok()
}

pub fn write_record(criu_dir: &Path, r: &SocketRecord) -> Result<(), EngineError> {
    let p = criu_dir.join(SOCKETS_FILE);
    std::fs::write(&p, serde_json::to_vec_pretty(r).unwrap_or_default())
        .map_err(EngineError::io(&p))
}

/// TCP states CRIU treats as a connection (`tcp_connection()`): ESTABLISHED, SYN_SENT,
/// FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING.
fn connected_state(st: u8) -> bool {
    matches!(st, 0x01 | 0x02 | 0x04 | 0x05 | 0x08 | 0x09 | 0x0B)
}
const LISTEN: u8 = 0x0A;

/// One line of `/proc/net/tcp` or `tcp6`: (local, remote, state, inode).
fn parse_line(line: &str) -> Option<(SocketAddr, SocketAddr, u8, u64)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let local = parse_addr(f.get(1)?)?;
    let remote = parse_addr(f.get(2)?)?;
    let st = u8::from_str_radix(f.get(3)?, 16).ok()?;
    let inode = f.get(9)?.parse().ok()?;
    Some((local, remote, st, inode))
}

/// `0100007F:2329` (IPv4: one native-endian word) or 32 hex digits (IPv6: four native-endian
/// words) and a port. IPv4-mapped IPv6 addresses come back as IPv4.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (a, p) = s.split_once(':')?;
    let port = u16::from_str_radix(p, 16).ok()?;
    let word = |h: &str| u32::from_str_radix(h, 16).ok().map(u32::to_ne_bytes);
    let ip = match a.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(a)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(a.get(i * 8..i * 8 + 8)?)?);
            }
            let v6 = Ipv6Addr::from(b);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The TCP sockets the processes `pids` hold, from `/proc` (each network namespace read once).
pub fn scan(pids: &[i32]) -> SocketRecord {
    let mut inodes = BTreeSet::new();
    let mut netns: BTreeMap<PathBuf, i32> = BTreeMap::new();
    for &pid in pids {
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
            for e in rd.flatten() {
                if let Ok(t) = std::fs::read_link(e.path()) {
                    let t = t.to_string_lossy();
                    if let Some(n) = t
                        .strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .and_then(|n| n.parse::<u64>().ok())
                    {
                        inodes.insert(n);
                    }
                }
            }
        }
        if let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/net")) {
            netns.entry(ns).or_insert(pid);
        }
    }
    let mut rec = SocketRecord::default();
    for pid in netns.values() {
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
                continue;
            };
            for (local, remote, st, inode) in text.lines().skip(1).filter_map(parse_line) {
                if !inodes.contains(&inode) {
                    continue;
                }
                if st == LISTEN {
                    rec.listening.push(local);
                } else if connected_state(st) {
                    rec.connections.push(Connection {
                        local,
                        remote,
                        peer_in_dump: false,
                    });
                }
            }
        }
    }
    let ends: BTreeSet<(SocketAddr, SocketAddr)> = rec
        .connections
        .iter()
        .map(|c| (c.local, c.remote))
        .collect();
    for c in &mut rec.connections {
        c.peer_in_dump = ends.contains(&(c.remote, c.local));
    }
    rec.listening.sort();
    rec.listening.dedup();
    rec
}

/// Whether the process's network namespace differs from this process's.
pub fn own_netns(pid: i32) -> bool {
    match (
        std::fs::read_link(format!("/proc/{pid}/ns/net")),
        std::fs::read_link("/proc/self/ns/net"),
    ) {
        (Ok(a), Ok(b)) => a != b,
        _ => false,
    }
}

/// A CRIU configuration file for one dump or restore, with the options runc cannot pass
/// (`tcp-close`, `skip-in-flight`), removed on drop.
#[derive(Debug)]
pub struct CriuConf {
    pub path: PathBuf,
    /// For CRIU's RPC path (no runc in between): a script that runs `criu` with the file.
    wrapper: Option<PathBuf>,
}

/// The environment variable CRIU reads its extra configuration file from.
pub const CRIU_CONFIG_ENV: &str = "CRIU_CONFIG_FILE";

impl CriuConf {
    /// Writes `<dir>/stasis-criu.conf` with the given options (one per line, CRIU's long option
    /// names without dashes).
    pub fn write(dir: &Path, options: &[&str]) -> Result<Self, EngineError> {
        let path = dir.join("stasis-criu.conf");
        let mut text = String::from("# written by stasis for one dump or restore\n");
        for o in options {
            text.push_str(o);
            text.push('\n');
        }
        std::fs::write(&path, text).map_err(EngineError::io(&path))?;
        Ok(Self {
            path,
            wrapper: None,
        })
    }

    /// A script next to the file that runs `criu` (at `criu`) with `CRIU_CONFIG_FILE` set, for
    /// CRIU's RPC client, which spawns `criu swrk` itself with this process's environment.
    pub fn criu_wrapper(&mut self, criu: &Path) -> Result<PathBuf, EngineError> {
        use std::os::unix::fs::PermissionsExt;
        let w = self.path.with_file_name("stasis-criu.sh");
        let quote = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', r"'\''"));
        let text = format!(
            "#!/bin/sh\n{CRIU_CONFIG_ENV}={} exec {} \"$@\"\n",
            quote(&self.path),
            quote(criu)
        );
        std::fs::write(&w, text).map_err(EngineError::io(&w))?;
        std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o700))
            .map_err(EngineError::io(&w))?;
        self.wrapper = Some(w.clone());
        Ok(w)
    }
}

impl Drop for CriuConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(w) = &self.wrapper {
            let _ = std::fs::remove_file(w);
        }
    }
}

/// The CRIU options of a dump: connections are dumped (`--tcp-established`, which stasis passes
/// itself) unless `close`, and connections half-way through a listening socket's accept queue are
/// left out (`skip-in-flight`: their clients retry), so a busy server's checkpoints do not fail.
/// `nftables`: CRIU locks the network with nftables ([`nftables_lock`]).
pub fn dump_options(close: bool, nftables: bool) -> Vec<&'static str> {
    let mut o = vec!["skip-in-flight"];
    if close {
        o.push("tcp-close");
    }
    if nftables {
        o.push("network-lock nftables");
    }
    o
}

/// Whether CRIU should lock the network with nftables (`criu check --feature
/// network_lock_nftables`, asked once per process) rather than its default, iptables. nftables
/// runs inside CRIU (libnftables); iptables is a program CRIU runs, and the agent runs CRIU with
/// `chroot /host`, a root that CRIU loses when it comes back from the dumped container's mount
/// namespace: its unlock then finds no `iptables-restore` and the pod's network namespace stays
/// locked (a `CRIU` chain that drops everything, one more jump per heartbeat) — seen on the local
/// cluster, where a pod stopped answering its readiness probe after its first checkpoint. The
/// restore takes the method from the checkpoint's inventory.
pub fn nftables_lock(criu: &Path) -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        std::process::Command::new(criu)
            .args(["check", "--feature", "network_lock_nftables"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// CRIU's network lock (`iptables_network_lock_internal`): the rules it loads into a namespace
/// while it dumps established connections, with the mark its own packets carry.
const LOCK_RULES: &str = "*filter\n:CRIU - [0:0]\n-I INPUT -j CRIU\n-I OUTPUT -j CRIU\n-A CRIU -m mark --mark 0xC114 -j ACCEPT\n-A CRIU -j DROP\nCOMMIT\n";

/// What checkpoints and restores of sockets need on this machine, tried for real (for `stasis
/// doctor`): CRIU takes the options stasis hands it in a configuration file (`tcp-close`,
/// `skip-in-flight`; a file with an unknown option must fail, so the file is really read), and
/// CRIU's network lock loads (`iptables-restore` with the mark match, in a throwaway network
/// namespace). `Ok`: a summary; `Err`: what fails and the fix.
pub fn probe(criu: &Path) -> Result<String, (String, String)> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let dir = std::env::temp_dir().join(format!("stasis-doctor-{}", std::process::id()));
    let fail = |what: String, fix: &str| (what, fix.to_owned());
    std::fs::create_dir_all(&dir).map_err(|e| {
        fail(
            format!("{}: {e}", dir.display()),
            "a writable temporary directory ($TMPDIR)",
        )
    })?;
    let run_check = |options: &[&str]| -> Result<bool, String> {
        let conf = CriuConf::write(&dir, options).map_err(|e| e.to_string())?;
        Command::new(criu)
            .arg("check")
            .env(CRIU_CONFIG_ENV, &conf.path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .map_err(|e| format!("cannot run {}: {e}", criu.display()))
    };
    let nft = nftables_lock(criu);
    let known = run_check(&dump_options(true, nft));
    let bogus = run_check(&["stasis-doctor-no-such-option"]);
    let _ = std::fs::remove_dir(&dir);
    match (known, bogus) {
        (Err(e), _) | (_, Err(e)) => return Err(fail(e, "install CRIU >= 4.2 (scripts/setup)")),
        (Ok(false), _) => {
            return Err(fail(
                "CRIU refuses the options tcp-close and skip-in-flight in its configuration file".into(),
                "install CRIU >= 4.2 (scripts/setup)",
            ))
        }
        (Ok(true), Ok(true)) => {
            return Err(fail(
                format!("CRIU does not read {CRIU_CONFIG_ENV}: servers' checkpoints fail on connections being accepted, and connections cannot be closed at a restore"),
                "use a CRIU that reads its configuration files (a build or wrapper without --no-default-config)",
            ))
        }
        (Ok(true), Ok(false)) => {}
    }
    if nft {
        return Ok(
            "CRIU takes tcp-close and skip-in-flight from stasis's configuration file, and locks the network with nftables (inside CRIU): connections are dumped, a server accepting connections checkpoints, and a restore closes what it cannot keep"
                .into(),
        );
    }
    let lock = Command::new("unshare")
        .args(["--net", "iptables-restore", "-w"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            if let Some(mut i) = c.stdin.take() {
                i.write_all(LOCK_RULES.as_bytes())?;
            }
            c.wait_with_output()
        });
    match lock {
        Ok(o) if o.status.success() => Ok(
            "CRIU takes tcp-close and skip-in-flight from stasis's configuration file, and its network lock loads (iptables-restore, mark match): connections are dumped, a server accepting connections checkpoints, and a restore closes what it cannot keep"
                .into(),
        ),
        Ok(o) => Err(fail(
            format!(
                "CRIU's network lock does not load in a network namespace: iptables-restore: {}",
                crate::tools::tail(&o.stderr, 2)
            ),
            "install iptables and a kernel with the xt_mark match (CONFIG_NETFILTER_XT_MARK)",
        )),
        Err(e) => Err(fail(
            format!("cannot run unshare --net iptables-restore: {e}"),
            "install util-linux and iptables (scripts/setup)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(l: &str, r: &str, peer: bool) -> Connection {
        Connection {
            local: l.parse().unwrap(),
            remote: r.parse().unwrap(),
            peer_in_dump: peer,
        }
    }

    fn rec(conns: Vec<Connection>, leave_running: bool) -> SocketRecord {
        SocketRecord {
            connections: conns,
            listening: vec!["0.0.0.0:9000".parse().unwrap()],
            state_dumped: true,
            leave_running,
            own_netns: false,
        }
    }

    #[test]
    fn proc_net_tcp_lines_parse() {
        let l = "   0: 0100007F:2329 0100007F:B0F6 01 00000000:00000000 00:00000000 00000000     0        0 633333 1 0000000000000000 20 4 30 10 -1";
        let (a, b, st, ino) = parse_line(l).unwrap();
        assert_eq!(a, "127.0.0.1:9001".parse().unwrap());
        assert_eq!(b, "127.0.0.1:45302".parse().unwrap());
        assert_eq!((st, ino), (1, 633333));
        let l6 = "   1: 0000000000000000FFFF00000100007F:2329 00000000000000000000000001000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1";
        let (a, b, st, _) = parse_line(l6).unwrap();
        assert_eq!(
            a,
            "127.0.0.1:9001".parse().unwrap(),
            "v4-mapped comes back as v4"
        );
        assert_eq!(b, "[::1]:0".parse().unwrap());
        assert_eq!(st, LISTEN);
        assert!(parse_line("  sl  local_address rem_address   st tx_queue").is_none());
    }

    #[test]
    fn scan_finds_own_listening_and_connected_sockets_and_pairs_them() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let r = scan(&[std::process::id() as i32]);
        assert!(r.listening.contains(&l.local_addr().unwrap()), "{r:?}");
        for s in [&a, &b] {
            let c = r
                .connections
                .iter()
                .find(|c| c.local == s.local_addr().unwrap())
                .unwrap_or_else(|| panic!("{s:?} missing from {r:?}"));
            assert!(c.peer_in_dump, "both ends are ours: {c:?}");
        }
    }

    #[test]
    fn the_rule() {
        let yes = |_: IpAddr| true;
        let no = |_: IpAddr| false;
        let ext = conn("10.0.0.5:9000", "10.0.0.9:51000", false);
        let int = conn("127.0.0.1:9000", "127.0.0.1:51000", true);
        let keep = |d: Decision| d.keeps();
        // Stop mode, same namespace, address there: kept.
        assert!(keep(decide(
            Some(&rec(vec![ext.clone()], false)),
            &Target::Current,
            false,
            &yes
        )));
        // ... but not when asked, into a new netns, or where the address is gone.
        assert!(!keep(decide(
            Some(&rec(vec![ext.clone()], false)),
            &Target::Current,
            true,
            &yes
        )));
        assert!(!keep(decide(
            Some(&rec(vec![ext.clone()], false)),
            &Target::New,
            false,
            &yes
        )));
        let d = decide(
            Some(&rec(vec![ext.clone()], false)),
            &Target::Current,
            false,
            &no,
        );
        assert!(d.describe().contains("10.0.0.5"), "{}", d.describe());
        // Leave-running: an external peer moved on, closed; both ends dumped, kept.
        assert!(!keep(decide(
            Some(&rec(vec![ext.clone()], true)),
            &Target::Current,
            false,
            &yes
        )));
        assert!(keep(decide(
            Some(&rec(vec![int.clone()], true)),
            &Target::Current,
            false,
            &yes
        )));
        assert!(!keep(decide(
            Some(&rec(vec![int, ext.clone()], true)),
            &Target::Current,
            false,
            &yes
        )));
        // Not dumped (checkpoint --no-tcp-established): only closed.
        let mut nd = rec(vec![ext.clone()], false);
        nd.state_dumped = false;
        assert!(!keep(decide(Some(&nd), &Target::Current, false, &yes)));
        // The tree's own namespace is recreated: closed.
        let mut own = rec(vec![ext], false);
        own.own_netns = true;
        assert!(!keep(decide(Some(&own), &Target::Current, false, &yes)));
        // No connections: close (never fails); no record: the old behaviour in place only.
        assert!(!keep(decide(
            Some(&rec(vec![], false)),
            &Target::Current,
            false,
            &yes
        )));
        assert!(keep(decide(None, &Target::Current, false, &yes)));
        assert!(!keep(decide(None, &Target::New, false, &yes)));
    }

    #[test]
    fn probe_catches_a_criu_that_ignores_its_configuration_file() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let fake = d.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (what, _fix) = probe(&fake).unwrap_err();
        assert!(what.contains("does not read CRIU_CONFIG_FILE"), "{what}");
        // One that knows neither option.
        std::fs::write(
            &fake,
            "#!/bin/sh\ngrep -q tcp-close \"$CRIU_CONFIG_FILE\" && exit 1\nexit 0\n",
        )
        .unwrap();
        let (what, _fix) = probe(&fake).unwrap_err();
        assert!(what.contains("refuses the options"), "{what}");
    }

    #[test]
    fn conf_file_and_wrapper_are_written_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let mut c = CriuConf::write(d.path(), &dump_options(true, true)).unwrap();
        let text = std::fs::read_to_string(&c.path).unwrap();
        assert!(
            text.contains("\nskip-in-flight\ntcp-close\nnetwork-lock nftables\n"),
            "{text}"
        );
        let w = c.criu_wrapper(Path::new("/opt/it's/criu")).unwrap();
        let s = std::fs::read_to_string(&w).unwrap();
        assert!(s.contains(r"exec '/opt/it'\''s/criu' "), "{s}");
        drop(c);
        assert!(!w.exists());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
