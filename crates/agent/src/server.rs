//! The node-api server on `/run/stasis/agent.sock` (0600 in a 0700 directory): one request per
//! connection, one thread per connection (bounded), answers from a [`NodeHandler`].

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use stasis_node_api::server::{read_request, write_response};
use stasis_node_api::{
    ContainerExitedRequest, FinalCheckpointRequest, ReportRequest, RequestBody, ResponseBody,
    RestorePlanRequest,
};
use tracing::{debug, warn};

/// Connections served at once; more are answered with an `error`.
pub const MAX_CONNECTIONS: usize = 64;

/// What the agent does with each request.
pub trait NodeHandler: Send + Sync {
    fn restore_plan(&self, req: &RestorePlanRequest) -> ResponseBody;
    /// May block up to the request's deadline.
    fn final_checkpoint(&self, req: &FinalCheckpointRequest) -> ResponseBody;
    fn report(&self, req: &ReportRequest);
    /// A container the runtime is deleting after its processes ended: prepare a restart in
    /// place when it was OOM-killed. Quick (no network): the wrapper waits for the answer.
    fn container_exited(&self, req: &ContainerExitedRequest) -> ResponseBody;
}

fn handle(conn: UnixStream, h: &dyn NodeHandler) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let req = match read_request(&conn) {
        Ok(r) => r,
        Err(e) => {
            debug!(error = %e, "bad node-api request");
            return;
        }
    };
    let op = match &req.body {
        RequestBody::Ping => "ping",
        RequestBody::RestorePlan(_) => "restore_plan",
        RequestBody::FinalCheckpoint(_) => "final_checkpoint",
        RequestBody::ContainerExited(_) => "container_exited",
        RequestBody::Report(_) => "report",
    };
    let _span = tracing::info_span!("node_api", op).entered();
    let body = match &req.body {
        RequestBody::Ping => ResponseBody::Pong {
            agent: format!("stasisd {}", env!("CARGO_PKG_VERSION")),
        },
        RequestBody::RestorePlan(r) => h.restore_plan(r),
        RequestBody::FinalCheckpoint(r) => h.final_checkpoint(r),
        RequestBody::ContainerExited(r) => h.container_exited(r),
        RequestBody::Report(r) => {
            h.report(r);
            return;
        }
    };
    if let Err(e) = write_response(&conn, body) {
        debug!(error = %e, "could not answer a node-api request");
    }
}

/// One connection's place among the [`MAX_CONNECTIONS`]: given back when dropped, which is
/// also when its thread could not be started (the closure that holds it is dropped then).
struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A place, or `None` when every one is taken.
    fn take(active: &Arc<AtomicUsize>) -> Option<Slot> {
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot(active.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts a connection's thread.
type Spawn = fn(Box<dyn FnOnce() + Send>) -> std::io::Result<()>;

fn connection_thread(f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("node-api-conn".into())
        .stack_size(256 << 10)
        .spawn(f)
        .map(drop)
}

/// The node-api server, running on its own thread until [`Server::stop`].
pub struct Server {
    thread: JoinHandle<()>,
    /// The accepting socket itself (a second handle on it), to wake the accept at stop.
    listener: UnixListener,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Sets `stop`, wakes the accept and waits for the server's thread (the connections in
    /// progress finish on their own threads). The accept is woken by shutting the listening
    /// socket down, never by connecting to its path: in a rolling update the next agent has
    /// bound the path anew before this one stops, so a connection there reached the next
    /// agent, this one's accept never returned, and the old agent pod waited for the
    /// kubelet's SIGKILL at the end of its grace period (60 s per node).
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both)
        {
            warn!(error = %e, "cannot shut the node-api socket down");
        }
        let _ = self.thread.join();
    }
}

