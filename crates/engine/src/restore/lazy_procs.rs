//! The processes around a lazy restore: `criu lazy-pages`, the `runc` that asks for it, the
//! killer of a container whose memory cannot arrive, and the watchdog that kills it if stasis
//! dies mid-transfer.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::error::EngineError;
use crate::runc::Runc;
use crate::tools;

/// Starts `criu lazy-pages` on the images in `criu_dir` with its page server on `sock`, and
/// waits until it listens for the restore on `lazy-pages.socket` in `work`.
pub(super) fn start_daemon(
    criu_dir: &Path,
    work: &Path,
    log: &Path,
    sock: UnixStream,
) -> Result<Child, EngineError> {
    let (criu, _) = tools::criu_checked()?;
    let (ready_r, ready_w) = cloexec_pipe(criu_dir)?;
    let sock_fd = inheritable(OwnedFd::from(sock), criu_dir)?;
    let ready_fd = inheritable(ready_w, criu_dir)?;
    let child = Command::new(&criu)
        .arg("lazy-pages")
        .arg("-D")
        .arg(criu_dir)
        .arg("-W")
        .arg(work)
        .args(["--page-server", "--ps-socket"])
        .arg(sock_fd.as_raw_fd().to_string())
        .arg("--status-fd")
        .arg(ready_fd.as_raw_fd().to_string())
        .arg("-o")
        .arg(log.file_name().unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(EngineError::io(&criu))?;
    drop((sock_fd, ready_fd));
    let mut ready = std::fs::File::from(ready_r);
    let mut b = [0u8; 1];
    if ready.read_exact(&mut b).is_err() {
        let detail =
            tools::criu_log_errors(log).unwrap_or_else(|| "it wrote no error (see its log)".into());
        return Err(EngineError::ToolFailed {
            what: "criu lazy-pages".into(),
            detail: format!("it did not start: {detail}"),
            log: Some(log.to_path_buf()),
        });
    }
    Ok(child)
}

/// A pipe whose ends no child inherits unless it is handed one (`Stdio::from`, or
/// [`inheritable`]). A plain `pipe(2)` leaked both ends into every process started meanwhile: the
/// watchdog held the write end of its own stdin, so it never saw the end of the process that
/// started it, and a `criu lazy-pages` daemon that no restore used waited forever.
fn cloexec_pipe(what: &Path) -> Result<(OwnedFd, OwnedFd), EngineError> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| EngineError::io(what)(e.into()))
}

/// A copy of `fd` that a child process inherits (the original keeps its close-on-exec).
pub(super) fn inheritable(fd: OwnedFd, what: &Path) -> Result<OwnedFd, EngineError> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::empty()))
        .map_err(|e| EngineError::io(what)(e.into()))?;
    Ok(fd)
}

/// The container a lazy restore's pages go to, which a failure must end.
pub enum KillTarget {
    /// A container this process restores: `runc restore` is its child (`stasis restore --lazy`).
    Container {
        runc: Runc,
        id: String,
        /// `runc restore` has returned.
        restore_finished: Arc<AtomicBool>,
    },
    /// A container another process restores with the work dir `dir` (`stasis-runc create` on
    /// a plan the agent serves; the daemon listens there): it announces the container there
    /// before its `runc restore` and the outcome after it ([`announce`], [`announce_outcome`]).
    Announced { dir: PathBuf },
}

impl KillTarget {
    fn describe(&self) -> String {
        match self {
            KillTarget::Container { id, .. } => id.clone(),
            KillTarget::Announced { dir } => {
                announced(dir).map_or_else(|| format!("(none yet, {})", dir.display()), |a| a.id)
            }
        }
    }
}

/// Ends the container after a failure: as soon as runc knows it (a failure can come while
/// `runc restore` still runs), and until it is gone.
pub(super) struct Killer {
    pub(super) target: KillTarget,
    /// `criu lazy-pages`, stopped once the container is dead: it would wait for the answer
    /// it never gets (spinning: the watchdog holds the socket open).
    pub(super) daemon: i32,
}

impl Killer {
    pub(super) fn id(&self) -> String {
        self.target.describe()
    }

