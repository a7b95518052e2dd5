//! One checkpoint at a time per pod, and a termination checkpoint that replaces a heartbeat
//! still uploading (docs/design.md §12.3).
//!
//! A pod's checkpoints run one after another: each holds the pod's [`BusyGuard`] from before its
//! freeze to after its record. A termination checkpoint that finds a heartbeat in progress
//! waits for it, but not for all of it ([`Busy::take_for_final`]): once the heartbeat's capture
//! is done ([`UploadStop::uploading`]), the final checkpoint either tells its upload to stop
//! (it fits the time left, and holds newer state) or takes that capture as the pod's final one
//! (the stop came while it was being captured, or a new one would not fit), so that the grace
//! period goes to the state the replacement should resume from.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::info;

use crate::executor::{CheckpointOutcome, UploadStop};

/// Pods with a checkpoint in progress: one at a time per pod. A waiter sleeps on a condition
/// variable until a checkpoint ends or reaches its upload, not in a poll.
#[derive(Debug, Default)]
pub struct Busy {
    pods: Mutex<HashMap<String, Holder>>,
    changed: Condvar,
}

/// The checkpoint that holds a pod.
#[derive(Debug, Default)]
struct Holder {
    /// Set by a heartbeat when its upload starts.
    upload: Option<Upload>,
}

/// A heartbeat's upload in progress.
#[derive(Debug)]
struct Upload {
    /// `true` sent stops it.
    stop: watch::Sender<bool>,
    /// The reference it publishes.
    reference: String,
    /// When its capture ended and it began.
    since: Instant,
    /// Set when it is taken as the pod's final checkpoint (never stopped then): told the
    /// heartbeat's end, which its termination record follows.
    adopted: Option<mpsc::Sender<AdoptedEnd>>,
}

/// How an adopted heartbeat ended: its outcome, or why it failed.
pub type AdoptedEnd = std::result::Result<CheckpointOutcome, String>;

/// How a termination checkpoint's wait for its pod ended ([`Busy::take_for_final`]).
pub enum FinalWait<'a> {
    /// The pod is free: take the final checkpoint.
    Taken(BusyGuard<'a>),
    /// The heartbeat whose capture is done is the final checkpoint (its reference): its upload
    /// goes on, and the stop may go on now. The first to adopt it is told how it ends (the
    /// others of the pod's containers get `None`).
    Adopted(String, Option<mpsc::Receiver<AdoptedEnd>>),
    /// Still held at the deadline.
    TimedOut,
}

pub struct BusyGuard<'a> {
    set: &'a Busy,
    uid: String,
}

