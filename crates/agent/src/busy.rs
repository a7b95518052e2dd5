//! One checkpoint at a time per pod, and a termination checkpoint that replaces a heartbeat
//! still uploading (docs/design.md §12.3).
//!
//! A pod's checkpoints run one after another: each holds the pod's [`BusyGuard`] from before its
//! freeze to after its record. A termination checkpoint that finds a heartbeat in progress
//! waits for it, but not for all of it: once the heartbeat's capture is done
//! ([`UploadStop::uploading`]), its upload holds memory older than the stop, and the final
//! checkpoint may tell it to stop ([`Busy::take_superseding`]), so that the grace period goes to
//! the state the replacement should resume from.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::info;

use crate::executor::UploadStop;

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
    /// Set by a heartbeat when its upload starts: `true` sent stops it.
    upload: Option<watch::Sender<bool>>,
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

    /// [`Busy::take_by`] for a termination checkpoint: while it waits, a heartbeat of the pod
    /// whose upload is running is told to stop when `fits(time left)` says the termination
    /// checkpoint can finish in that time. Asked again each time the holder changes stage.
    pub fn take_superseding(
        &self,
        uid: &str,
        deadline: Instant,
        fits: impl Fn(Duration) -> bool,
    ) -> Option<BusyGuard<'_>> {
        let mut pods = self.pods();
        loop {
            if let Some(g) = self.take(&mut pods, uid) {
                return Some(g);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if let Some(upload) = pods.get(uid).and_then(|h| h.upload.as_ref()) {
                if !*upload.borrow() && fits(left) {
                    info!(pod_uid = %uid, left_ms = left.as_millis() as u64, "stopping the upload of the pod's heartbeat: its final checkpoint replaces it");
                    upload.send_replace(true);
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
    fn uploading(&self) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        let mut pods = self.busy.pods();
        match pods.get_mut(&self.uid) {
            // The pod's guard is held by this heartbeat: its upload can be stopped from now on.
            Some(h) => h.upload = Some(tx),
            // Not held (a caller without the guard): nothing can stop it; the receiver stays
            // `false` (a dropped sender only ends `changed()`).
            None => drop(tx),
        }
        drop(pods);
        self.busy.changed.notify_all();
        rx
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

    /// A termination checkpoint waits through a heartbeat's capture, stops its upload as soon
    /// as the upload starts (woken by it, not by a poll), and takes the pod when the heartbeat
    /// lets go.
    #[test]
    fn a_final_checkpoint_that_fits_stops_a_heartbeat_upload() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let stop = b.upload_stop("u1");
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let got = b
                    .take_superseding("u1", t + Duration::from_secs(10), |_| true)
                    .is_some();
                (got, t.elapsed())
            })
        };
        // The capture: not stopped, whatever the time.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!b.is_uploading("u1"));
        let mut rx = stop.uploading();
        assert!(b.is_uploading("u1"));
        let t = Instant::now();
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
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        drop(g);
        let (got, _) = waiter.join().unwrap();
        assert!(got);
    }

    /// One that does not fit lets the upload finish (it is the newest state that can be
    /// published), and a plain waiter never stops one.
    #[test]
    fn an_upload_is_let_finish_when_the_final_checkpoint_does_not_fit() {
        let b = Arc::new(Busy::default());
        let g = b.try_take("u1").unwrap();
        let rx = b.upload_stop("u1").uploading();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let waiter = {
            let (b, asked) = (b.clone(), asked.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                b.take_superseding("u1", deadline, |left| {
                    asked.lock().unwrap().push(left);
                    false
                })
                .is_some()
            })
        };
        let manual = {
            let b = b.clone();
            std::thread::spawn(move || {
                b.take_by("u1", Instant::now() + Duration::from_secs(10))
                    .is_some()
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(!*rx.borrow(), "stopped");
        let asked = asked.lock().unwrap().clone();
        assert!(
            !asked.is_empty() && asked[0] <= Duration::from_secs(10),
            "{asked:?}"
        );
        drop(g);
        assert!(waiter.join().unwrap());
        assert!(manual.join().unwrap());
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
