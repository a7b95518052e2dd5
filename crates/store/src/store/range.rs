//! Random access to a checkpoint's chunks: one chunk's plaintext at a time, for readers that
//! need parts of a file before the rest (a lazy restore serves the pages a process touches
//! first). Every chunk is authenticated before a byte of it is returned, as in a full get.

use object_store::path::Path as ObjPath;
use stasis_core::{ChunkRef, Manifest};

use super::Store;
use crate::error::Result;
use crate::key::Key;

/// A reader lease on one checkpoint, held while its chunks are read piecemeal (see
/// [`Store::lease_for_reading`]).
#[derive(Debug)]
pub struct ReadLease(Option<ObjPath>);

impl Store {
    /// Takes a reader lease on the checkpoint `m` describes, so that a concurrent [`Store::gc`]
    /// spares its chunks until [`Store::release`]. It is not renewed: a reader that takes
    /// longer than the lease's time to live (10 min by default) may see a chunk collected,
    /// which fails that read (`ChunkMissing`), never returns other data.
    pub async fn lease_for_reading(&self, m: &Manifest) -> Result<ReadLease> {
        Ok(ReadLease(self.read_lease(&m.workload, &m.id, "get").await?))
    }

    /// Drops a lease taken by [`Store::lease_for_reading`].
    pub async fn release(&self, lease: ReadLease) {
        if let Some(p) = &lease.0 {
            self.drop_lease(p).await;
        }
    }

    /// The plaintext of one chunk of `file` (a path of the checkpoint, for messages): from the
    /// node's cache when it holds an authentic copy, else from the store (cached on the way).
    /// Authenticated, decrypted, decompressed and checked against its id; a chunk the store
    /// lacks is [`crate::StoreError::ChunkMissing`], one that fails is
    /// [`crate::StoreError::ChunkCorrupt`], both naming the chunk and the file.
    pub async fn read_chunk(&self, key: &Key, c: &ChunkRef, file: &str) -> Result<Vec<u8>> {
        self.with_chunk(key, c, file, |plain| Ok(plain.to_vec()))
            .await
    }
}
