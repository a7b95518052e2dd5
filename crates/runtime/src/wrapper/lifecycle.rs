//! `start`, `kill` and `delete`: what the wrapper adds to runc's own (the restored marker, the
//! checkpoint before a SIGTERM, the exit report of an OOM-killed container or of one whose
//! restore was lost before it started).

use super::*;

impl Ctx {
    pub(super) fn start(&self, id: Option<&str>) -> ! {
        let Some(id) = id.filter(|i| planfile::path_for_container(Path::new("/"), i).is_some())
        else {
            self.passthrough()
        };
        let marker = self.cfg.restored_dir().join(id);
        let m: Option<RestoredMarker> = std::fs::read(&marker)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        match m {
            Some(m) if m.root == self.inv.globals.root => {
                let _ = std::fs::remove_file(&marker);
                self.log(
                    Level::Info,
                    &format!(
                        "start {id}: restored from {} and already running",
                        m.checkpoint_ref
                    ),
                );
                std::process::exit(0)
            }
            _ => self.passthrough(),
        }
    }

    pub(super) fn kill(&self, k: &KillArgs) -> ! {
        let Some(id) = k.id.as_deref() else {
            self.passthrough()
        };
        if !argv::is_sigterm(k.signal.as_deref())
            || self.cfg.final_checkpoint_timeout.is_zero()
            || planfile::path_for_container(Path::new("/"), id).is_none()
        {
            self.passthrough()
        }
        let kind = self
            .runc_state(id)
            .map_or(ContainerKind::Plain, |(_, kind)| kind);
        if kind == ContainerKind::Sandbox {
            self.passthrough()
        }
        let deadline_ms = self.cfg.final_checkpoint_timeout.as_millis() as u64;
        let started = Instant::now();
        let answer =
            self.client(Duration::from_millis(500))
                .final_checkpoint(FinalCheckpointRequest {
                    container_id: id.to_owned(),
                    pod: pod_of(&kind),
                    deadline_ms,
                    answer_when_captured: true,
                    hold_until_stopped: false,
                });
        let ms = started.elapsed().as_millis();
        let end_with_kill = answer.as_ref().is_ok_and(CheckpointAnswer::end_with_kill);
        match answer {
            Ok(CheckpointAnswer::Done { checkpoint_ref, .. }) => self.log(
                Level::Info,
                &format!("final checkpoint of {id} before SIGTERM: {checkpoint_ref} ({ms} ms)"),
            ),
            Ok(CheckpointAnswer::Captured { checkpoint_ref, .. }) => self.log(
                Level::Info,
                &format!(
                    "final checkpoint of {id} before SIGTERM: {checkpoint_ref} captured ({ms} ms), uploading"
                ),
            ),
            Ok(CheckpointAnswer::Skipped { reason }) => self.log(
                Level::Info,
                &format!("no final checkpoint of {id}: {reason}"),
            ),
            Ok(CheckpointAnswer::Failed { reason }) => self.log(
                Level::Warning,
                &format!("final checkpoint of {id} failed ({ms} ms): {reason}"),
            ),
            Err(e) if e.is_no_agent() => {}
            Err(e) => self.log(
                Level::Warning,
                &format!("final checkpoint of {id}: no answer from the agent ({ms} ms): {e}"),
            ),
        }
        if end_with_kill {
            // Its continuation is in the checkpoint; a clean exit on SIGTERM would tell the
            // pod's owner (a Job) that the work is finished.
            self.log(
                Level::Info,
                &format!("{id} ends with SIGKILL: its pod's exit would read as finished work"),
            );
            self.exec(&self.inv.kill_with_signal(k, "KILL"))
        }
        self.passthrough()
    }

    /// runc's state of a container (`<root>/<id>/state.json`) and what kind of container its
    /// annotations say it is (sandbox, app container of a pod, plain).
    pub(super) fn runc_state(&self, id: &str) -> Option<(Vec<u8>, ContainerKind)> {
        let root = self
            .inv
            .globals
            .root
            .as_deref()
            .unwrap_or(RUNC_DEFAULT_ROOT);
        let raw = std::fs::read(Path::new(root).join(id).join("state.json")).ok()?;
        let kind = bundle::annotations_from_runc_state(&raw)
            .map_or(ContainerKind::Plain, |a| bundle::classify(&a));
        Some((raw, kind))
    }

