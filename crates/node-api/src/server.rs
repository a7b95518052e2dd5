//! The agent's side: binding the socket safely, serving one connection, and [`TestServer`], a
//! std-threads server for tests (the real agent serves the same messages from its own runtime).

use std::io::{self, BufReader};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::codec::{read_message, write_message, CodecError};
use crate::proto::*;

/// Binds the agent socket: parent directory created 0700 if missing, a stale socket replaced
/// (anything else at the path is an error), the socket chmod 0600.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Decodes one request line (for an agent with its own I/O, e.g. an async runtime): `Err` holds
/// the `error` response to send back (another protocol version, or a request that does not parse).
pub fn decode_request(line: &[u8]) -> Result<Request, Response> {
    let refuse = |reason: String| Response::new(ResponseBody::Error { reason });
    let v: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| refuse(format!("bad request: {e}")))?;
    let version = v.get("v").and_then(|x| x.as_u64());
    if version != Some(u64::from(PROTOCOL_VERSION)) {
        return Err(refuse(format!(
            "unsupported protocol version {}; this agent speaks {PROTOCOL_VERSION}",
            version.map_or_else(|| "(none)".to_owned(), |v| v.to_string())
        )));
    }
    serde_json::from_value(v).map_err(|e| refuse(format!("bad request: {e}")))
}

/// Encodes one response as a line (newline included).
pub fn encode_response(body: ResponseBody) -> Vec<u8> {
    let mut b = serde_json::to_vec(&Response::new(body)).unwrap_or_default();
    b.push(b'\n');
    b
}

/// Reads one request from a connection. A request in another protocol version, or one that does
/// not parse, is answered with an `error` response here and returned as `Err`.
pub fn read_request(stream: &UnixStream) -> Result<Request, CodecError> {
    let v: serde_json::Value = read_message(&mut BufReader::new(stream))?;
    let version = v.get("v").and_then(|x| x.as_u64());
    let refuse = |reason: String| {
        let _ = write_message(
            &mut &*stream,
            &Response::new(ResponseBody::Error {
                reason: reason.clone(),
            }),
        );
        reason
    };
    if version != Some(u64::from(PROTOCOL_VERSION)) {
        let r = refuse(format!(
            "unsupported protocol version {}; this agent speaks {PROTOCOL_VERSION}",
            version.map_or_else(|| "(none)".to_owned(), |v| v.to_string())
        ));
        return Err(CodecError::Io(io::Error::new(
            io::ErrorKind::InvalidData,
            r,
        )));
    }
    serde_json::from_value(v).map_err(|e| {
        refuse(format!("bad request: {e}"));
        CodecError::Malformed(e)
    })
}

/// Writes one response.
pub fn write_response(stream: &UnixStream, body: ResponseBody) -> Result<(), CodecError> {
    write_message(&mut &*stream, &Response::new(body))
}

type Handler = dyn Fn(&Request) -> Option<ResponseBody> + Send + Sync;

