//! stasis-store: checkpoint archives in an object store (DESIGN §6).
//!
//! A checkpoint is a directory of files (CRIU images, the rootfs diff, small JSON files). The
//! store cuts every file into content-defined chunks (FastCDC, min 512 KiB / avg 1 MiB / max
//! 4 MiB, in 64 MiB segments), addresses each chunk by keyed BLAKE3 of its plaintext, compresses
//! it (zstd level 1, unless it does not shrink), encrypts it (AES-256-GCM, random nonce, chunk id as associated
//! data), uploads the chunks the store does not have yet, and publishes a MAC-authenticated
//! manifest last, atomically. A manifest that can be read therefore describes a complete
//! checkpoint; a checkpoint whose manifest is missing does not exist. See [`chunk`] for the chunk
//! format, [`key`] for keys and the key file, [`envelope`] for the manifest envelope.
//!
//! ## Layout
//!
//! ```text
//! <root>/chunks/<key_id>/<first 2 hex of id>/<chunk id>     encrypted chunk objects
//! <root>/manifests/<workload>/<checkpoint id>.json           manifest envelopes (published last)
//! <root>/leases/<workload>/<checkpoint id>.json              writer lease (while a put runs)
//! <root>/leases/<workload>/<checkpoint id>.read-<8 hex>.json reader lease (while a get runs)
//! <root>/locks/gc.json                                       garbage collection lock
//! ```
//!
//! Chunk objects live under the key id, so a chunk stored under another key is never taken as
//! present, and chunk ids (keyed hashes) reveal nothing about equal content across keys.
//!
//! ## Deduplication
//!
//! For every chunk a put asks the backend (`HEAD`, or the file's metadata on `file://`) whether
//! its object exists with a size that chunk can be stored as (exactly the raw size, or a
//! compressed ciphertext at least 1/32 smaller), and uploads it unless it does. So consecutive
//! checkpoints of one workload share unchanged chunks, and the second checkpoint of a mostly
//! unchanged image writes only its changed regions; a chunk deleted, truncated or replaced by a
//! writer to the bucket is stored again rather than named by a manifest that cannot be restored.
//!
//! ## Bounds on what is read
//!
//! A reader refuses an object larger than its format allows before it reads its body (from the
//! size the backend announces: the GET's content length, the file's size) and reads the body as
//! a stream that stops at the bound, with [`StoreError::ObjectTooLarge`] naming the object, its
//! size and the bound:
//!
//! | object | bound |
//! |---|---|
//! | chunk | its raw size, `15 + len + 16` for the `len` its manifest gives (at most [`chunk::MAX_CHUNK_OBJECT`]) |
//! | manifest | [`envelope::MAX_MANIFEST_OBJECT`] (32 MiB); a put that would publish a larger one fails |
//! | lease, GC lock | [`MAX_LEASE_OBJECT`] (64 KiB); a larger one counts as no lease |
//!
//! Chunk lengths in a manifest are bounded by [`stasis_core::manifest::MAX_CHUNK_LEN`] and its
//! totals must match its files (`Manifest::validate`), so nothing a reader allocates comes from a
//! number larger than what the bounded manifest lists.
//!
//! ## Garbage collection and the lease protocol
//!
//! GC is mark-and-sweep: keep the newest `keep_last` manifests of every workload, delete the
//! others, then delete chunks that no kept manifest references. It must never delete a chunk a
//! checkpoint in progress relies on (that checkpoint has no manifest yet), so:
//!
//! 1. A **writer** puts its lease `leases/<workload>/<id>.json` (start time, renewal time, TTL)
//!    *before* it looks at any existing chunk, renews it every TTL/3 while it uploads, and deletes
//!    it after the manifest is published (or the put failed).
//! 2. The writer then reads `locks/gc.json`. While a live GC lock exists it waits (polling, up to
//!    `gc_wait`); if the lock is still there after that, it relies on no existing chunk: it skips
//!    the latest-manifest and `HEAD` shortcuts and uploads every chunk itself (fresh objects,
//!    spared by the grace period below).
//! 3. **GC** creates `locks/gc.json` (create-if-absent; a live lock held by another GC makes it
//!    fail with [`StoreError::GcBusy`], an expired one is replaced), *then* lists the leases.
//!    If any live lease exists it still applies retention to manifests but skips the chunk
//!    sweep, and says so in [`GcReport::sweep_skipped`]. Expired leases (writers that died) are
//!    removed.
//! 4. GC also spares unreferenced chunks younger than `grace` (by the backend's last-modified
//!    time): choose `grace` longer than a GC run.
//!
//! Either the writer's lease is listed by GC (GC put its lock before listing, the writer put its
//! lease before reading the lock: with read-after-write consistent backends, as `file://` and S3
//! are, one of them sees the other), so no chunk is swept, or the writer sees the lock and waits
//! for GC to finish before relying on anything. Readers (`get_checkpoint`) hold a lease too, so a
//! restore in progress never loses chunks.
//!
//! ## Pipeline
//!
//! Put: chunker threads (one per CPU, at most 4) take 64 MiB segments of the files in turn,
//! read them with 16 MiB reads and cut chunks; hashing, compression and encryption run on
//! tokio's blocking pool (at most `cpu_workers` at once), and up to `concurrency` chunks are in
//! flight (uploading included), so memory stays bounded (about
//! `(concurrency + 4) × 2 × 4 MiB + chunkers × 16 MiB` at worst) whatever the image size.
//! Get: `concurrency` chunk downloads in flight, each streamed into a recycled aligned buffer,
//! then decrypted, decompressed, verified and written with a positioned write into the
//! pre-sized file, while the other downloads go on (no chunk waits for another).
//!
//! ## Node chunk cache
//!
//! A [`ChunkCache`] attached with [`Store::with_cache`] holds chunk objects as the store has
//! them (encrypted), bounded by size, least recently used first, in a directory shared by every
//! restore on the node. Restores read it first and authenticate what they read like anything
//! fetched (a cached object that fails is removed and fetched again); they cache what they
//! fetch, and puts cache what they write, so a restore on the node that checkpointed (a restart
//! in place) needs no fetch and no plaintext image kept on the node. [`Store::prefetch`] fills
//! it with a checkpoint's missing chunks without restoring (pre-staging: a later heartbeat of
//! the same workload costs only its new chunks).
//!
//! The library never starts a tokio runtime: call it from one (multi-threaded for
//! `spawn_blocking` to overlap with I/O; a current-thread runtime works too).

pub mod cache;
pub mod chunk;
pub mod envelope;
pub mod error;
pub mod key;
mod local;
#[doc(hidden)]
pub mod profile;
pub mod progress;
mod store;
/// The manifest drafts of the integration tests, for the unit tests.
#[cfg(test)]
#[path = "../tests/common/draft.rs"]
mod test_draft;

pub use cache::{CacheStats, ChunkCache};
pub use error::{Result, StoreError};
pub use key::Key;
pub use progress::{NoProgress, Progress};
pub use store::{
    CheckpointSummary, GcReport, PrefetchReport, Store, StoreOptions, MAX_LEASE_OBJECT,
};
