//! The latest checkpoint of each container, kept on the node as a reference only, so a container
//! the OOM killer ended restarts in place from it: its chunks were cached as they uploaded (the
//! node's chunk cache holds them as the store does, encrypted and authenticated), and the
//! restart fetches them through the store (cache first, the bucket for what was evicted) into a
//! restore directory that is removed after the restore. No memory image stays on the node's
//! disk between checkpoints.

use super::*;

use std::path::PathBuf;

use stasis_node_api::planfile::{self, Failed};
use stasis_node_api::{Plan, MAX_PREPARE_WAIT_MS, PROTOCOL_VERSION};
use tracing::{info, warn};

use crate::error::{AgentError, Result};

/// What a kept latest checkpoint is (`.stasis-latest.json` in `.latest-<container>`): a
/// reference, never the images.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeptLatest {
    pub checkpoint_ref: String,
    pub rootfs_method: Option<stasis_core::manifest::RootfsMethod>,
    pub tcp_established: bool,
    /// The namespace whose data key the checkpoint is under.
    #[serde(default)]
    pub namespace: String,
    /// The digest of the manifest this agent published: the fetch refuses any other.
    #[serde(default)]
    pub manifest_digest: Option<String>,
    /// Logical bytes of the checkpoint: what the wait for its fetch is sized from.
    #[serde(default)]
    pub bytes: u64,
    /// The checkpointed container's image digest, when recorded: the restarted container is
    /// the same container of the same pod (a changed image changes the pod's spec hash, which
    /// the restart checks).
    #[serde(default)]
    pub image_digest: Option<String>,
}
pub(super) const KEPT_LATEST: &str = ".stasis-latest.json";
/// Written when a kept checkpoint is planned for a restart in place: a second OOM kill before
/// the next checkpoint does not restore it again (no restore loop).
pub(super) const RESTORED_IN_PLACE: &str = ".stasis-restored-in-place";

/// The fixed part of the wait for a restart in place (manifest read, key, plan file, a loaded
/// node), and the slowest fetch rate it is sized for (the bucket's, when the cache lost chunks).
const PREPARE_BASE_MS: u64 = 5_000;
const PREPARE_BYTES_PER_MS: u64 = 50_000;

impl KeptLatest {
    /// How long the restarted container's `create` may wait for this checkpoint's plan.
    pub fn prepare_wait_ms(&self) -> u64 {
        (PREPARE_BASE_MS + self.bytes / PREPARE_BYTES_PER_MS).min(MAX_PREPARE_WAIT_MS)
    }
}

/// Why a container the OOM killer ended restarts cold instead of in place from its kept
/// checkpoint (the wrapper's `NoPlan` reason, and the pod's `ColdStart` Event).
#[derive(Debug, thiserror::Error)]
pub enum NotInPlace {
    #[error("its pod is being deleted")]
    PodDeleting,
    #[error("its pod's restartPolicy is Never")]
    RestartPolicyNever,
    #[error("no valid pod UID and container name")]
    InvalidNames,
    #[error("no checkpoint of this container kept on this node")]
    NothingKept,
    #[error("the record of its kept checkpoint {path} is unreadable: {why}")]
    Unreadable { path: PathBuf, why: String },
    #[error("its latest checkpoint {0} was restored in place already and the container was OOM-killed again (no restore loop)")]
    RestoredAlready(String),
    #[error("the container runtime on this node (stasis-runc) is too old to wait for a restart in place; update it with the agent")]
    RuntimeCannotWait,
    #[error("its latest checkpoint {checkpoint_ref} could not be fetched for the restart: {why}")]
    Fetch { checkpoint_ref: String, why: String },
    #[error("its latest checkpoint {0} was fetched after the restart stopped waiting for it")]
    TooLate(String),
    #[error(transparent)]
    Agent(#[from] AgentError),
}

impl Executor {
    pub(super) fn pod_images(&self, pod_uid: &str) -> PathBuf {
        self.cfg.images_dir.join(pod_uid)
    }

    pub(super) fn kept_dir(&self, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
        (safe_component(pod_uid) && safe_component(container_name)).then(|| {
            self.pod_images(pod_uid)
                .join(format!(".latest-{container_name}"))
        })
    }

