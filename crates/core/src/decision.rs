//! The restore decision at admission, as a pure function (DESIGN §3–§5).
//!
//! The webhook gathers the facts (who created the pod, the SubjectAccessReview answer, the
//! matching policy, the pod's annotations and volumes, how the previous instance ended, the claim
//! on a lineage, the spec hashes and any compatibility mismatches) and [`decide`] says
//! [`Decision::Restore`] or [`Decision::ColdStart`]. A cold start's reason is the text of the
//! `ColdStart` Event on the pod.
//!
//! The checks run in this order, the first that fails deciding (so the Event names the most
//! fundamental reason):
//!
//! 1. annotation `stasis.dev/cold-start: "true"` — the user asked for a cold start;
//! 2. who may cause a restore: a pod created by its workload's own controller needs a matching
//!    `CheckpointPolicy`; a pod created directly by a person or service account needs the
//!    restore permission (SubjectAccessReview);
//! 3. volumes: writable PersistentVolumes, hostPath and other uncaptured writable volumes not in
//!    the policy's `safeVolumes` — memory from one instant would pair with disk from a later one;
//! 4. how the previous instance ended: evictions, preemptions, node loss, OOM kills and graceful
//!    stops restore; an error exit (a crash) restores only with `restoreOnCrash`; a container
//!    that completed successfully never restores;
//! 5. the lineage: a claim, and a checkpoint the restore-loop guard allows;
//! 6. the normalised spec hash of the pod equals the checkpoint's;
//! 7. no compatibility mismatch (image digests, declared engine/model versions...).

use std::fmt;

use crate::fingerprint::Mismatch;
use crate::lineage::{Claim, RestoreChoice};
use crate::names::COLD_START;
use crate::podspec::SpecHash;
use crate::reference::{CheckpointId, WorkloadName};

/// The built-in controllers that create the pods of each controlling owner kind: the kind and
/// the controller's service account in `kube-system` (kube-controller-manager with
/// `--use-service-account-credentials`). The chart's ValidatingAdmissionPolicy names the same
/// accounts (a test in stasis-controller keeps them equal).
pub const WORKLOAD_CONTROLLERS: &[(&str, &str)] = &[
    ("ReplicaSet", "replicaset-controller"),
    ("StatefulSet", "statefulset-controller"),
    ("Job", "job-controller"),
    ("DaemonSet", "daemon-set-controller"),
];
/// kube-controller-manager's own user, when it runs without per-controller service accounts.
pub const CONTROLLER_MANAGER_USER: &str = "system:kube-controller-manager";

/// Who created the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requester {
    /// The workload's own controller (ReplicaSet, StatefulSet, Job controller) created it.
    WorkloadController,
    /// A person or a service account created it directly.
    Direct {
        /// The admission request's user.
        user: String,
        /// The SubjectAccessReview answer for the restore permission.
        may_restore: bool,
    },
}

impl Requester {
    /// Classifies the admission request's user. A pod counts as created by its workload's own
    /// controller only when the user is the built-in controller for the kind of the pod's
    /// controlling owner: `system:serviceaccount:kube-system:<replicaset|statefulset|job|
    /// daemon-set>-controller` (kube-controller-manager with
    /// `--use-service-account-credentials`, the usual setup) or `system:kube-controller-manager`
    /// (without it). Owner references alone prove nothing (anyone who may create a pod can write
    /// them); other controllers (operators) count as direct requesters and need the restore
    /// permission, which a cluster admin grants to their service account.
    pub fn classify(user: &str, controller_kind: Option<&str>, may_restore: bool) -> Self {
        let expected = WORKLOAD_CONTROLLERS
            .iter()
            .find(|(kind, _)| Some(*kind) == controller_kind)
            .map(|(_, sa)| *sa);
        let is_controller = expected.is_some_and(|sa| {
            user == CONTROLLER_MANAGER_USER
                || user.strip_prefix("system:serviceaccount:kube-system:") == Some(sa)
        });
        if is_controller {
            Self::WorkloadController
        } else {
            Self::Direct {
                user: user.to_owned(),
                may_restore,
            }
        }
    }
}

/// How the previous instance of this pod (the source) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LastExit {
    /// Evicted (drain, node pressure, taint), preempted, or its node was lost.
    Evicted,
    /// Killed by the kernel's OOM killer.
    OomKilled,
    /// Stopped gracefully (deleted, SIGTERM within its grace period).
    Terminated,
    /// Exited by itself with a non-zero code or a signal of its own: a crash.
    Error { exit_code: i32 },
    /// Exited successfully: its work was done.
    Completed,
    /// Nothing known (first start of a replacement whose source left no status).
    Unknown,
}

