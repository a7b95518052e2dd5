//! Plan files: the agent's restore decisions, dropped where the runtime wrapper can read them
//! without any round trip.
//!
//! ```text
//! <plans>/<container-id>.json                      a plan for one container id
//! <plans>/pod_<pod-uid>_<container-name>.json      a plan for a pod's container, whatever its id
//! <plans>/<either>.json.consumed                   a plan the wrapper has taken (single use)
//! <image-dir>/.stasis-verified                     the agent's stamp: this image dir holds the
//!                                                  verified archive of `checkpoint_ref`
//! <plans>/pod_<pod-uid>_<container-name>.pending   the runtime's note that the agent is preparing
//!                                                  a restart in place: `create` waits for the plan
//!                                                  until `until_unix_ms` (the runtime's side)
//! <plans>/pod_<pod-uid>_<container-name>.failed    the agent's note that that preparation failed,
//!                                                  and why: `create` stops waiting (the agent's side)
//! <plans>/pod_<pod-uid>_<container-name>.skip      the agent's note that this init container ran
//!                                                  before the checkpoint being restored: `create`
//!                                                  makes it exit 0 without running its command
//! <plans>/report_<container-id>.json               the runtime's report of a restore's outcome,
//!                                                  written before it is sent; the agent removes
//!                                                  it once handled (delivery at least once)
//! <plans>/taking_<container-id>.json               that report claimed by the agent handling it
//! ```
//!
//! The container id is chosen by containerd only when the container is created, so the agent
//! usually writes the per-pod form (it knows the pod uid and container name from its
//! `PodRestore`); the per-id form wins when both exist. Files are written to a temporary name in
//! the same directory and renamed into place, so a reader sees a whole plan or none. A plan is
//! used at most once: the wrapper renames it to `.consumed` before it acts on it, so a container
//! that restarts in place (or a restore that fails) never loops on the same plan; the agent writes
//! a new plan if it wants another restore, and removes consumed ones.
//!
//! Example:
//!
//! ```json
//! {"v":1,"pod_uid":"0b5c…","container_name":"app","image_dir":"/var/lib/stasis/restore/0b5c…/app",
//!  "rootfs_method":"overlay_upper","checkpoint_ref":"default/counter/lineage-3/17",
//!  "tcp_established":true,"expires_at_unix_ms":1795000000000}
//! ```
//!
//! Trust: plans decide whose memory a container gets, so the wrapper reads only files owned by its
//! own (root) uid and writable by nobody else, in a directory with the same property.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::proto::{Plan, PROTOCOL_VERSION};

/// The name of the agent's verification stamp inside an image directory.
pub const VERIFIED_STAMP: &str = ".stasis-verified";

/// The largest plan file or stamp read.
const MAX_FILE: u64 = 64 * 1024;

/// The content of a plan file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanFile {
    pub v: u32,
    /// For a per-id plan: the container it is for (checked against the file name's id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The pod and container the plan is for; checked against the bundle's annotations when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    #[serde(flatten)]
    pub plan: Plan,
    /// After this instant (Unix milliseconds) the plan is void.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_unix_ms: Option<u64>,
}

/// The agent's stamp on a verified image directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifiedStamp {
    pub v: u32,
    pub checkpoint_ref: String,
    #[serde(default)]
    pub verified_at_unix_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not trusted: {why}")]
    Untrusted { path: PathBuf, why: String },
    #[error("{path}: malformed: {source}")]
    Malformed {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: protocol version {got}, this runtime reads {PROTOCOL_VERSION}")]
    Version { path: PathBuf, got: u32 },
}

/// Whether `s` is safe as one path component (container ids, pod uids, container names).
fn safe_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'+'))
        && !s.starts_with('.')
}

/// `<dir>/<container-id>.json`; `None` for an id that is not a plain name.
pub fn path_for_container(dir: &Path, container_id: &str) -> Option<PathBuf> {
    safe_component(container_id).then(|| dir.join(format!("{container_id}.json")))
}

/// `<dir>/pod_<pod-uid>_<container-name>.json`; `None` when either is empty or not a plain name.
pub fn path_for_pod(dir: &Path, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
    (safe_component(pod_uid) && safe_component(container_name))
        .then(|| dir.join(format!("pod_{pod_uid}_{container_name}.json")))
}

