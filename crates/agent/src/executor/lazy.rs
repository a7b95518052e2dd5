//! Lazy restores on the node (DESIGN §6.2a, "the node path"): the agent stages only the small
//! files and the eager pages of a checkpoint, runs the engine's page server and `criu
//! lazy-pages` on the image dir, and writes a plan that says so; `stasis-runc create` then runs
//! `runc restore --lazy-pages` and the container runs before its memory has arrived. The agent
//! serves the rest until full residency (the wrapper exits after `create`; the agent holds the
//! store and the node's chunk cache).
//!
//! The page server's threads are plain threads of the engine; the store is reached through the
//! engine's synchronous `ChunkSource`, each chunk a `Handle::block_on` from those threads (none
//! of which forks, and none of which is a runtime thread).

use super::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use stasis_core::manifest::{pod_container_dir, PodIndex, POD_INDEX_FILE};
use stasis_core::{FileEntry, Manifest, RootfsMethod, Source};
use stasis_engine::restore::lazy::{self, KillTarget, LazyCancel, LazyOptions, ManifestSource};
use stasis_node_api::{planfile, ColdStartCause, Plan, PodRef, ReportEvent, ReportRequest};
use tracing::{info, warn};

/// Whether the agent restores lazily where it can (`--lazy-restore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LazyRestore {
    /// Lazily when the checkpoint and the node allow it, else in full.
    #[default]
    Auto,
    /// Always in full (every page fetched before `create`).
    Off,
}

/// Why a restore is served lazily or in full: `Ok(())` lazily, `Err(why)` in full.
pub fn choose(
    mode: LazyRestore,
    manifest: &Manifest,
    node: impl FnOnce() -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    if mode == LazyRestore::Off {
        return Err("lazy restore is off on this node (--lazy-restore=off)".into());
    }
    if !matches!(manifest.source, Source::Container { .. }) {
        return Err(
            "the checkpoint is a process tree, which the node path restores in full".into(),
        );
    }
    if manifest.gpu_processes > 0 || manifest.requirements.node.gpu.is_some() {
        return Err("the checkpoint has GPU state, which is restored before the processes run and touches their memory".into());
    }
    node()
}

/// The lazy restores this agent serves, by pod UID and container name.
#[derive(Default)]
pub(super) struct LazyRestores {
    auto: AtomicBool,
    /// Whether this node can restore lazily, checked once (`criu check`).
    node: OnceLock<std::result::Result<(), String>>,
    serving: Arc<Mutex<HashMap<(String, String), Serving>>>,
    next: AtomicU64,
    on_failure: Arc<OnceLock<FailureHook>>,
    /// Why a container's lazy restore failed before the container ran (its restore then fails
    /// too, and the wrapper's report of that cannot know the cause): taken by that report.
    failed_before_run: Arc<Mutex<HashMap<(String, String), String>>>,
}

struct Serving {
    generation: u64,
    cancel: LazyCancel,
}

/// A lazy restore that failed after its container may have run: the container was killed (its
/// memory could not arrive); `reason` names the chunk.
#[derive(Debug, Clone)]
pub struct LazyFailure {
    pub pod_uid: String,
    pub container_name: String,
    /// The container restored from it, when it got that far.
    pub container_id: Option<String>,
    pub checkpoint_ref: String,
    pub reason: String,
}

impl LazyFailure {
    /// The failure as the wrapper reports a failed restore: the restore's status becomes a
    /// cold start with a typed cause (what the restore-loop guard counts) and a Warning Event
    /// names the chunk.
    pub fn report(&self) -> ReportRequest {
        ReportRequest {
            container_id: self.container_id.clone().unwrap_or_default(),
            pod: PodRef {
                pod_uid: self.pod_uid.clone(),
                pod_namespace: String::new(),
                pod_name: String::new(),
                container_name: self.container_name.clone(),
            },
            event: ReportEvent::ColdStart {
                cause: ColdStartCause::RestoreFailed,
                reason: format!(
                    "the restored container was killed because its memory could not be served: {}; its next start is cold",
                    self.reason
                ),
                checkpoint_ref: Some(self.checkpoint_ref.clone()),
            },
        }
    }
}

