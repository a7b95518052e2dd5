//! The messages. Every message is one JSON object with a protocol version `v`; requests carry an
//! `op`, responses a `result`:
//!
//! ```text
//! → {"v":1,"op":"ping"}
//! ← {"v":1,"result":"pong","agent":"stasisd 0.1.0"}
//! → {"v":1,"op":"restore_plan","container_id":"c1","pod_uid":"…","pod_namespace":"ns","pod_name":"p","container_name":"app"}
//! ← {"v":1,"result":"plan","image_dir":"/var/lib/stasis/…","rootfs_method":"overlay_upper","checkpoint_ref":"…","tcp_established":true}
//! ← {"v":1,"result":"no_plan","reason":"no PodRestore for this pod"}
//! → {"v":1,"op":"final_checkpoint","container_id":"c1","deadline_ms":20000}
//! ← {"v":1,"result":"done","checkpoint_ref":"…"} | {"v":1,"result":"captured","checkpoint_ref":"…"} (with "answer_when_captured":true) | {"v":1,"result":"skipped","reason":"…"} | {"v":1,"result":"failed","reason":"…"}
//! → {"v":1,"op":"container_exited","container_id":"c1","pod_uid":"…",…,"oom_killed":true,"wait_for_plan":true}
//! ← {"v":1,"result":"preparing","checkpoint_ref":"…","wait_ms":12000} (a restore in place is being prepared: the
//!   restart's `create` waits for its plan file up to wait_ms) | {"v":1,"result":"plan",…} (prepared already: agents
//!   before `preparing`) | {"v":1,"result":"no_plan","reason":"…"}
//! → {"v":1,"op":"report","container_id":"c1","pod_uid":"…",…,"event":{"kind":"restored","checkpoint_ref":"…","restore_ms":180}}
//!   (no answer: fire and forget)
//! ← {"v":1,"result":"error","reason":"unsupported protocol version 2"}   (any request the agent cannot serve)
//! ```
//!
//! Compatibility: a peer rejects a message whose `v` it does not speak; fields may be added within
//! a version (unknown fields are ignored, new fields have defaults). An answer a peer does not
//! know (a newer agent's) fails to parse and counts as no plan: a cold start, never a wait. The
//! agent answers `preparing` only to a runtime that says it can wait (`wait_for_plan`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
pub use stasis_core::manifest::RootfsMethod;

/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The Kubernetes identity of a container, from its bundle's CRI annotations. Fields the runtime
/// does not know are empty strings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    #[serde(default)]
    pub pod_uid: String,
    #[serde(default)]
    pub pod_namespace: String,
    #[serde(default)]
    pub pod_name: String,
    #[serde(default)]
    pub container_name: String,
}

