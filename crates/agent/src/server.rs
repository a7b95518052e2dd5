//! The node-api server on `/run/stasis/agent.sock` (0600 in a 0700 directory): one request per
//! connection, one thread per connection (bounded), answers from a [`NodeHandler`].

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

/// Serves until `stop` is set (and one more connection arrives, which [`wake`] provides).
pub fn serve(
    listener: UnixListener,
    handler: Arc<dyn NodeHandler>,
    stop: Arc<AtomicBool>,
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
                if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                    active.fetch_sub(1, Ordering::SeqCst);
                    let _ = write_response(
                        &conn,
                        ResponseBody::Error {
                            reason: "agent busy".into(),
                        },
                    );
                    continue;
                }
                let (h, active) = (handler.clone(), active.clone());
                let spawned = std::thread::Builder::new()
                    .name("node-api-conn".into())
                    .stack_size(256 << 10)
                    .spawn(move || {
                        handle(conn, &*h);
                        active.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    warn!("cannot spawn a connection thread");
                }
            }
        })
        .expect("spawn the node-api thread")
}

/// Unblocks [`serve`]'s accept after `stop` was set.
pub fn wake(path: &std::path::Path) {
    let _ = UnixStream::connect(path);
}