    pub(super) fn kill(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        // Found once (it runs `runc --version`), not on every pass.
        let mut own_runc: Option<Runc> = None;
        loop {
            // What to do now: kill the tasks of a `runc restore` in progress (below `parent`),
            // remove a restored container, or nothing more.
            let (restoring_under, restored): (Option<i32>, Option<(Runc, String)>) =
                match &self.target {
                    KillTarget::Container {
                        runc,
                        id,
                        restore_finished,
                    } => match restore_finished.load(Ordering::SeqCst) {
                        false => (Some(std::process::id() as i32), None),
                        true => (None, Some((runc.clone(), id.clone()))),
                    },
                    KillTarget::Announced { dir } => match announced(dir) {
                        // No container was restored from these files: nothing runs on them.
                        None => break,
                        Some(a) => match a.outcome {
                            None => (Some(a.pid), None),
                            Some(false) => break,
                            Some(true) => (
                                None,
                                Some((
                                    own_runc.get_or_insert_with(|| a.killer_runc()).clone(),
                                    a.id,
                                )),
                            ),
                        },
                    },
                };
            if let Some(parent) = restoring_under {
                // CRIU's restorer itself touches lazy pages (the TLS, when it registers rseq),
                // so `runc restore` cannot finish while a page it needs is held back: end the
                // tasks being restored (and CRIU), and runc reports the restore failed.
                kill_restoring_tasks(parent);
            }
            if let Some((runc, id)) = restored {
                match runc.exists(&id) {
                    Ok(true) => {
                        if let Err(e) = runc.delete_force(&id) {
                            warn!(container = %id, error = %e, "cannot remove the container yet");
                        }
                    }
                    Ok(false) => break,
                    Err(_) => {}
                }
            }
            if Instant::now() > deadline {
                warn!(container = %self.id(), "gave up killing the container after a failed lazy restore");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Our own unreaped child: the pid is still its.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.daemon),
            nix::sys::signal::SIGKILL,
        );
    }
}

/// The file in a lazy restore's work dir that names the container restored from it.
const TARGET_FILE: &str = ".lazy-target";
/// The file that says how its `runc restore` ended (`restored` or `failed`).
const OUTCOME_FILE: &str = ".lazy-outcome";

/// The file that names the processes serving a lazy restore whose container another process
/// restores ([`KillTarget::Announced`]): the daemon and the watchdog, one pid per line.
const HELPERS_FILE: &str = ".lazy-helpers";

/// Names the processes serving the restore with the work dir `dir`, for [`adopt_helpers`].
pub(super) fn record_helpers(dir: &Path, pids: &[i32]) -> std::io::Result<()> {
    let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
    write_replacing(&dir.join(HELPERS_FILE), &text)
}

/// The processes [`record_helpers`] named for `dir`, each checked to be the one named (it has
/// `dir` among its arguments: a pid reused by another process is not it). An error says which
/// one is gone.
fn helpers(dir: &Path) -> Result<Vec<i32>, String> {
    let raw = std::fs::read_to_string(dir.join(HELPERS_FILE)).map_err(|e| {
        format!(
            "no process serving the restore is named in {} ({e})",
            dir.display()
        )
    })?;
    let pids: Vec<i32> = raw.lines().filter_map(|l| l.trim().parse().ok()).collect();
    if pids.is_empty() {
        return Err(format!(
            "no process serving the restore is named in {}",
            dir.display()
        ));
    }
    let serves = |pid: i32| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            c.split(|b| *b == 0)
                .any(|a| a == dir.as_os_str().as_encoded_bytes())
        })
    };
    match pids.iter().find(|p| !serves(**p)) {
        Some(gone) => Err(format!("process {gone} serving the restore is gone")),
        None => Ok(pids),
    }
}

/// Whether every process serving the restore with the work dir `dir` still runs.
pub fn helpers_alive(dir: &Path) -> bool {
    helpers(dir).is_ok()
}

/// Moves the processes serving the restore with the work dir `dir` (the `criu lazy-pages`
/// daemon, which holds the userfaultfds, and the watchdog, which holds the page server's
/// socket) into the caller's cgroups, out of the agent's container: there they die with the
/// agent (its runtime kills every process left in its cgroups), the daemon's userfaultfds close
/// and the pages that had not arrived read as zeros. Outside, the watchdog sees the agent gone
/// and ends the container first. Called by the wrapper before `runc restore --lazy-pages`.
pub fn adopt_helpers(dir: &Path) -> Result<(), String> {
    for pid in helpers(dir)? {
        crate::cgroup::move_into_own_cgroups(pid).map_err(|e| {
            format!("cannot move process {pid} serving the restore out of the agent's cgroups: {e}")
        })?;
    }
    Ok(())
}