type FailureHook = Box<dyn Fn(LazyFailure) + Send + Sync>;

/// One container's share of a checkpoint: a one-container checkpoint whole, or a pod member's
/// directory `containers/<name>/` (its files with that prefix taken off, as its image dir
/// holds them).
struct LazyPart {
    name: String,
    /// What the checkpoint's file paths have before the image dir's (`containers/<name>/`).
    prefix: String,
    files: Vec<FileEntry>,
    rootfs: Option<RootfsMethod>,
}

impl LazyPart {
    fn member(manifest: &Manifest, index: &PodIndex, name: &str) -> Result<Self> {
        let prefix = format!("{}/", pod_container_dir(name));
        let container = index
            .containers
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| {
                AgentError::Invalid(format!(
                    "{}: the pod index has no container {name}",
                    manifest.reference()
                ))
            })?;
        let files = manifest
            .files
            .iter()
            .filter_map(|f| {
                let path = f.path.strip_prefix(&prefix)?.to_owned();
                Some(FileEntry { path, ..f.clone() })
            })
            .collect();
        Ok(LazyPart {
            name: name.to_owned(),
            prefix,
            files,
            rootfs: container.rootfs.as_ref().map(|r| r.method),
        })
    }
}

impl LazyRestores {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Serving>> {
        self.serving.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops serving a container's restore (its image dir is about to be replaced or removed).
    fn cancel(&self, pod_uid: &str, container_name: &str, why: &str) {
        if let Some(s) = self
            .lock()
            .remove(&(pod_uid.to_owned(), container_name.to_owned()))
        {
            s.cancel.cancel(why);
        }
    }

    pub(super) fn serves(&self, pod_uid: &str, container_name: &str) -> bool {
        self.lock()
            .contains_key(&(pod_uid.to_owned(), container_name.to_owned()))
    }
}

impl Executor {
    /// Turns lazy restores on (`auto`) or off; off until called.
    pub fn set_lazy_restore(&self, mode: LazyRestore) {
        self.lazy
            .auto
            .store(mode == LazyRestore::Auto, Ordering::Relaxed);
    }

    /// Called, on the thread that waited for it, with each lazy restore that failed after its
    /// container was created (the first call installs it; the agent's Events and restore
    /// statuses).
    pub fn on_lazy_failure(&self, hook: impl Fn(LazyFailure) + Send + Sync + 'static) {
        let _ = self.lazy.on_failure.set(Box::new(hook));
    }

    /// Whether `manifest` is restored lazily here: `Err(why)` when in full.
    pub(super) fn lazy_choice(&self, manifest: &Manifest) -> std::result::Result<(), String> {
        let mode = match self.lazy.auto.load(Ordering::Relaxed) {
            true => LazyRestore::Auto,
            false => LazyRestore::Off,
        };
        choose(mode, manifest, || {
            self.lazy.node.get_or_init(lazy::node_supports_lazy).clone()
        })
    }

    /// Stages every container `names` of `manifest` restores, each served by its own page
    /// server; all or none (a container that cannot be staged stops those staged before it, and
    /// the caller restores in full).
    pub(super) fn stage_lazy_all(
        &self,
        job: &PrepareJob,
        key: &Key,
        manifest: &Manifest,
        names: &[String],
    ) -> Result<Vec<prepare::Fetched>> {
        let parts = match manifest
            .pod_containers()
            .map_err(|e| AgentError::Invalid(format!("{}: {e}", manifest.reference())))?
        {
            None => vec![LazyPart {
                name: names[0].clone(),
                prefix: String::new(),
                files: manifest.files.clone(),
                rootfs: manifest.rootfs.as_ref().map(|r| r.method),
            }],
            Some(_) => {
                let index = self.read_pod_index(key, manifest)?;
                names
                    .iter()
                    .map(|name| LazyPart::member(manifest, &index, name))
                    .collect::<Result<_>>()?
            }
        };
        let mut staged: Vec<prepare::Fetched> = Vec::with_capacity(parts.len());
        for part in parts {
            match self.stage_lazy(job, key, manifest, part) {
                Ok(f) => staged.push(f),
                Err(e) => {
                    for f in &staged {
                        self.lazy.cancel(
                            &job.pod_uid,
                            &f.container_name,
                            "another container of the pod could not be staged",
                        );
                    }
                    return Err(e);
                }
            }
        }
        Ok(staged)
    }

