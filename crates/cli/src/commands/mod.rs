//! One module per command; [`run`] dispatches.

mod checkpoint;
mod doctor;
mod gc;
mod inspect;
mod key;
mod list;
mod restore;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use stasis_store::{Key, Store};

use crate::args::{Cli, Command, StoreArgs};
use crate::output;

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    output::set_mode(cli.global.output);
    let progress = crate::progress::Bars::new(!cli.global.quiet && !output::json_mode());
    match cli.command {
        Command::Checkpoint(c) => checkpoint::run(c, &progress),
        Command::Restore(r) => restore::run(r, &progress),
        Command::List(l) => list::run(l),
        Command::Inspect(i) => inspect::run(i),
        Command::Gc(g) => gc::run(g),
        Command::Key(k) => key::run(k),
        Command::Doctor(d) => doctor::run(d),
    }
}

/// A runtime for the store's async I/O. The engine (which forks CRIU and runc) never runs on it.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// The key (`--key`, else the default key, created on first use) and the store.
pub(crate) fn open_store(args: &StoreArgs) -> anyhow::Result<(Key, Store)> {
    let key = match &args.key {
        Some(path) => Key::load(path)?,
        None => Key::load_or_create_default()?,
    };
    let store = Store::open(&args.store)?;
    Ok((key, store))
}

pub(crate) fn store_reachable(url: &str) -> Result<String, (String, String)> {
    let fix = || "check the store URL and its credentials (AWS_* variables for s3://)".to_owned();
    let store = Store::open(url).map_err(|e| (e.to_string(), fix()))?;
    let rt = runtime().map_err(|e| (e.to_string(), fix()))?;
    rt.block_on(store.list(None))
        .map(|l| format!("{url}: reachable, {} checkpoints", l.len()))
        .map_err(|e| (e.to_string(), fix()))
}

/// A scratch directory for one checkpoint or restore, removed when dropped. Its name carries this
/// process's pid so that leftovers of a killed run can be recognised and removed.
pub(crate) struct ScratchDir {
    pub path: PathBuf,
}

impl ScratchDir {
    pub fn new(work_dir: &Path, what: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(work_dir)
            .with_context(|| format!("cannot create the work directory {}", work_dir.display()))?;
        remove_stale(work_dir);
        let path = work_dir.join(format!(
            "{what}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        set_private(&path);
        Ok(Self { path })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn set_private(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700));
}

/// Removes scratch directories left by stasis processes that no longer run.
fn remove_stale(work_dir: &Path) {
    let Ok(rd) = std::fs::read_dir(work_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.split('-').nth(1))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(dir = %e.path().display(), "removing scratch directory of a stasis run that died");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

pub(crate) fn now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// This process's peak resident memory so far (`VmHWM`), in bytes: reported so that the
/// streaming pipeline's memory bound can be checked.
pub(crate) fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}