/// `<dir>/pod_<pod-uid>_<container-name>.<ext>`: the per-pod name with another extension.
fn path_for_pod_ext(dir: &Path, pod_uid: &str, container_name: &str, ext: &str) -> Option<PathBuf> {
    path_for_pod(dir, pod_uid, container_name).map(|p| p.with_extension(ext))
}

/// A restart in place being prepared: the runtime's `create` of the container waits for its
/// plan file until `until_unix_ms`, written by the runtime from the agent's `preparing` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub v: u32,
    pub checkpoint_ref: String,
    pub until_unix_ms: u64,
}

/// The agent could not prepare the restart in place it said it was preparing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failed {
    pub v: u32,
    pub checkpoint_ref: String,
    pub reason: String,
}

/// An init container of a pod being restored that already ran before the checkpoint: running it
/// again would redo its work against the restored state (a migration applied twice, a file
/// appended to again), so the wrapper makes it succeed without running its command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skip {
    pub v: u32,
    /// The checkpoint the pod restores (for the log line).
    pub checkpoint_ref: String,
    /// After this instant (Unix milliseconds) the note is void.
    pub expires_at_unix_ms: u64,
}

/// `<dir>/pod_<pod-uid>_<container-name>.skip`.
pub fn path_for_skip(dir: &Path, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
    path_for_pod_ext(dir, pod_uid, container_name, "skip")
}

/// Writes a skip note atomically (the agent's side).
pub fn write_skip(path: &Path, s: &Skip) -> io::Result<()> {
    write_atomic(path, &serde_json::to_vec(s)?)
}

/// The skip note, if any (trusted as plan files are: it decides whether a command runs).
pub fn read_skip(path: &Path) -> Result<Option<Skip>, PlanFileError> {
    read_trusted(path)
}

/// Where the agent serves a pod container's lazy restore (the plan's `work_dir`): `lazy/<pod-uid>/
/// <container-name>` beside the plans directory `dir` (on the run directory); `None` when either
/// is empty or not a plain name.
pub fn lazy_work_dir(dir: &Path, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
    (safe_component(pod_uid) && safe_component(container_name))
        .then(|| lazy_root(dir).join(pod_uid).join(container_name))
}

/// The directory of every lazy restore's work dir, beside the plans directory `dir`.
pub fn lazy_root(dir: &Path) -> PathBuf {
    dir.parent()
        .map_or_else(|| dir.join("lazy"), |p| p.join("lazy"))
}

/// `<dir>/pod_<pod-uid>_<container-name>.pending`.
pub fn path_for_pending(dir: &Path, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
    path_for_pod_ext(dir, pod_uid, container_name, "pending")
}

/// `<dir>/pod_<pod-uid>_<container-name>.failed`.
pub fn path_for_failed(dir: &Path, pod_uid: &str, container_name: &str) -> Option<PathBuf> {
    path_for_pod_ext(dir, pod_uid, container_name, "failed")
}

/// Writes a pending note atomically (the runtime's side, from `preparing`).
pub fn write_pending(path: &Path, p: &Pending) -> io::Result<()> {
    write_atomic(path, &serde_json::to_vec(p)?)
}

/// The pending note, if any (trusted as plan files are: it makes `create` wait).
pub fn read_pending(path: &Path) -> Result<Option<Pending>, PlanFileError> {
    read_trusted(path)
}

/// Writes a failure note atomically (the agent's side).
pub fn write_failed(path: &Path, f: &Failed) -> io::Result<()> {
    write_atomic(path, &serde_json::to_vec(f)?)
}

/// The failure note, if any.
pub fn read_failed(path: &Path) -> Result<Option<Failed>, PlanFileError> {
    read_trusted(path)
}

/// `<dir>/report_<container-id>.json`: a runtime's report of a restore's outcome, written before
/// it is sent over the socket and removed by the agent once handled, so that a report is
/// delivered at least once: sent to an agent that died before handling it, or to none (an agent
/// restart), the agent that runs next still finds it.
pub fn path_for_report(dir: &Path, container_id: &str) -> Option<PathBuf> {
    safe_component(container_id).then(|| dir.join(format!("{REPORT_PREFIX}{container_id}.json")))
}
const REPORT_PREFIX: &str = "report_";