/// A container restored lazily by another process (announced in the work dir).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// The runc that restores it, and its root.
    pub runc: PathBuf,
    pub root: PathBuf,
    pub id: String,
    /// The process whose `runc` child restores it.
    pub pid: i32,
    /// How its `runc restore` ended; `None`: still running.
    pub outcome: Option<bool>,
}

impl Announcement {
    /// The runc that ends the announced container from this process: its own (`$STASIS_RUNC`,
    /// else on `PATH`: the agent's reaches the node's runc from its container, where the path
    /// the wrapper runs need not exist), else the wrapper's; on the announced root.
    fn killer_runc(&self) -> Runc {
        Runc::new(Some(&self.root))
            .ok()
            .filter(|r| {
                Command::new(&r.binary)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .unwrap_or_else(|| Runc {
                binary: self.runc.clone(),
                root: self.root.clone(),
            })
    }
}

/// Names the container about to be restored with the work dir `dir` (before `runc restore`
/// starts) from `checkpoint_ref`, so that the page server can end it if its memory cannot
/// arrive. One line per field (the watchdog reads it with `sh`): runc, root, id, pid, checkpoint.
pub fn announce(
    dir: &Path,
    runc: &Runc,
    id: &str,
    pid: i32,
    checkpoint_ref: &str,
) -> std::io::Result<()> {
    let fields = [
        runc.binary.to_string_lossy().into_owned(),
        runc.root.to_string_lossy().into_owned(),
        id.to_owned(),
        pid.to_string(),
        checkpoint_ref.to_owned(),
    ];
    if fields.iter().any(|f| f.contains('\n')) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a runc path or container id with a newline",
        ));
    }
    let _ = std::fs::remove_file(dir.join(OUTCOME_FILE));
    write_replacing(&dir.join(TARGET_FILE), &(fields.join("\n") + "\n"))
}

/// Records how the announced container's `runc restore` ended.
pub fn announce_outcome(dir: &Path, restored: bool) -> std::io::Result<()> {
    let what = if restored { "restored\n" } else { "failed\n" };
    write_replacing(&dir.join(OUTCOME_FILE), what)
}

fn write_replacing(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// The file the watchdog leaves when it killed a restored container whose memory could not
/// arrive (its agent died): the container's announcement.
const KILLED_FILE: &str = ".lazy-killed";

/// The checkpoint of a container restored with the work dir `dir` that the watchdog killed
/// because its memory could not arrive, if any; the record is removed (it is acted on once).
pub fn take_killed(dir: &Path) -> Option<String> {
    let file = dir.join(KILLED_FILE);
    let raw = std::fs::read_to_string(&file).ok()?;
    let _ = std::fs::remove_file(&file);
    raw.lines()
        .nth(4)
        .filter(|r| !r.is_empty())
        .map(str::to_owned)
}

/// The container announced in `dir`, if any.
pub fn announced(dir: &Path) -> Option<Announcement> {
    let raw = std::fs::read_to_string(dir.join(TARGET_FILE)).ok()?;
    let mut l = raw.lines();
    let (runc, root, id, pid) = (l.next()?, l.next()?, l.next()?, l.next()?);
    let outcome = std::fs::read_to_string(dir.join(OUTCOME_FILE))
        .ok()
        .map(|s| s.trim() == "restored");
    Some(Announcement {
        runc: runc.into(),
        root: root.into(),
        id: id.to_owned(),
        pid: pid.parse().ok()?,
        outcome,
    })
}

/// SIGKILLs everything below the `runc` children of `parent` (the `runc restore` in
/// progress): CRIU and the tasks it is restoring, which may sit in a page fault that will not be
/// answered (a fatal signal ends that wait).
fn kill_restoring_tasks(parent: i32) {
    let procs: Vec<(i32, i32, String)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (head, rest) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1.to_owned();
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid, comm))
        })
        .collect();
    let mut below: Vec<i32> = procs
        .iter()
        .filter(|(_, ppid, comm)| *ppid == parent && comm == "runc")
        .map(|(pid, _, _)| *pid)
        // Only a `runc restore`: after a failed restore the wrapper runs `runc create` for a
        // cold start, whose processes must live.
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"restore"))
        })
        .collect();
    let mut i = 0;
    while i < below.len() {
        let parent = below[i];
        below.extend(procs.iter().filter(|p| p.1 == parent).map(|p| p.0));
        i += 1;
    }
    for pid in below
        .into_iter()
        .filter(|p| procs.iter().any(|q| q.0 == *p && q.2 != "runc"))
    {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
}