/// Everything [`decide`] looks at.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreInputs {
    pub requester: Requester,
    /// A `CheckpointPolicy` selects the pod: its `restoreOnCrash`. `None`: no policy matches.
    pub policy_restore_on_crash: Option<bool>,
    /// The pod's `stasis.dev/cold-start` annotation.
    pub cold_start_annotation: Option<String>,
    /// Unsafe volumes not declared safe ([`crate::podspec::unsafe_volumes`]).
    pub unsafe_volumes: Vec<String>,
    pub last_exit: LastExit,
    /// The lineage claim (see [`crate::lineage::claim`]); `None` when nothing was claimable.
    pub claim: Option<Claim>,
    /// The pod's normalised spec hash.
    pub pod_spec_hash: SpecHash,
    /// The spec hash the chosen checkpoint recorded (`None`: it recorded none).
    pub checkpoint_spec_hash: Option<SpecHash>,
    /// Compatibility mismatches found between the checkpoint and the pod.
    pub mismatches: Vec<Mismatch>,
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Restore {
        lineage: WorkloadName,
        checkpoint: CheckpointId,
        /// The generation the pod now holds (its own checkpoints carry it).
        generation: u64,
    },
    ColdStart {
        reason: ColdStartReason,
    },
}

/// Why a pod cold-starts. `Display` is the `ColdStart` Event's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColdStartReason {
    Requested,
    NoPolicy,
    NotPermitted {
        user: String,
    },
    UnsafeVolumes(Vec<String>),
    Crashed {
        exit_code: i32,
    },
    Completed,
    NoLineage,
    NoCheckpoint(String),
    SpecMismatch {
        pod: SpecHash,
        checkpoint: Option<SpecHash>,
    },
    Incompatible(Vec<Mismatch>),
}

impl ColdStartReason {
    /// A short CamelCase label for metrics and the `PodRestore`'s condition reason.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Requested => "Requested",
            Self::NoPolicy => "NoPolicy",
            Self::NotPermitted { .. } => "NotPermitted",
            Self::UnsafeVolumes(_) => "UnsafeVolumes",
            Self::Crashed { .. } => "Crashed",
            Self::Completed => "Completed",
            Self::NoLineage => "NoLineage",
            Self::NoCheckpoint(_) => "NoCheckpoint",
            Self::SpecMismatch { .. } => "SpecMismatch",
            Self::Incompatible(_) => "Incompatible",
        }
    }
}

impl fmt::Display for ColdStartReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Requested => write!(f, "cold start requested by annotation {COLD_START}=true"),
            Self::NoPolicy => write!(f, "no CheckpointPolicy selects this pod"),
            Self::NotPermitted { user } => write!(
                f,
                "pod created by {user}, who may not restore checkpoints (restore permission on podrestores.stasis.dev)"
            ),
            Self::UnsafeVolumes(v) => write!(
                f,
                "writable volumes not captured by checkpoints: {}; declare them in the policy's safeVolumes to restore anyway",
                v.join(", ")
            ),
            Self::Crashed { exit_code } => write!(
                f,
                "the previous container crashed (exit code {exit_code}); restoreOnCrash is off, and its memory may hold the cause"
            ),
            Self::Completed => write!(f, "the previous container completed successfully"),
            Self::NoLineage => write!(f, "no orphaned lineage of this workload to continue"),
            Self::NoCheckpoint(why) => write!(f, "{why}"),
            Self::SpecMismatch { pod, checkpoint } => match checkpoint {
                Some(c) => write!(
                    f,
                    "pod spec differs from the checkpoint's source in security-relevant fields (spec hash {pod}, checkpoint {c})"
                ),
                None => write!(f, "the checkpoint records no pod spec hash; not restoring into {pod}"),
            },
            Self::Incompatible(m) => {
                write!(f, "incompatible checkpoint: ")?;
                for (i, m) in m.iter().enumerate() {
                    if i > 0 {
                        write!(f, "; ")?;
                    }
                    write!(f, "{}: checkpoint has {}, pod has {}", m.field, m.recorded, m.found)?;
                }
                Ok(())
            }
        }
    }
}

fn cold(reason: ColdStartReason) -> Decision {
    Decision::ColdStart { reason }
}