/// A small agent for tests: serves each connection on its own thread with `handler` (return
/// `None` to answer nothing; sleep in it to play a slow agent) and records every request.
/// Stops and removes its socket when dropped.
pub struct TestServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    requests: Arc<Mutex<Vec<Request>>>,
    thread: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start(
        path: impl Into<PathBuf>,
        handler: impl Fn(&Request) -> Option<ResponseBody> + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let path = path.into();
        let listener = bind(&path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let thread = {
            let (stop, requests) = (stop.clone(), requests.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (handler, requests) = (handler.clone(), requests.clone());
                    std::thread::spawn(move || {
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                        let Ok(req) = read_request(&conn) else { return };
                        requests.lock().unwrap().push(req.clone());
                        if let Some(body) = handler(&req) {
                            let _ = write_response(&conn, body);
                        }
                    });
                }
            })
        };
        Ok(Self {
            path,
            stop,
            requests,
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The requests received so far.
    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    /// Waits until at least `n` requests arrived (or `timeout`), and returns them.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Request> {
        self.wait_until(timeout, |r| r.len() >= n)
    }

    /// Waits until the requests received so far satisfy `done` (or `timeout`),
    /// and returns them. Reports arrive in any order and beside other
    /// requests, so a test waits for the ones it checks, not for a count.
    pub fn wait_until(&self, timeout: Duration, done: impl Fn(&[Request]) -> bool) -> Vec<Request> {
        let until = Instant::now() + timeout;
        loop {
            let r = self.requests();
            if done(&r) || Instant::now() >= until {
                return r;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Client, ClientError};
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;

    fn plan() -> Plan {
        Plan {
            image_dir: "/var/lib/stasis/images/abc".into(),
            rootfs_method: Some(RootfsMethod::ChangedSinceStart),
            checkpoint_ref: "default/counter/7".into(),
            tcp_established: true,
            lazy: false,
            work_dir: None,
        }
    }

    fn agent(req: &Request) -> Option<ResponseBody> {
        Some(match &req.body {
            RequestBody::Ping => ResponseBody::Pong {
                agent: "test".into(),
            },
            RequestBody::RestorePlan(r) if r.pod.container_name == "app" => {
                ResponseBody::Plan(plan())
            }
            RequestBody::RestorePlan(_) => ResponseBody::NoPlan {
                reason: "no PodRestore".into(),
            },
            RequestBody::FinalCheckpoint(f) if f.container_id == "slow" => {
                std::thread::sleep(Duration::from_millis(f.deadline_ms + 300));
                ResponseBody::Done {
                    checkpoint_ref: "late".into(),
                    end_with_kill: false,
                }
            }
            RequestBody::FinalCheckpoint(f) => ResponseBody::Done {
                checkpoint_ref: format!("ref-{}", f.container_id),
                end_with_kill: f.container_id == "job",
            },
            RequestBody::ContainerExited(c) if c.oom_killed && c.wait_for_plan => {
                ResponseBody::Preparing {
                    checkpoint_ref: "l/1".into(),
                    wait_ms: 9_000,
                }
            }
            RequestBody::ContainerExited(c) if c.oom_killed => ResponseBody::Plan(plan()),
            RequestBody::ContainerExited(_) => ResponseBody::NoPlan {
                reason: "not OOM-killed".into(),
            },
            RequestBody::Report(_) => return None,
        })
    }

    #[test]
    fn container_exited_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let srv = TestServer::start(dir.path().join("a.sock"), agent).unwrap();
        let c = Client::new(srv.path());
        let ask = |oom, wait_for_plan| {
            c.container_exited(ContainerExitedRequest {
                container_id: "c1".into(),
                pod: PodRef::default(),
                oom_killed: oom,
                wait_for_plan,
                restore_lost: None,
                memory_lost: false,
            })
            .unwrap()
        };
        assert_eq!(
            ask(true, true),
            ExitAnswer::Preparing {
                checkpoint_ref: "l/1".into(),
                wait_ms: 9_000
            }
        );
        assert_eq!(ask(true, false), ExitAnswer::Plan(plan()));
        assert!(matches!(ask(false, true), ExitAnswer::NoPlan { .. }));
    }

    #[test]
    fn round_trips_through_the_test_server() {
        let t = tempfile::tempdir().unwrap();
        let sock = t.path().join("run/agent.sock");
        let srv = TestServer::start(&sock, agent).unwrap();
        let md = std::fs::metadata(&sock).unwrap();
        assert_eq!(md.mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::metadata(sock.parent().unwrap()).unwrap().mode() & 0o777,
            0o700
        );

        let c = Client::new(&sock);
        assert_eq!(c.ping().unwrap(), "test");
        let pod = PodRef {
            pod_uid: "u".into(),
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            container_name: "app".into(),
        };
        assert_eq!(
            c.restore_plan(RestorePlanRequest {
                container_id: "c1".into(),
                pod: pod.clone()
            })
            .unwrap(),
            PlanAnswer::Plan(plan())
        );
        assert_eq!(
            c.restore_plan(RestorePlanRequest {
                container_id: "c2".into(),
                pod: PodRef::default()
            })
            .unwrap(),
            PlanAnswer::NoPlan {
                reason: "no PodRestore".into()
            }
        );
        assert_eq!(
            c.final_checkpoint(FinalCheckpointRequest {
                container_id: "c1".into(),
                pod: PodRef::default(),
                deadline_ms: 1000,
                answer_when_captured: false,
                hold_until_stopped: false,
            })
            .unwrap(),
            CheckpointAnswer::Done {
                checkpoint_ref: "ref-c1".into(),
                end_with_kill: false,
            }
        );
        let job = c
            .final_checkpoint(FinalCheckpointRequest {
                container_id: "job".into(),
                pod: PodRef::default(),
                deadline_ms: 1000,
                answer_when_captured: false,
                hold_until_stopped: false,
            })
            .unwrap();
        assert!(job.end_with_kill(), "{job:?}");
        let report = ReportRequest {
            container_id: "c1".into(),
            pod,
            event: ReportEvent::Restored {
                checkpoint_ref: "r".into(),
                restore_ms: 5,
            },
        };
        c.report(report.clone()).unwrap();
        let got = srv.wait_for(6, Duration::from_secs(2));
        assert_eq!(got.len(), 6);
        assert!(got.contains(&Request::new(RequestBody::Report(report))));
    }

    #[test]
    fn a_late_agent_times_out_within_the_deadline() {
        let t = tempfile::tempdir().unwrap();
        let sock = t.path().join("agent.sock");
        let _srv = TestServer::start(&sock, agent).unwrap();
        let c = Client::new(&sock).with_io_timeout(Duration::from_millis(100));
        let start = Instant::now();
        let e = c
            .final_checkpoint(FinalCheckpointRequest {
                container_id: "slow".into(),
                pod: PodRef::default(),
                deadline_ms: 200,
                answer_when_captured: false,
                hold_until_stopped: false,
            })
            .unwrap_err();
        let took = start.elapsed();
        assert!(e.is_timeout(), "{e}");
        assert!(took >= Duration::from_millis(290), "{took:?}");
        assert!(took < Duration::from_millis(800), "{took:?}");
    }

    #[test]
    fn no_agent_fails_fast() {
        let t = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let e = Client::new(t.path().join("absent.sock"))
            .ping()
            .unwrap_err();
        assert!(e.is_no_agent(), "{e}");
        // A stale socket file with nobody listening.
        let stale = t.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        let e = Client::new(&stale).ping().unwrap_err();
        assert!(e.is_no_agent(), "{e}");
        assert!(start.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn a_silent_agent_times_out_on_read() {
        let t = tempfile::tempdir().unwrap();
        let sock = t.path().join("agent.sock");
        let _srv = TestServer::start(&sock, |_| {
            std::thread::sleep(Duration::from_millis(500));
            None
        })
        .unwrap();
        let start = Instant::now();
        let e = Client::new(&sock)
            .with_io_timeout(Duration::from_millis(80))
            .ping()
            .unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(start.elapsed() < Duration::from_millis(400));
    }

    #[test]
    fn other_versions_are_refused_both_ways() {
        let t = tempfile::tempdir().unwrap();
        let sock = t.path().join("agent.sock");
        let _srv = TestServer::start(&sock, agent).unwrap();
        // A client from the future: the agent answers with an error.
        let mut s = UnixStream::connect(&sock).unwrap();
        s.write_all(b"{\"v\":2,\"op\":\"ping\"}\n").unwrap();
        let r: Response = read_message(&mut BufReader::new(&s)).unwrap();
        assert!(
            matches!(&r.body, ResponseBody::Error { reason } if reason.contains("version 2")),
            "{r:?}"
        );
        // An agent from the future: the client refuses its answer.
        let sock2 = t.path().join("future.sock");
        let l = bind(&sock2).unwrap();
        let th = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let _: Request = read_message(&mut BufReader::new(&c)).unwrap();
            c.write_all(b"{\"v\":9,\"result\":\"pong\",\"agent\":\"x\"}\n")
                .unwrap();
        });
        let e = Client::new(&sock2).ping().unwrap_err();
        assert!(matches!(e, ClientError::Version { got: 9 }), "{e}");
        th.join().unwrap();
        // An agent that hangs up without answering.
        let sock3 = t.path().join("rude.sock");
        let _rude = TestServer::start(&sock3, |_| None).unwrap();
        let e = Client::new(&sock3).ping().unwrap_err();
        assert!(matches!(e, ClientError::Codec { .. }), "{e}");
    }

    #[test]
    fn decode_and_encode_for_other_runtimes() {
        let q = decode_request(br#"{"v":1,"op":"ping"}"#).unwrap();
        assert_eq!(q.body, RequestBody::Ping);
        let e = decode_request(br#"{"v":3,"op":"ping"}"#).unwrap_err();
        assert!(matches!(e.body, ResponseBody::Error { reason } if reason.contains("version 3")));
        let e = decode_request(br#"{"v":1,"op":"launch"}"#).unwrap_err();
        assert!(
            matches!(e.body, ResponseBody::Error { reason } if reason.starts_with("bad request"))
        );
        assert!(decode_request(b"{").is_err());
        let line = encode_response(ResponseBody::Skipped { reason: "x".into() });
        assert_eq!(line, b"{\"v\":1,\"result\":\"skipped\",\"reason\":\"x\"}\n");
    }

    #[test]
    fn bind_refuses_to_replace_a_non_socket() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("agent.sock");
        std::fs::write(&p, "x").unwrap();
        assert!(bind(&p).is_err());
        std::fs::remove_file(&p).unwrap();
        drop(bind(&p).unwrap());
        // A stale socket is replaced.
        drop(bind(&p).unwrap());
    }
}