/// The watchdog of a container announced in the work dir `$0` (the daemon: `$1`), in `sh`
/// (busybox's in the agent's image). Told nothing (the agent died): no restore may connect any
/// more (the socket goes first); a `runc restore` of the announced container still running
/// cannot get the pages it waits for (CRIU's restorer touches lazy pages itself), so CRIU and
/// the tasks it restores (the children and grandchildren of the wrapper's `runc restore`) are
/// killed until the wrapper records the outcome, and runc reports the restore failed; a
/// container restored is killed, its announcement kept as `.lazy-killed` (the restarted
/// container's create asks the next agent to restore it again: [`take_killed`]). Only then the
/// daemon, so that no page is read as zeros.
const ANNOUNCED_WATCHDOG: &str = r#"read x; [ "$x" = done ] && exit 0
rm -f "$0/lazy-pages.socket"
restoring() {
  read -r _ rc _ rp _ < "/proc/$1/stat" 2>/dev/null && [ "$rc" = "(runc)" ] && [ "$rp" = "$w" ] &&
    tr '\0' '\n' < "/proc/$1/cmdline" | grep -qx restore
}
if [ -f "$0/.lazy-target" ]; then
  w=$(sed -n 4p "$0/.lazy-target")
  while [ ! -f "$0/.lazy-outcome" ] && kill -0 "$w" 2>/dev/null; do
    for s in /proc/[0-9]*/stat; do
      read -r p _ _ pp _ < "$s" 2>/dev/null || continue
      if restoring "$pp"; then kill -KILL "$p"; continue; fi
      read -r _ _ _ gp _ < "/proc/$pp/stat" 2>/dev/null && restoring "$gp" && kill -KILL "$p"
    done
    sleep 0.1
  done
  if [ "$(cat "$0/.lazy-outcome" 2>/dev/null)" = restored ]; then
    cp "$0/.lazy-target" "$0/.lazy-killed"
    { read r; read root; read id; } < "$0/.lazy-target"
    # This process's runc (the agent's: the wrapper's path need not exist in its mount
    # namespace), else the wrapper's; killed until runc finds it no longer running (5 s at most).
    rc=${STASIS_RUNC:-$(command -v runc)}
    "$rc" --version >/dev/null 2>&1 || rc=$r
    n=0
    while [ -n "$id" ] && [ $n -lt 50 ] && "$rc" --root "$root" kill "$id" KILL 2>/dev/null; do
      n=$((n + 1)); sleep 0.1
    done
  fi
fi
kill -KILL "$1""#;

/// A process in a session of its own that holds the page server's socket and kills the
/// container unless told that the transfer ended: if this process dies mid-transfer, the
/// daemon keeps waiting on the socket (no page is zero-filled) until the container is dead.
pub(super) struct Watchdog {
    tell: Option<std::fs::File>,
    child: Option<Child>,
}

