//! Retention and garbage collection.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::ObjectStore;
use stasis_core::WorkloadName;

use super::{
    blocking, manifest_path, now_ms, rfc3339_ms, CheckpointSummary, GcReport, LeaseDoc, Store,
    GC_LOCK,
};
use crate::envelope::{self, MAX_MANIFEST_OBJECT};
use crate::error::{Result, StoreError};
use crate::key::Key;

/// Kept manifests the mark phase reads at once.
const MARK_READS: usize = 32;

impl Store {
    // ---------------------------------------------------------------- gc

    /// Retention and garbage collection: keeps the newest `keep_last` checkpoints of every
    /// workload, deletes the other manifests, then deletes chunks of this key that no kept
    /// manifest references and that are older than `grace`. See the crate docs for how this
    /// stays safe next to running writers.
    pub async fn gc(&self, key: &Key, keep_last: usize, grace: Duration) -> Result<GcReport> {
        let lock = ObjPath::from(GC_LOCK);
        let doc = LeaseDoc::new("gc", self.opts.gc_lock_ttl);
        let created = self.put_create(&lock, doc.to_bytes()).await;
        match created {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                if let Some(other) = self.read_doc(&lock).await? {
                    if other.live(now_ms()) {
                        return Err(StoreError::GcBusy {
                            path: format!("{}/{lock}", self.url.trim_end_matches('/')),
                            expires: rfc3339_ms(other.expires_ms()),
                            holder: other.holder,
                        });
                    }
                }
                tracing::warn!("replacing an expired garbage collection lock");
                self.put_lease(&lock, &doc).await?;
            }
            Err(e) => return Err(self.be(&lock, e)),
        }
        let r = self.gc_locked(key, keep_last, grace).await;
        self.drop_lease(&lock).await;
        r
    }

    pub(super) async fn gc_locked(
        &self,
        key: &Key,
        keep_last: usize,
        grace: Duration,
    ) -> Result<GcReport> {
        let mut report = GcReport::default();
        let now = now_ms();

        // Leases: live ones block the sweep; expired ones (dead writers) are removed.
        let lease_prefix = ObjPath::from("leases");
        let leases: Vec<_> = self
            .os
            .list(Some(&lease_prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&lease_prefix, e))?;
        let mut live = Vec::new();
        for l in leases {
            match self.read_doc(&l.location).await? {
                Some(doc) if doc.live(now) => live.push(l.location.to_string()),
                _ => {
                    self.drop_lease(&l.location).await;
                    report.expired_leases_removed += 1;
                }
            }
        }

        // Retention.
        let mut by_workload: BTreeMap<WorkloadName, Vec<CheckpointSummary>> = BTreeMap::new();
        for s in self.list(None).await? {
            by_workload.entry(s.workload.clone()).or_default().push(s);
        }
        let mut kept = Vec::new();
        let mut expired = Vec::new();
        for (_, mut v) in by_workload {
            v.sort_by(|a, b| b.id.cmp(&a.id));
            for (i, s) in v.into_iter().enumerate() {
                if i < keep_last {
                    kept.push(s);
                } else {
                    expired.push(s);
                }
            }
        }
        // One bulk request per thousand manifests on S3 (DeleteObjects), not one each: with
        // 10,000 pods a retention pass deletes tens of thousands.
        let paths: Vec<_> = expired
            .iter()
            .map(|s| Ok(manifest_path(&s.workload, &s.id)))
            .collect();
        let mut deleted = self.os.delete_stream(futures::stream::iter(paths).boxed());
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.be(&ObjPath::from("manifests"), e)),
            }
        }
        drop(deleted);
        report.manifests_deleted = expired.iter().map(|s| s.reference().to_string()).collect();
        report.manifests_kept = kept.len() as u64;

        if !live.is_empty() {
            report.sweep_skipped = Some(format!(
                "{} checkpoint operation(s) in progress ({}); chunks are swept by a later gc",
                live.len(),
                live.join(", ")
            ));
            return Ok(report);
        }

        // Mark. The kept manifests are read MARK_READS at a time (in order, so the first one
        // that cannot be verified still stops the sweep): one round trip each, in sequence,
        // made a gc of 50,000 kept checkpoints take minutes.
        let mut referenced: HashSet<String> = HashSet::new();
        let store = self;
        let mut reads = futures::stream::iter(kept)
            .map(move |s: CheckpointSummary| async move {
                let p = manifest_path(&s.workload, &s.id);
                let r = store.get_bounded(&p, MAX_MANIFEST_OBJECT).await;
                (s, p, r)
            })
            .buffered(MARK_READS);
        while let Some((s, p, read)) = reads.next().await {
            let bytes = match read {
                Ok(Some(b)) => b,
                Ok(None) => continue,
                Err(e @ StoreError::ObjectTooLarge { .. }) => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be verified ({e}); not sweeping chunks",
                        s.reference()
                    ));
                    return Ok(report);
                }
                Err(e) => return Err(e),
            };
            match envelope::peek_key_id(&bytes) {
                Some(id) if id == key.id() => {}
                // Another key's checkpoint: its chunks live under another key id, untouched here.
                Some(_) => continue,
                // Not even an envelope (truncated, damaged): whose chunks it names is unknown,
                // and they may be this key's. Sweeping now could turn a repairable manifest
                // into a lost checkpoint.
                None => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be read (manifest {} is not a manifest envelope: truncated or damaged); not sweeping chunks until it is repaired or deleted",
                        s.reference(),
                        self.shown(&p)
                    ));
                    return Ok(report);
                }
            }
            match envelope::open(key, p.as_ref(), &s.workload, &s.id, &bytes) {
                Ok(m) => referenced.extend(m.chunk_ids().map(str::to_owned)),
                Err(e) => {
                    report.sweep_skipped = Some(format!(
                        "kept checkpoint {} cannot be verified ({e}); not sweeping chunks",
                        s.reference()
                    ));
                    return Ok(report);
                }
            }
        }

        // Sweep.
        let prefix = ObjPath::from(format!("chunks/{}", key.id()));
        let metas: Vec<_> = self
            .os
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&prefix, e))?;
        let grace_ms = grace.as_millis() as i64;
        let now = now_ms() as i64;
        let mut doomed = Vec::new();
        for meta in metas {
            let Some(name) = meta.location.filename() else {
                continue;
            };
            if referenced.contains(name) {
                report.chunks_kept += 1;
            } else if now - meta.last_modified.timestamp_millis() < grace_ms {
                report.chunks_spared_young += 1;
            } else {
                report.bytes_deleted += meta.size;
                doomed.push(Ok(meta.location));
            }
        }
        let mut deleted = self.os.delete_stream(futures::stream::iter(doomed).boxed());
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) => report.chunks_deleted += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.be(&prefix, e)),
            }
        }
        if let Some(root) = &self.local_root {
            let dir = root.join("chunks").join(key.id());
            report.staging_files_removed = blocking(move || remove_staging(&dir, grace)).await?;
        }
        Ok(report)
    }
}

/// Removes `<name>#<digits>` staging files (left by writers killed mid-write) older than `grace`
/// from the fan-out directories under `dir`.
pub(super) fn remove_staging(dir: &Path, grace: Duration) -> u64 {
    let mut n = 0;
    let Ok(fanout) = std::fs::read_dir(dir) else {
        return 0;
    };
    for sub in fanout.flatten() {
        let Ok(entries) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let staging = name
                .to_str()
                .and_then(|s| s.split_once('#'))
                .is_some_and(|(_, d)| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= grace);
            if staging && old && std::fs::remove_file(e.path()).is_ok() {
                n += 1;
            }
        }
    }
    n
}
