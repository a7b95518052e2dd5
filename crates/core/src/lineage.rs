//! Lineages, claims, generations and fencing (DESIGN §3), retention per lineage, and the
//! restore-loop guard.
//!
//! A lineage is the history of checkpoints one running pod writes. When the pod dies its lineage
//! is *orphaned*; a replacement pod of the same workload *claims* exactly one orphaned lineage
//! and continues it. Rules, each enforced here:
//!
//! - **One holder.** Only orphaned lineages can be claimed, and a claim makes the lineage held:
//!   two replicas never share a lineage, and no checkpoint is restored twice.
//! - **Newest first.** Among orphaned lineages of the workload, the one whose latest checkpoint
//!   is newest is claimed (ties and lineages without checkpoints: by id, for determinism).
//! - **Fencing.** Every claim bumps the lineage's generation; a checkpoint carries the generation
//!   its writer held. [`may_publish`] refuses a checkpoint from an older generation, so a pod on
//!   a cut-off node can never publish a new latest after its replacement claimed the lineage.
//!   Orphaning does not fence: the final checkpoint of a pod being stopped (written under the
//!   same generation) still publishes, and its replacement waits for it (DESIGN §3).
//! - **Final checkpoint first.** While an orphaned lineage of the workload has a termination
//!   checkpoint in flight, [`claim_wait`] says how long to hold the claim back (bounded by the
//!   source's grace period): claiming first would fence that checkpoint off and restore an older
//!   one (DESIGN §3, "ordering on termination").
//! - **Retention** counts per lineage and never deletes a lineage's latest.
//! - **No restore loops.** A restore that fails again the same way marks its checkpoint bad and
//!   backs off to the previous one; after [`MAX_BAD_BACKOFF`] bad checkpoints, cold start.
//!
//! The holder is an opaque token: the pod's UID once it has one. A mutating webhook sees a new
//! pod before the API server assigns its UID (and, for `generateName` pods, its name), so at
//! admission the holder is a claim token the webhook generates and writes into the pod (an
//! annotation); the controller later [`Lineage::release`]s claims whose pod never appeared.
//!
//! The controller persists these records (optimistic concurrency on the object that holds them
//! makes each claim atomic); this module decides.

use serde::{Deserialize, Serialize};

use crate::reference::{CheckpointId, WorkloadName};
use crate::workload::bounded_name;

/// A complete checkpoint of a lineage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageCheckpoint {
    pub id: CheckpointId,
    /// Generation its writer held.
    pub generation: u64,
    /// Creation time, Unix milliseconds (for `maxAge` retention).
    pub created_unix_ms: u64,
    /// Digest of its manifest as the writing agent reported it when the controller published
    /// it (`sha256:<64 hex>` of the manifest's canonical JSON): the restoring agent refuses a
    /// manifest that does not match, so a node holding the data key cannot replace another
    /// node's published checkpoint. `None` only for checkpoints published before digests were
    /// recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_digest: Option<String>,
}

/// A failed restore, remembered so the same failure does not repeat forever.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreFailure {
    pub checkpoint: CheckpointId,
    /// What went wrong, reduced to something comparable: `restore: <error kind>`,
    /// `exit: OOMKilled`, `exit: 139`.
    pub signature: String,
}

