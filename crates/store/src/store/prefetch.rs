//! Prefetch: a checkpoint's chunks into the node's chunk cache, without restoring anything (a
//! restore that follows on this node reads them there).

use std::collections::HashSet;

use futures::StreamExt;
use stasis_core::CheckpointRef;

use super::{blocking, chunk_rel, Store};
use crate::chunk;
use crate::error::{Result, StoreError};
use crate::key::Key;

/// What a prefetch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefetchReport {
    /// Distinct chunks the checkpoint names.
    pub chunks: u64,
    /// Of those, already in the cache.
    pub cached_already: u64,
    /// Fetched from the store into the cache.
    pub fetched: u64,
    /// Stored bytes fetched.
    pub fetched_bytes: u64,
}

impl Store {
    /// Brings the chunks of a checkpoint that the node's cache lacks into it (under a reader
    /// lease, as a get). Later checkpoints of the same workload then cost only their new chunks.
    /// Objects go into the cache as fetched, bounded by their manifest lengths but not
    /// authenticated: every read from the cache authenticates, and a bad entry costs a fetch.
    /// A store without a cache refuses (nothing to fill).
    pub async fn prefetch(&self, key: &Key, reference: &CheckpointRef) -> Result<PrefetchReport> {
        let cache = self.cache().cloned().ok_or_else(|| {
            StoreError::Internal("prefetch needs a store with a chunk cache".into())
        })?;
        let id = self.resolve(reference).await?;
        let lease = self
            .read_lease(&reference.workload, &id, "prefetch")
            .await?;
        let r = async {
            let m = self.read_manifest_id(key, &reference.workload, &id).await?;
            let mut seen = HashSet::new();
            let mut report = PrefetchReport::default();
            let mut todo = Vec::new();
            for (file, c) in m
                .files
                .iter()
                .flat_map(|f| f.chunks.iter().map(move |c| (f.path.as_str(), c)))
            {
                if !seen.insert(c.id.as_str()) {
                    continue;
                }
                report.chunks += 1;
                if cache.contains(key.id(), &c.id) {
                    report.cached_already += 1;
                } else {
                    todo.push((file, c));
                }
            }
            let mut fetches = std::pin::pin!(futures::stream::iter(todo)
                .map(|(file, c)| {
                    let cache = cache.clone();
                    async move {
                        let rel = chunk_rel(key.id(), &c.id);
                        let limit = chunk::max_object_len(c.len as usize);
                        let mut obj = self.fetch_object(&rel, limit).await?.ok_or_else(|| {
                            StoreError::ChunkMissing {
                                chunk: c.id.clone(),
                                file: file.to_owned(),
                                path: self.shown(&rel.as_str().into()),
                            }
                        })?;
                        let (kid, id) = (key.id().to_owned(), c.id.clone());
                        let n = obj.len() as u64;
                        blocking(move || cache.insert(&kid, &id, &mut obj)).await?;
                        Ok::<_, StoreError>(n)
                    }
                })
                .buffer_unordered(self.opts.concurrency.max(1)));
            while let Some(n) = fetches.next().await {
                report.fetched += 1;
                report.fetched_bytes += n?;
            }
            Ok(report)
        }
        .await;
        if let Some(lease) = &lease {
            self.drop_lease(lease).await;
        }
        r
    }
}
