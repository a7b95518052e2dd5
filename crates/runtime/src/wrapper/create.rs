//! `create`: the plan lookup, and the restore that replaces `runc create` when a plan is found.

use super::*;

use stasis_engine::restore::lazy;

impl Ctx {
    pub(super) fn lookup_plan(&self, id: &str, kind: &ContainerKind, deadline: Instant) -> Lookup {
        let dir = self.cfg.plans_dir();
        let pod = pod_of(kind);
        let candidates = [
            planfile::path_for_container(&dir, id),
            planfile::path_for_pod(&dir, &pod.pod_uid, &pod.container_name),
        ];
        for p in candidates.into_iter().flatten() {
            match planfile::read(&p) {
                Ok(Some(plan)) => {
                    // A restart in place prepared before this create: its wait is over.
                    inplace::clear_pending(&dir, &pod.pod_uid, &pod.container_name);
                    return Lookup::Found {
                        plan,
                        file: Some(p),
                    };
                }
                Ok(None) => {}
                Err(e) => {
                    return Lookup::Missing {
                        cause: ColdStartCause::PlanRefused,
                        reason: format!("unusable plan file: {e}"),
                        skip_report: false,
                        expected: false,
                    }
                }
            }
        }
        let asking = self.ask_again_after_lost_memory(id, kind);
        // A restart in place the agent is preparing: wait for its plan (bounded by its answer,
        // and with the asking above by one restart's bound in all).
        let at_most =
            Duration::from_millis(stasis_node_api::MAX_PREPARE_WAIT_MS).saturating_sub(asking);
        let missing = |cause, reason| Lookup::Missing {
            cause,
            reason,
            skip_report: false,
            expected: false,
        };
        match inplace::wait_for_plan(&dir, &pod.pod_uid, &pod.container_name, now_ms(), at_most) {
            Waited::NotPending => {}
            Waited::Plan { plan, file } => {
                return Lookup::Found {
                    plan,
                    file: Some(file),
                }
            }
            Waited::Unusable { reason } => return missing(ColdStartCause::PlanRefused, reason),
            // The agent said why with its own Event when it wrote the note.
            Waited::Failed(f) => {
                return Lookup::Missing {
                    cause: ColdStartCause::RestoreFailed,
                    reason: format!(
                        "the restart in place from {} could not be prepared: {}",
                        f.checkpoint_ref, f.reason
                    ),
                    skip_report: true,
                    expected: false,
                }
            }
            Waited::TimedOut {
                checkpoint_ref,
                waited_ms,
            } => {
                return missing(
                    ColdStartCause::Other,
                    format!("the restart in place from {checkpoint_ref} was not prepared within {waited_ms} ms"),
                )
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Lookup::Missing {
                cause: ColdStartCause::Other,
                reason: "no plan file, and no time left to ask the agent".into(),
                skip_report: false,
                expected: false,
            };
        }
        match self.client(left).restore_plan(RestorePlanRequest {
            container_id: id.to_owned(),
            pod,
        }) {
            Ok(PlanAnswer::Plan(plan)) => Lookup::Found {
                plan: PlanFile {
                    v: PROTOCOL_VERSION,
                    container_id: Some(id.to_owned()),
                    pod_uid: None,
                    container_name: None,
                    plan,
                    expires_at_unix_ms: None,
                },
                file: None,
            },
            // The agent has just heard of this container and said no: no report needed.
            Ok(PlanAnswer::NoPlan { reason }) => Lookup::Missing {
                cause: ColdStartCause::NoPlan,
                reason: format!("no restore plan: {reason}"),
                skip_report: true,
                expected: true,
            },
            Err(e) if e.is_no_agent() => Lookup::Missing {
                cause: ColdStartCause::NoPlan,
                reason: "no restore plan (no plan file, no agent)".into(),
                skip_report: true,
                expected: true,
            },
            Err(e) => Lookup::Missing {
                cause: ColdStartCause::Other,
                reason: format!("no plan file, and the agent did not answer in time: {e}"),
                skip_report: false,
                expected: false,
            },
        }
    }

    pub(super) fn create(&self, c: &CreateArgs) -> ! {
        let Some(id) = c.id.as_deref() else {
            self.passthrough()
        };
        let bundle_dir = PathBuf::from(c.bundle.as_deref().unwrap_or("."));
        let bundle = match bundle::read(&bundle_dir) {
            Ok(b) => b,
            // runc will refuse it too, with its own message.
            Err(_) => self.passthrough(),
        };
        let kind = bundle::classify(&bundle.annotations);
        match decide::precheck(
            &self.inv,
            c,
            &kind,
            bundle::forces_cold_start(&bundle.annotations),
        ) {
            Precheck::Passthrough => self.passthrough(),
            Precheck::Cold(cause, reason) => self.cold(id, &kind, Cold::doubt(cause, reason, None)),
            Precheck::LookForPlan => {}
        }
        self.skip_if_noted(id, &bundle_dir, &kind);
        let deadline = Instant::now() + self.cfg.plan_timeout;
        let (pf, file) = match self.lookup_plan(id, &kind, deadline) {
            Lookup::Found {
                plan,
                file: Some(file),
            } if plan.plan.lazy
                && !lazy_daemon_listens(&plan.plan)
                && planfile::path_for_pod(
                    &self.cfg.plans_dir(),
                    &pod_of(&kind).pod_uid,
                    &pod_of(&kind).container_name,
                )
                .is_some_and(|p| p == file) =>
            {
                self.served_again(id, &kind, &plan.plan.checkpoint_ref, &file)
            }
            Lookup::Found { plan, file } => (plan, file),
            Lookup::Missing {
                cause,
                reason,
                skip_report,
                expected,
            } => self.cold(
                id,
                &kind,
                Cold {
                    cause,
                    reason,
                    checkpoint_ref: None,
                    skip_report,
                    expected,
                },
            ),
        };
        let plan = self.take_plan(id, &kind, &pf, file.as_deref());
        self.restore(id, c, &bundle, &kind, &plan)
    }

    /// Checks a plan found for this container and consumes its file (a plan is used once,
    /// accepted or not: no restore loops); a refused plan is a cold start with the reason.
    fn take_plan(
        &self,
        id: &str,
        kind: &ContainerKind,
        pf: &PlanFile,
        file: Option<&Path>,
    ) -> stasis_node_api::Plan {
        let ckpt = Some(pf.plan.checkpoint_ref.clone());
        let verdict = decide::accept(pf, id, kind, now_ms(), &image_facts(&pf.plan));
        if file.is_some_and(|f| planfile::consume(f).is_err()) {
            self.cold(
                id,
                kind,
                Cold::doubt(
                    ColdStartCause::PlanRefused,
                    "the plan was taken by another create".into(),
                    ckpt,
                ),
            );
        }
        verdict.unwrap_or_else(|reason| {
            self.cold(
                id,
                kind,
                Cold::doubt(ColdStartCause::PlanRefused, reason, ckpt),
            )
        })
    }

    /// The container this one restarts was restored lazily and killed because its memory could
    /// not arrive (its agent died mid-transfer; the watchdog left the record in the work dir):
    /// the next agent is asked to restore its checkpoint again, in place, as for a restore lost
    /// before its container started, waiting for an agent to answer up to the bound of any
    /// restart in place. Its `preparing` answer is the pending note the lookup then waits on;
    /// without one the container starts cold as it would have. Returns how long it asked: the
    /// wait for the plan gets the rest of that bound, so that the create (the kubelet waits 2
    /// minutes for it) never waits twice the bound.
    fn ask_again_after_lost_memory(&self, id: &str, kind: &ContainerKind) -> Duration {
        let pod = pod_of(kind);
        let Some(checkpoint_ref) =
            planfile::lazy_work_dir(&self.cfg.plans_dir(), &pod.pod_uid, &pod.container_name)
                .and_then(|dir| lazy::take_killed(&dir))
        else {
            return Duration::ZERO;
        };
        let started = Instant::now();
        let what = format!(
            "the container restored lazily from {checkpoint_ref} before {id} was ended as its agent died before all its memory arrived"
        );
        let until = Instant::now() + Duration::from_millis(stasis_node_api::MAX_PREPARE_WAIT_MS);
        while !self.ask_in_place(id, kind, false, Some(checkpoint_ref.clone()), true, &what) {
            if Instant::now() > until {
                self.log(
                    Level::Warning,
                    &format!(
                        "{what}; no agent answered within {} s",
                        stasis_node_api::MAX_PREPARE_WAIT_MS / 1000
                    ),
                );
                return started.elapsed();
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        started.elapsed()
    }

    /// A lazy plan (at `file`) whose `criu lazy-pages` daemon is gone: its agent died after
    /// preparing it. The next agent prepares it again (`inplace::wait_for_served_again`): the
    /// new plan, or the cold start with the reason when none comes.
    fn served_again(
        &self,
        id: &str,
        kind: &ContainerKind,
        checkpoint_ref: &str,
        file: &Path,
    ) -> (PlanFile, Option<PathBuf>) {
        let pod = pod_of(kind);
        let ckpt = checkpoint_ref.to_owned();
        self.log(
            Level::Info,
            &format!(
                "the agent that served the memory of {ckpt} lazily is gone: waiting for the next agent to serve it again"
            ),
        );
        let cold = |cause, reason: String, skip_report| -> ! {
            // Used once, as any plan: a later create of the container does not wait again.
            let _ = planfile::consume(file);
            self.cold(
                id,
                kind,
                Cold {
                    cause,
                    reason,
                    checkpoint_ref: Some(ckpt.clone()),
                    skip_report,
                    expected: false,
                },
            )
        };
        match inplace::wait_for_served_again(
            &self.cfg.plans_dir(),
            &pod.pod_uid,
            &pod.container_name,
            lazy_daemon_listens,
        ) {
            Waited::Plan { plan, file } => (plan, Some(file)),
            Waited::Unusable { reason } => cold(ColdStartCause::PlanRefused, reason, false),
            // The agent said why with its own Event.
            Waited::Failed(f) => cold(
                ColdStartCause::RestoreFailed,
                format!("{ckpt} could not be served again: {}", f.reason),
                true,
            ),
            Waited::NotPending | Waited::TimedOut { .. } => cold(
                ColdStartCause::PlanRefused,
                format!(
                    "the agent that served the memory of {ckpt} lazily stopped, and no agent served it again within {} s",
                    stasis_node_api::MAX_PREPARE_WAIT_MS / 1000
                ),
                false,
            ),
        }
    }

    /// An init container the agent noted as run before the checkpoint its pod restores: the
    /// note is consumed, the bundle's command becomes stasis's exit-0 program, and runc creates
    /// it as asked. Returns when there is no note, or (logged) when it cannot be honoured: the
    /// init container then runs its command, as without stasis.
    fn skip_if_noted(&self, id: &str, bundle_dir: &Path, kind: &ContainerKind) {
        let pod = pod_of(kind);
        let Some(path) =
            planfile::path_for_skip(&self.cfg.plans_dir(), &pod.pod_uid, &pod.container_name)
        else {
            return;
        };
        let note = match planfile::read_skip(&path) {
            Ok(Some(n)) => n,
            Ok(None) => return,
            Err(e) => {
                self.log(Level::Warning, &format!("unusable skip note: {e}"));
                return;
            }
        };
        // Used once, like a plan.
        if planfile::consume(&path).is_err() || note.expires_at_unix_ms < now_ms() {
            return;
        }
        let done = crate::skip::beside_wrapper()
            .and_then(|dir| crate::skip::install(&dir))
            .map_err(|e| format!("cannot install stasis's exit-0 program: {e}"))
            .and_then(|program| crate::skip::rewrite_bundle(bundle_dir, &program));
        match done {
            Ok(()) => {
                self.log(
                    Level::Info,
                    &format!(
                        "init container {} ({id}) ran before checkpoint {}, which its pod restores: it exits 0 without running its command",
                        pod.container_name, note.checkpoint_ref
                    ),
                );
                self.passthrough()
            }
            Err(e) => self.log(
                Level::Warning,
                &format!(
                    "init container {} runs its command again although its pod restores checkpoint {}: {e}",
                    pod.container_name, note.checkpoint_ref
                ),
            ),
        }
    }

    pub(super) fn restore(
        &self,
        id: &str,
        c: &CreateArgs,
        bundle: &bundle::Bundle,
        kind: &ContainerKind,
        plan: &stasis_node_api::Plan,
    ) -> ! {
        let ckpt = Some(plan.checkpoint_ref.clone());
        let started = Instant::now();
        // The marker goes down before anything is restored: `start` finds it (the container runs
        // already), and so does `delete` of a container that never started, whose create was
        // given up while or after it restored (the kubelet or containerd died, or timed out):
        // that restore is lost, and the agent prepares it again for the next create.
        if let Err(e) = self.mark_restored(id, plan, kind) {
            self.cold(
                id,
                kind,
                Cold::doubt(
                    ColdStartCause::RestoreFailed,
                    format!("cannot write the restore marker: {e}"),
                    ckpt,
                ),
            );
        }
        if let Some(method) = plan.rootfs_method {
            if let Err(e) = stasis_engine::rootfs::apply(
                &ImageDir::new(&plan.image_dir),
                method,
                &bundle.rootfs,
            ) {
                self.not_restored(
                    id,
                    kind,
                    format!("putting the checkpoint's files back failed ({e}); the rootfs may hold part of them"),
                    ckpt,
                );
            }
        }
        // A lazy plan's work dir is where the agent's `criu lazy-pages` listens (on the run
        // directory, as the plan says); otherwise one of the wrapper's own.
        let work = match plan.lazy {
            true => plan.lazy_work_dir(),
            false => self.cfg.work_dir().join(id),
        };
        if !plan.lazy {
            let _ = std::fs::remove_dir_all(&work);
        }
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&work)
        {
            self.not_restored(
                id,
                kind,
                format!("cannot make the work dir {}: {e}", work.display()),
                ckpt,
            );
        }
        // Established TCP connections: kept where they can continue, closed elsewhere (a pod's
        // new network namespace has another address; DESIGN §9.8). Closing is `tcp-close`,
        // which runc has no flag for: a CRIU configuration file in the work dir.
        let tcp = stasis_engine::sockets::decide_for(
            stasis_engine::sockets::read_record(&plan.image_dir.join("criu")).as_ref(),
            &bundle.tcp_target(),
            !plan.tcp_established,
        );
        let conf = if tcp.keeps() {
            None
        } else {
            stasis_engine::sockets::CriuConf::write(&work, &["tcp-close"])
                .map_err(|e| {
                    self.log(
                        Level::Warning,
                        &format!("cannot write the CRIU configuration: {e}"),
                    )
                })
                .ok()
        };
        let plan_tcp = stasis_node_api::Plan {
            tcp_established: tcp.keeps(),
            ..plan.clone()
        };
        let args = decide::restore_args(&self.inv, c, id, &plan_tcp, &work);
        let mut runc = Command::new(&self.real);
        if let Some(conf) = &conf {
            runc.env(stasis_engine::sockets::CRIU_CONFIG_ENV, &conf.path);
        }
        let lazy = plan.lazy.then_some(work.as_path());
        // The processes serving its memory (`criu lazy-pages`, holding the userfaultfds, and
        // the watchdog) were started in the agent's container: moved into this process's
        // cgroups they outlive the agent, whose death would otherwise close the userfaultfds
        // and leave the pages not yet arrived to read as zeros.
        let adopted = match lazy {
            Some(dir) => lazy::adopt_helpers(dir)
                .map_err(|e| format!("the service of its memory cannot outlive the agent ({e})")),
            None => Ok(()),
        };
        if let (Some(dir), Ok(())) = (lazy, &adopted) {
            // The agent's page server ends this container if its memory cannot arrive: it
            // must know which one, and whether `runc restore` still runs.
            let runc = stasis_engine::runc::Runc {
                binary: self.real.clone(),
                root: self
                    .inv
                    .globals
                    .root
                    .as_deref()
                    .unwrap_or(stasis_engine::runc::DEFAULT_ROOT)
                    .into(),
            };
            if let Err(e) = lazy::announce(
                dir,
                &runc,
                id,
                std::process::id() as i32,
                &plan.checkpoint_ref,
            ) {
                self.not_restored(
                    id,
                    kind,
                    format!("cannot name the container to the agent serving its memory: {e}"),
                    ckpt,
                );
            }
        }
        let status = adopted.map(|()| runc.args(&args).status());
        // A restore that failed can leave CRIU's cgroup yard (a tmpfs with the cgroup
        // hierarchies inside) mounted in its work dir, on the host, where only this process's
        // mount namespace can undo it: the agent, whose view of the dir is another namespace's,
        // could never remove it, and each failed restore would leave its mounts on the node.
        let leftover = stasis_engine::mounts::unmount_under(&work);
        if !leftover.is_empty() {
            self.log(
                Level::Warning,
                &format!(
                    "unmounted what the restore left mounted in {}: {:?}{}",
                    work.display(),
                    leftover.unmounted,
                    if leftover.failed.is_empty() {
                        String::new()
                    } else {
                        format!("; could not unmount {:?}", leftover.failed)
                    }
                ),
            );
        }
        if let (Some(dir), Ok(status)) = (lazy, &status) {
            let _ = lazy::announce_outcome(dir, matches!(status, Ok(s) if s.success()));
        }
        let failure = match status {
            Err(why) => Some(why),
            Ok(Ok(s)) if s.success() => self.resume_gpu(id, c, &bundle.dir, plan).err(),
            Ok(Ok(s)) => Some(format!(
                "runc restore failed ({s}){}",
                criu_errors(&work.join("restore.log"))
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            )),
            Ok(Err(e)) => Some(format!("cannot run {}: {e}", self.real.display())),
        };
        if let Some(why) = failure {
            let _ = Command::new(&self.real)
                .args(decide::delete_args(&self.inv, id))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
            // The agent serving the memory went away while the restore connected to it (after
            // the plan's check: its watchdog removed the socket): its successor serves the
            // restore again, as for a plan found stale. Once.
            let pod = pod_of(kind);
            let taken =
                planfile::path_for_pod(&self.cfg.plans_dir(), &pod.pod_uid, &pod.container_name);
            if plan.lazy
                && !lazy_daemon_listens(plan)
                && !LAZY_RETRIED.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                if let Some(file) = taken.filter(|f| planfile::unconsume(f)) {
                    self.log(
                        Level::Info,
                        &format!(
                            "the restore of {} failed as the agent serving its memory went away ({why})",
                            plan.checkpoint_ref
                        ),
                    );
                    let (pf, file) = self.served_again(id, kind, &plan.checkpoint_ref, &file);
                    let again = self.take_plan(id, kind, &pf, file.as_deref());
                    self.restore(id, c, bundle, kind, &again)
                }
            }
            let files = if plan.rootfs_method.is_some() {
                " (the checkpoint's files stay in the rootfs, as after a crash)"
            } else {
                ""
            };
            self.not_restored(id, kind, format!("{why}{files}"), ckpt);
        }
        if bundle.own_netns {
            self.loopback_up(id, c.pid_file.as_deref());
        }
        let restore_ms = started.elapsed().as_millis() as u64;
        self.log(
            Level::Info,
            &format!(
                "restored {id} from checkpoint {} in {restore_ms} ms, {} (CRIU log: {})",
                plan.checkpoint_ref,
                tcp.describe(),
                work.join("restore.log").display()
            ),
        );
        self.report(
            id,
            pod_of(kind),
            ReportEvent::Restored {
                checkpoint_ref: plan.checkpoint_ref.clone(),
                restore_ms,
            },
        );
        std::process::exit(0)
    }

    /// A restore that failed in this create: its marker goes (the cold container's `start` must
    /// run it, and its `delete` must not take the restore for lost), then the cold start.
    fn not_restored(&self, id: &str, kind: &ContainerKind, why: String, ckpt: Option<String>) -> ! {
        let _ = std::fs::remove_file(self.cfg.restored_dir().join(id));
        self.cold(
            id,
            kind,
            Cold::doubt(ColdStartCause::RestoreFailed, why, ckpt),
        )
    }

    /// The checkpoint's CUDA processes come back from `runc restore` with their GPU state in host
    /// memory (CHECKPOINTED, every CUDA call blocked): restore it onto the GPUs the device plugin
    /// gave this container and unlock them (DESIGN §7). `Err`: why the restore becomes a cold
    /// start (the caller deletes the container; killing CHECKPOINTED processes is safe).
    pub(super) fn resume_gpu(
        &self,
        id: &str,
        c: &CreateArgs,
        bundle_dir: &Path,
        plan: &stasis_node_api::Plan,
    ) -> Result<(), String> {
        let record = match stasis_engine::cuda::read_gpu_record(&plan.image_dir) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("the checkpoint's GPU record: {e}")),
        };
        let pid = c
            .pid_file
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse::<i32>().ok())
            .ok_or("the restored container's pid is unknown (no --pid-file), so its GPU state cannot be restored")?;
        let report = stasis_engine::cuda::resume_after_restore(
            pid,
            record.processes,
            &record.recorded,
            Some(bundle_dir),
        )
        .map_err(|e| format!("restoring the GPU state failed: {e}"))?;
        self.log(
            Level::Info,
            &format!(
                "restored {id}: GPU state of {} CUDA process(es) restored in {:.0} ms{}",
                report.processes,
                report.total_ms,
                if report.remapped {
                    " onto the GPUs this container was given"
                } else {
                    ""
                }
            ),
        );
        Ok(())
    }

    /// A restored network namespace of its own comes back with `lo` down (DESIGN §8).
    pub(super) fn loopback_up(&self, id: &str, pid_file: Option<&str>) {
        let pid = pid_file
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse::<u32>().ok());
        let ok = pid.is_some_and(|pid| {
            Command::new("nsenter")
                .args([
                    "-t",
                    &pid.to_string(),
                    "-n",
                    "ip",
                    "link",
                    "set",
                    "lo",
                    "up",
                ])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        if !ok {
            self.log(
                Level::Warning,
                &format!("restored {id}: could not bring up loopback in its network namespace"),
            );
        }
    }

    pub(super) fn mark_restored(
        &self,
        id: &str,
        plan: &stasis_node_api::Plan,
        kind: &ContainerKind,
    ) -> std::io::Result<()> {
        let dir = self.cfg.restored_dir();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let m = RestoredMarker {
            v: PROTOCOL_VERSION,
            checkpoint_ref: plan.checkpoint_ref.clone(),
            root: self.inv.globals.root.clone(),
            restored_at_unix_ms: now_ms(),
            pod: matches!(kind, ContainerKind::App(_)).then(|| pod_of(kind)),
        };
        let tmp = dir.join(format!(".{id}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(&m)?)?;
        std::fs::rename(&tmp, dir.join(id))
    }
}

/// Whether the agent's `criu lazy-pages` daemon listens for a lazy plan's restore: its socket is
/// in the plan's work dir (the agent's watchdog removes it when the agent dies), and the
/// processes serving the restore run (a container's end kills the watchdog too).
fn lazy_daemon_listens(plan: &stasis_node_api::Plan) -> bool {
    let work = plan.lazy_work_dir();
    work.join("lazy-pages.socket").exists() && lazy::helpers_alive(&work)
}

/// A lazy restore is tried again at most once after its agent went away.
static LAZY_RETRIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What the plan's check needs to know of its image dir.
fn image_facts(plan: &stasis_node_api::Plan) -> ImageFacts {
    let img = &plan.image_dir;
    ImageFacts {
        criu_inventory: img.join("criu/inventory.img").is_file(),
        rootfs_diff: img.join("rootfs/diff.tar").is_file(),
        stamp: planfile::read_verified_stamp(img)
            .map(|s| s.map(|s| s.checkpoint_ref))
            .map_err(|e| e.to_string()),
        lazy_daemon: lazy_daemon_listens(plan),
    }
}
