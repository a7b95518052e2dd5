//! Prefetch: a checkpoint's chunks into the node's chunk cache, without restoring anything and
//! without its key (a restore that follows on this node reads them there, and authenticates
//! them there).

use std::sync::Arc;

use futures::StreamExt;
use stasis_core::{CheckpointId, CheckpointRef, ChunkRef, WorkloadName};

use super::{blocking, chunk_rel, Store};
use crate::cache::{ChunkCache, Claim};
use crate::chunk;
use crate::error::{Result, StoreError};

/// What a prefetch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefetchReport {
    /// Distinct chunks the checkpoint names.
    pub chunks: u64,
    /// Of those, already in the cache (or brought in meanwhile by a restore on this node, which
    /// the prefetch waited for instead of fetching them too).
    pub cached_already: u64,
    /// Fetched from the store into the cache.
    pub fetched: u64,
    /// Stored bytes fetched.
    pub fetched_bytes: u64,
}

impl Store {
    /// Brings the chunks of a checkpoint that the node's cache lacks into it (under a reader
    /// lease, as a get). Later checkpoints of the same workload then cost only their new chunks.
    ///
    /// Needs no key: the manifest's key id and chunk list are read without authenticating them
    /// (the envelope is a MAC, not encryption; [`crate::envelope::unverified_chunks`]), and the
    /// chunk objects go into the cache as stored, not authenticated either: every read from
    /// the cache authenticates, so a forged list or a bad object costs fetches, never wrong
    /// data. What a forged manifest can make the node fetch is bounded: the manifest object by
    /// [`crate::envelope::MAX_MANIFEST_OBJECT`], each chunk id must be an id (64 lower-case
    /// hex digits, under a 16-hex key id), each object is read only up to its chunk's length
    /// allows, and a checkpoint whose objects could exceed the cache's bound is refused before
    /// anything is fetched ([`StoreError::ExceedsCache`]). A store without a cache refuses
    /// (nothing to fill).
    pub async fn prefetch(&self, reference: &CheckpointRef) -> Result<PrefetchReport> {
        let cache = self.cache().cloned().ok_or_else(|| {
            StoreError::Internal("prefetch needs a store with a chunk cache".into())
        })?;
        let id = self.resolve(reference).await?;
        let lease = self
            .read_lease(&reference.workload, &id, "prefetch")
            .await?;
        let r = self.prefetch_leased(cache, &reference.workload, &id).await;
        if let Some(lease) = &lease {
            self.drop_lease(lease).await;
        }
        r
    }

    async fn prefetch_leased(
        &self,
        cache: Arc<ChunkCache>,
        w: &WorkloadName,
        id: &CheckpointId,
    ) -> Result<PrefetchReport> {
        let list = self.read_unverified_chunks(w, id).await?;
        let bytes = list.max_object_bytes();
        if bytes > cache.max_bytes() {
            return Err(StoreError::ExceedsCache {
                reference: format!("{w}/{id}"),
                bytes,
                limit: cache.max_bytes(),
            });
        }
        let key_id = list.key_id;
        let mut report = PrefetchReport {
            chunks: list.chunks.len() as u64,
            ..Default::default()
        };
        let todo: Vec<(String, ChunkRef)> = list
            .chunks
            .into_iter()
            .filter(|(_, c)| !cache.contains(&key_id, &c.id))
            .collect();
        report.cached_already = report.chunks - todo.len() as u64;
        let mut fetches = std::pin::pin!(futures::stream::iter(todo)
            .map(|(file, c)| self.prefetch_chunk(cache.clone(), key_id.clone(), file, c))
            .buffer_unordered(self.opts.concurrency.max(1)));
        while let Some(n) = fetches.next().await {
            match n? {
                Some(n) => {
                    report.fetched += 1;
                    report.fetched_bytes += n;
                }
                None => report.cached_already += 1,
            }
        }
        Ok(report)
    }

    /// Fetches one chunk object (of `file`, for messages) into the cache as stored; its size,
    /// or `None` when a restore on this node cached it meanwhile.
    async fn prefetch_chunk(
        &self,
        cache: Arc<ChunkCache>,
        key_id: String,
        file: String,
        c: ChunkRef,
    ) -> Result<Option<u64>> {
        // Held until the chunk is cached: a restore of it meanwhile waits instead of fetching.
        let _fetching = match cache.claim(&key_id, &c.id) {
            Some(Claim::Wait(other)) => {
                Claim::wait(other).await;
                return Ok(None);
            }
            Some(Claim::Fetch(_)) if cache.contains(&key_id, &c.id) => return Ok(None),
            mine => mine,
        };
        let rel = chunk_rel(&key_id, &c.id);
        let limit = chunk::max_object_len(c.len as usize);
        let mut obj =
            self.fetch_object(&rel, limit)
                .await?
                .ok_or_else(|| StoreError::ChunkMissing {
                    chunk: c.id.clone(),
                    file,
                    path: self.shown(&rel.as_str().into()),
                })?;
        let n = obj.len() as u64;
        blocking(move || cache.insert(&key_id, &c.id, &mut obj)).await?;
        Ok(Some(n))
    }
}
