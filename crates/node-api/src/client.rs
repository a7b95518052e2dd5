//! A synchronous client of the agent socket, bounded in time everywhere: connect (a non-blocking
//! connect, retried while the agent's backlog is full), write and read each stop at a deadline.
//! A missing or dead agent fails within microseconds (`ENOENT` / `ECONNREFUSED`).

use std::io::{self, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::codec::{read_message, write_message, CodecError};
use crate::proto::*;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nobody listens (no socket file, or a stale one): the agent is not running.
    #[error("no agent at {path}: {source}")]
    NoAgent { path: PathBuf, source: io::Error },
    #[error("agent at {path}: {what} timed out after {after_ms} ms")]
    Timeout {
        path: PathBuf,
        what: &'static str,
        after_ms: u64,
    },
    #[error("agent at {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("agent at {path}: {source}")]
    Codec { path: PathBuf, source: CodecError },
    #[error("agent speaks protocol version {got}, this client {PROTOCOL_VERSION}")]
    Version { got: u32 },
    #[error("agent refused the request: {reason}")]
    Agent { reason: String },
    #[error("unexpected answer from the agent: {got}")]
    Unexpected { got: String },
}

impl ClientError {
    /// The agent is not there at all (as opposed to there but slow or broken).
    pub fn is_no_agent(&self) -> bool {
        matches!(self, ClientError::NoAgent { .. })
    }
    pub fn is_timeout(&self) -> bool {
        matches!(self, ClientError::Timeout { .. })
    }
}

