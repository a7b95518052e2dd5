//! One module per command; [`run`] dispatches.

pub mod archive;
mod checkpoint;
mod doctor;
mod gc;
mod inspect;
mod key;
mod list;
mod pod;
mod restore;

use std::path::Path;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use stasis_engine::EngineError;
use stasis_store::{Key, Store, StoreOptions};

use crate::args::{Cli, Command, StoreArgs};
use crate::output;
use crate::scratch::ScratchDir;

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    output::set_mode(cli.global.output);
    let _ = STORE_TIMEOUT.set(Duration::from_secs_f64(cli.global.store_timeout.max(0.1)));
    let progress = crate::progress::Bars::new(!cli.global.quiet && !output::json_mode());
    match cli.command {
        Command::Checkpoint(c) => checkpoint::run(c, &progress),
        Command::Restore(r) => restore::run(r, &progress),
        Command::List(l) => list::run(l),
        Command::Inspect(i) => inspect::run(i, &progress),
        Command::Gc(g) => gc::run(g),
        Command::Key(k) => key::run(k),
        Command::Doctor(d) => doctor::run(d),
        Command::Export(e) => archive::export(e, &progress),
        Command::Import(i) => archive::import(i, &progress),
        Command::Advise(a) => Ok(crate::advise::run(&a.args)),
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

/// What a command does to the store and the key: a writer creates a missing local store and the
/// default key on first use; a reader creates nothing (a missing store or key is an error that
/// says so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

static STORE_TIMEOUT: OnceLock<Duration> = OnceLock::new();

/// Store options for this run: `--store-timeout`, and whether a local store may be created.
pub(crate) fn store_options(access: Access) -> StoreOptions {
    StoreOptions {
        create: access == Access::Write,
        request_timeout: STORE_TIMEOUT
            .get()
            .copied()
            .unwrap_or(StoreOptions::default().request_timeout),
        ..StoreOptions::default()
    }
}

/// The key: `--key` (or `$STASIS_KEY_FILE`), else the default key, which only a writer creates.
pub(crate) fn load_key(path: Option<&Path>, access: Access) -> anyhow::Result<Key> {
    match (path, access) {
        (Some(p), _) => Ok(Key::load(p)?),
        (None, Access::Write) => Ok(Key::load_or_create_default()?),
        (None, Access::Read) => {
            let p = Key::default_path()?;
            if !p.exists() {
                anyhow::bail!(
                    "no key: pass --key FILE (or set STASIS_KEY_FILE) with the key the checkpoints were written with; the default key {} does not exist (a checkpoint creates it)",
                    p.display()
                );
            }
            Ok(Key::load(&p)?)
        }
    }
}

/// The key and the store.
pub(crate) fn open_store(args: &StoreArgs, access: Access) -> anyhow::Result<(Key, Store)> {
    let store = Store::open_with(&args.store, store_options(access))?;
    let key = load_key(args.key.as_deref(), access)?;
    Ok((key, store))
}

/// A reader's start: the key, the store, a runtime, and the manifest a reference names.
pub struct Opened {
    pub key: Key,
    pub store: Store,
    pub rt: tokio::runtime::Runtime,
    pub manifest: stasis_core::manifest::Manifest,
}

impl Opened {
    pub(crate) fn new(args: &StoreArgs, reference: &str) -> anyhow::Result<Self> {
        let (key, store) = open_store(args, Access::Read)?;
        Self::with(key, store, reference)
    }

    /// A reader's start with the key and store in hand (`kubectl stasis export`: a namespace's
    /// data key). Its own runtime: not to be called on one.
    pub fn with(key: Key, store: Store, reference: &str) -> anyhow::Result<Self> {
        let reference: stasis_core::CheckpointRef = reference.parse()?;
        let rt = runtime()?;
        let manifest = rt.block_on(store.read_manifest(&key, &reference))?;
        Ok(Self {
            key,
            store,
            rt,
            manifest,
        })
    }

    /// Fetches the checkpoint's files into `dir` (with progress), given up on a signal.
    pub(crate) fn fetch(&self, dir: &Path, bars: &crate::progress::Bars) -> anyhow::Result<()> {
        let exact = self.manifest.reference();
        match self.rt.block_on(self.store.get_checkpoint_until(
            &self.key,
            &exact,
            dir,
            bars,
            crate::signals::cancelled(),
        )) {
            Ok(_) => crate::signals::check().map_err(Into::into),
            Err(stasis_store::StoreError::Cancelled) => Err(crate::signals::interrupted().into()),
            Err(e) => Err(anyhow::Error::from(e).context(format!("fetching {exact} failed"))),
        }
    }
}

pub(crate) fn store_reachable(url: &str) -> Result<String, (String, String)> {
    let fix = || "check the store URL and its credentials (AWS_* variables for s3://)".to_owned();
    let store =
        Store::open_with(url, store_options(Access::Read)).map_err(|e| (e.to_string(), fix()))?;
    let rt = runtime().map_err(|e| (e.to_string(), fix()))?;
    let n = rt
        .block_on(store.list(None))
        .map_err(|e| (e.to_string(), fix()))?
        .len();
    // Whether checkpoints can be written (a probe object, put and deleted): a read-only store
    // still serves restores, so it is said, not failed.
    match rt.block_on(store.check_writable()) {
        Ok(()) => Ok(format!("{url}: reachable, writable, {n} checkpoints")),
        Err(e) if e.is_read_only() => Ok(format!(
            "{url}: reachable, {n} checkpoints, READ-ONLY here: restores work, checkpoints will fail ({e})"
        )),
        Err(e) => Err((e.to_string(), fix())),
    }
}

/// An engine failure that cites a log in the scratch directory (about to be removed): the
/// logs are kept under `<work dir>/failed/` and the error cites the kept copy.
pub(crate) fn keep_failure_logs(e: EngineError, scratch: &ScratchDir) -> EngineError {
    match e {
        EngineError::ToolFailed {
            what,
            detail,
            log: Some(log),
        } if log.starts_with(&scratch.path) => {
            let kept = scratch.keep_logs().and_then(|dir| {
                let p = dir.join(log.file_name()?);
                p.exists().then_some(p)
            });
            EngineError::ToolFailed {
                what,
                detail,
                log: kept,
            }
        }
        e => e,
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