/// `<dir>/taking_<container-id>.json`: a report an agent has claimed and is handling (renamed
/// from [`path_for_report`]'s name). Left behind only by an agent that died while handling it:
/// the agent that starts next handles it again.
pub fn path_for_claimed_report(dir: &Path, container_id: &str) -> Option<PathBuf> {
    safe_component(container_id).then(|| dir.join(format!("{CLAIMED_PREFIX}{container_id}.json")))
}
const CLAIMED_PREFIX: &str = "taking_";

/// Writes a report atomically (the runtime's side, before it sends it).
pub fn write_report(path: &Path, r: &crate::ReportRequest) -> io::Result<()> {
    write_atomic(path, &serde_json::to_vec(r)?)
}

/// A report file, claimed or not, if any (trusted as plan files are: it sets a restore's
/// outcome).
pub fn read_report(path: &Path) -> Result<Option<crate::ReportRequest>, PlanFileError> {
    read_trusted(path)
}

/// What [`claim_report`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportClaim {
    /// The caller holds the report now, under this (claimed) name: it handles it, then removes
    /// the file.
    Mine(PathBuf),
    /// Another handler claimed it first (its claimed name exists): it is not the caller's.
    Another,
    /// Neither name exists: no report file was written (a runtime that writes none, or could
    /// not), or one was handled and removed already.
    NoFile,
}