impl Watchdog {
    pub(super) fn start(
        target: &KillTarget,
        sock: &UnixStream,
        daemon: i32,
    ) -> Result<Self, EngineError> {
        // The container to kill: known now, or announced in the work dir by the process that
        // restores it, then only once its `runc restore` has ended `restored` (the watchdog
        // waits for that outcome while the restoring process lives). Then the daemon, which
        // would otherwise wait forever for a restore or for its page server: once the
        // container is dead (or none can connect any more: its socket removed first, before
        // the announcement is looked at), no page of it can be read as zeros.
        let (script, args): (&str, Vec<std::ffi::OsString>) = match target {
            KillTarget::Container { runc, id, .. } => (
                "read x; [ \"$x\" = done ] && exit 0; \"$0\" --root \"$1\" kill \"$2\" KILL; kill -KILL \"$3\"",
                vec![
                    runc.binary.clone().into(),
                    runc.root.clone().into(),
                    id.into(),
                    daemon.to_string().into(),
                ],
            ),
            KillTarget::Announced { dir } => (
                ANNOUNCED_WATCHDOG,
                vec![dir.clone().into(), daemon.to_string().into()],
            ),
        };
        let what = std::env::temp_dir();
        let (r, w) = cloexec_pipe(&what)?;
        let held = sock
            .try_clone()
            .map_err(EngineError::io(&what))
            .and_then(|s| inheritable(OwnedFd::from(s), &what))?;
        let child = Command::new("setsid")
            .args(["sh", "-c", script])
            .args(args)
            .stdin(Stdio::from(r))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| EngineError::ToolMissing {
                tool: "setsid/sh".into(),
                hint: format!("cannot start the lazy restore's watchdog: {e}"),
            })?;
        drop(held);
        Ok(Watchdog {
            tell: Some(std::fs::File::from(w)),
            child: Some(child),
        })
    }

    /// The watchdog's pid, while it runs.
    pub(super) fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    pub(super) fn done(&mut self) {
        if let Some(mut t) = self.tell.take() {
            let _ = t.write_all(b"done\n");
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, Instant};

    /// The agent dies while the announced container's `runc restore` still runs: that restore
    /// cannot get its pages (it would wait forever), so the watchdog kills what runs below the
    /// restoring `runc` (CRIU and its tasks; here a `sleep`) until the outcome is recorded, then
    /// the daemon. A `runc` not restoring (the wrapper's cold start) is left alone.
    #[test]
    fn the_watchdog_ends_a_restore_in_progress_when_its_starter_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        // A stand-in `runc` (the kernel names a script's process after the script): its child
        // stands for CRIU; it prints that child's pid and waits for it.
        let runc = bin.join("runc");
        std::fs::write(&runc, "#!/bin/sh\nsleep 60 &\necho $!\nwait\n").unwrap();
        std::fs::set_permissions(&runc, std::fs::Permissions::from_mode(0o755)).unwrap();
        let start = |verb: &str| {
            let mut c = Command::new(&runc)
                .arg(verb)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut line = String::new();
            std::io::BufRead::read_line(
                &mut std::io::BufReader::new(c.stdout.take().unwrap()),
                &mut line,
            )
            .unwrap();
            (c, line.trim().parse::<i32>().unwrap())
        };
        let (mut restoring, criu) = start("restore");
        let (mut creating, init) = start("create");
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        let r = Runc {
            binary: runc.clone(),
            root: dir.path().join("root"),
        };
        announce(&work, &r, "c1", std::process::id() as i32, "ckpt-1").unwrap();
        let mut daemon = Command::new("sleep").arg("60").spawn().unwrap();
        let (sock, _peer) = UnixStream::pair().unwrap();
        let target = KillTarget::Announced { dir: work.clone() };
        let mut dog = Watchdog::start(&target, &sock, daemon.id() as i32).unwrap();
        drop(dog.tell.take());

        let alive = |pid: i32| {
            std::path::Path::new(&format!("/proc/{pid}")).exists()
                && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
        };
        let until = Instant::now() + Duration::from_secs(10);
        let restore_ended = loop {
            if let Some(st) = restoring.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let cold_start_lives = alive(init);
        // The daemon waits for the outcome (the restore's process, this one, still runs).
        let daemon_waited = daemon.try_wait().unwrap().is_none();
        announce_outcome(&work, false).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let daemon_ended = loop {
            if daemon.try_wait().unwrap().is_some() {
                break true;
            }
            if Instant::now() > until {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for c in [&mut creating, &mut restoring, &mut daemon] {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::SIGKILL);
        if let Some(mut c) = dog.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert!(
            restore_ended.is_some() && !alive(criu),
            "the restore in progress was not ended ({restore_ended:?})"
        );
        assert!(
            cold_start_lives,
            "the watchdog killed a runc that does not restore"
        );
        assert!(
            daemon_waited,
            "the daemon was killed before the restore's outcome"
        );
        assert!(daemon_ended, "the daemon was not ended after the outcome");
    }

    /// The process that started the watchdog dies (its end of the pipe closes without "done"):
    /// the watchdog must see it and end the daemon, which would otherwise wait forever.
    #[test]
    fn the_watchdog_ends_the_daemon_when_its_starter_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("criu")).unwrap();
        let mut daemon = Command::new("sleep").arg("60").spawn().unwrap();
        let (sock, _peer) = UnixStream::pair().unwrap();
        let target = KillTarget::Announced {
            dir: dir.path().to_path_buf(),
        };
        let mut dog = Watchdog::start(&target, &sock, daemon.id() as i32).unwrap();
        // A process started meanwhile (as the daemon, runc or another restore's watchdog are)
        // must not hold the watchdog's pipe either.
        let mut bystander = Command::new("sleep").arg("60").spawn().unwrap();
        drop(dog.tell.take());
        let until = Instant::now() + Duration::from_secs(10);
        let ended = loop {
            if let Some(status) = daemon.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = bystander.kill();
        let _ = bystander.wait();
        if ended.is_none() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        if let Some(mut c) = dog.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert!(
            ended.is_some(),
            "the watchdog did not end the daemon after its starter's end of the pipe closed"
        );
    }
}