    pub(super) fn delete(&self, id: Option<&str>) -> ! {
        if let Some(id) = id.filter(|i| planfile::path_for_container(Path::new("/"), i).is_some()) {
            // The restore marker of a container that never started: its create restored it (or
            // was stopped while restoring it) and was then given up, so the restore is lost.
            let marker = self.cfg.restored_dir().join(id);
            let lost = std::fs::read(&marker)
                .ok()
                .and_then(|b| serde_json::from_slice::<RestoredMarker>(&b).ok())
                .filter(|m| m.root == self.inv.globals.root);
            let _ = std::fs::remove_file(&marker);
            let _ = std::fs::remove_dir_all(self.cfg.work_dir().join(id));
            self.tell_exit(id, lost);
        }
        self.passthrough()
    }

    /// An app container killed by the OOM killer, or one whose restore was lost before it
    /// started (`restore_lost`: the checkpoint): tell the agent before runc deletes its state
    /// and cgroup (the only place that still says so). The agent answers at once that it is
    /// preparing the restore in place; the note of it makes the restart's `create` wait for the
    /// plan (`inplace`). Bounded (500 ms); a missing agent is quiet; an answer this runtime does
    /// not know is no plan (a cold start).
    pub(super) fn tell_exit(&self, id: &str, lost: Option<RestoredMarker>) {
        // (runc has no state of a container whose create was stopped before runc made it: the
        // marker names its pod then)
        let (oom_killed, kind) = match (self.runc_state(id), &lost) {
            (Some((raw, kind)), _) => (bundle::oom_killed_from_runc_state(&raw), kind),
            (None, Some(RestoredMarker { pod: Some(p), .. })) => {
                (false, ContainerKind::App(p.clone()))
            }
            (None, _) => return,
        };
        let restore_lost = lost.map(|m| m.checkpoint_ref);
        if !matches!(kind, ContainerKind::App(_)) || !(oom_killed || restore_lost.is_some()) {
            return;
        }
        let what = match &restore_lost {
            Some(c) => format!("{id} was deleted before it started, losing its restore from {c}"),
            None => format!("{id} was OOM-killed"),
        };
        let _ = self.ask_in_place(id, &kind, oom_killed, restore_lost, false, &what);
    }

    /// Asks the agent for the restart in place of container `id` (`what` happened to it), and
    /// records its `preparing` answer as the pending note the restart's `create` waits on.
    /// `false`: no agent answered.
    pub(super) fn ask_in_place(
        &self,
        id: &str,
        kind: &ContainerKind,
        oom_killed: bool,
        restore_lost: Option<String>,
        memory_lost: bool,
        what: &str,
    ) -> bool {
        let answer =
            self.client(Duration::from_millis(500))
                .container_exited(ContainerExitedRequest {
                    container_id: id.to_owned(),
                    pod: pod_of(kind),
                    oom_killed,
                    wait_for_plan: true,
                    restore_lost,
                    memory_lost,
                });
        match answer {
            Ok(ExitAnswer::Preparing {
                checkpoint_ref,
                wait_ms,
            }) => {
                let pod = pod_of(kind);
                match inplace::record_pending(
                    &self.cfg.plans_dir(),
                    &pod.pod_uid,
                    &pod.container_name,
                    &checkpoint_ref,
                    wait_ms,
                    now_ms(),
                ) {
                    Ok(bound) => self.log(
                        Level::Info,
                        &format!("{what}: the agent is preparing its restart in place from {checkpoint_ref}; its create waits up to {bound} ms for it"),
                    ),
                    Err(e) => self.log(
                        Level::Warning,
                        &format!("{what}; its restart cannot wait for the restore in place being prepared ({e}) and may start cold"),
                    ),
                }
            }
            Ok(ExitAnswer::Plan(p)) => self.log(
                Level::Info,
                &format!("{what}: its restart restores {} in place", p.checkpoint_ref),
            ),
            Ok(ExitAnswer::NoPlan { reason }) => self.log(
                Level::Info,
                &format!("{what}; its restart starts cold: {reason}"),
            ),
            Err(e) if e.is_no_agent() => return false,
            Err(e) => {
                self.log(
                    Level::Warning,
                    &format!("{what}; no answer from the agent: {e}"),
                );
                return false;
            }
        }
        true
    }
}
