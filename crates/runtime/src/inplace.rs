//! A restart in place being prepared (docs/design.md §12.5a): `delete` of an OOM-killed
//! container records the agent's `preparing` answer as a pending note beside the plan files, and
//! the restarted container's `create` waits for the plan file (or the agent's failure note) up to
//! the note's bound. The fetch is then off `delete`'s 500 ms path, and a large container's restart
//! waits for its plan instead of starting cold.
//!
//! Everything here is files in the plans directory, read only when trusted (root, not writable by
//! others: `planfile`); a missing, untrusted or expired note is no wait at all.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use stasis_node_api::planfile::{self, Failed, Pending, PlanFile};
use stasis_node_api::{MAX_PREPARE_WAIT_MS, PROTOCOL_VERSION};

/// How often `create` looks for the plan while it waits.
const POLL: Duration = Duration::from_millis(20);

/// Records the agent's `preparing` answer (the `delete` side): `create` waits until
/// `now_ms + wait_ms`, at most [`MAX_PREPARE_WAIT_MS`]. A failure note of an earlier restart is
/// removed, so that only this preparation's outcome ends the wait.
pub fn record_pending(
    plans_dir: &Path,
    pod_uid: &str,
    container_name: &str,
    checkpoint_ref: &str,
    wait_ms: u64,
    now_ms: u64,
) -> std::io::Result<u64> {
    let (Some(pending), Some(failed)) = (
        planfile::path_for_pending(plans_dir, pod_uid, container_name),
        planfile::path_for_failed(plans_dir, pod_uid, container_name),
    ) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "no plain pod uid and container name",
        ));
    };
    let bound = wait_ms.min(MAX_PREPARE_WAIT_MS);
    planfile::write_pending(
        &pending,
        &Pending {
            v: PROTOCOL_VERSION,
            checkpoint_ref: checkpoint_ref.to_owned(),
            until_unix_ms: now_ms + bound,
        },
    )?;
    let _ = std::fs::remove_file(failed);
    Ok(bound)
}

/// Removes the pending note of a container (its plan was there before `create` looked): a
/// later `create` of it (a crash's restart) must not wait for a plan that will not come.
pub fn clear_pending(plans_dir: &Path, pod_uid: &str, container_name: &str) {
    if let Some(p) = planfile::path_for_pending(plans_dir, pod_uid, container_name) {
        let _ = std::fs::remove_file(p);
    }
}

/// What waiting for a restart in place gave (the `create` side).
#[derive(Debug)]
pub enum Waited {
    /// No restart in place is being prepared for this container (or its note is expired).
    NotPending,
    /// The plan file appeared.
    Plan { plan: PlanFile, file: PathBuf },
    /// A plan file appeared that cannot be read.
    Unusable { reason: String },
    /// The agent could not prepare it.
    Failed(Failed),
    /// Nothing came before the note's bound.
    TimedOut {
        checkpoint_ref: String,
        waited_ms: u64,
    },
}

/// Waits for the plan of a restart in place while a pending note says one is being prepared,
/// up to the note's bound (and never more than [`MAX_PREPARE_WAIT_MS`] from `now_ms`). The note
/// is removed whatever the outcome: one wait per restart. `at_most` bounds it further (what is
/// left of the create's own budget, so that asking and waiting together stay within the
/// kubelet's patience).
pub fn wait_for_plan(
    plans_dir: &Path,
    pod_uid: &str,
    container_name: &str,
    now_ms: u64,
    at_most: Duration,
) -> Waited {
    let (Some(pending_path), Some(plan_path), Some(failed_path)) = (
        planfile::path_for_pending(plans_dir, pod_uid, container_name),
        planfile::path_for_pod(plans_dir, pod_uid, container_name),
        planfile::path_for_failed(plans_dir, pod_uid, container_name),
    ) else {
        return Waited::NotPending;
    };
    let pending = match planfile::read_pending(&pending_path) {
        Ok(Some(p)) if p.until_unix_ms > now_ms => p,
        Ok(None) => return Waited::NotPending,
        // Expired, untrusted or malformed: no wait.
        _ => {
            let _ = std::fs::remove_file(&pending_path);
            return Waited::NotPending;
        }
    };
    let bound = Duration::from_millis((pending.until_unix_ms - now_ms).min(MAX_PREPARE_WAIT_MS))
        .min(at_most);
    let waited = wait_until(
        &plan_path,
        &failed_path,
        bound,
        pending.checkpoint_ref,
        |_| true,
    );
    let _ = std::fs::remove_file(&pending_path);
    waited
}

