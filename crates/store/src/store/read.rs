//! Listing, resolving and reading manifests; bounded object reads.

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use stasis_core::{CheckpointId, CheckpointRef, Manifest, Selector, WorkloadName};

use super::{manifest_path, CheckpointSummary, Store};
use crate::envelope::{self, UnverifiedChunks, MAX_MANIFEST_OBJECT};
use crate::error::{Result, StoreError};
use crate::key::Key;

impl Store {
    // ---------------------------------------------------------------- listing and resolving

    /// Checkpoints in the store (all workloads, or one), sorted by workload then id (oldest
    /// first). Nothing is verified; objects that are not manifests are ignored.
    pub async fn list(&self, workload: Option<&WorkloadName>) -> Result<Vec<CheckpointSummary>> {
        let prefix = match workload {
            Some(w) => ObjPath::from(format!("manifests/{w}")),
            None => ObjPath::from("manifests"),
        };
        let metas: Vec<_> = self
            .os
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|e| self.be(&prefix, e))?;
        let mut out: Vec<CheckpointSummary> = metas
            .into_iter()
            .filter_map(|m| {
                let parts: Vec<_> = m.location.parts().collect();
                if parts.len() != 3 || parts[0].as_ref() != "manifests" {
                    return None;
                }
                let w = WorkloadName::new(parts[1].as_ref()).ok()?;
                let id = CheckpointId::parse(parts[2].as_ref().strip_suffix(".json")?).ok()?;
                Some(CheckpointSummary {
                    workload: w,
                    id,
                    manifest_bytes: m.size,
                    published_unix_ms: m.last_modified.timestamp_millis(),
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.workload, &a.id).cmp(&(&b.workload, &b.id)));
        Ok(out)
    }

    /// The id a reference names: `latest` is the greatest id with a manifest; an exact id must
    /// have a manifest.
    pub async fn resolve(&self, reference: &CheckpointRef) -> Result<CheckpointId> {
        let not_found = || StoreError::NotFound {
            reference: reference.to_string(),
        };
        match &reference.selector {
            Selector::Latest => self
                .list(Some(&reference.workload))
                .await?
                .into_iter()
                .map(|s| s.id)
                .max()
                .ok_or_else(not_found),
            Selector::Id(id) => {
                let p = manifest_path(&reference.workload, id);
                match self.os.head(&p).await {
                    Ok(_) => Ok(id.clone()),
                    Err(object_store::Error::NotFound { .. }) => Err(StoreError::ManifestMissing {
                        reference: reference.to_string(),
                        path: self.shown(&p),
                    }),
                    Err(e) => Err(self.be(&p, e)),
                }
            }
        }
    }

    /// Reads, authenticates and validates a checkpoint's manifest.
    pub async fn read_manifest(&self, key: &Key, reference: &CheckpointRef) -> Result<Manifest> {
        let id = self.resolve(reference).await?;
        self.read_manifest_id(key, &reference.workload, &id).await
    }

    /// The newest checkpoint of `workload` whose manifest is authentic and valid under `key`,
    /// with the newer ones that were skipped and why (wrong key, tampered, unsupported). Backend
    /// errors are returned, not skipped. Chunks are verified later, by [`Store::get_checkpoint`].
    pub async fn read_latest_valid(
        &self,
        key: &Key,
        workload: &WorkloadName,
    ) -> Result<(Manifest, Vec<(CheckpointId, StoreError)>)> {
        let mut skipped = Vec::new();
        let mut all = self.list(Some(workload)).await?;
        all.reverse();
        for s in all {
            match self.read_manifest_id(key, workload, &s.id).await {
                Ok(m) => return Ok((m, skipped)),
                Err(
                    e @ (StoreError::WrongKey { .. }
                    | StoreError::ManifestTampered { .. }
                    | StoreError::ManifestInvalid { .. }
                    | StoreError::ObjectTooLarge { .. }
                    | StoreError::ManifestMissing { .. }),
                ) => {
                    tracing::warn!(checkpoint = %s.reference(), error = %e, "skipping checkpoint");
                    skipped.push((s.id, e));
                }
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::NotFound {
            reference: format!(
                "{workload}/latest (no valid checkpoint under key {})",
                key.id()
            ),
        })
    }

    pub(super) async fn read_manifest_id(
        &self,
        key: &Key,
        w: &WorkloadName,
        id: &CheckpointId,
    ) -> Result<Manifest> {
        let (path, bytes) = self.manifest_object(w, id).await?;
        envelope::open(key, &path, w, id, &bytes)
    }

    /// The key id and chunk list of a checkpoint's manifest, read without the key and not
    /// authenticated ([`envelope::unverified_chunks`]): for a prefetch only.
    pub(super) async fn read_unverified_chunks(
        &self,
        w: &WorkloadName,
        id: &CheckpointId,
    ) -> Result<UnverifiedChunks> {
        let (path, bytes) = self.manifest_object(w, id).await?;
        envelope::unverified_chunks(&path, w, id, &bytes)
    }

    /// A manifest object (its full name, its bytes), bounded by [`MAX_MANIFEST_OBJECT`].
    async fn manifest_object(
        &self,
        w: &WorkloadName,
        id: &CheckpointId,
    ) -> Result<(String, Bytes)> {
        let p = manifest_path(w, id);
        let bytes = self
            .get_bounded(&p, MAX_MANIFEST_OBJECT)
            .await?
            .ok_or_else(|| StoreError::ManifestMissing {
                reference: format!("{w}/{id}"),
                path: self.shown(&p),
            })?;
        Ok((self.shown(&p), bytes))
    }

    /// The object's full name, for messages.
    pub(super) fn shown(&self, p: &ObjPath) -> String {
        format!("{}/{p}", self.url.trim_end_matches('/'))
    }

    /// Reads a whole object of at most `limit` bytes; `Ok(None)` when it does not exist. A
    /// larger object is refused from the size the backend announces (the GET's content length,
    /// a file's size) before its body is read, and the body is read as a stream that stops at
    /// the limit, so an object that is larger than announced costs no more memory either.
    pub(super) async fn get_bounded(&self, p: &ObjPath, limit: u64) -> Result<Option<Bytes>> {
        let r = match self.os.get(p).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.be(p, e)),
        };
        let too_large = |size| StoreError::ObjectTooLarge {
            path: self.shown(p),
            size,
            limit,
        };
        if r.meta.size > limit {
            return Err(too_large(r.meta.size));
        }
        let mut out = bytes::BytesMut::with_capacity(r.meta.size as usize);
        let mut body = r.into_stream();
        while let Some(part) = body.next().await {
            let part = part.map_err(|e| self.be(p, e))?;
            let n = (out.len() + part.len()) as u64;
            if n > limit {
                return Err(too_large(n));
            }
            out.extend_from_slice(&part);
        }
        Ok(Some(out.freeze()))
    }

    /// Deletes a checkpoint's manifest (its chunks go at the next [`Store::gc`]). Returns the
    /// id deleted.
    pub async fn delete_checkpoint(&self, reference: &CheckpointRef) -> Result<CheckpointId> {
        let id = self.resolve(reference).await?;
        let p = manifest_path(&reference.workload, &id);
        self.os.delete(&p).await.map_err(|e| self.be(&p, e))?;
        Ok(id)
    }
}