/// One lineage's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    /// Unique id, also the store's workload name for its checkpoints.
    pub id: WorkloadName,
    /// The workload key ([`crate::workload::WorkloadIdentity::key`]).
    pub workload: WorkloadName,
    /// Bumped by every claim; starts at 1.
    pub generation: u64,
    /// Token of the pod that holds (or last held) the lineage: its UID, or the claim token
    /// written into it at admission.
    pub holder: Option<String>,
    /// The holder is gone: the lineage waits for a replacement to claim it.
    pub orphaned: bool,
    /// Complete checkpoints, oldest first.
    pub checkpoints: Vec<LineageCheckpoint>,
    /// Restore failures since the last successful restore.
    pub failures: Vec<RestoreFailure>,
    /// Checkpoints a restore failed from twice the same way (or [`MAX_TRIES_PER_CHECKPOINT`]
    /// times in any way): never restored again.
    pub bad: Vec<CheckpointId>,
    /// A termination (final) checkpoint is in flight and may take until this time (Unix ms: the
    /// end of the holder's grace period).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_deadline_unix_ms: Option<u64>,
    /// When the holder's stop began (Unix ms): only a checkpoint created since ends the wait
    /// for the final one (a heartbeat that was in flight at the stop is older than the memory
    /// the final checkpoint will hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_since_unix_ms: Option<u64>,
    /// A restore found a checkpoint's stored objects gone or damaged (a deleted manifest, a
    /// missing or corrupt chunk): anyone who can write to the bucket can cause that, so it is an
    /// alarm, not a reason to go back to older memory. While set, every restore choice is a cold
    /// start; the next published checkpoint clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity_alarm: Option<IntegrityAlarm>,
}

/// See [`Lineage::integrity_alarm`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntegrityAlarm {
    pub checkpoint: CheckpointId,
    /// What the store found, as the restoring agent reported it.
    pub cause: String,
    pub unix_ms: u64,
}

/// Tries of one checkpoint (failing in different ways) before it is marked bad.
pub const MAX_TRIES_PER_CHECKPOINT: usize = 3;
/// Bad checkpoints passed over (newest first) before the guard gives up and cold-starts: the
/// latest, then the previous one, then a cold start.
pub const MAX_BAD_BACKOFF: usize = 2;

/// The result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub lineage: WorkloadName,
    /// The generation the claimant now holds (checkpoints it writes carry it).
    pub generation: u64,
    /// What to restore from, per the restore-loop guard.
    pub choice: RestoreChoice,
    /// True when the pod already held this lineage (a retried admission): nothing was bumped.
    pub existing: bool,
}

/// What the restore-loop guard allows for a lineage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreChoice {
    /// Restore this checkpoint.
    Checkpoint {
        id: CheckpointId,
        /// The generation it was written under.
        generation: u64,
    },
    /// No checkpoint to restore; the text says why.
    ColdStart(String),
}

/// Why a checkpoint was not published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    #[error("lineage {lineage} is at generation {current}; a checkpoint written under generation {written} is fenced off (a newer pod claimed the lineage)")]
    Fenced {
        lineage: WorkloadName,
        current: u64,
        written: u64,
    },
}

impl Lineage {
    /// A new lineage for a pod that found nothing to claim, held by `holder`. Its id is the
    /// workload key plus the first 8 hex digits of the holder token (a UID or a random claim
    /// token), lengthened (then suffixed) until it is distinct from every id in `existing`.
    pub fn start(workload: &WorkloadName, holder: &str, existing: &[Lineage]) -> Self {
        let hex: String = holder
            .chars()
            .filter(char::is_ascii_hexdigit)
            .map(|c| c.to_ascii_lowercase())
            .collect();
        let taken = |id: &WorkloadName| existing.iter().any(|l| &l.id == id);
        let mut id = None;
        for len in [8, 12, 16, 32] {
            let tail = if hex.is_empty() {
                "0"
            } else {
                &hex[..len.min(hex.len())]
            };
            let candidate = bounded_name(&format!("{}.{tail}", workload.as_str()));
            if !taken(&candidate) {
                id = Some(candidate);
                break;
            }
        }
        let id = id.unwrap_or_else(|| {
            (1..)
                .map(|n| bounded_name(&format!("{}.{hex}.{n}", workload.as_str())))
                .find(|c| !taken(c))
                .expect("an unbounded sequence has a free name")
        });
        Self {
            id,
            workload: workload.clone(),
            generation: 1,
            holder: Some(holder.to_owned()),
            orphaned: false,
            checkpoints: Vec::new(),
            failures: Vec::new(),
            bad: Vec::new(),
            final_deadline_unix_ms: None,
            final_since_unix_ms: None,
            integrity_alarm: None,
        }
    }