/// A request on the agent socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub v: u32,
    #[serde(flatten)]
    pub body: RequestBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum RequestBody {
    Ping,
    /// Is there a verified checkpoint on this node for this container to restore from?
    RestorePlan(RestorePlanRequest),
    /// The container is being stopped (SIGTERM): take a last checkpoint within `deadline_ms`.
    FinalCheckpoint(FinalCheckpointRequest),
    /// What the runtime did with a container; fire and forget (the agent does not answer).
    Report(ReportRequest),
    /// The container's processes are gone and the runtime is deleting it (`runc delete`): how it
    /// ended, so the agent can prepare a restore in place before the kubelet restarts it.
    ContainerExited(ContainerExitedRequest),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerExitedRequest {
    pub container_id: String,
    #[serde(flatten)]
    pub pod: PodRef,
    /// The kernel's OOM killer killed a process of the container (its memory cgroup says so).
    #[serde(default)]
    pub oom_killed: bool,
    /// The runtime understands a `preparing` answer: its `create` of the restarted container
    /// waits for the plan. Absent (false) from runtimes that predate it; the agent then never
    /// answers `preparing`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait_for_plan: bool,
    /// The container was restored from this checkpoint and deleted before it ever started (the
    /// kubelet or containerd gave up on its create, which had consumed the restore's plan): the
    /// restore was lost before the workload ran, and the next create of the container should
    /// restore again. Absent from runtimes that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_lost: Option<String>,
    /// With `restore_lost`: the container did run from that restore, and was ended because its
    /// memory could not arrive (the node's agent stopped during its lazy restore). The restore
    /// is lost the same way; only what the Events say differs. Absent from runtimes that
    /// predate it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory_lost: bool,
}

/// The longest a runtime's `create` waits for a restart in place being prepared, whatever the
/// agent's `preparing` answer says (well inside the kubelet's 2-minute runtime request timeout).
pub const MAX_PREPARE_WAIT_MS: u64 = 60_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePlanRequest {
    pub container_id: String,
    #[serde(flatten)]
    pub pod: PodRef,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalCheckpointRequest {
    pub container_id: String,
    /// The pod and container, when the runtime knows them (from runc's state).
    #[serde(flatten)]
    pub pod: PodRef,
    /// The longest the runtime will wait for the answer; the agent bounds it further by the
    /// pod's grace period and answers `skipped` or `failed` rather than run late.
    pub deadline_ms: u64,
    /// Answer `captured` as soon as the memory and files are captured (the container is running
    /// again), while the upload goes on: the stop then proceeds without the workload running on
    /// (and doing work the checkpoint will not hold) for the length of the upload.
    #[serde(default)]
    pub answer_when_captured: bool,
    /// Taken ahead of the pod's stop (the eviction responder's request; the runtime never asks
    /// it): the pod is kept frozen from the capture until its stop comes when its policy has
    /// `holdUntilEvicted`, and the stop may take a newer checkpoint when it was not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hold_until_stopped: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportRequest {
    pub container_id: String,
    #[serde(flatten)]
    pub pod: PodRef,
    pub event: ReportEvent,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReportEvent {
    /// `create` restored the container from this checkpoint.
    Restored {
        checkpoint_ref: String,
        /// Wall time of the restore inside `create` (rootfs diff + `runc restore`).
        restore_ms: u64,
    },
    /// `create` started the container cold; `reason` says why (no plan, a doubt, a failure).
    ColdStart {
        /// What kind of cold start, for the agent's restore-failure bookkeeping.
        #[serde(default)]
        cause: ColdStartCause,
        reason: String,
        /// The plan that was not used, when there was one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint_ref: Option<String>,
    },
}

/// Why a container started cold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColdStartCause {
    /// No plan for this container (the ordinary first start).
    NoPlan,
    /// The pod asked for it (`stasis.dev/cold-start`).
    Forced,
    /// The runtime could not use the call as a restore (flags it does not know, extra fds).
    Unsupported,
    /// A plan existed but did not fit (other pod, expired, unverified or incomplete image).
    PlanRefused,
    /// The restore was attempted and failed (rootfs diff, `runc restore`).
    RestoreFailed,
    /// Anything else (and causes a newer runtime reports that this version does not know).
    #[default]
    #[serde(other)]
    Other,
}

/// A response on the agent socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub v: u32,
    #[serde(flatten)]
    pub body: ResponseBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ResponseBody {
    Pong {
        #[serde(default)]
        agent: String,
    },
    Plan(Plan),
    NoPlan {
        reason: String,
    },
    /// A restore in place of `checkpoint_ref` is being prepared (fetched through the node's
    /// chunk cache): the plan file appears within `wait_ms`, or a failure note does. Only to a
    /// `container_exited` with `wait_for_plan`.
    Preparing {
        checkpoint_ref: String,
        wait_ms: u64,
    },
    /// The final checkpoint is complete and published.
    Done {
        checkpoint_ref: String,
        /// End the container with SIGKILL instead of the signal it was sent (see
        /// [`CheckpointAnswer::end_with_kill`]). Absent (false) from agents that predate it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        end_with_kill: bool,
    },
    /// The final checkpoint's memory and files are captured; its upload goes on (it publishes
    /// `checkpoint_ref` when complete, or nothing). Only for `answer_when_captured`.
    Captured {
        checkpoint_ref: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        end_with_kill: bool,
    },
    /// No final checkpoint was taken, on purpose (not opted in, policy off, deadline too short).
    Skipped {
        reason: String,
    },
    Failed {
        reason: String,
    },
    /// The agent could not serve the request (bad request, unsupported version).
    Error {
        reason: String,
    },
}

/// A restore the agent has prepared: the archive is fetched, verified and unpacked into
/// `image_dir` (an `stasis_engine::image::ImageDir`: `criu/` and `rootfs/`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub image_dir: PathBuf,
    /// How the filesystem changes were captured; `None`: nothing to put back.
    #[serde(default)]
    pub rootfs_method: Option<RootfsMethod>,
    /// The checkpoint's name in the store (reported back, shown in Events).
    pub checkpoint_ref: String,
    /// Restore established TCP connections (`--tcp-established`).
    #[serde(default)]
    pub tcp_established: bool,
    /// The agent serves the memory lazily: `image_dir` holds every file but the page images,
    /// which hold only the pages CRIU maps itself, and a `criu lazy-pages` daemon fed by the
    /// agent listens in the restore's work dir ([`Plan::lazy_work_dir`]) for `runc restore
    /// --lazy-pages`. Absent (older agents): a full restore.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lazy: bool,
    /// A lazy plan's work dir, on the agent's run directory (not the images' disk, which may
    /// fill after the staging): the daemon's socket and log, the restore's log and the note
    /// naming the container to the agent. Absent (agents before it): `image_dir/criu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_dir: Option<PathBuf>,
}

impl Plan {
    /// Where a lazy plan's restore runs (its `--work-path`): where the daemon listens.
    pub fn lazy_work_dir(&self) -> PathBuf {
        self.work_dir
            .clone()
            .unwrap_or_else(|| self.image_dir.join("criu"))
    }
}

/// The answer to a `restore_plan` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanAnswer {
    Plan(Plan),
    NoPlan { reason: String },
}