    /// Records `kept` as the container's latest checkpoint: `.latest-<container>/` is replaced by
    /// a directory holding only `.stasis-latest.json` (no images; whatever an older agent kept
    /// there goes, and so does the restore-loop marker of the previous checkpoint).
    pub(super) fn keep_latest(
        &self,
        pod_uid: &str,
        container_name: &str,
        kept: &KeptLatest,
    ) -> Result<()> {
        let Some(dir) = self.kept_dir(pod_uid, container_name) else {
            return Ok(());
        };
        private_dir(&self.cfg.images_dir)?;
        private_dir(&self.pod_images(pod_uid))?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(AgentError::io(&dir))?;
        }
        private_dir(&dir)?;
        let f = dir.join(KEPT_LATEST);
        let json = serde_json::to_vec(kept).map_err(|e| AgentError::Invalid(e.to_string()))?;
        std::fs::write(&f, json).map_err(AgentError::io(&f))
    }

    /// The container's kept checkpoint, when a restart in place may restore it: something is
    /// kept, its record reads, and it was not restored in place already (a second OOM kill
    /// before the next checkpoint starts cold: no restore loop). Reads local files only.
    pub fn kept_for_restart(
        &self,
        pod_uid: &str,
        container_name: &str,
    ) -> std::result::Result<KeptLatest, NotInPlace> {
        let dir = self
            .kept_dir(pod_uid, container_name)
            .ok_or(NotInPlace::InvalidNames)?;
        let file = dir.join(KEPT_LATEST);
        let raw = match std::fs::read(&file) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(NotInPlace::NothingKept)
            }
            Err(e) => return Err(NotInPlace::Agent(AgentError::io(&file)(e))),
        };
        // A damaged record is said as such, not taken for "nothing kept".
        let kept: KeptLatest =
            serde_json::from_slice(&raw).map_err(|e| NotInPlace::Unreadable {
                path: file.clone(),
                why: e.to_string(),
            })?;
        if dir.join(RESTORED_IN_PLACE).exists() {
            return Err(NotInPlace::RestoredAlready(kept.checkpoint_ref));
        }
        Ok(kept)
    }

    /// Marks the kept checkpoint as taken for a restart in place (before its fetch starts: an
    /// OOM kill during the fetch, or after the restore, does not take it again).
    pub fn mark_restored_in_place(&self, pod_uid: &str, container_name: &str) -> Result<()> {
        let dir = self
            .kept_dir(pod_uid, container_name)
            .ok_or_else(|| AgentError::Invalid("no valid pod UID and container name".into()))?;
        let marker = dir.join(RESTORED_IN_PLACE);
        std::fs::write(&marker, b"").map_err(AgentError::io(&marker))
    }

    /// Prepares a restart in place from the kept checkpoint (`job` names it, with the pod's
    /// namespace, spec hash and declared versions): fetched through the store (the chunk cache
    /// first, the bucket for chunks it lost) into the pod's restore directory, checked against
    /// the digest this agent published, stamped, with the GPU record; then `record` (the
    /// PodRestore), then the plan file, valid until the restart's `create` stops waiting
    /// (`until_ms`). On failure the failure note ends that wait, and the restore directory goes.
    pub fn prepare_in_place(
        &self,
        job: &PrepareJob,
        until_ms: u64,
        record: impl FnOnce(&str),
    ) -> std::result::Result<Plan, NotInPlace> {
        let container_name = job.container_name.clone().unwrap_or_default();
        let cache_before = self.store.cache().map(|c| c.stats());
        let r = self
            .fetch_counted(job)
            .map(|mut f| f.swap_remove(0))
            .map_err(|e| NotInPlace::Fetch {
                checkpoint_ref: job.reference.to_string(),
                why: e.to_string(),
            })
            .and_then(|f| {
                if now_ms() > until_ms {
                    return Err(NotInPlace::TooLate(f.plan.checkpoint_ref));
                }
                record(&f.plan.checkpoint_ref);
                self.write_plan_until(&job.pod_uid, &container_name, &f.plan, until_ms)?;
                if let (Some(c), Some(before)) = (self.store.cache(), cache_before) {
                    let now = c.stats();
                    info!(checkpoint_ref = %f.plan.checkpoint_ref, fetch_ms = f.fetch_ms, bytes = f.bytes,
                        cache_hits = now.hits - before.hits, cache_misses = now.misses - before.misses,
                        "restart in place prepared");
                }
                Ok(f.plan)
            });
        if let Err(why) = &r {
            warn!(pod_uid = %job.pod_uid, container = %container_name, %why, "restart in place not prepared");
            self.forget(&job.pod_uid, &container_name);
            if let Some(p) =
                planfile::path_for_failed(&self.cfg.plans_dir, &job.pod_uid, &container_name)
            {
                let note = Failed {
                    v: PROTOCOL_VERSION,
                    checkpoint_ref: job.reference.to_string(),
                    reason: why.to_string(),
                };
                if let Err(e) = planfile::write_failed(&p, &note) {
                    warn!(path = %p.display(), error = %e, "cannot write the failure note of a restart in place");
                }
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_store::{ChunkCache, Key, NoProgress, Store};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    const UID: &str = "0b5c-uid";

    fn job(reference: &str, manifest_digest: Option<String>) -> PrepareJob {
        PrepareJob {
            reference: reference.parse().unwrap(),
            namespace: "ns".into(),
            pod_uid: UID.into(),
            container_name: Some("app".into()),
            layout: None,
            spec_hash: None,
            image_digest: None,
            declared: BTreeMap::new(),
            manifest_digest,
        }
    }

    fn files_under(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(dir) else {
            return out;
        };
        for e in rd.flatten() {
            if e.path().is_dir() {
                out.extend(files_under(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    /// A restart in place, from the kept reference to the plan, against a `file://` store with a
    /// chunk cache (real store code, real encryption): the kept directory holds no image; the
    /// fetch is served by the cache, then by the bucket once the cache lost the chunks; with the
    /// chunks gone from both it fails, says why in the note the waiting `create` reads, and
    /// leaves no restore directory; a fetch that ends after the wait is not planned.
    #[test]
    fn restart_in_place_keeps_a_reference_and_fetches_through_the_cache_then_the_bucket() {
        if stasis_engine::node::fingerprint().criu.is_none() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CRIU is required under CI"
            );
            eprintln!(
                "SKIPPED: no CRIU on this machine (the restore's compatibility check needs it)"
            );
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let rt = test_runtime();
        let store = Store::open(&format!("file://{}", t.path().join("store").display())).unwrap();
        let cache = Arc::new(ChunkCache::open(&t.path().join("cache"), 64 << 20).unwrap());
        assert!(store.set_cache(cache.clone()));
        let key = Key::random();
        let exec = test_executor(t.path(), &rt, Some(store), key.clone());

        // A checkpoint as the agent uploads one: its chunks land in the cache as they upload.
        let img = t.path().join("scratch");
        std::fs::create_dir_all(img.join("criu")).unwrap();
        let pages: Vec<u8> = (0..3 << 20).map(|_| rand::random::<u8>()).collect();
        std::fs::write(img.join("criu/pages-1.img"), &pages).unwrap();
        std::fs::write(img.join("criu/inventory.img"), b"inventory").unwrap();
        let draft = super::super::prepare::tests::manifest(
            &[
                (label::CONTAINER_NAME, "app"),
                (label::TCP_ESTABLISHED, "false"),
            ],
            &[],
        );
        let manifest = rt
            .block_on(exec.store.put_checkpoint(&key, draft, &img, &NoProgress))
            .unwrap();
        assert!(cache.stats().inserted > 0, "{:?}", cache.stats());
        std::fs::remove_dir_all(&img).unwrap();

        // What the checkpoint keeps: a reference, no image.
        let kept = KeptLatest {
            checkpoint_ref: manifest.reference().to_string(),
            rootfs_method: None,
            tcp_established: false,
            namespace: "ns".into(),
            manifest_digest: Some(crate::fence::manifest_digest(&manifest)),
            bytes: manifest.stats.logical_bytes,
            image_digest: None,
        };
        let kept_dir = exec.kept_dir(UID, "app").unwrap();
        std::fs::create_dir_all(kept_dir.join("criu")).unwrap();
        std::fs::write(kept_dir.join("criu/pages-1.img"), b"an older agent's image").unwrap();
        exec.keep_latest(UID, "app", &kept).unwrap();
        assert_eq!(
            files_under(&exec.cfg.images_dir),
            vec![kept_dir.join(KEPT_LATEST)]
        );
        assert_eq!(exec.kept_for_restart(UID, "app").unwrap(), kept);
        assert_eq!(
            kept.prepare_wait_ms(),
            PREPARE_BASE_MS + (3 << 20) / PREPARE_BYTES_PER_MS
        );

        let job = job(&kept.checkpoint_ref, kept.manifest_digest.clone());
        let plan_path = planfile::path_for_pod(&exec.cfg.plans_dir, UID, "app").unwrap();
        let failed_path = planfile::path_for_failed(&exec.cfg.plans_dir, UID, "app").unwrap();
        let prepare = |until: u64| {
            let recorded = std::cell::RefCell::new(None);
            let before = cache.stats();
            let r =
                exec.prepare_in_place(&job, until, |c| *recorded.borrow_mut() = Some(c.to_owned()));
            let after = cache.stats();
            (
                r,
                recorded.into_inner(),
                after.hits - before.hits,
                after.misses - before.misses,
            )
        };
        let until = now_ms() + 60_000;
        let check_plan = |plan: &Plan| {
            assert_eq!(plan.checkpoint_ref, kept.checkpoint_ref);
            assert_eq!(
                std::fs::read(plan.image_dir.join("criu/pages-1.img")).unwrap(),
                pages
            );
            let stamp = planfile::read_verified_stamp(&plan.image_dir)
                .unwrap()
                .unwrap();
            assert_eq!(stamp.checkpoint_ref, kept.checkpoint_ref);
            let file = planfile::read(&plan_path).unwrap().unwrap();
            assert_eq!(file.expires_at_unix_ms, Some(until));
        };

        // 1. The cache serves every chunk.
        let (r, recorded, hits, misses) = prepare(until);
        let plan = r.unwrap();
        check_plan(&plan);
        assert_eq!(recorded.as_deref(), Some(kept.checkpoint_ref.as_str()));
        assert!(hits > 0 && misses == 0, "hits {hits}, misses {misses}");
        // The restore's report removes the restore directory and the plan, not the reference.
        exec.forget(UID, "app");
        assert_eq!(
            files_under(&exec.cfg.images_dir),
            vec![kept_dir.join(KEPT_LATEST)]
        );
        assert!(!plan_path.exists());

        // 2. The cache lost the chunks (evicted): the bucket serves them.
        std::fs::remove_dir_all(t.path().join("cache").join(key.id())).unwrap();
        let (r, _, hits, misses) = prepare(until);
        check_plan(&r.unwrap());
        assert!(hits == 0 && misses > 0, "hits {hits}, misses {misses}");
        exec.forget(UID, "app");

        // 3. Gone from both: a failure the waiting create reads, and nothing left behind.
        std::fs::remove_dir_all(t.path().join("cache").join(key.id())).unwrap();
        std::fs::remove_dir_all(t.path().join("store/chunks")).unwrap();
        let (r, recorded, _, _) = prepare(until);
        let e = r.unwrap_err();
        assert!(matches!(e, NotInPlace::Fetch { .. }), "{e}");
        assert!(recorded.is_none() && !plan_path.exists());
        let note = planfile::read_failed(&failed_path).unwrap().unwrap();
        assert_eq!(note.checkpoint_ref, kept.checkpoint_ref);
        assert_eq!(note.reason, e.to_string());
        assert_eq!(
            files_under(&exec.cfg.images_dir),
            vec![kept_dir.join(KEPT_LATEST)]
        );

        // 4. The restore-loop marker: taken once.
        exec.mark_restored_in_place(UID, "app").unwrap();
        assert!(matches!(
            exec.kept_for_restart(UID, "app"),
            Err(NotInPlace::RestoredAlready(r)) if r == kept.checkpoint_ref
        ));
        // The next checkpoint's reference clears it.
        exec.keep_latest(UID, "app", &kept).unwrap();
        assert!(exec.kept_for_restart(UID, "app").is_ok());
    }

    /// A checkpoint the store does not have: the failure is named and noted, nothing recorded.
    #[test]
    fn a_checkpoint_that_cannot_be_fetched_is_noted_for_the_waiting_create() {
        let t = tempfile::tempdir().unwrap();
        let rt = test_runtime();
        let exec = test_executor(t.path(), &rt, None, Key::random());
        let job = job("ns_pod_p.0000beef/latest", None);
        // Nothing in the store: the failure is named, and noted for the waiting create.
        let e = exec
            .prepare_in_place(&job, now_ms() + 60_000, |_| panic!("recorded"))
            .unwrap_err();
        assert!(matches!(e, NotInPlace::Fetch { .. }), "{e}");
        let failed = planfile::path_for_failed(&exec.cfg.plans_dir, UID, "app").unwrap();
        assert!(planfile::read_failed(&failed).unwrap().is_some());
    }
}