/// A client of one agent socket.
#[derive(Debug, Clone)]
pub struct Client {
    pub socket: PathBuf,
    /// The longest a connect may take (only a full backlog makes a unix connect wait).
    pub connect_timeout: Duration,
    /// The longest a whole exchange may take, connect included (final checkpoints add their
    /// own deadline to it).
    pub io_timeout: Duration,
}

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            connect_timeout: Duration::from_millis(100),
            io_timeout: Duration::from_millis(200),
        }
    }

    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    pub fn with_io_timeout(mut self, d: Duration) -> Self {
        self.io_timeout = d;
        self
    }

    /// Connects, bounded by `min(connect_timeout, deadline)`.
    fn connect(&self, deadline: Instant) -> Result<UnixStream, ClientError> {
        let start = Instant::now();
        let until = deadline.min(start + self.connect_timeout);
        let io_err = |e: Errno| ClientError::Io {
            path: self.socket.clone(),
            source: e.into(),
        };
        let addr = UnixAddr::new(self.socket.as_path()).map_err(io_err)?;
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(io_err)?;
        loop {
            match connect(fd.as_raw_fd(), &addr) {
                Ok(()) => break,
                Err(Errno::EINTR) => continue,
                // A unix stream connect only fails with EAGAIN when the listener's backlog is
                // full: the agent is there but busy.
                Err(Errno::EAGAIN) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(Errno::EAGAIN) => {
                    return Err(ClientError::Timeout {
                        path: self.socket.clone(),
                        what: "connect",
                        after_ms: start.elapsed().as_millis() as u64,
                    })
                }
                Err(e @ (Errno::ENOENT | Errno::ECONNREFUSED | Errno::ENOTDIR)) => {
                    return Err(ClientError::NoAgent {
                        path: self.socket.clone(),
                        source: e.into(),
                    })
                }
                Err(e) => return Err(io_err(e)),
            }
        }
        let s = UnixStream::from(fd);
        s.set_nonblocking(false).map_err(|e| ClientError::Io {
            path: self.socket.clone(),
            source: e,
        })?;
        Ok(s)
    }

    fn remaining(
        &self,
        deadline: Instant,
        what: &'static str,
        started: Instant,
    ) -> Result<Duration, ClientError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ClientError::Timeout {
                path: self.socket.clone(),
                what,
                after_ms: started.elapsed().as_millis() as u64,
            });
        }
        Ok(left)
    }

    fn codec_err(
        &self,
        what: &'static str,
        started: Instant,
    ) -> impl Fn(CodecError) -> ClientError + '_ {
        move |e| {
            if e.is_timeout() {
                ClientError::Timeout {
                    path: self.socket.clone(),
                    what,
                    after_ms: started.elapsed().as_millis() as u64,
                }
            } else {
                ClientError::Codec {
                    path: self.socket.clone(),
                    source: e,
                }
            }
        }
    }

    fn send(
        &self,
        body: RequestBody,
        deadline: Instant,
        started: Instant,
    ) -> Result<UnixStream, ClientError> {
        let mut s = self.connect(deadline)?;
        let left = self.remaining(deadline, "write", started)?;
        s.set_write_timeout(Some(left))
            .map_err(|e| ClientError::Io {
                path: self.socket.clone(),
                source: e,
            })?;
        write_message(&mut s, &Request::new(body)).map_err(self.codec_err("write", started))?;
        Ok(s)
    }

    /// One request and its answer, all of it within `total`.
    pub fn call(&self, body: RequestBody, total: Duration) -> Result<ResponseBody, ClientError> {
        let started = Instant::now();
        let deadline = started + total;
        let s = self.send(body, deadline, started)?;
        let left = self.remaining(deadline, "read", started)?;
        s.set_read_timeout(Some(left))
            .map_err(|e| ClientError::Io {
                path: self.socket.clone(),
                source: e,
            })?;
        let resp: Response =
            read_message(&mut BufReader::new(&s)).map_err(self.codec_err("read", started))?;
        if resp.v != PROTOCOL_VERSION {
            return Err(ClientError::Version { got: resp.v });
        }
        match resp.body {
            ResponseBody::Error { reason } => Err(ClientError::Agent { reason }),
            b => Ok(b),
        }
    }

    /// `ping`: the agent's version string.
    pub fn ping(&self) -> Result<String, ClientError> {
        match self.call(RequestBody::Ping, self.io_timeout)? {
            ResponseBody::Pong { agent } => Ok(agent),
            other => Err(unexpected(&other)),
        }
    }

    /// `restore_plan`, within `io_timeout`.
    pub fn restore_plan(&self, req: RestorePlanRequest) -> Result<PlanAnswer, ClientError> {
        match self.call(RequestBody::RestorePlan(req), self.io_timeout)? {
            ResponseBody::Plan(p) => Ok(PlanAnswer::Plan(p)),
            ResponseBody::NoPlan { reason } => Ok(PlanAnswer::NoPlan { reason }),
            other => Err(unexpected(&other)),
        }
    }

    /// `container_exited`, within `io_timeout`: `Preparing` when the agent is preparing a
    /// restore in place for the container's restart (only with `wait_for_plan`), `Plan` when it
    /// prepared one already (agents that predate `preparing`).
    pub fn container_exited(&self, req: ContainerExitedRequest) -> Result<ExitAnswer, ClientError> {
        let wait_for_plan = req.wait_for_plan;
        match self.call(RequestBody::ContainerExited(req), self.io_timeout)? {
            ResponseBody::Plan(p) => Ok(ExitAnswer::Plan(p)),
            ResponseBody::Preparing {
                checkpoint_ref,
                wait_ms,
            } if wait_for_plan => Ok(ExitAnswer::Preparing {
                checkpoint_ref,
                wait_ms,
            }),
            ResponseBody::NoPlan { reason } => Ok(ExitAnswer::NoPlan { reason }),
            other => Err(unexpected(&other)),
        }
    }

    /// `final_checkpoint`: waits at most `deadline_ms` plus `io_timeout` for the answer.
    pub fn final_checkpoint(
        &self,
        req: FinalCheckpointRequest,
    ) -> Result<CheckpointAnswer, ClientError> {
        let total = Duration::from_millis(req.deadline_ms) + self.io_timeout;
        match self.call(RequestBody::FinalCheckpoint(req), total)? {
            ResponseBody::Done {
                checkpoint_ref,
                end_with_kill,
            } => Ok(CheckpointAnswer::Done {
                checkpoint_ref,
                end_with_kill,
            }),
            ResponseBody::Captured {
                checkpoint_ref,
                end_with_kill,
            } => Ok(CheckpointAnswer::Captured {
                checkpoint_ref,
                end_with_kill,
            }),
            ResponseBody::Skipped { reason } => Ok(CheckpointAnswer::Skipped { reason }),
            ResponseBody::Failed { reason } => Ok(CheckpointAnswer::Failed { reason }),
            other => Err(unexpected(&other)),
        }
    }

    /// `report`: connect and write within `io_timeout`; no answer is read.
    pub fn report(&self, req: ReportRequest) -> Result<(), ClientError> {
        let started = Instant::now();
        self.send(RequestBody::Report(req), started + self.io_timeout, started)
            .map(drop)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

fn unexpected(b: &ResponseBody) -> ClientError {
    ClientError::Unexpected {
        got: serde_json::to_string(b).unwrap_or_else(|_| format!("{b:?}")),
    }
}
