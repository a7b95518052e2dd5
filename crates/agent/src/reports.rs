//! The runtime's reports of a restore's outcome, delivered at least once (docs/design.md §12.5).
//!
//! The wrapper writes each report to the plans directory (`report_<container id>.json`) before
//! it sends it over the socket. Whoever handles it here, the socket handler or the pickup of
//! report files, first claims the file (`planfile::claim_report`: a rename to
//! `taking_<container id>.json`, which one caller only wins), and removes the claimed file once
//! the report is handled. So a report is handled once while the agent lives, and a report the
//! agent died handling (its claimed file left) is handled again by the agent that starts next:
//! a duplicate, which `Agent::handle_report` tolerates, rather than a restore whose outcome
//! nobody hears of (the soak's lost report: a restored replacement's PodRestore left `Ready`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use stasis_api::RestorePhase;
use stasis_node_api::planfile::{self, ReportClaim};
use stasis_node_api::{ReportEvent, ReportRequest};
use tracing::{info, warn};

use crate::node::Agent;

/// How old an unclaimed report file must be before the pickup takes it. The wrapper sends a
/// report right after writing it (connect and write bounded by its connect timeout, 100 ms by
/// default) and the socket handler claims the file as soon as it has read the request, so a
/// younger file is most likely on its way over the socket, whose delivery should win: were the
/// pickup to take it and remove it first, the socket handler would find no file and take the
/// report for one from a runtime that writes none, handling it twice.
pub const PICKUP_MIN_AGE: Duration = Duration::from_secs(10);

/// Whether a report may have been handled before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Over the socket, its file claimed by this handler (or none written): the first time.
    First,
    /// Taken from a file: an agent may have handled it and died before removing the file, or
    /// (one that predates the claims) handled it without removing it.
    MaybeAgain,
}

/// Whether a report that may have been handled before is shown by its PodRestore's `phase`
/// already, and so not applied again: a cold start once the PodRestore says `ColdStart` (a
/// restore is not `Restored` again after a member of it started cold), a restore once it says
/// `Restored`. What this costs when the report was in fact new (another container of the pod
/// reported the same first): its Event is not emitted. A cold start on a `Restored` PodRestore
/// is applied: a member starting cold is news, whoever reported before.
pub fn already_reported(phase: Option<RestorePhase>, event: &ReportEvent) -> bool {
    matches!(
        (phase, event),
        (Some(RestorePhase::ColdStart), _)
            | (Some(RestorePhase::Restored), ReportEvent::Restored { .. })
    )
}

impl Agent {
    /// A report over the socket: handled once its file is claimed, or when the runtime wrote
    /// none (one that predates the files, or could not write it); not when the pickup has
    /// claimed the file first (it handles it).
    pub(crate) fn report_from_socket(&self, req: &ReportRequest) {
        let claim = match planfile::path_for_report(&self.exec.cfg.plans_dir, &req.container_id) {
            Some(path) => planfile::claim_report(&path),
            None => Ok(ReportClaim::NoFile),
        };
        match claim {
            Ok(ReportClaim::Mine(claimed)) => {
                self.handle_report(req, Delivery::First);
                remove(&claimed);
            }
            Ok(ReportClaim::Another) => {
                info!(container = %req.container_id, "a report whose file was taken first: handled there, not here");
            }
            Ok(ReportClaim::NoFile) => self.handle_report(req, Delivery::First),
            Err(e) => {
                // Handled now rather than left to the pickup, which may take it again.
                warn!(container = %req.container_id, error = %e, "cannot claim a report's file");
                self.handle_report(req, Delivery::First);
            }
        }
    }

    /// The pickup, every few seconds: takes the report files in the plans directory `dir` that
    /// no one claimed within [`PICKUP_MIN_AGE`] (sent to no agent, or to one that died before
    /// claiming them), each handled as if it had come over the socket. Returns how many.
    pub fn take_undelivered_reports(&self, dir: &Path) -> usize {
        let mut taken = 0;
        for path in planfile::undelivered_reports(dir, PICKUP_MIN_AGE) {
            match planfile::claim_report(&path) {
                Ok(ReportClaim::Mine(claimed)) => {
                    info!(path = %path.display(), "a report no agent took over the socket");
                    taken += usize::from(self.take_claimed(&claimed, false));
                }
                Ok(ReportClaim::Another | ReportClaim::NoFile) => {}
                Err(e) => warn!(path = %path.display(), error = %e, "cannot claim a report"),
            }
        }
        taken
    }

    /// At the agent's start: the reports its predecessor claimed and died handling
    /// (`planfile::claimed_reports`, listed before this agent's socket listens, so that none of
    /// them is this agent's own claim), whatever their age. Each is handled once more, its
    /// file removed first: an agent killed while handling it again loses it, but a report
    /// whose handling itself kills the agent does not do so at every start. Returns how many.
    pub fn take_predecessors_reports(&self, claimed: &[PathBuf]) -> usize {
        claimed
            .iter()
            .filter(|p| self.take_claimed(p, true))
            .count()
    }