/// The answer to a `container_exited` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitAnswer {
    /// The plan file is written already.
    Plan(Plan),
    /// The plan is being prepared: wait for it at most `wait_ms`.
    Preparing {
        checkpoint_ref: String,
        wait_ms: u64,
    },
    NoPlan {
        reason: String,
    },
}

/// The answer to a `final_checkpoint` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointAnswer {
    Done {
        checkpoint_ref: String,
        end_with_kill: bool,
    },
    Captured {
        checkpoint_ref: String,
        end_with_kill: bool,
    },
    Skipped {
        reason: String,
    },
    Failed {
        reason: String,
    },
}

impl CheckpointAnswer {
    /// Whether the runtime ends the container with SIGKILL rather than pass the SIGTERM on.
    /// The agent asks for it when the pod's owner reads a clean exit as the work being finished
    /// (`restartPolicy` `Never` or `OnFailure`: a Job's pod): the work's continuation is in the
    /// checkpoint, and a workload that exits 0 on SIGTERM would otherwise mark its Job
    /// complete, so that no replacement (and no restore) ever comes.
    pub fn end_with_kill(&self) -> bool {
        matches!(
            self,
            CheckpointAnswer::Done {
                end_with_kill: true,
                ..
            } | CheckpointAnswer::Captured {
                end_with_kill: true,
                ..
            }
        )
    }
}

impl Request {
    pub fn new(body: RequestBody) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            body,
        }
    }
}

impl Response {
    pub fn new(body: ResponseBody) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            body,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodRef {
        PodRef {
            pod_uid: "7c1b-uid".into(),
            pod_namespace: "ns".into(),
            pod_name: "p-0".into(),
            container_name: "app".into(),
        }
    }