/// Waits for a lazy restore to be served again: the plan file `create` found names a
/// `criu lazy-pages` daemon that is gone (`listens` says no). That happens when the agent that
/// served it died after preparing it (its watchdog removes the socket): the agent that starts
/// next withdraws such a plan, leaves a pending note and prepares the restore again
/// (docs/design.md §12.5c). So `create` waits, up to [`MAX_PREPARE_WAIT_MS`], for a newer plan
/// file whose daemon listens (or a full one), instead of starting a container cold whose
/// checkpoint is fetched and verified on this node. The agent's failure note ends the wait;
/// the stale plan file is left for the agent to withdraw.
pub fn wait_for_served_again(
    plans_dir: &Path,
    pod_uid: &str,
    container_name: &str,
    listens: impl Fn(&stasis_node_api::Plan) -> bool,
) -> Waited {
    let (Some(plan_path), Some(failed_path)) = (
        planfile::path_for_pod(plans_dir, pod_uid, container_name),
        planfile::path_for_failed(plans_dir, pod_uid, container_name),
    ) else {
        return Waited::NotPending;
    };
    // A plan whose daemon listens: the agent withdraws the stale plan before it stages the
    // restore again, so a plan found with its daemon listening is the new one. (Not told apart
    // by its inode: the withdrawn file's is free for the new one.)
    let waited = wait_until(
        &plan_path,
        &failed_path,
        Duration::from_millis(MAX_PREPARE_WAIT_MS),
        String::new(),
        |p| !p.plan.lazy || listens(&p.plan),
    );
    if matches!(waited, Waited::Plan { .. } | Waited::Failed(_)) {
        clear_pending(plans_dir, pod_uid, container_name);
    }
    waited
}

