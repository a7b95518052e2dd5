//! Writer and reader leases, the GC lock, create-if-absent puts.

use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use stasis_core::{CheckpointId, WorkloadName};

use super::{lease_path, now_ms, Store, GC_LOCK, MAX_LEASE_OBJECT};
use crate::error::{Result, StoreError};

/// A lease or lock document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LeaseDoc {
    pub(super) holder: String,
    pub(super) purpose: String,
    pub(super) started_unix_ms: u64,
    pub(super) renewed_unix_ms: u64,
    pub(super) ttl_ms: u64,
}

impl LeaseDoc {
    pub(super) fn new(purpose: &str, ttl: Duration) -> Self {
        let now = now_ms();
        LeaseDoc {
            holder: holder(),
            purpose: purpose.to_owned(),
            started_unix_ms: now,
            renewed_unix_ms: now,
            ttl_ms: ttl.as_millis() as u64,
        }
    }
    pub(super) fn expires_ms(&self) -> u64 {
        self.renewed_unix_ms.saturating_add(self.ttl_ms)
    }
    pub(super) fn live(&self, now: u64) -> bool {
        now < self.expires_ms()
    }
    pub(super) fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

pub(super) fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{host}/pid {}", std::process::id())
}

impl Store {
    /// Create-if-absent. Backends without conditional puts (some S3-compatible servers) get a
    /// check-then-put, which is enough here: manifest ids are unique, and two GCs racing for the
    /// lock only repeat each other's work.
    pub(super) async fn put_create(&self, p: &ObjPath, body: Bytes) -> object_store::Result<()> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .os
            .put_opts(p, PutPayload::from_bytes(body.clone()), opts)
            .await
        {
            Ok(_) => Ok(()),
            Err(object_store::Error::NotImplemented { .. }) => {
                match self.os.head(p).await {
                    Ok(_) => {
                        return Err(object_store::Error::AlreadyExists {
                            path: p.to_string(),
                            source: "object exists".into(),
                        })
                    }
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
                self.os
                    .put(p, PutPayload::from_bytes(body))
                    .await
                    .map(|_| ())
            }
            Err(e) => Err(e),
        }
    }

    // ---------------------------------------------------------------- leases

    pub(super) async fn put_lease(&self, p: &ObjPath, doc: &LeaseDoc) -> Result<()> {
        self.os
            .put(p, PutPayload::from_bytes(doc.to_bytes()))
            .await
            .map(|_| ())
            .map_err(|e| self.be(p, e))
    }

    pub(super) async fn drop_lease(&self, p: &ObjPath) {
        match self.os.delete(p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(lease = %p, error = %e, "could not remove lease; it expires on its own")
            }
        }
    }

    /// Puts a reader's lease on checkpoint `w/id` and returns its path; `None` for a store this
    /// reader may not write (a read-only mount, read-only credentials), which is still read,
    /// without the lease: only a concurrent gc could then remove its chunks.
    pub(super) async fn read_lease(
        &self,
        w: &WorkloadName,
        id: &CheckpointId,
        purpose: &str,
    ) -> Result<Option<ObjPath>> {
        let lease = lease_path(w, id, &format!(".read-{:08x}", rand::random::<u32>()));
        match self
            .put_lease(&lease, &LeaseDoc::new(purpose, self.opts.lease_ttl))
            .await
        {
            Ok(()) => Ok(Some(lease)),
            Err(e) if e.is_read_only() => {
                tracing::warn!(error = %e, "the store cannot be written here: reading without a read lease (a gc running elsewhere at the same time could remove this checkpoint's chunks)");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// A lease or lock document; `None` when absent, oversized or unreadable (a dead writer's
    /// leftover, or not stasis's).
    pub(super) async fn read_doc(&self, p: &ObjPath) -> Result<Option<LeaseDoc>> {
        match self.get_bounded(p, MAX_LEASE_OBJECT).await {
            Ok(b) => Ok(b.and_then(|b| serde_json::from_slice(&b).ok())),
            Err(e @ StoreError::ObjectTooLarge { .. }) => {
                tracing::warn!(error = %e, "ignoring an oversized lease");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Waits (bounded by `gc_wait`) while a live GC lock exists. Returns whether existing chunks
    /// may be relied on.
    pub(super) async fn wait_for_gc(&self) -> Result<bool> {
        let deadline = Instant::now() + self.opts.gc_wait;
        let lock = ObjPath::from(GC_LOCK);
        loop {
            match self.read_doc(&lock).await? {
                Some(doc) if doc.live(now_ms()) => {
                    if Instant::now() >= deadline {
                        tracing::warn!(holder = %doc.holder, "garbage collection still running; uploading every chunk instead of relying on existing ones");
                        return Ok(false);
                    }
                    tracing::debug!(holder = %doc.holder, "waiting for garbage collection to finish");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => return Ok(true),
            }
        }
    }
}