/// Serves until [`Server::stop`] (or until `stop` is set and one more connection arrives).
pub fn serve(
    listener: UnixListener,
    handler: Arc<dyn NodeHandler>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<Server> {
    let accepting = listener.try_clone()?;
    Ok(Server {
        thread: serve_with(accepting, handler, stop.clone(), connection_thread),
        listener,
        stop,
    })
}

fn serve_with(
    listener: UnixListener,
    handler: Arc<dyn NodeHandler>,
    stop: Arc<AtomicBool>,
    spawn: Spawn,
) -> JoinHandle<()> {
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("node-api".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                };
                let Some(slot) = Slot::take(&active) else {
                    let _ = write_response(
                        &conn,
                        ResponseBody::Error {
                            reason: "agent busy".into(),
                        },
                    );
                    continue;
                };
                let h = handler.clone();
                let spawned = spawn(Box::new(move || {
                    let _slot = slot;
                    handle(conn, &*h);
                }));
                if let Err(e) = spawned {
                    warn!(error = %e, "cannot spawn a connection thread");
                }
            }
        })
        .expect("spawn the node-api thread")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    struct Nothing;
    impl NodeHandler for Nothing {
        fn restore_plan(&self, _: &RestorePlanRequest) -> ResponseBody {
            ResponseBody::NoPlan {
                reason: "test".into(),
            }
        }
        fn final_checkpoint(&self, _: &FinalCheckpointRequest) -> ResponseBody {
            ResponseBody::Skipped {
                reason: "test".into(),
            }
        }
        fn report(&self, _: &ReportRequest) {}
        fn container_exited(&self, _: &ContainerExitedRequest) -> ResponseBody {
            ResponseBody::NoPlan {
                reason: "test".into(),
            }
        }
    }

    static REFUSED: AtomicU32 = AtomicU32::new(0);

    /// Refuses the first `MAX_CONNECTIONS + 1` threads (as a process at its thread limit
    /// does), then starts them.
    fn thread_limit_then_ok(f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
        if REFUSED.fetch_add(1, Ordering::SeqCst) <= MAX_CONNECTIONS as u32 {
            return Err(std::io::Error::other("thread limit"));
        }
        connection_thread(f)
    }

    /// A connection whose thread could not be started gives its place back: after more such
    /// failures than there are places, the server still answers instead of "agent busy"
    /// forever.
    #[test]
    fn a_failed_spawn_gives_its_slot_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = stasis_node_api::server::bind(&path).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let accepting = listener.try_clone().unwrap();
        let server = Server {
            thread: serve_with(
                accepting,
                Arc::new(Nothing),
                stop.clone(),
                thread_limit_then_ok,
            ),
            listener,
            stop,
        };
        let client = stasis_node_api::Client::new(&path)
            .with_connect_timeout(Duration::from_secs(2))
            .with_io_timeout(Duration::from_millis(500));
        for _ in 0..=MAX_CONNECTIONS {
            // Each one fails: its thread never starts, the connection is dropped.
            assert!(client.ping().is_err());
        }
        let answer = client.ping();
        assert!(
            matches!(&answer, Ok(a) if a.starts_with("stasisd")),
            "{answer:?}"
        );
        server.stop();
    }

    /// A rolling update: the next agent binds the socket path anew while this one still runs.
    /// Stopping this one must neither wait for a connection that now goes to the next one nor
    /// disturb the next one.
    #[test]
    fn stop_returns_while_the_next_agent_holds_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let old = serve(
            stasis_node_api::server::bind(&path).unwrap(),
            Arc::new(Nothing),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let next = serve(
            stasis_node_api::server::bind(&path).unwrap(),
            Arc::new(Nothing),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let (done, stopped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            old.stop();
            let _ = done.send(());
        });
        assert!(
            stopped.recv_timeout(Duration::from_secs(5)).is_ok(),
            "the old server did not stop while the next one holds the path"
        );
        let client = stasis_node_api::Client::new(&path)
            .with_connect_timeout(Duration::from_secs(2))
            .with_io_timeout(Duration::from_secs(2));
        let answer = client.ping();
        assert!(
            matches!(&answer, Ok(a) if a.starts_with("stasisd")),
            "the next agent still answers: {answer:?}"
        );
        next.stop();
    }
}