/// The restore decision (the module documentation gives the order of the checks).
pub fn decide(inputs: &RestoreInputs) -> Decision {
    if inputs
        .cold_start_annotation
        .as_deref()
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    {
        return cold(ColdStartReason::Requested);
    }
    match &inputs.requester {
        Requester::WorkloadController if inputs.policy_restore_on_crash.is_none() => {
            return cold(ColdStartReason::NoPolicy)
        }
        Requester::Direct {
            user,
            may_restore: false,
        } => return cold(ColdStartReason::NotPermitted { user: user.clone() }),
        _ => {}
    }
    if !inputs.unsafe_volumes.is_empty() {
        return cold(ColdStartReason::UnsafeVolumes(
            inputs.unsafe_volumes.clone(),
        ));
    }
    match inputs.last_exit {
        LastExit::Error { exit_code } if !inputs.policy_restore_on_crash.unwrap_or(false) => {
            return cold(ColdStartReason::Crashed { exit_code })
        }
        LastExit::Completed => return cold(ColdStartReason::Completed),
        _ => {}
    }
    let Some(claim) = &inputs.claim else {
        return cold(ColdStartReason::NoLineage);
    };
    let checkpoint = match &claim.choice {
        RestoreChoice::Checkpoint { id, .. } => id.clone(),
        RestoreChoice::ColdStart(why) => return cold(ColdStartReason::NoCheckpoint(why.clone())),
    };
    if inputs.checkpoint_spec_hash.as_ref() != Some(&inputs.pod_spec_hash) {
        return cold(ColdStartReason::SpecMismatch {
            pod: inputs.pod_spec_hash.clone(),
            checkpoint: inputs.checkpoint_spec_hash.clone(),
        });
    }
    if !inputs.mismatches.is_empty() {
        return cold(ColdStartReason::Incompatible(inputs.mismatches.clone()));
    }
    Decision::Restore {
        lineage: claim.lineage.clone(),
        checkpoint,
        generation: claim.generation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ckpt() -> CheckpointId {
        CheckpointId::from_parts(1_700_000_000_000, 7)
    }
    fn hash(s: &str) -> SpecHash {
        SpecHash(format!("blake3:{s}"))
    }
    fn ok_inputs() -> RestoreInputs {
        RestoreInputs {
            requester: Requester::WorkloadController,
            policy_restore_on_crash: Some(false),
            cold_start_annotation: None,
            unsafe_volumes: vec![],
            last_exit: LastExit::Evicted,
            claim: Some(Claim {
                lineage: WorkloadName::new("prod_deploy_counter.3f2a9c10").unwrap(),
                generation: 3,
                choice: RestoreChoice::Checkpoint {
                    id: ckpt(),
                    generation: 2,
                },
                existing: false,
            }),
            pod_spec_hash: hash("aa"),
            checkpoint_spec_hash: Some(hash("aa")),
            mismatches: vec![],
        }
    }
    fn reason(d: Decision) -> ColdStartReason {
        match d {
            Decision::ColdStart { reason } => reason,
            other => panic!("expected a cold start, got {other:?}"),
        }
    }

    #[test]
    fn restores_when_everything_holds() {
        for exit in [
            LastExit::Evicted,
            LastExit::OomKilled,
            LastExit::Terminated,
            LastExit::Unknown,
        ] {
            let i = RestoreInputs {
                last_exit: exit,
                ..ok_inputs()
            };
            assert_eq!(
                decide(&i),
                Decision::Restore {
                    lineage: WorkloadName::new("prod_deploy_counter.3f2a9c10").unwrap(),
                    checkpoint: ckpt(),
                    generation: 3
                }
            );
        }
    }

    #[test]
    fn annotation_forces_cold_start_first() {
        let i = RestoreInputs {
            cold_start_annotation: Some("True".into()),
            requester: Requester::Direct {
                user: "mallory".into(),
                may_restore: false,
            },
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert_eq!(r, ColdStartReason::Requested);
        assert!(r.to_string().contains("stasis.dev/cold-start=true"));
        let i = RestoreInputs {
            cold_start_annotation: Some("false".into()),
            ..ok_inputs()
        };
        assert!(matches!(decide(&i), Decision::Restore { .. }));
    }

    #[test]
    fn who_may_restore() {
        // Controller-created pods need a policy.
        let i = RestoreInputs {
            policy_restore_on_crash: None,
            ..ok_inputs()
        };
        assert_eq!(reason(decide(&i)), ColdStartReason::NoPolicy);
        // Directly created pods need the restore permission...
        let i = RestoreInputs {
            requester: Requester::Direct {
                user: "alice".into(),
                may_restore: false,
            },
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert!(r.to_string().contains("alice"), "{r}");
        assert_eq!(r.label(), "NotPermitted");
        // ... with which they restore even without a policy.
        let i = RestoreInputs {
            requester: Requester::Direct {
                user: "admin".into(),
                may_restore: true,
            },
            policy_restore_on_crash: None,
            ..ok_inputs()
        };
        assert!(matches!(decide(&i), Decision::Restore { .. }));
    }

    #[test]
    fn requester_classification() {
        let rs = "system:serviceaccount:kube-system:replicaset-controller";
        assert_eq!(
            Requester::classify(rs, Some("ReplicaSet"), false),
            Requester::WorkloadController
        );
        assert_eq!(
            Requester::classify("system:kube-controller-manager", Some("StatefulSet"), false),
            Requester::WorkloadController
        );
        assert_eq!(
            Requester::classify(
                "system:serviceaccount:kube-system:job-controller",
                Some("Job"),
                false
            ),
            Requester::WorkloadController
        );
        // The ReplicaSet controller's identity does not vouch for a StatefulSet pod.
        assert!(matches!(
            Requester::classify(rs, Some("StatefulSet"), false),
            Requester::Direct { .. }
        ));
        // A person who forged an owner reference is a direct requester.
        assert_eq!(
            Requester::classify("alice", Some("ReplicaSet"), false),
            Requester::Direct {
                user: "alice".into(),
                may_restore: false
            }
        );
        // Operators and bare pods: direct.
        assert!(matches!(
            Requester::classify("system:serviceaccount:ops:operator", Some("TrainJob"), true),
            Requester::Direct {
                may_restore: true,
                ..
            }
        ));
        assert!(matches!(
            Requester::classify("system:kube-controller-manager", None, false),
            Requester::Direct { .. }
        ));
    }

    #[test]
    fn unsafe_volumes_cold_start_with_their_names() {
        let i = RestoreInputs {
            unsafe_volumes: vec!["db".into(), "logs".into()],
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert!(r.to_string().contains("db, logs") && r.to_string().contains("safeVolumes"));
    }

    #[test]
    fn crashes_cold_start_unless_policy_says_otherwise() {
        let i = RestoreInputs {
            last_exit: LastExit::Error { exit_code: 139 },
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert!(r.to_string().contains("exit code 139"), "{r}");
        let i = RestoreInputs {
            last_exit: LastExit::Error { exit_code: 139 },
            policy_restore_on_crash: Some(true),
            ..ok_inputs()
        };
        assert!(matches!(decide(&i), Decision::Restore { .. }));
        let i = RestoreInputs {
            last_exit: LastExit::Completed,
            policy_restore_on_crash: Some(true),
            ..ok_inputs()
        };
        assert_eq!(reason(decide(&i)), ColdStartReason::Completed);
    }

    #[test]
    fn lineage_and_guard() {
        let i = RestoreInputs {
            claim: None,
            ..ok_inputs()
        };
        assert_eq!(reason(decide(&i)), ColdStartReason::NoLineage);
        let mut i = ok_inputs();
        i.claim.as_mut().unwrap().choice =
            RestoreChoice::ColdStart("restores from 2 checkpoint(s) failed repeatedly".into());
        let r = reason(decide(&i));
        assert!(r.to_string().contains("failed repeatedly"));
    }

    #[test]
    fn spec_hash_must_match() {
        let i = RestoreInputs {
            pod_spec_hash: hash("bb"),
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert!(r.to_string().contains("security-relevant"), "{r}");
        let i = RestoreInputs {
            checkpoint_spec_hash: None,
            ..ok_inputs()
        };
        assert!(reason(decide(&i))
            .to_string()
            .contains("records no pod spec hash"));
    }

    #[test]
    fn mismatches_are_named() {
        let i = RestoreInputs {
            mismatches: vec![Mismatch {
                field: "declared.engine".into(),
                recorded: "v1".into(),
                found: "v2".into(),
            }],
            ..ok_inputs()
        };
        let r = reason(decide(&i));
        assert_eq!(
            r.to_string(),
            "incompatible checkpoint: declared.engine: checkpoint has v1, pod has v2"
        );
        assert_eq!(r.label(), "Incompatible");
    }
}
