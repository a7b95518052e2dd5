//! `stasis restore --lazy`: the store as the engine's page source (DESIGN §6.2a).
//!
//! The engine's page server and fetching threads ask for one chunk at a time; each request
//! runs on the command's tokio runtime (`Handle::block_on` from those threads, none of which
//! forks) and is authenticated by the store before a byte of it is returned.

use std::sync::Arc;

use stasis_core::manifest::Manifest;
use stasis_engine::restore::lazy::{self, LazyReport, ManifestSource};
use stasis_engine::restore::{ContainerRestore, Restored};
use stasis_engine::EngineError;

use crate::args::StoreArgs;
use crate::commands::{open_store, Access, Opened};

/// Restores `req` lazily from the checkpoint `manifest` describes: calls `running` once the
/// container runs, and returns once every page is in place. The outer error is the store's
/// (before anything started), the inner one the restore's.
pub(super) fn restore(
    opened: &Opened,
    store_args: &StoreArgs,
    manifest: &Manifest,
    req: &ContainerRestore<'_>,
    running: impl FnOnce(&Restored, u64),
) -> anyhow::Result<Result<(Restored, LazyReport), EngineError>> {
    // A store of its own for the fetching threads (the command's is borrowed by the caller).
    let (key, store) = open_store(store_args, Access::Read)?;
    let lease = opened.rt.block_on(store.lease_for_reading(manifest))?;
    let store = Arc::new(store);
    let rt = opened.rt.handle().clone();
    let source = {
        let store = store.clone();
        Arc::new(ManifestSource::new(manifest.files.clone(), move |f, c| {
            rt.block_on(store.read_chunk(&key, c, &f.path))
                .map_err(|e| e.to_string())
        }))
    };
    let result =
        lazy::restore_container_lazy(req, source, lazy::LazyOptions::default()).and_then(|r| {
            running(&r.restored, r.running_ms());
            let restored = r.restored;
            r.wait_resident().map(|report| (restored, report))
        });
    opened.rt.block_on(store.release(lease));
    Ok(result)
}