    /// The newest complete checkpoint.
    pub fn latest(&self) -> Option<&LineageCheckpoint> {
        self.checkpoints.iter().max_by(|a, b| a.id.cmp(&b.id))
    }

    /// The holder pod is going or gone (deletion timestamp set, evicted, its node lost).
    /// Idempotent. Does not fence: a final checkpoint under the current generation still
    /// publishes.
    pub fn orphan(&mut self) {
        self.orphaned = true;
    }

    /// A claim whose pod never appeared (admission passed, creation failed): the lineage is
    /// claimable again. The generation stays bumped, so nothing is unfenced.
    pub fn release(&mut self) {
        self.orphaned = true;
    }

    /// The holder began stopping at `since_unix_ms` and its termination checkpoint may run
    /// until `deadline_unix_ms`.
    pub fn begin_final(&mut self, deadline_unix_ms: u64, since_unix_ms: u64) {
        self.final_deadline_unix_ms = Some(deadline_unix_ms);
        self.final_since_unix_ms = Some(since_unix_ms);
    }

    /// The termination checkpoint failed or was abandoned ([`Lineage::publish`] of a checkpoint
    /// created since the stop began ends it too).
    pub fn end_final(&mut self) {
        self.final_deadline_unix_ms = None;
        self.final_since_unix_ms = None;
    }

    /// Records a complete checkpoint, unless it is fenced off ([`may_publish`]).
    pub fn publish(&mut self, checkpoint: LineageCheckpoint) -> Result<(), FenceError> {
        if !may_publish(self, checkpoint.generation) {
            return Err(FenceError::Fenced {
                lineage: self.id.clone(),
                current: self.generation,
                written: checkpoint.generation,
            });
        }
        let created_unix_ms = checkpoint.created_unix_ms;
        if !self.checkpoints.iter().any(|c| c.id == checkpoint.id) {
            // A checkpoint newer than the damaged one holds newer memory: restoring it is no
            // rollback, so it ends the alarm.
            if self
                .integrity_alarm
                .as_ref()
                .is_some_and(|a| checkpoint.id > a.checkpoint)
            {
                self.integrity_alarm = None;
            }
            self.checkpoints.push(checkpoint);
            self.checkpoints.sort_by(|a, b| a.id.cmp(&b.id));
        }
        if self
            .final_since_unix_ms
            .is_none_or(|since| created_unix_ms >= since)
        {
            self.end_final();
        }
        Ok(())
    }

    /// The restore-loop guard: walk checkpoints newest first, skipping bad ones; after
    /// [`MAX_BAD_BACKOFF`] bad ones, cold start.
    pub fn restore_choice(&self) -> RestoreChoice {
        if let Some(a) = &self.integrity_alarm {
            return RestoreChoice::ColdStart(format!(
                "checkpoint {} of lineage {} is damaged in the store ({}); stasis does not fall back to older memory: the next checkpoint ends this",
                a.checkpoint, self.id, a.cause
            ));
        }
        let mut skipped = 0;
        for c in self.checkpoints.iter().rev() {
            if self.bad.contains(&c.id) {
                skipped += 1;
                if skipped >= MAX_BAD_BACKOFF {
                    break;
                }
                continue;
            }
            return RestoreChoice::Checkpoint {
                id: c.id.clone(),
                generation: c.generation,
            };
        }
        if skipped == 0 {
            RestoreChoice::ColdStart(format!("lineage {} has no complete checkpoint", self.id))
        } else {
            let why = self
                .failures
                .last()
                .map(|f| format!(" (last: {})", f.signature))
                .unwrap_or_default();
            RestoreChoice::ColdStart(format!(
                "restores from {skipped} checkpoint(s) of lineage {} failed repeatedly{why}; not restoring again",
                self.id
            ))
        }
    }