/// Polls until a plan file that `usable` takes appears at `plan_path` (an unreadable one ends
/// the wait too), the agent's failure note at `failed_path` (removed), or `bound` has passed.
fn wait_until(
    plan_path: &Path,
    failed_path: &Path,
    bound: Duration,
    checkpoint_ref: String,
    usable: impl Fn(&PlanFile) -> bool,
) -> Waited {
    let started = Instant::now();
    loop {
        match planfile::read(plan_path) {
            Ok(Some(plan)) if usable(&plan) => {
                return Waited::Plan {
                    plan,
                    file: plan_path.to_path_buf(),
                }
            }
            Ok(_) => {}
            Err(e) => {
                return Waited::Unusable {
                    reason: format!("unusable plan file: {e}"),
                }
            }
        }
        if let Ok(Some(f)) = planfile::read_failed(failed_path) {
            let _ = std::fs::remove_file(failed_path);
            return Waited::Failed(f);
        }
        if started.elapsed() >= bound {
            return Waited::TimedOut {
                checkpoint_ref,
                waited_ms: started.elapsed().as_millis() as u64,
            };
        }
        std::thread::sleep(POLL.min(bound.saturating_sub(started.elapsed())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_node_api::Plan;

    fn plan_file() -> PlanFile {
        PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("u1".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: "/var/lib/stasis/images/u1/app".into(),
                rootfs_method: None,
                checkpoint_ref: "l/1".into(),
                tcp_established: false,
                lazy: false,
                work_dir: None,
            },
            expires_at_unix_ms: None,
        }
    }

    fn now() -> u64 {
        stasis_core::time::now_ms()
    }

    /// No bound of the caller's own.
    const MAX_WAIT: Duration = Duration::from_millis(MAX_PREPARE_WAIT_MS);

    /// What is left of the create's budget bounds the wait, whatever the note allows: a create
    /// that spent most of it asking an agent does not wait the note's full minute on top.
    #[test]
    fn the_callers_budget_bounds_the_wait() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        record_pending(&dir, "u1", "app", "l/1", 60_000, now()).unwrap();
        let started = Instant::now();
        let waited = wait_for_plan(&dir, "u1", "app", now(), Duration::from_millis(200));
        assert!(
            matches!(waited, Waited::TimedOut { ref checkpoint_ref, .. } if checkpoint_ref == "l/1"),
            "{waited:?}"
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }

    /// A lazy plan whose daemon died with its agent: `create` waits for the next agent's plan
    /// (written after it withdrew the stale one), not for the stale one, and takes it once its
    /// daemon listens.
    #[test]
    fn a_lazy_plan_whose_daemon_died_is_waited_for_until_served_again() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let path = dir.join("pod_u1_app.json");
        let mut stale = plan_file();
        stale.plan.lazy = true;
        stale.plan.work_dir = Some("/run/stasis/lazy/u1/app".into());
        planfile::write(&path, &stale).unwrap();
        let mut fresh = stale.clone();
        fresh.plan.checkpoint_ref = "l/1-again".into();
        let next_agent = {
            let (dir, path, fresh) = (dir.clone(), path.clone(), fresh.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                // Withdrawn with a pending note, then prepared again.
                std::fs::remove_file(&path).unwrap();
                record_pending(&dir, "u1", "app", "l/1", 60_000, now()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                planfile::write(&path, &fresh).unwrap();
            })
        };
        let started = Instant::now();
        // Only the fresh plan's daemon listens.
        let waited = wait_for_served_again(&dir, "u1", "app", |p| p.checkpoint_ref == "l/1-again");
        next_agent.join().unwrap();
        match waited {
            Waited::Plan { plan, file } => {
                assert_eq!(plan, fresh);
                assert_eq!(file, path);
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() >= Duration::from_millis(190));
        assert!(!dir.join("pod_u1_app.pending").exists(), "the note stays");

        // A plan file written again still without its daemon does not end the wait; the
        // agent's failure note does.
        let failer = {
            let (dir, path, stale) = (dir.clone(), path.clone(), stale.clone());
            std::thread::spawn(move || {
                planfile::write(&path, &stale).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                planfile::write_failed(
                    &dir.join("pod_u1_app.failed"),
                    &Failed {
                        v: PROTOCOL_VERSION,
                        checkpoint_ref: "l/1".into(),
                        reason: "the chunk cache could not give it".into(),
                    },
                )
                .unwrap();
            })
        };
        let waited = wait_for_served_again(&dir, "u1", "app", |_| false);
        failer.join().unwrap();
        assert!(matches!(waited, Waited::Failed(f) if f.reason.contains("chunk cache")));
    }

    #[test]
    fn no_note_no_wait_and_an_expired_note_is_dropped() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let started = Instant::now();
        assert!(matches!(
            wait_for_plan(&dir, "u1", "app", now(), MAX_WAIT),
            Waited::NotPending
        ));
        record_pending(&dir, "u1", "app", "l/1", 5_000, now() - 10_000).unwrap();
        assert!(matches!(
            wait_for_plan(&dir, "u1", "app", now(), MAX_WAIT),
            Waited::NotPending
        ));
        assert!(!dir.join("pod_u1_app.pending").exists());
        assert!(started.elapsed() < Duration::from_millis(500));
    }

    #[test]
    fn the_wait_ends_when_the_plan_appears() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let bound = record_pending(&dir, "u1", "app", "l/1", 600_000, now()).unwrap();
        assert_eq!(bound, MAX_PREPARE_WAIT_MS, "the bound is capped");
        let writer = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                planfile::write(&dir.join("pod_u1_app.json"), &plan_file()).unwrap();
            })
        };
        let started = Instant::now();
        match wait_for_plan(&dir, "u1", "app", now(), MAX_WAIT) {
            Waited::Plan { plan, file } => {
                assert_eq!(plan, plan_file());
                assert_eq!(file, dir.join("pod_u1_app.json"));
            }
            other => panic!("{other:?}"),
        }
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(140) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        writer.join().unwrap();
        assert!(
            !dir.join("pod_u1_app.pending").exists(),
            "one wait per restart"
        );
    }

    #[test]
    fn a_failure_note_ends_the_wait_and_the_bound_holds() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        // A failure note of an earlier restart does not end this one's wait.
        let failed = dir.join("pod_u1_app.failed");
        let note = Failed {
            v: PROTOCOL_VERSION,
            checkpoint_ref: "l/1".into(),
            reason: "a chunk is missing from the cache and the bucket".into(),
        };
        planfile::write_failed(&failed, &note).unwrap();
        record_pending(&dir, "u1", "app", "l/1", 300, now()).unwrap();
        assert!(!failed.exists());
        let started = Instant::now();
        match wait_for_plan(&dir, "u1", "app", now(), MAX_WAIT) {
            Waited::TimedOut {
                checkpoint_ref,
                waited_ms,
            } => {
                assert_eq!(checkpoint_ref, "l/1");
                assert!((250..2_000).contains(&waited_ms), "{waited_ms}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(2));

        record_pending(&dir, "u1", "app", "l/1", 30_000, now()).unwrap();
        planfile::write_failed(&failed, &note).unwrap();
        let started = Instant::now();
        match wait_for_plan(&dir, "u1", "app", now(), MAX_WAIT) {
            Waited::Failed(f) => assert_eq!(f, note),
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(!failed.exists() && !dir.join("pod_u1_app.pending").exists());
    }
}