    /// A pod checkpoint's index (`pod.json`), read through the store and checked against its
    /// manifest: which rootfs capture each container has.
    fn read_pod_index(&self, key: &Key, manifest: &Manifest) -> Result<PodIndex> {
        let exact = manifest.reference();
        let entry = manifest
            .files
            .iter()
            .find(|f| f.path == POD_INDEX_FILE)
            .ok_or_else(|| AgentError::Invalid(format!("{exact}: no {POD_INDEX_FILE}")))?;
        let mut raw = Vec::with_capacity(entry.size as usize);
        for c in &entry.chunks {
            raw.extend(
                self.rt
                    .block_on(self.store.read_chunk(key, c, &entry.path))?,
            );
        }
        prepare::parse_index(&raw, manifest)
    }

    /// Stages one container of `manifest` (`part`) into its image dir and serves its pages until
    /// full residency (a thread of its own); returns what its plan needs.
    fn stage_lazy(
        &self,
        job: &PrepareJob,
        key: &Key,
        manifest: &Manifest,
        part: LazyPart,
    ) -> Result<prepare::Fetched> {
        let LazyPart {
            name,
            prefix,
            files,
            rootfs,
        } = part;
        let image_dir = self.pod_images(&job.pod_uid).join(&name);
        let work = self.lazy_work_dir(&job.pod_uid, &name);
        self.lazy.cancel(
            &job.pod_uid,
            &name,
            "a newer restore of the container replaced it",
        );
        for d in [&image_dir, &work] {
            if d.exists() {
                std::fs::remove_dir_all(d).map_err(AgentError::io(d))?;
            }
        }
        private_dir(&image_dir)?;
        if let Err(e) = private_dir(&work) {
            let _ = std::fs::remove_dir_all(&image_dir);
            return Err(e);
        }
        let t = Instant::now();
        let lease = self.rt.block_on(self.store.lease_for_reading(manifest))?;
        let source = {
            let (store, key, rt) = (self.store.clone(), key.clone(), self.rt.clone());
            // Paths as in the container's image dir; the store names the checkpoint's own.
            Arc::new(ManifestSource::new(files, move |f, c| {
                rt.block_on(store.read_chunk(&key, c, &format!("{prefix}{}", f.path)))
                    .map_err(|e| e.to_string())
            }))
        };
        let served = lazy::serve_lazy(
            &image_dir,
            &work,
            source,
            LazyOptions::default(),
            KillTarget::Announced { dir: work.clone() },
        );
        let server = match served {
            Ok(s) => s,
            Err(e) => {
                self.rt.block_on(self.store.release(lease));
                let _ = std::fs::remove_dir_all(&image_dir);
                let _ = std::fs::remove_dir_all(&work);
                return Err(e.into());
            }
        };
        let checkpoint_ref = manifest.reference().to_string();
        if let Err(e) = planfile::write_verified_stamp(&image_dir, &checkpoint_ref) {
            server.abandon("the image dir could not be stamped");
            self.rt.block_on(self.store.release(lease));
            return Err(AgentError::io(&image_dir)(e));
        }
        let fetch_ms = ms(t);
        let bytes = server.staged_bytes();
        let generation = self.lazy.next.fetch_add(1, Ordering::Relaxed);
        let id = (job.pod_uid.clone(), name.clone());
        self.lazy.lock().insert(
            id.clone(),
            Serving {
                generation,
                cancel: server.canceller(),
            },
        );
        let (store, rt, metrics, serving, on_failure, failed_before_run) = (
            self.store.clone(),
            self.rt.clone(),
            self.metrics.clone(),
            self.lazy.serving.clone(),
            self.lazy.on_failure.clone(),
            self.lazy.failed_before_run.clone(),
        );
        let (dir, work_dir, reference) = (image_dir.clone(), work.clone(), checkpoint_ref.clone());
        let waiter = move || {
            let r = server.wait_resident();
            rt.block_on(store.release(lease));
            let current = {
                let mut m = serving.lock().unwrap_or_else(|e| e.into_inner());
                let mine = m.get(&id).is_some_and(|s| s.generation == generation);
                if mine {
                    m.remove(&id);
                }
                mine
            };
            let announced = lazy::announced(&work_dir);
            match r {
                Ok(rep) => {
                    metrics.restore("lazy_resident");
                    metrics.phase_ms("lazy_resident", rep.resident_ms);
                    info!(pod_uid = %id.0, container = %id.1, checkpoint_ref = %reference, resident_ms = rep.resident_ms, requests = rep.requests, demand_fetches = rep.demand_fetches, "lazily restored container resident");
                }
                // Cancelled before any container ran on the files, or withdrawn on purpose (a
                // newer restore of the container, its pod gone, its restore lost before the
                // container started): nothing to report.
                Err(e) if !current || announced.as_ref().and_then(|a| a.outcome) != Some(true) => {
                    info!(pod_uid = %id.0, container = %id.1, reason = %e, "lazy restore no longer served");
                    // Not withdrawn: it failed before the container ran, whose restore fails
                    // with it; the report of that failure takes the cause.
                    if current {
                        failed_before_run
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(id.clone(), e.to_string());
                    }
                }
                Err(e) => {
                    metrics.restore("lazy_failed");
                    warn!(pod_uid = %id.0, container = %id.1, checkpoint_ref = %reference, error = %e, "lazy restore failed after the container ran: it was killed");
                    if let Some(hook) = on_failure.get() {
                        hook(LazyFailure {
                            pod_uid: id.0.clone(),
                            container_name: id.1.clone(),
                            container_id: announced.map(|a| a.id),
                            checkpoint_ref: reference.clone(),
                            reason: e.to_string(),
                        });
                    }
                }
            }
            // A newer restore of the container owns the directories now.
            if current {
                let _ = std::fs::remove_dir_all(&dir);
                let _ = std::fs::remove_dir_all(&work_dir);
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("lazy-restore".into())
            .spawn(waiter)
        {
            self.lazy
                .cancel(&job.pod_uid, &name, "no thread to serve it");
            return Err(AgentError::Invalid(format!(
                "cannot start the thread that serves the lazy restore: {e}"
            )));
        }
        info!(pod_uid = %job.pod_uid, container = %name, %checkpoint_ref, staged_bytes = bytes, fetch_ms, "lazy restore staged: its pages are served until the container is resident");
        Ok(prepare::Fetched {
            plan: Plan {
                image_dir,
                rootfs_method: rootfs,
                checkpoint_ref,
                tcp_established: prepare::restores_established_tcp(manifest),
                lazy: true,
                work_dir: Some(work),
            },
            container_name: name,
            fetch_ms,
            bytes,
        })
    }

    /// Where a lazy restore of a pod's container runs (its daemon's socket, the logs, the note
    /// naming the container): `<run dir>/lazy/<pod-uid>/<container>`, beside the plans on the
    /// run directory (a tmpfs on a node), never on the images' disk: a disk that fills once
    /// the files are staged must not fail the restore.
    pub(super) fn lazy_work_dir(&self, pod_uid: &str, container_name: &str) -> PathBuf {
        self.cfg.lazy_dir().join(pod_uid).join(container_name)
    }

    /// Whether a container's images are still in use by a lazy restore whose container runs
    /// (its pages are arriving): `forget` then leaves them to the restore, which removes them
    /// at residency; otherwise it stops serving them.
    pub(super) fn release_lazy(&self, pod_uid: &str, container_name: &str) -> bool {
        if !self.lazy.serves(pod_uid, container_name) {
            return false;
        }
        if lazy::announced(&self.lazy_work_dir(pod_uid, container_name)).and_then(|a| a.outcome)
            == Some(true)
        {
            return true;
        }
        self.lazy.cancel(
            pod_uid,
            container_name,
            "the container was not restored from it",
        );
        false
    }

    /// Why the container's lazy restore failed before the container ran, once (a damaged chunk,
    /// named): what the report of its failed restore cannot know. A restore still served is
    /// waited for up to `wait` (its failure ends it moments before `runc restore` fails).
    pub fn lazy_failure_before_run(
        &self,
        pod_uid: &str,
        container_name: &str,
        wait: std::time::Duration,
    ) -> Option<String> {
        let id = (pod_uid.to_owned(), container_name.to_owned());
        let until = Instant::now() + wait;
        while self.lazy.serves(pod_uid, container_name) && Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        self.lazy
            .failed_before_run
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
    }

    /// A container's restore was lost before the container started (its create was given up):
    /// its lazy restore stops being served, without a failure report when the process it served
    /// is killed with the container (the restart in place serves the checkpoint again).
    pub fn restore_lost(&self, pod_uid: &str, container_name: &str) {
        self.lazy.cancel(
            pod_uid,
            container_name,
            "its container was deleted before it started",
        );
    }

    /// At the agent's start: the lazy restores an earlier agent prepared and no create has
    /// taken yet. Their page servers died with that agent, so a create must not restore from
    /// them: each plan is withdrawn, and a pending note makes the container's create wait (up
    /// to `wait_ms`) for the restore prepared again. Returns the pods' UIDs, whose `Ready`
    /// PodRestores are prepared again.
    pub fn withdraw_orphaned_lazy_plans(&self, wait_ms: u64) -> std::collections::HashSet<String> {
        let mut pods = std::collections::HashSet::new();
        let Ok(rd) = std::fs::read_dir(&self.cfg.plans_dir) else {
            return pods;
        };
        for e in rd.flatten() {
            let path = e.path();
            let Ok(Some(file)) = planfile::read(&path) else {
                continue;
            };
            let (Some(uid), Some(name)) = (&file.pod_uid, &file.container_name) else {
                continue;
            };
            // (a plan file is named after its pod and container: one named otherwise is not ours)
            if !file.plan.lazy
                || planfile::path_for_pod(&self.cfg.plans_dir, uid, name).as_ref() != Some(&path)
            {
                continue;
            }
            let pending = planfile::path_for_pending(&self.cfg.plans_dir, uid, name);
            let noted = pending.map(|p| {
                planfile::write_pending(
                    &p,
                    &planfile::Pending {
                        v: stasis_node_api::PROTOCOL_VERSION,
                        checkpoint_ref: file.plan.checkpoint_ref.clone(),
                        until_unix_ms: now_ms() + wait_ms,
                    },
                )
            });
            let _ = std::fs::remove_file(&path);
            warn!(pod_uid = %uid, container = %name, checkpoint_ref = %file.plan.checkpoint_ref, waits = noted.is_some_and(|r| r.is_ok()),
                "a lazy restore prepared before this agent started lost its page server: prepared again");
            pods.insert(uid.clone());
        }
        pods
    }

    /// Stops serving the lazy restores of pods no longer on this node.
    pub(super) fn cancel_lazy_gone(&self, live_pod_uids: &std::collections::HashSet<String>) {
        let gone: Vec<(String, String)> = self
            .lazy
            .lock()
            .keys()
            .filter(|(uid, _)| !live_pod_uids.contains(uid))
            .cloned()
            .collect();
        for (uid, name) in gone {
            self.lazy
                .cancel(&uid, &name, "its pod is no longer on this node");
        }
        // (a failure before its container ran that no report took: its pod is gone too)
        self.lazy
            .failed_before_run
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(uid, _), _| live_pod_uids.contains(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::manifest::POD_CONTAINERS_LABEL;

    fn supported() -> std::result::Result<(), String> {
        Ok(())
    }

    #[test]
    fn lazy_plans_an_earlier_agent_left_are_withdrawn_and_waited_for() {
        let t = tempfile::tempdir().unwrap();
        let rt = test_runtime();
        let exec = test_executor(t.path(), &rt, None, stasis_store::Key::random());
        let dir = exec.cfg.plans_dir.clone();
        let plan = |uid: &str, lazy: bool| planfile::PlanFile {
            v: stasis_node_api::PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some(uid.into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: t.path().join("images").join(uid).join("app"),
                rootfs_method: None,
                checkpoint_ref: format!("l/{uid}"),
                tcp_established: true,
                lazy,
                work_dir: None,
            },
            expires_at_unix_ms: Some(now_ms() + 60_000),
        };
        let path = |uid: &str| planfile::path_for_pod(&dir, uid, "app").unwrap();
        planfile::write(&path("lazy"), &plan("lazy", true)).unwrap();
        planfile::write(&path("full"), &plan("full", false)).unwrap();
        // A lazy plan taken by a create already: its container runs, nothing to redo.
        planfile::write(&path("taken"), &plan("taken", true)).unwrap();
        planfile::consume(&path("taken")).unwrap();

        let pods = exec.withdraw_orphaned_lazy_plans(30_000);
        assert_eq!(pods, std::collections::HashSet::from(["lazy".to_owned()]));
        assert!(!path("lazy").exists() && path("full").exists());
        let pending =
            planfile::read_pending(&planfile::path_for_pending(&dir, "lazy", "app").unwrap())
                .unwrap()
                .expect("the create waits for the restore prepared again");
        assert_eq!(pending.checkpoint_ref, "l/lazy");
        assert!(pending.until_unix_ms > now_ms() + 20_000);
        assert!(exec.withdraw_orphaned_lazy_plans(30_000).is_empty());
    }

    #[test]
    fn the_fallback_to_a_full_restore_is_chosen_per_checkpoint_and_node() {
        let mut plain = super::super::prepare::tests::manifest(&[], &[]);
        plain.requirements.node.gpu = None;
        assert_eq!(choose(LazyRestore::Auto, &plain, supported), Ok(()));
        let full = |m: &Manifest, mode, node: std::result::Result<(), String>| {
            choose(mode, m, || node).unwrap_err()
        };
        assert!(full(&plain, LazyRestore::Off, Ok(())).contains("--lazy-restore=off"));
        // The node cannot (criu check failed): in full, with its reason.
        assert_eq!(
            full(
                &plain,
                LazyRestore::Auto,
                Err("criu check --feature uffd-noncoop failed".into())
            ),
            "criu check --feature uffd-noncoop failed"
        );
        let mut cuda = plain.clone();
        cuda.gpu_processes = 1;
        assert!(full(&cuda, LazyRestore::Auto, Ok(())).contains("GPU state"));
        let mut tree = plain.clone();
        tree.source = Source::Process { pid: 7 };
        assert!(full(&tree, LazyRestore::Auto, Ok(())).contains("process tree"));
        // A pod checkpoint goes lazily too, each container with its own page server.
        let mut pod = plain.clone();
        pod.labels
            .insert(POD_CONTAINERS_LABEL.into(), "app,sidecar".into());
        assert_eq!(choose(LazyRestore::Auto, &pod, supported), Ok(()));
        // The node is asked only when the checkpoint could go lazily.
        let mut asked = false;
        let _ = choose(LazyRestore::Auto, &cuda, || {
            asked = true;
            Ok(())
        });
        assert!(!asked);
    }
}