    /// A restore found `checkpoint`'s objects gone or damaged in the store: never restored
    /// again, and no older checkpoint either until a newer one is published
    /// ([`Lineage::integrity_alarm`]).
    pub fn record_integrity_failure(
        &mut self,
        checkpoint: &CheckpointId,
        cause: &str,
        now_ms: u64,
    ) {
        if !self.bad.contains(checkpoint) {
            self.bad.push(checkpoint.clone());
        }
        self.integrity_alarm = Some(IntegrityAlarm {
            checkpoint: checkpoint.clone(),
            cause: cause.chars().take(200).collect(),
            unix_ms: now_ms,
        });
    }

    /// Remembers a failed restore (or a restored pod that failed). The checkpoint becomes bad
    /// when it failed twice with the same signature, or [`MAX_TRIES_PER_CHECKPOINT`] times.
    pub fn record_restore_failure(&mut self, checkpoint: &CheckpointId, signature: &str) {
        let same = self
            .failures
            .iter()
            .filter(|f| &f.checkpoint == checkpoint && f.signature == signature)
            .count();
        let any = self
            .failures
            .iter()
            .filter(|f| &f.checkpoint == checkpoint)
            .count();
        self.failures.push(RestoreFailure {
            checkpoint: checkpoint.clone(),
            signature: signature.to_owned(),
        });
        if (same + 1 >= 2 || any + 1 >= MAX_TRIES_PER_CHECKPOINT) && !self.bad.contains(checkpoint)
        {
            self.bad.push(checkpoint.clone());
        }
    }

    /// A restore worked (the pod ran past its probation): forget the failures. Bad checkpoints
    /// stay bad.
    pub fn record_restore_success(&mut self) {
        self.failures.clear();
    }

    /// Number of failures since the last success.
    pub fn failure_count(&self) -> usize {
        self.failures.len()
    }
}

/// True when a checkpoint written under `checkpoint_generation` may become the lineage's
/// latest: only the current generation publishes. False after any newer claim.
pub fn may_publish(lineage: &Lineage, checkpoint_generation: u64) -> bool {
    checkpoint_generation == lineage.generation
}

/// How long to hold back a claim for `workload`: `Some(t)` (Unix ms) while an orphaned lineage
/// of the workload has a final checkpoint in flight whose deadline `t` is still ahead (retry
/// when it publishes or at `t`, whichever is first); `None` to claim now.
pub fn claim_wait(lineages: &[Lineage], workload: &WorkloadName, now_unix_ms: u64) -> Option<u64> {
    lineages
        .iter()
        .filter(|l| &l.workload == workload && l.orphaned)
        .filter_map(|l| l.final_deadline_unix_ms)
        .filter(|d| *d > now_unix_ms)
        .max()
}

/// Claims a lineage of `workload` for the pod whose holder token is `holder`:
///
/// 1. a lineage this pod already holds is returned unchanged (admission may be retried);
/// 2. otherwise the orphaned lineage of the workload with the newest latest checkpoint is taken:
///    holder set, no longer orphaned, generation bumped;
/// 3. `None` when there is none: the caller starts a new lineage ([`Lineage::start`]).
pub fn claim(lineages: &mut [Lineage], workload: &WorkloadName, holder: &str) -> Option<Claim> {
    if let Some(l) = lineages
        .iter()
        .find(|l| &l.workload == workload && !l.orphaned && l.holder.as_deref() == Some(holder))
    {
        return Some(Claim {
            lineage: l.id.clone(),
            generation: l.generation,
            choice: l.restore_choice(),
            existing: true,
        });
    }
    let pick = lineages
        .iter_mut()
        .filter(|l| &l.workload == workload && l.orphaned)
        .max_by(|a, b| {
            let la = a.latest().map(|c| &c.id);
            let lb = b.latest().map(|c| &c.id);
            // Newest latest first; a lineage with checkpoints beats one without (Some > None);
            // then the smaller id wins (reverse, since max_by keeps the greatest).
            la.cmp(&lb).then_with(|| b.id.cmp(&a.id))
        })?;
    pick.generation += 1;
    pick.holder = Some(holder.to_owned());
    pick.orphaned = false;
    Some(Claim {
        lineage: pick.id.clone(),
        generation: pick.generation,
        choice: pick.restore_choice(),
        existing: false,
    })
}