    /// Handles the claimed report file `path` and removes it (before handling it when
    /// `remove_first`); an unreadable one is removed unhandled.
    fn take_claimed(&self, path: &Path, remove_first: bool) -> bool {
        let read = planfile::read_report(path);
        if remove_first || !matches!(read, Ok(Some(_))) {
            remove(path);
        }
        match read {
            Ok(Some(req)) => {
                info!(container = %req.container_id, pod = %req.pod.pod_name, "a report taken from its file");
                self.handle_report(&req, Delivery::MaybeAgain);
                if !remove_first {
                    remove(path);
                }
                true
            }
            Ok(None) => false,
            Err(e) => {
                warn!(path = %path.display(), error = %e, "a report file that cannot be taken: removed");
                false
            }
        }
    }
}

fn remove(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(path = %path.display(), error = %e, "cannot remove a handled report"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::{CheckpointOutcome, NotInPlace};
    use crate::fence::{Stamp, Verdict};
    use crate::node::{Busy, Cluster, InPlace, PodInfo, Standalone};
    use crate::status::PodKey;
    use stasis_node_api::{ColdStartCause, PodRef};
    use std::sync::{Arc, Mutex};
    use std::time::SystemTime;

    /// Standalone, recording each report the cluster is told: (container id, maybe again).
    #[derive(Default)]
    struct Recording(Mutex<Vec<(String, bool)>>);

    impl Recording {
        fn take(&self) -> Vec<(String, bool)> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    impl Cluster for Recording {
        fn pod(&self, pod: &PodRef) -> Option<PodInfo> {
            Standalone.pod(pod)
        }
        fn stamp(&self, pod: &PodKey) -> Result<Stamp, String> {
            Standalone.stamp(pod)
        }
        fn fence(&self, _: &Stamp) -> Verdict {
            Verdict::NoRecord
        }
        fn checkpoint_started(
            &self,
            _: &PodInfo,
            _: &Stamp,
            _: &str,
            _: Duration,
        ) -> Option<String> {
            None
        }
        fn checkpoint_finished(
            &self,
            _: Option<&str>,
            _: &PodInfo,
            _: &Stamp,
            _: &crate::Result<CheckpointOutcome>,
        ) {
        }
        fn report(&self, req: &ReportRequest, delivery: Delivery) {
            self.0
                .lock()
                .unwrap()
                .push((req.container_id.clone(), delivery == Delivery::MaybeAgain));
        }
        fn restart_in_place(&self, _: &PodInfo, _: &str, _: InPlace, _: Result<&str, &NotInPlace>) {
        }
    }

    fn report(id: &str, event: ReportEvent) -> ReportRequest {
        ReportRequest {
            container_id: id.into(),
            pod: PodRef {
                pod_uid: "uid-1".into(),
                pod_namespace: "ns".into(),
                pod_name: "pod-1".into(),
                container_name: "app".into(),
            },
            event,
        }
    }

    fn restored() -> ReportEvent {
        ReportEvent::Restored {
            checkpoint_ref: "l/1".into(),
            restore_ms: 5,
        }
    }

    fn cold() -> ReportEvent {
        ReportEvent::ColdStart {
            cause: ColdStartCause::RestoreFailed,
            reason: "runc restore failed".into(),
            checkpoint_ref: Some("l/1".into()),
        }
    }

    /// Writes `id`'s report file as the wrapper does, `age` old.
    fn leave(dir: &Path, id: &str, event: ReportEvent, age: Duration) -> PathBuf {
        let p = planfile::path_for_report(dir, id).unwrap();
        planfile::write_report(&p, &report(id, event)).unwrap();
        set_age(&p, age);
        p
    }

    fn set_age(p: &Path, age: Duration) {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(SystemTime::now() - age)
            .unwrap();
    }

    /// An agent on a test executor, its cluster recording; its plans directory.
    fn agent(t: &Path, rt: &tokio::runtime::Runtime) -> (Agent, Arc<Recording>, PathBuf) {
        let exec = Arc::new(crate::executor::test_executor(
            t,
            rt,
            None,
            stasis_store::Key::random(),
        ));
        let cluster = Arc::new(Recording::default());
        let dir = exec.cfg.plans_dir.clone();
        let agent = Agent {
            exec,
            cluster: cluster.clone(),
            busy: Arc::new(Busy::default()),
        };
        (agent, cluster, dir)
    }

    const OLD: Duration = Duration::from_secs(60);

    /// The pickup takes the report files no one claimed for a while, once; not a fresh one
    /// (on its way over the socket), nor a claimed one (being handled).
    #[test]
    fn the_pickup_takes_old_unclaimed_reports_once() {
        let t = tempfile::tempdir().unwrap();
        let rt = crate::executor::test_runtime();
        let (agent, cluster, dir) = agent(t.path(), &rt);
        leave(&dir, "c1", restored(), OLD);
        leave(&dir, "c2", cold(), OLD);
        let fresh = leave(&dir, "c4", restored(), Duration::ZERO);
        let claimed = planfile::path_for_claimed_report(&dir, "c5").unwrap();
        planfile::write_report(&claimed, &report("c5", restored())).unwrap();
        set_age(&claimed, OLD);
        // Not a report: removed, not counted; other files of the directory are not touched.
        std::fs::write(dir.join("report_c3.json"), b"{not json").unwrap();
        set_age(&dir.join("report_c3.json"), OLD);
        std::fs::write(dir.join("pod_uid-1_app.skip"), b"{}").unwrap();

        assert_eq!(agent.take_undelivered_reports(&dir), 2);
        assert_eq!(
            cluster.take(),
            [("c1".to_string(), true), ("c2".to_string(), true)]
        );
        let m = agent.exec.metrics.render();
        assert!(
            m.contains("stasis_agent_restores_total{result=\"restored\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("stasis_agent_restores_total{result=\"cold_start\"} 1"),
            "{m}"
        );
        assert_eq!(planfile::undelivered_reports(&dir, Duration::ZERO), [fresh]);
        assert_eq!(planfile::claimed_reports(&dir), [claimed]);
        assert!(dir.join("pod_uid-1_app.skip").exists());
        // Taken once.
        assert_eq!(agent.take_undelivered_reports(&dir), 0);
        assert!(cluster.take().is_empty());
    }

    /// At its start an agent takes the reports its predecessor claimed and died handling,
    /// however recent, as ones that may have been handled.
    #[test]
    fn a_predecessors_claimed_reports_are_taken_at_start() {
        let t = tempfile::tempdir().unwrap();
        let rt = crate::executor::test_runtime();
        let (agent, cluster, dir) = agent(t.path(), &rt);
        let p = leave(&dir, "c1", restored(), Duration::ZERO);
        let ReportClaim::Mine(claimed) = planfile::claim_report(&p).unwrap() else {
            panic!("claimed");
        };
        std::fs::write(dir.join("taking_c2.json"), b"{not json").unwrap();
        assert_eq!(agent.take_undelivered_reports(&dir), 0, "not by the pickup");
        let at_start = planfile::claimed_reports(&dir);
        assert_eq!(at_start.len(), 2);
        assert_eq!(agent.take_predecessors_reports(&at_start), 1);
        assert_eq!(cluster.take(), [("c1".to_string(), true)]);
        assert!(!claimed.exists());
        assert!(planfile::claimed_reports(&dir).is_empty(), "both removed");
    }

    /// Over the socket: a report whose file the handler claims is handled and its file
    /// removed; one whose file the pickup claimed first is not handled twice; one with no file
    /// at all (an older runtime) is handled.
    #[test]
    fn a_socket_report_is_handled_once_with_or_without_its_file() {
        let t = tempfile::tempdir().unwrap();
        let rt = crate::executor::test_runtime();
        let (agent, cluster, dir) = agent(t.path(), &rt);
        let p = leave(&dir, "c1", restored(), Duration::ZERO);
        agent.report_from_socket(&report("c1", restored()));
        assert_eq!(cluster.take(), [("c1".to_string(), false)]);
        assert!(!p.exists());
        assert!(planfile::claimed_reports(&dir).is_empty());

        // The pickup holds c3's file (claimed) while it handles it: not handled here too.
        let p = leave(&dir, "c3", cold(), OLD);
        let ReportClaim::Mine(claimed) = planfile::claim_report(&p).unwrap() else {
            panic!("claimed");
        };
        agent.report_from_socket(&report("c3", cold()));
        assert!(cluster.take().is_empty(), "the pickup handles it");
        assert!(claimed.exists(), "the pickup removes it");

        agent.report_from_socket(&report("c4", restored()));
        agent.report_from_socket(&report("not/plain", restored()));
        assert_eq!(
            cluster.take(),
            [("c4".to_string(), false), ("not/plain".to_string(), false)]
        );
    }

    #[test]
    fn a_repeat_is_dropped_when_its_pod_restore_shows_it() {
        use RestorePhase::*;
        for (phase, event, dropped) in [
            (Some(Restored), restored(), true),
            (Some(ColdStart), restored(), true),
            (Some(ColdStart), cold(), true),
            (Some(Restored), cold(), false),
            (Some(Ready), restored(), false),
            (Some(Ready), cold(), false),
            (Some(Failed), restored(), false),
            (None, restored(), false),
        ] {
            assert_eq!(
                already_reported(phase, &event),
                dropped,
                "{phase:?} {event:?}"
            );
        }
    }
}