impl Busy {
    fn pods(&self) -> MutexGuard<'_, HashMap<String, Holder>> {
        self.pods.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, pods: &mut HashMap<String, Holder>, uid: &str) -> Option<BusyGuard<'_>> {
        if pods.contains_key(uid) {
            return None;
        }
        pods.insert(uid.to_owned(), Holder::default());
        Some(BusyGuard {
            set: self,
            uid: uid.to_owned(),
        })
    }

    pub fn try_take(&self, uid: &str) -> Option<BusyGuard<'_>> {
        self.take(&mut self.pods(), uid)
    }

    /// Takes the pod once its checkpoint in progress (if any) ended; `None` at `deadline`.
    pub fn take_by(&self, uid: &str, deadline: Instant) -> Option<BusyGuard<'_>> {
        self.take_superseding(uid, deadline, |_| false)
    }

    /// [`Busy::take_by`] for a checkpoint that never adopts a heartbeat but stops one's upload
    /// when `fits(time left)` (the eviction responder's, a cloud notice's:
    /// [`Busy::take_for_final`] without `adopt_since`).
    pub fn take_superseding(
        &self,
        uid: &str,
        deadline: Instant,
        fits: impl Fn(Duration) -> bool,
    ) -> Option<BusyGuard<'_>> {
        match self.take_for_final(uid, deadline, None, fits) {
            FinalWait::Taken(g) => Some(g),
            FinalWait::Adopted(..) | FinalWait::TimedOut => None,
        }
    }

    /// [`Busy::take_by`] for a checkpoint taken because the pod is about to end. While it waits,
    /// a heartbeat of the pod whose capture is done (its upload running) is
    /// - taken as the final checkpoint when `adopt_since` is given (the final checkpoint may end
    ///   at another's capture) and the capture ended after that instant (the stop came during
    ///   the capture: it holds the state at the stop);
    /// - else told to stop when `fits(time left)` says a new checkpoint can finish in that time;
    /// - else, with `adopt_since` given, taken as the final checkpoint: it is the newest state
    ///   that can be published before the deadline, and the stop need not wait for its upload.
    ///
    /// Decided again each time the holder changes stage; an adopted upload is never stopped.
    pub fn take_for_final(
        &self,
        uid: &str,
        deadline: Instant,
        adopt_since: Option<Instant>,
        fits: impl Fn(Duration) -> bool,
    ) -> FinalWait<'_> {
        let mut pods = self.pods();
        loop {
            if let Some(g) = self.take(&mut pods, uid) {
                return FinalWait::Taken(g);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return FinalWait::TimedOut;
            };
            if let Some(upload) = pods.get_mut(uid).and_then(|h| h.upload.as_mut()) {
                let stopped = *upload.stop.borrow();
                let adopted = upload.adopted.is_some();
                let adopt = |u: &mut Upload| {
                    let ends = u.adopted.is_none().then(|| {
                        info!(pod_uid = %uid, reference = %u.reference, "the pod's heartbeat, captured, is its final checkpoint; its upload goes on");
                        let (tx, rx) = mpsc::channel();
                        u.adopted = Some(tx);
                        rx
                    });
                    FinalWait::Adopted(u.reference.clone(), ends)
                };
                match adopt_since {
                    _ if stopped => {}
                    Some(_) if adopted => return adopt(upload),
                    Some(asked) if upload.since >= asked => return adopt(upload),
                    _ if adopted => {}
                    _ if fits(left) => {
                        info!(pod_uid = %uid, left_ms = left.as_millis() as u64, "stopping the upload of the pod's heartbeat: its final checkpoint replaces it");
                        upload.stop.send_replace(true);
                    }
                    Some(_) => return adopt(upload),
                    None => {}
                }
            }
            pods = self
                .changed
                .wait_timeout(pods, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn is_busy(&self, uid: &str) -> bool {
        self.pods().contains_key(uid)
    }

    /// Whether the pod's checkpoint in progress is a heartbeat in its upload.
    pub fn is_uploading(&self, uid: &str) -> bool {
        self.pods().get(uid).is_some_and(|h| h.upload.is_some())
    }

    /// Waits until no checkpoint is in progress (its upload and record included), at most until
    /// `deadline`; the pods still busy then (none: all ended).
    pub fn wait_idle(&self, deadline: Instant) -> Vec<String> {
        let mut pods = self.pods();
        while !pods.is_empty() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            pods = self
                .changed
                .wait_timeout(pods, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        pods.keys().cloned().collect()
    }

    /// The handle a heartbeat of `uid` (holding its guard) gives its executor job, through which
    /// a termination checkpoint may stop its upload.
    pub fn upload_stop(self: &Arc<Self>, uid: &str) -> Arc<dyn UploadStop> {
        Arc::new(HeartbeatUpload {
            busy: self.clone(),
            uid: uid.to_owned(),
        })
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.set.pods().remove(&self.uid);
        self.set.changed.notify_all();
    }
}

/// A heartbeat's [`UploadStop`]: its upload registered on the pod's holder.
#[derive(Debug)]
struct HeartbeatUpload {
    busy: Arc<Busy>,
    uid: String,
}

impl UploadStop for HeartbeatUpload {
    fn uploading(&self, reference: &str) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        let mut pods = self.busy.pods();
        match pods.get_mut(&self.uid) {
            // The pod's guard is held by this heartbeat: its upload can be stopped (or adopted)
            // from now on.
            Some(h) => {
                h.upload = Some(Upload {
                    stop: tx,
                    reference: reference.to_owned(),
                    since: Instant::now(),
                    adopted: None,
                })
            }
            // Not held (a caller without the guard): nothing can stop it; the receiver stays
            // `false` (a dropped sender only ends `changed()`).
            None => drop(tx),
        }
        drop(pods);
        self.busy.changed.notify_all();
        rx
    }

    fn finished(&self, r: &crate::error::Result<CheckpointOutcome>) {
        let pods = self.busy.pods();
        let adopter = pods
            .get(&self.uid)
            .and_then(|h| h.upload.as_ref())
            .and_then(|u| u.adopted.as_ref());
        if let Some(tx) = adopter {
            let end = match r {
                Ok(o) => Ok(o.clone()),
                Err(e) => Err(e.to_string()),
            };
            let _ = tx.send(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_checkpoint_per_pod_at_a_time() {
        let b = Busy::default();
        let g = b.try_take("u1").unwrap();
        assert!(b.try_take("u1").is_none());
        assert!(b.try_take("u2").is_some());
        assert!(b.is_busy("u1"));
        drop(g);
        assert!(!b.is_busy("u1"));
        assert!(b.try_take("u1").is_some());
    }

    /// A waiter wakes when the checkpoint in progress ends (not at its next poll), and gives up
    /// at its deadline.
    #[test]
    fn a_waiter_takes_the_pod_when_it_is_freed() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(b.take_by("u1", soon).is_none());
        assert!(Instant::now() >= soon);
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let got = b.take_by("u1", t + Duration::from_secs(10)).is_some();
                (got, t.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        drop(g);
        let (got, waited) = waiter.join().unwrap();
        assert!(got);
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    fn wait_stopped(rx: &mut watch::Receiver<bool>) {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|s| *s))
                    .await
                    .expect("the upload was not stopped")
                    .unwrap();
            });
    }

    /// A stop that comes while a heartbeat uploads, with a new checkpoint that fits: the
    /// upload is told to stop at once, and the pod is taken when the heartbeat lets go.
    #[test]
    fn a_final_checkpoint_that_fits_stops_a_heartbeat_upload() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let mut rx = b.upload_stop("u1").uploading("l/hb");
        assert!(b.is_uploading("u1"));
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let deadline = t + Duration::from_secs(10);
                matches!(
                    b.take_for_final("u1", deadline, Some(t), |_| true),
                    FinalWait::Taken(_)
                )
            })
        };
        let t = Instant::now();
        wait_stopped(&mut rx);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        drop(g);
        assert!(waiter.join().unwrap());
    }

    /// A stop that comes while a heartbeat is being captured waits for the capture (never cut
    /// short), then takes that capture as the final checkpoint, woken by the upload's start:
    /// the upload is not stopped, another container's stop gets the same answer, and a
    /// checkpoint that may not adopt (the eviction responder's) does not stop it either.
    #[test]
    fn a_stop_during_a_heartbeat_capture_adopts_that_capture() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let asked = Instant::now();
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                match b.take_for_final("u1", deadline, Some(asked), |_| true) {
                    FinalWait::Adopted(r, _) => Some(r),
                    _ => None,
                }
            })
        };
        // The capture: nothing decided, whatever the time.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished());
        let rx = b.upload_stop("u1").uploading("l/hb");
        assert_eq!(waiter.join().unwrap().as_deref(), Some("l/hb"));
        let soon = Instant::now() + Duration::from_secs(10);
        assert!(matches!(
            b.take_for_final("u1", soon, Some(Instant::now()), |_| true),
            FinalWait::Adopted(r, _) if r == "l/hb"
        ));
        let brief = Instant::now() + Duration::from_millis(100);
        assert!(matches!(
            b.take_for_final("u1", brief, None, |_| true),
            FinalWait::TimedOut
        ));
        assert!(!*rx.borrow(), "an adopted upload was stopped");
        drop(g);
    }

    /// A stop during the upload when a new checkpoint does not fit: the heartbeat is the final
    /// checkpoint (its upload goes on); without adoption (the eviction responder's) the upload
    /// is let finish and waited for.
    #[test]
    fn an_upload_is_let_finish_when_the_final_checkpoint_does_not_fit() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let rx = b.upload_stop("u1").uploading("l/hb");
        let later = Instant::now() + Duration::from_secs(10);
        assert!(matches!(
            b.take_for_final("u1", later, Some(Instant::now()), |_| false),
            FinalWait::Adopted(r, _) if r == "l/hb"
        ));
        // Without adoption (another pod here): the upload is waited for, never stopped.
        let b2 = Arc::new(Busy::default());
        let g2 = b2.try_take("u1").unwrap();
        let rx2 = b2.upload_stop("u1").uploading("l/hb2");
        let asked = Arc::new(Mutex::new(Vec::new()));
        let waiter = {
            let (b2, asked) = (b2.clone(), asked.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                let fits = |left| {
                    asked.lock().unwrap().push(left);
                    false
                };
                matches!(
                    b2.take_for_final("u1", deadline, None, fits),
                    FinalWait::Taken(_)
                )
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(!*rx2.borrow(), "stopped");
        let asked = asked.lock().unwrap().clone();
        assert!(
            !asked.is_empty() && asked[0] <= Duration::from_secs(10),
            "{asked:?}"
        );
        drop(g2);
        assert!(waiter.join().unwrap());
        assert!(!*rx.borrow());
        drop(g);
    }

    /// A stopping agent waits for the checkpoints in progress: it names those still running at
    /// its deadline, and returns as soon as the last one ends.
    #[test]
    fn wait_idle_waits_for_every_checkpoint_in_progress() {
        let b = Arc::new(Busy::default());
        assert!(
            b.wait_idle(Instant::now()).is_empty(),
            "nothing in progress"
        );
        let g = b.try_take("u1").unwrap();
        assert_eq!(
            b.wait_idle(Instant::now() + Duration::from_millis(50)),
            vec!["u1".to_string()]
        );
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                (b.wait_idle(t + Duration::from_secs(10)), t.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        drop(g);
        let (left, waited) = waiter.join().unwrap();
        assert!(left.is_empty(), "{left:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }
}