    #[test]
    fn wire_format_is_flat_and_versioned() {
        let r = Request::new(RequestBody::RestorePlan(RestorePlanRequest {
            container_id: "c1".into(),
            pod: pod(),
        }));
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"v":1,"op":"restore_plan","container_id":"c1","pod_uid":"7c1b-uid","pod_namespace":"ns","pod_name":"p-0","container_name":"app"}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&Request::new(RequestBody::Ping)).unwrap(),
            r#"{"v":1,"op":"ping"}"#
        );
        let plan = Response::new(ResponseBody::Plan(Plan {
            image_dir: "/var/lib/stasis/img/x".into(),
            rootfs_method: Some(RootfsMethod::OverlayUpper),
            checkpoint_ref: "ns/p/3".into(),
            tcp_established: true,
            lazy: false,
            work_dir: None,
        }));
        let s = serde_json::to_string(&plan).unwrap();
        assert_eq!(
            s,
            r#"{"v":1,"result":"plan","image_dir":"/var/lib/stasis/img/x","rootfs_method":"overlay_upper","checkpoint_ref":"ns/p/3","tcp_established":true}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&s).unwrap(), plan);
    }

    #[test]
    fn every_message_round_trips() {
        let reqs = [
            RequestBody::Ping,
            RequestBody::FinalCheckpoint(FinalCheckpointRequest {
                container_id: "c".into(),
                pod: pod(),
                deadline_ms: 20_000,
                answer_when_captured: false,
                hold_until_stopped: false,
            }),
            RequestBody::Report(ReportRequest {
                container_id: "c".into(),
                pod: pod(),
                event: ReportEvent::Restored {
                    checkpoint_ref: "r".into(),
                    restore_ms: 12,
                },
            }),
            RequestBody::Report(ReportRequest {
                container_id: "c".into(),
                pod: PodRef::default(),
                event: ReportEvent::ColdStart {
                    cause: ColdStartCause::NoPlan,
                    reason: "no plan".into(),
                    checkpoint_ref: None,
                },
            }),
        ];
        let reqs = reqs.into_iter().chain([
            RequestBody::ContainerExited(ContainerExitedRequest {
                container_id: "c".into(),
                pod: pod(),
                oom_killed: true,
                wait_for_plan: true,
                restore_lost: None,
                memory_lost: false,
            }),
            RequestBody::ContainerExited(ContainerExitedRequest {
                container_id: "c".into(),
                pod: pod(),
                oom_killed: true,
                wait_for_plan: false,
                restore_lost: None,
                memory_lost: false,
            }),
            RequestBody::ContainerExited(ContainerExitedRequest {
                container_id: "c".into(),
                pod: pod(),
                oom_killed: false,
                wait_for_plan: true,
                restore_lost: Some("l/1".into()),
                memory_lost: true,
            }),
        ]);
        for b in reqs {
            let r = Request::new(b);
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r, "{s}");
        }
        let resps = [
            ResponseBody::Pong { agent: "a".into() },
            ResponseBody::NoPlan { reason: "x".into() },
            ResponseBody::Done {
                checkpoint_ref: "r".into(),
                end_with_kill: false,
            },
            ResponseBody::Captured {
                checkpoint_ref: "r".into(),
                end_with_kill: true,
            },
            ResponseBody::Preparing {
                checkpoint_ref: "l/1".into(),
                wait_ms: 9_000,
            },
            ResponseBody::Skipped { reason: "s".into() },
            ResponseBody::Failed { reason: "f".into() },
            ResponseBody::Error { reason: "e".into() },
        ];
        for b in resps {
            let r = Response::new(b);
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Response>(&s).unwrap(), r, "{s}");
        }
    }

    #[test]
    fn unknown_fields_are_ignored_and_defaults_apply() {
        let r: Response = serde_json::from_str(
            r#"{"v":1,"result":"plan","image_dir":"/i","checkpoint_ref":"c","future":"x"}"#,
        )
        .unwrap();
        assert_eq!(
            r.body,
            ResponseBody::Plan(Plan {
                image_dir: "/i".into(),
                rootfs_method: None,
                checkpoint_ref: "c".into(),
                tcp_established: false,
                lazy: false,
                work_dir: None,
            })
        );
        // A lazy plan of an agent before the work dir moved to the run directory: the images'
        // `criu/`, where that agent's daemon listens.
        let old: Plan =
            serde_json::from_str(r#"{"image_dir":"/i","checkpoint_ref":"c","lazy":true}"#).unwrap();
        assert_eq!(old.lazy_work_dir(), PathBuf::from("/i/criu"));
        let e: ReportEvent =
            serde_json::from_str(r#"{"kind":"cold_start","cause":"cosmic_rays","reason":"r"}"#)
                .unwrap();
        assert_eq!(
            e,
            ReportEvent::ColdStart {
                cause: ColdStartCause::Other,
                reason: "r".into(),
                checkpoint_ref: None
            }
        );
        let q: Request =
            serde_json::from_str(r#"{"v":1,"op":"restore_plan","container_id":"c"}"#).unwrap();
        assert_eq!(
            q.body,
            RequestBody::RestorePlan(RestorePlanRequest {
                container_id: "c".into(),
                pod: PodRef::default()
            })
        );
    }

    /// The restart in place across versions: an old runtime's `container_exited` (no
    /// `wait_for_plan`) reads as one that cannot wait, so a new agent never answers it
    /// `preparing`; a new runtime's request reads in an old agent (the field ignored), whose
    /// `plan` / `no_plan` answers the new runtime still takes; and an old runtime that got a
    /// `preparing` anyway fails to parse it (no plan: a cold start), as it would any answer it
    /// does not know.
    #[test]
    fn preparing_between_old_and_new_peers() {
        let old_request = r#"{"v":1,"op":"container_exited","container_id":"c","pod_uid":"u","container_name":"app","oom_killed":true}"#;
        match serde_json::from_str::<Request>(old_request).unwrap().body {
            RequestBody::ContainerExited(c) => assert!(c.oom_killed && !c.wait_for_plan),
            other => panic!("{other:?}"),
        }
        let new_request = serde_json::to_string(&Request::new(RequestBody::ContainerExited(
            ContainerExitedRequest {
                container_id: "c".into(),
                pod: pod(),
                oom_killed: true,
                wait_for_plan: true,
                restore_lost: None,
                memory_lost: false,
            },
        )))
        .unwrap();
        assert!(
            new_request.ends_with(r#""oom_killed":true,"wait_for_plan":true}"#),
            "{new_request}"
        );
        // The old agent's view of the new request: its type had no `wait_for_plan`.
        #[derive(Deserialize)]
        struct OldExited {
            container_id: String,
            #[serde(default)]
            oom_killed: bool,
        }
        let old: OldExited = serde_json::from_str(&new_request).unwrap();
        assert!(old.oom_killed && old.container_id == "c");

        let preparing = serde_json::to_string(&Response::new(ResponseBody::Preparing {
            checkpoint_ref: "l/1".into(),
            wait_ms: 9_000,
        }))
        .unwrap();
        assert_eq!(
            preparing,
            r#"{"v":1,"result":"preparing","checkpoint_ref":"l/1","wait_ms":9000}"#
        );
        // The old runtime's view of `preparing`: its answers were plan | no_plan | ... only.
        #[derive(Debug, Deserialize)]
        #[serde(tag = "result", rename_all = "snake_case")]
        #[allow(dead_code)]
        enum OldAnswer {
            Plan(Plan),
            NoPlan { reason: String },
        }
        assert!(serde_json::from_str::<OldAnswer>(&preparing).is_err());
        // And an answer this runtime does not know fails to parse the same way.
        assert!(
            serde_json::from_str::<Response>(r#"{"v":1,"result":"streaming","wait_ms":1}"#)
                .is_err()
        );
    }
}