/// Claims the report file `report` (a [`path_for_report`] name) for handling, by renaming it to
/// its [`path_for_claimed_report`] name: a rename succeeds for one caller only, so of the
/// agent's socket handler and its pickup of report files (or of two agents during a rolling
/// update) exactly one handles it.
pub fn claim_report(report: &Path) -> io::Result<ReportClaim> {
    let id = report_id(report, REPORT_PREFIX)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a report file name"))?;
    let dir = report.parent().unwrap_or(Path::new(""));
    let claimed = path_for_claimed_report(dir, id)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a plain container id"))?;
    match std::fs::rename(report, &claimed) {
        Ok(()) => Ok(ReportClaim::Mine(claimed)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => match claimed.symlink_metadata() {
            Ok(_) => Ok(ReportClaim::Another),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(ReportClaim::NoFile),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// The container id in a report file's name (`<prefix><id>.json`), when it is a plain name.
fn report_id<'a>(path: &'a Path, prefix: &str) -> Option<&'a str> {
    let id = path
        .file_name()?
        .to_str()?
        .strip_prefix(prefix)?
        .strip_suffix(".json")?;
    safe_component(id).then_some(id)
}

/// The unclaimed report files in `dir` last written at least `min_age` ago (the agent's side),
/// in name order. A file whose time is ahead of the clock counts as old: the clock was set
/// back, and a report must not wait for it to catch up.
pub fn undelivered_reports(dir: &Path, min_age: std::time::Duration) -> Vec<PathBuf> {
    let now = std::time::SystemTime::now();
    let old_enough = |p: &Path| {
        p.symlink_metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| now.duration_since(t).map_or(true, |age| age >= min_age))
    };
    let mut out = reports_named(dir, REPORT_PREFIX);
    out.retain(|p| old_enough(p));
    out
}

/// The claimed report files in `dir` (`taking_<id>.json`), in name order: at an agent's start,
/// those its predecessor was handling when it died.
pub fn claimed_reports(dir: &Path) -> Vec<PathBuf> {
    reports_named(dir, CLAIMED_PREFIX)
}

fn reports_named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| report_id(p, prefix).is_some())
        .collect();
    out.sort();
    out
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PlanFileError + '_ {
    move |source| PlanFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn check_trusted(path: &Path, md: &std::fs::Metadata) -> Result<(), PlanFileError> {
    let me = nix::unistd::geteuid().as_raw();
    let why = if md.uid() != me {
        Some(format!("owned by uid {}, not {me}", md.uid()))
    } else if md.mode() & 0o022 != 0 {
        Some(format!(
            "mode {:o} is writable by others",
            md.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(PlanFileError::Untrusted {
            path: path.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Reads a trusted, bounded JSON file; `Ok(None)` when it does not exist.
fn read_trusted<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, PlanFileError> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path)(e)),
    };
    let md = f.metadata().map_err(io_err(path))?;
    if !md.is_file() {
        return Err(PlanFileError::Untrusted {
            path: path.into(),
            why: "not a regular file".into(),
        });
    }
    check_trusted(path, &md)?;
    if let Some(dir) = path.parent() {
        let dmd = std::fs::metadata(dir).map_err(io_err(dir))?;
        check_trusted(dir, &dmd)?;
    }
    let mut buf = Vec::with_capacity(md.len().min(MAX_FILE) as usize);
    f.take(MAX_FILE + 1)
        .read_to_end(&mut buf)
        .map_err(io_err(path))?;
    if buf.len() as u64 > MAX_FILE {
        return Err(PlanFileError::Untrusted {
            path: path.into(),
            why: format!("larger than {MAX_FILE} bytes"),
        });
    }
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(|source| PlanFileError::Malformed {
            path: path.into(),
            source,
        })
}

/// Reads a plan file; `Ok(None)` when there is none.
pub fn read(path: &Path) -> Result<Option<PlanFile>, PlanFileError> {
    let p: Option<PlanFile> = read_trusted(path)?;
    match p {
        Some(p) if p.v != PROTOCOL_VERSION => Err(PlanFileError::Version {
            path: path.into(),
            got: p.v,
        }),
        p => Ok(p),
    }
}

/// Writes `content` to `path` atomically (temporary file in the same directory, fsync, rename),
/// mode 0600; the directory is created 0700 if missing.
fn write_atomic(path: &Path, content: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no parent directory"))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let r = f
        .write_all(content)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Writes a plan file atomically (the agent's side).
pub fn write(path: &Path, plan: &PlanFile) -> io::Result<()> {
    write_atomic(path, &serde_json::to_vec(plan)?)
}

/// Where a plan at `path` goes once taken: `<path>.consumed`.
pub fn consumed_path(path: &Path) -> PathBuf {
    let mut to = path.as_os_str().to_owned();
    to.push(".consumed");
    PathBuf::from(to)
}

/// Takes a plan (the wrapper's side): renames it to `<path>.consumed`, so it is used once.
/// Returns the new path; an error means someone else took it first (or it is gone).
pub fn consume(path: &Path) -> io::Result<PathBuf> {
    let to = consumed_path(path);
    std::fs::rename(path, &to)?;
    Ok(to)
}

/// Puts a taken plan back at `path` (a restore that failed because the agent serving it went
/// away: the next agent withdraws it and prepares the restore again). `false` when there is
/// no taken plan to put back, or a plan is there already.
pub fn unconsume(path: &Path) -> bool {
    !path.exists() && std::fs::rename(consumed_path(path), path).is_ok()
}

/// Stamps `image_dir` as holding the verified archive of `checkpoint_ref` (the agent's side,
/// after fetching, verifying and unpacking).
pub fn write_verified_stamp(image_dir: &Path, checkpoint_ref: &str) -> io::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let s = VerifiedStamp {
        v: PROTOCOL_VERSION,
        checkpoint_ref: checkpoint_ref.into(),
        verified_at_unix_ms: now,
    };
    write_atomic(&image_dir.join(VERIFIED_STAMP), &serde_json::to_vec(&s)?)
}

/// The agent's stamp in `image_dir`, if any.
pub fn read_verified_stamp(image_dir: &Path) -> Result<Option<VerifiedStamp>, PlanFileError> {
    read_trusted(&image_dir.join(VERIFIED_STAMP))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::RootfsMethod;
    use std::os::unix::fs::PermissionsExt;

    fn sample() -> PlanFile {
        PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("0b5c7e1a-1111-2222-3333-444455556666".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: "/var/lib/stasis/restore/x".into(),
                rootfs_method: Some(RootfsMethod::OverlayUpper),
                checkpoint_ref: "default/counter/17".into(),
                tcp_established: true,
                lazy: false,
                work_dir: None,
            },
            expires_at_unix_ms: Some(1_795_000_000_000),
        }
    }

    #[test]
    fn paths_are_plain_names_only() {
        let d = Path::new("/run/stasis/plans");
        assert_eq!(
            path_for_container(d, "4f1e9c").unwrap(),
            Path::new("/run/stasis/plans/4f1e9c.json")
        );
        assert_eq!(
            path_for_pod(d, "0b5c-uid", "app").unwrap(),
            Path::new("/run/stasis/plans/pod_0b5c-uid_app.json")
        );
        for bad in ["", "..", "a/b", ".hidden", "a b", "x\n"] {
            assert!(path_for_container(d, bad).is_none(), "{bad:?}");
            assert!(path_for_pod(d, bad, "app").is_none(), "{bad:?}");
            assert!(path_for_pod(d, "uid", bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn write_read_consume() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let p = path_for_pod(&dir, "0b5c-uid", "app").unwrap();
        assert!(read(&p).unwrap().is_none());
        write(&p, &sample()).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read(&p).unwrap().unwrap(), sample());
        // Only the plan is in the directory (no temporary left over).
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let used = consume(&p).unwrap();
        assert!(used.to_string_lossy().ends_with("app.json.consumed"));
        assert!(read(&p).unwrap().is_none());
        assert!(consume(&p).is_err(), "a plan is taken once");
    }

    #[test]
    fn documented_example_parses() {
        let j = r#"{"v":1,"pod_uid":"0b5c","container_name":"app","image_dir":"/i",
            "rootfs_method":"overlay_upper","checkpoint_ref":"default/counter/lineage-3/17",
            "tcp_established":true,"expires_at_unix_ms":1795000000000}"#;
        let p: PlanFile = serde_json::from_str(j).unwrap();
        assert_eq!(p.plan.rootfs_method, Some(RootfsMethod::OverlayUpper));
        assert_eq!(p.expires_at_unix_ms, Some(1_795_000_000_000));
    }

    #[test]
    fn untrusted_malformed_and_foreign_versions_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let p = path_for_container(&dir, "c1").unwrap();
        write(&p, &sample()).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(read(&p), Err(PlanFileError::Untrusted { .. })));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(read(&p), Err(PlanFileError::Untrusted { .. })));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();

        std::fs::write(&p, "{").unwrap();
        assert!(matches!(read(&p), Err(PlanFileError::Malformed { .. })));
        let mut future = serde_json::to_value(sample()).unwrap();
        future["v"] = 2.into();
        std::fs::write(&p, future.to_string()).unwrap();
        assert!(matches!(
            read(&p),
            Err(PlanFileError::Version { got: 2, .. })
        ));
    }

    #[test]
    fn pending_and_failed_notes_round_trip_beside_the_plan() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let pending = path_for_pending(&dir, "0b5c-uid", "app").unwrap();
        let failed = path_for_failed(&dir, "0b5c-uid", "app").unwrap();
        assert_eq!(pending, dir.join("pod_0b5c-uid_app.pending"));
        assert_eq!(failed, dir.join("pod_0b5c-uid_app.failed"));
        assert!(path_for_pending(&dir, "..", "app").is_none());
        assert!(read_pending(&pending).unwrap().is_none());
        let p = Pending {
            v: PROTOCOL_VERSION,
            checkpoint_ref: "l/1".into(),
            until_unix_ms: 7,
        };
        write_pending(&pending, &p).unwrap();
        assert_eq!(read_pending(&pending).unwrap(), Some(p));
        let f = Failed {
            v: PROTOCOL_VERSION,
            checkpoint_ref: "l/1".into(),
            reason: "chunk missing".into(),
        };
        write_failed(&failed, &f).unwrap();
        assert_eq!(read_failed(&failed).unwrap(), Some(f));
        std::fs::set_permissions(&failed, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(
            read_failed(&failed),
            Err(PlanFileError::Untrusted { .. })
        ));
        let skip = path_for_skip(&dir, "0b5c-uid", "init").unwrap();
        assert_eq!(skip, dir.join("pod_0b5c-uid_init.skip"));
        assert!(read_skip(&skip).unwrap().is_none());
        let k = Skip {
            v: PROTOCOL_VERSION,
            checkpoint_ref: "l/1".into(),
            expires_at_unix_ms: 9,
        };
        write_skip(&skip, &k).unwrap();
        assert_eq!(read_skip(&skip).unwrap(), Some(k));
        std::fs::set_permissions(&skip, std::fs::Permissions::from_mode(0o622)).unwrap();
        assert!(matches!(
            read_skip(&skip),
            Err(PlanFileError::Untrusted { .. })
        ));
    }

    fn report(id: &str) -> crate::ReportRequest {
        crate::ReportRequest {
            container_id: id.into(),
            pod: crate::PodRef::default(),
            event: crate::ReportEvent::Restored {
                checkpoint_ref: "l/1".into(),
                restore_ms: 5,
            },
        }
    }

    #[test]
    fn report_names_are_plain_names_only() {
        let d = Path::new("/run/stasis/plans");
        assert_eq!(
            path_for_report(d, "4f1e9c").unwrap(),
            d.join("report_4f1e9c.json")
        );
        assert_eq!(
            path_for_claimed_report(d, "4f1e9c").unwrap(),
            d.join("taking_4f1e9c.json")
        );
        for bad in ["", "..", "a/b", ".hidden", "a b"] {
            assert!(path_for_report(d, bad).is_none(), "{bad:?}");
            assert!(path_for_claimed_report(d, bad).is_none(), "{bad:?}");
        }
        // Only a report file's name can be claimed.
        for not_a_report in [
            "4f1e9c.json",
            "report_.json",
            "report_a b.json",
            "taking_c.json",
        ] {
            let e = claim_report(&d.join(not_a_report)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{not_a_report}");
        }
    }

    /// A report is claimed by one caller only; the others learn whether someone holds it or
    /// there is no file at all.
    #[test]
    fn a_report_is_claimed_once() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let p = path_for_report(&dir, "c1").unwrap();
        write_report(&p, &report("c1")).unwrap();
        let claimed = path_for_claimed_report(&dir, "c1").unwrap();
        assert_eq!(
            claim_report(&p).unwrap(),
            ReportClaim::Mine(claimed.clone())
        );
        assert!(!p.exists());
        assert_eq!(read_report(&claimed).unwrap(), Some(report("c1")));
        assert_eq!(claim_report(&p).unwrap(), ReportClaim::Another);
        std::fs::remove_file(&claimed).unwrap();
        assert_eq!(claim_report(&p).unwrap(), ReportClaim::NoFile);
    }

    #[test]
    fn undelivered_reports_are_the_old_enough_unclaimed_ones() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("plans");
        let min_age = std::time::Duration::from_secs(10);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        let ahead = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
        for (id, mtime) in [("a", Some(old)), ("b", None), ("c", Some(ahead))] {
            let p = path_for_report(&dir, id).unwrap();
            write_report(&p, &report(id)).unwrap();
            if let Some(m) = mtime {
                std::fs::File::options()
                    .write(true)
                    .open(&p)
                    .unwrap()
                    .set_modified(m)
                    .unwrap();
            }
        }
        let taking = path_for_claimed_report(&dir, "d").unwrap();
        write_report(&taking, &report("d")).unwrap();
        std::fs::write(dir.join("pod_u_app.json"), b"{}").unwrap();
        // The fresh one ("b") is on its way over the socket; one ahead of the clock is old.
        assert_eq!(
            undelivered_reports(&dir, min_age),
            [dir.join("report_a.json"), dir.join("report_c.json")]
        );
        assert_eq!(
            undelivered_reports(&dir, std::time::Duration::ZERO).len(),
            3
        );
        assert_eq!(claimed_reports(&dir), [taking]);
        assert!(undelivered_reports(&t.path().join("none"), min_age).is_empty());
    }

    #[test]
    fn verified_stamp_round_trips() {
        let t = tempfile::tempdir().unwrap();
        assert!(read_verified_stamp(t.path()).unwrap().is_none());
        write_verified_stamp(t.path(), "ns/w/3").unwrap();
        let s = read_verified_stamp(t.path()).unwrap().unwrap();
        assert_eq!(s.checkpoint_ref, "ns/w/3");
        assert!(s.verified_at_unix_ms > 0);
    }
}