/// Retention for one lineage: the ids to delete so that at most `keep_last` complete checkpoints
/// remain and none is older than `max_age_ms` (when given). The latest is always kept, and so is
/// any id in `pinned` (a restore in progress reads it).
pub fn retention(
    lineage: &Lineage,
    keep_last: usize,
    max_age_ms: Option<u64>,
    now_unix_ms: u64,
    pinned: &[CheckpointId],
) -> Vec<CheckpointId> {
    let keep_last = keep_last.max(1);
    let latest = lineage.latest().map(|c| c.id.clone());
    let mut newest_first: Vec<&LineageCheckpoint> = lineage.checkpoints.iter().collect();
    newest_first.sort_by(|a, b| b.id.cmp(&a.id));
    newest_first
        .iter()
        .enumerate()
        .filter(|(i, c)| {
            let too_many = *i >= keep_last;
            let too_old =
                max_age_ms.is_some_and(|max| now_unix_ms.saturating_sub(c.created_unix_ms) > max);
            (too_many || too_old) && Some(&c.id) != latest.as_ref() && !pinned.contains(&c.id)
        })
        .map(|(_, c)| c.id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wl(s: &str) -> WorkloadName {
        WorkloadName::new(s).unwrap()
    }
    fn ck(ms: u64, gen: u64) -> LineageCheckpoint {
        LineageCheckpoint {
            id: CheckpointId::from_parts(ms, ms as u32),
            generation: gen,
            created_unix_ms: ms,
            manifest_digest: None,
        }
    }
    fn lineage_with(workload: &str, uid: &str, times: &[u64]) -> Lineage {
        let mut l = Lineage::start(&wl(workload), uid, &[]);
        for t in times {
            l.publish(ck(*t, l.generation)).unwrap();
        }
        l
    }

    #[test]
    fn start_gives_distinct_valid_ids() {
        let w = wl("ns_deploy_app");
        let a = Lineage::start(&w, "3f2a9c10-0000-4000-8000-000000000001", &[]);
        assert_eq!(a.id.as_str(), "ns_deploy_app.3f2a9c10");
        assert_eq!(a.generation, 1);
        assert!(!a.orphaned);
        // Same UID prefix: a longer id.
        let b = Lineage::start(
            &w,
            "3f2a9c10-1111-4000-8000-000000000002",
            std::slice::from_ref(&a),
        );
        assert_ne!(a.id, b.id);
        let c = Lineage::start(
            &w,
            "3f2a9c10-1111-4000-8000-000000000002",
            &[a.clone(), b.clone()],
        );
        assert!(c.id != a.id && c.id != b.id);
    }

    #[test]
    fn claim_takes_orphan_with_newest_latest_and_bumps_generation() {
        let mut old = lineage_with("w", "aaaaaaaa", &[1_000, 2_000]);
        let mut new = lineage_with("w", "bbbbbbbb", &[1_500, 3_000]);
        let mut other = lineage_with("x", "cccccccc", &[9_000]);
        old.orphan();
        new.orphan();
        other.orphan();
        let mut all = vec![old, new.clone(), other];
        let c = claim(&mut all, &wl("w"), "pod-1").unwrap();
        assert_eq!(c.lineage, new.id);
        assert_eq!(c.generation, 2);
        assert!(!c.existing);
        assert_eq!(
            c.choice,
            RestoreChoice::Checkpoint {
                id: ck(3_000, 1).id,
                generation: 1
            }
        );
        let held = all.iter().find(|l| l.id == new.id).unwrap();
        assert!(!held.orphaned);
        assert_eq!(held.holder.as_deref(), Some("pod-1"));
    }

    #[test]
    fn two_replicas_never_share_a_lineage() {
        let mut a = lineage_with("w", "aaaaaaaa", &[1_000]);
        a.orphan();
        let mut all = vec![a];
        let first = claim(&mut all, &wl("w"), "pod-1").unwrap();
        // The second replica finds nothing orphaned and must start its own lineage.
        assert!(claim(&mut all, &wl("w"), "pod-2").is_none());
        // The first claimant retrying admission gets the same claim, no second bump.
        let again = claim(&mut all, &wl("w"), "pod-1").unwrap();
        assert!(again.existing);
        assert_eq!(again.lineage, first.lineage);
        assert_eq!(again.generation, first.generation);
    }

    #[test]
    fn orphans_with_checkpoints_win_and_ties_break_by_id() {
        let mut empty = Lineage::start(&wl("w"), "00000000", &[]);
        empty.orphan();
        let mut full = lineage_with("w", "ffffffff", &[5]);
        full.orphan();
        let mut all = vec![empty.clone(), full.clone()];
        assert_eq!(claim(&mut all, &wl("w"), "p").unwrap().lineage, full.id);
        let mut e2 = Lineage::start(&wl("w"), "11111111", &[]);
        e2.orphan();
        let mut all = vec![e2.clone(), empty.clone()];
        assert_eq!(claim(&mut all, &wl("w"), "p").unwrap().lineage, empty.id);
        assert!(matches!(
            claim(&mut [e2], &wl("w"), "q").unwrap().choice,
            RestoreChoice::ColdStart(_)
        ));
    }

    #[test]
    fn fencing_refuses_old_generation_after_a_newer_claim() {
        let mut l = lineage_with("w", "aaaaaaaa", &[1_000]);
        let gen_of_source = l.generation;
        // Orphaning alone does not fence: a final checkpoint still publishes.
        l.orphan();
        assert!(may_publish(&l, gen_of_source));
        l.publish(ck(2_000, gen_of_source)).unwrap();
        let mut all = vec![l];
        let c = claim(&mut all, &wl("w"), "new-pod").unwrap();
        let l = &mut all[0];
        // The cut-off node's heartbeat arrives late: refused, latest unchanged.
        assert!(!may_publish(l, gen_of_source));
        let err = l.publish(ck(3_000, gen_of_source)).unwrap_err();
        assert!(err.to_string().contains("fenced off"), "{err}");
        assert_eq!(l.latest().unwrap().id, ck(2_000, 1).id);
        // The new holder publishes.
        l.publish(ck(4_000, c.generation)).unwrap();
        assert_eq!(l.latest().unwrap().id, ck(4_000, 2).id);
        // Publishing twice is idempotent.
        l.publish(ck(4_000, c.generation)).unwrap();
        assert_eq!(l.checkpoints.len(), 3);
    }

    #[test]
    fn claim_waits_for_an_in_flight_final_checkpoint() {
        let w = wl("w");
        let mut l = lineage_with("w", "aaaaaaaa", &[1_000]);
        // Drain: the pod gets its deletion timestamp, the agent starts the final checkpoint
        // (grace ends at t=31 s); the lineage is orphaned but not yet claimable.
        l.orphan();
        l.begin_final(31_000, 0);
        let mut all = vec![l];
        assert_eq!(claim_wait(&all, &w, 2_000), Some(31_000));
        assert_eq!(claim_wait(&all, &wl("other"), 2_000), None);
        // The final checkpoint publishes under the source's generation: claim now, and it is
        // the one restored.
        all[0].publish(ck(5_000, 1)).unwrap();
        assert_eq!(claim_wait(&all, &w, 6_000), None);
        let c = claim(&mut all, &w, "new").unwrap();
        assert!(
            matches!(c.choice, RestoreChoice::Checkpoint { ref id, .. } if *id == ck(5_000, 1).id)
        );
        // Past the deadline a hung final checkpoint no longer holds the claim back, and once
        // claimed it is fenced off.
        let mut l = lineage_with("w", "bbbbbbbb", &[1_000]);
        l.orphan();
        l.begin_final(31_000, 0);
        let mut all = vec![l];
        assert_eq!(claim_wait(&all, &w, 31_000), None);
        claim(&mut all, &w, "new").unwrap();
        assert!(all[0].publish(ck(32_000, 1)).is_err());
        // A failed final checkpoint ends the wait too.
        let mut l = lineage_with("w", "cccccccc", &[]);
        l.orphan();
        l.begin_final(31_000, 0);
        l.end_final();
        assert_eq!(claim_wait(&[l], &w, 0), None);
        // A heartbeat that was in flight when the stop began (created at 900 < 1 000) publishes
        // during the wait: it is older than the final checkpoint's memory, so the wait goes on.
        let mut l = lineage_with("w", "dddddddd", &[500]);
        l.orphan();
        l.begin_final(31_000, 1_000);
        l.publish(ck(900, 1)).unwrap();
        assert_eq!(claim_wait(&[l.clone()], &w, 2_000), Some(31_000));
        l.publish(ck(1_500, 1)).unwrap();
        assert_eq!(claim_wait(&[l], &w, 2_000), None);
    }

    #[test]
    fn release_makes_a_phantom_claim_claimable_without_unfencing() {
        let mut l = lineage_with("w", "aaaaaaaa", &[1_000]);
        l.orphan();
        let mut all = vec![l];
        let c = claim(&mut all, &wl("w"), "token-of-a-pod-that-never-appeared").unwrap();
        all[0].release();
        let d = claim(&mut all, &wl("w"), "real-pod").unwrap();
        assert_eq!(d.lineage, c.lineage);
        assert_eq!(d.generation, c.generation + 1);
        assert!(!may_publish(&all[0], c.generation));
    }

    #[test]
    fn restore_loop_backs_off_to_previous_then_cold_start() {
        let mut l = lineage_with("w", "aaaaaaaa", &[1_000, 2_000, 3_000]);
        let (c1, c2, c3) = (ck(1_000, 1).id, ck(2_000, 1).id, ck(3_000, 1).id);
        assert_eq!(
            l.restore_choice(),
            RestoreChoice::Checkpoint {
                id: c3.clone(),
                generation: 1
            }
        );
        // One failure: may be transient, try the same checkpoint again.
        l.record_restore_failure(&c3, "exit: 139");
        assert!(
            matches!(l.restore_choice(), RestoreChoice::Checkpoint { ref id, .. } if *id == c3)
        );
        // Fails again the same way: back off to the previous checkpoint.
        l.record_restore_failure(&c3, "exit: 139");
        assert!(
            matches!(l.restore_choice(), RestoreChoice::Checkpoint { ref id, .. } if *id == c2)
        );
        l.record_restore_failure(&c2, "exit: 139");
        l.record_restore_failure(&c2, "exit: 139");
        // Two bad checkpoints: cold start, never c1, and the reason names the failure.
        match l.restore_choice() {
            RestoreChoice::ColdStart(why) => {
                assert!(
                    why.contains("exit: 139") && why.contains("failed repeatedly"),
                    "{why}"
                )
            }
            other => panic!("expected cold start, got {other:?} (c1 = {c1})"),
        }
        assert_eq!(l.failure_count(), 4);
        // New checkpoints after the cold start are restorable again.
        l.publish(ck(4_000, 1)).unwrap();
        assert!(
            matches!(l.restore_choice(), RestoreChoice::Checkpoint { ref id, .. } if *id == ck(4_000, 1).id)
        );
        l.record_restore_success();
        assert_eq!(l.failure_count(), 0);
    }

    #[test]
    fn different_failures_still_end_after_max_tries() {
        let mut l = lineage_with("w", "aaaaaaaa", &[1_000]);
        let c = ck(1_000, 1).id;
        l.record_restore_failure(&c, "a");
        l.record_restore_failure(&c, "b");
        assert!(matches!(
            l.restore_choice(),
            RestoreChoice::Checkpoint { .. }
        ));
        l.record_restore_failure(&c, "c");
        assert!(matches!(l.restore_choice(), RestoreChoice::ColdStart(_)));
    }

    #[test]
    fn retention_per_lineage_keeps_latest_and_pinned() {
        let l = lineage_with("w", "aaaaaaaa", &[1_000, 2_000, 3_000, 4_000, 5_000]);
        let del = retention(&l, 2, None, 10_000, &[]);
        assert_eq!(del, vec![ck(3_000, 1).id, ck(2_000, 1).id, ck(1_000, 1).id]);
        let del = retention(&l, 2, None, 10_000, &[ck(2_000, 1).id]);
        assert_eq!(del, vec![ck(3_000, 1).id, ck(1_000, 1).id]);
        // Age: everything older than 2.5 s at t=6 s goes, but the latest stays even if old.
        let del = retention(&l, 10, Some(2_500), 6_000, &[]);
        assert_eq!(del, vec![ck(3_000, 1).id, ck(2_000, 1).id, ck(1_000, 1).id]);
        let del = retention(&l, 10, Some(1), 1_000_000, &[]);
        assert!(!del.contains(&ck(5_000, 1).id));
        assert_eq!(del.len(), 4);
        // keep_last 0 is treated as 1: the latest is never deleted.
        assert_eq!(retention(&l, 0, None, 0, &[]).len(), 4);
    }

    #[test]
    fn a_damaged_checkpoint_cold_starts_instead_of_rolling_back() {
        let mut l = lineage_with("ns_deploy_app", "uid-1", &[1_000, 2_000, 3_000]);
        let newest = l.latest().unwrap().id.clone();
        // An ordinary failure twice marks it bad and falls back to the previous checkpoint...
        let mut ordinary = l.clone();
        ordinary.record_restore_failure(&newest, "restore: runc failed");
        ordinary.record_restore_failure(&newest, "restore: runc failed");
        assert!(matches!(
            ordinary.restore_choice(),
            RestoreChoice::Checkpoint { ref id, .. } if id == &ck(2_000, 1).id
        ));
        // ...a damaged one (its manifest deleted from the bucket) never does.
        l.record_integrity_failure(&newest, "manifest missing", 4_000);
        assert!(l.bad.contains(&newest));
        match l.restore_choice() {
            RestoreChoice::ColdStart(why) => {
                assert!(why.contains("damaged in the store"), "{why}");
                assert!(why.contains("manifest missing"), "{why}");
            }
            other => panic!("rolled back to older memory: {other:?}"),
        }
        // It survives a round trip through the record.
        let back: Lineage = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back.integrity_alarm, l.integrity_alarm);
        // An older checkpoint published late does not end it; a newer one does.
        l.publish(ck(500, l.generation)).unwrap();
        assert!(l.integrity_alarm.is_some());
        l.publish(ck(5_000, l.generation)).unwrap();
        assert!(l.integrity_alarm.is_none());
        assert!(matches!(
            l.restore_choice(),
            RestoreChoice::Checkpoint { ref id, .. } if id == &ck(5_000, 1).id
        ));
        // Records written before the field existed read as no alarm.
        let mut old =
            serde_json::to_value(lineage_with("ns_deploy_app", "uid-1", &[1_000])).unwrap();
        old.as_object_mut().unwrap().remove("integrity_alarm");
        assert!(serde_json::from_value::<Lineage>(old)
            .unwrap()
            .integrity_alarm
            .is_none());
    }
}
