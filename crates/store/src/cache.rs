//! A node-local cache of chunk objects, shared by every restore on the node.
//!
//! It holds the store's chunk objects exactly as the store has them: compressed and encrypted
//! under the checkpoint's key, so nothing in it is plaintext and a reader without the key learns
//! no more than from the bucket. A restore reads a chunk from the cache first and authenticates
//! it like one from the store (AES-GCM, then the keyed hash against its id); a cached object
//! that fails is removed and the chunk fetched from the store instead. The cache is therefore
//! never trusted, only used: a damaged or stale entry costs a fetch, not a wrong restore.
//!
//! Layout: `<dir>/<key id>/<first 2 hex of id>/<chunk id>`, written like the local store's
//! chunks (`O_DIRECT` where the filesystem allows it, a staging file renamed into place, so a
//! reader never sees half an object). The directory is mode `0700`.
//!
//! Bounded by size, least recently used first: an index of the entries (size, last use) is
//! built from the directory when the cache is opened (last use from each file's modification
//! time, which a hit refreshes), so the order survives a restart; every insertion that takes the
//! total above the bound removes the least recently used entries until it fits. Processes that
//! share the directory each keep their own index: the bound is kept by each of them for what it
//! sees, and an entry another removed is a miss, never an error.
//!
//! Fetches into the cache are claimed (`ChunkCache::claim`): when a restore and a prefetch of
//! the same checkpoint run at once in one process (the agent's stores share one cache), a chunk
//! one of them is fetching is awaited by the other and then read from the cache, not fetched
//! twice.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::chunk::ChunkBuf;
use crate::error::{Result, StoreError};
use crate::local::{DirectIo, Fetched};

/// What the cache has done since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Bytes of the entries in the index.
    pub bytes: u64,
    pub entries: u64,
    /// Chunks a restore read from the cache and that authenticated.
    pub hits: u64,
    /// Chunks looked up and not found, or found and refused.
    pub misses: u64,
    pub inserted: u64,
    /// Entries removed to stay within the bound.
    pub evicted: u64,
    /// Cached objects that failed authentication and were removed.
    pub corrupt: u64,
    /// Chunks not stored because the cache's filesystem was nearly full
    /// ([`KEEP_FREE_BYTES`]).
    pub skipped_full: u64,
}

struct Entry {
    size: u64,
    tick: u64,
}

#[derive(Default)]
struct Index {
    entries: HashMap<String, Entry>,
    /// Last use → entry, oldest first.
    order: BTreeMap<u64, String>,
    tick: u64,
    stats: CacheStats,
}

impl Index {
    fn touch(&mut self, rel: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(rel) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, rel.to_owned());
        }
    }

    fn add(&mut self, rel: &str, size: u64) {
        self.forget(rel);
        self.tick += 1;
        self.entries.insert(
            rel.to_owned(),
            Entry {
                size,
                tick: self.tick,
            },
        );
        self.order.insert(self.tick, rel.to_owned());
        self.stats.bytes += size;
        self.stats.entries += 1;
    }

    fn forget(&mut self, rel: &str) -> bool {
        match self.entries.remove(rel) {
            Some(e) => {
                self.order.remove(&e.tick);
                self.stats.bytes -= e.size;
                self.stats.entries -= 1;
                true
            }
            None => false,
        }
    }

    /// The least recently used entry, removed from the index.
    fn pop_oldest(&mut self) -> Option<String> {
        let (_, rel) = self.order.pop_first()?;
        if let Some(e) = self.entries.remove(&rel) {
            self.stats.bytes -= e.size;
            self.stats.entries -= 1;
        }
        Some(rel)
    }
}

/// A bounded, node-local cache of encrypted chunk objects. See the module docs.
pub struct ChunkCache {
    dir: PathBuf,
    io: DirectIo,
    max_bytes: u64,
    index: Mutex<Index>,
    /// Chunks being fetched into the cache, by entry: what a second fetcher waits on.
    in_flight: Mutex<HashMap<String, watch::Receiver<()>>>,
}

/// Who fetches a chunk the cache lacks ([`ChunkCache::claim`]).
pub(crate) enum Claim {
    /// The caller: it fetches the chunk, caches it, then drops this.
    Fetch(InFlight),
    /// Another fetcher in this process: wait with [`Claim::wait`], then read the cache.
    Wait(watch::Receiver<()>),
}

impl Claim {
    /// Waits until the other fetcher is done (cached the chunk, or failed).
    pub(crate) async fn wait(mut rx: watch::Receiver<()>) {
        // Nothing is ever sent: `changed` fails once the fetcher drops its claim.
        while rx.changed().await.is_ok() {}
    }
}

/// A claimed fetch: its entry leaves the fetches in flight, and those waiting wake, when this
/// is dropped (after the caller cached the chunk, or gave up).
pub(crate) struct InFlight {
    cache: Arc<ChunkCache>,
    entry: String,
    _done: watch::Sender<()>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.cache
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.entry);
    }
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("dir", &self.dir)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

fn is_hex_id(s: &str) -> bool {
    s.len() >= 16 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The entry of a chunk, or `None` for names that are not ids (never a path outside the cache).
fn rel(key_id: &str, id: &str) -> Option<String> {
    (is_hex_id(key_id) && is_hex_id(id)).then(|| format!("{key_id}/{}/{id}", &id[..2]))
}

impl ChunkCache {
    /// Opens (creating it, mode `0700`) the cache in `dir`, bounded to `max_bytes`, and indexes
    /// what is there: staging files of interrupted writes are removed, and entries beyond the
    /// bound (a smaller bound than last time) are evicted oldest first.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<ChunkCache> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).map_err(|e| StoreError::io(dir, e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| StoreError::io(dir, e))?;
        let mut found = Vec::new();
        scan(dir, &mut found);
        found.sort_by_key(|(_, _, modified)| *modified);
        let mut index = Index::default();
        for (rel, size, _) in found {
            index.add(&rel, size);
        }
        let cache = ChunkCache {
            dir: dir.to_owned(),
            io: DirectIo::new(dir.to_owned()),
            max_bytes,
            index: Mutex::new(index),
            in_flight: Mutex::default(),
        };
        cache.evict();
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the index has the chunk (it may still have been removed by another process).
    pub fn contains(&self, key_id: &str, id: &str) -> bool {
        rel(key_id, id).is_some_and(|r| self.lock().entries.contains_key(&r))
    }

    /// Claims the fetch of a chunk: [`Claim::Fetch`] unless another fetch of it is in flight in
    /// this process, then [`Claim::Wait`]; `None` for names that are not ids.
    pub(crate) fn claim(self: &Arc<Self>, key_id: &str, id: &str) -> Option<Claim> {
        let entry = rel(key_id, id)?;
        let mut m = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rx) = m.get(&entry) {
            return Some(Claim::Wait(rx.clone()));
        }
        let (done, rx) = watch::channel(());
        m.insert(entry.clone(), rx);
        Some(Claim::Fetch(InFlight {
            cache: self.clone(),
            entry,
            _done: done,
        }))
    }

    /// The cached object of a chunk, at most `limit` bytes; `None` when absent (or unreadable,
    /// or larger than `limit`: such an entry is removed). Blocking.
    pub(crate) fn get(&self, key_id: &str, id: &str, limit: u64) -> Option<ChunkBuf> {
        let rel = rel(key_id, id)?;
        let found = match self.io.get(&rel, limit) {
            Ok(Fetched::Data(b)) => Some(b),
            Ok(Fetched::Missing) => None,
            Ok(Fetched::TooLarge(size)) => {
                tracing::warn!(entry = %rel, size, limit, "cached chunk object larger than its chunk can be; removing it");
                self.remove(&rel);
                None
            }
            Err(e) => {
                tracing::warn!(entry = %rel, error = %e, "cannot read a cached chunk; fetching it from the store");
                None
            }
        };
        let mut ix = self.lock();
        match &found {
            Some(b) => {
                ix.stats.hits += 1;
                if !ix.entries.contains_key(&rel) {
                    // Put there by another process sharing the directory.
                    ix.add(&rel, b.len() as u64);
                }
                ix.touch(&rel);
                drop(ix);
                // The order survives a restart through the file's modification time.
                let _ = std::fs::File::options()
                    .write(true)
                    .open(self.dir.join(&rel))
                    .and_then(|f| f.set_modified(SystemTime::now()));
            }
            None => {
                ix.stats.misses += 1;
                ix.forget(&rel);
            }
        }
        found
    }

    /// Stores a chunk object (as the store has it: encrypted). A failure to write is logged and
    /// otherwise ignored: the cache only saves fetches. Not stored either when the cache's
    /// filesystem would keep less than [`KEEP_FREE_BYTES`]: the cache shares the node's disk
    /// with the restores it serves, and a restore that made room on a full disk (the cache gave
    /// its chunks back) must not see the cache take that room again with the chunks it fetches.
    /// Blocking.
    pub(crate) fn insert(&self, key_id: &str, id: &str, obj: &mut ChunkBuf) {
        let Some(rel) = rel(key_id, id) else {
            return;
        };
        let size = obj.len() as u64;
        if size > self.max_bytes {
            return;
        }
        if free_bytes(&self.dir).is_some_and(|free| free < size + KEEP_FREE_BYTES) {
            self.lock().stats.skipped_full += 1;
            return;
        }
        // A direct write pads the buffer to the block size; the caller decodes it afterwards.
        let r = self.io.put(&rel, obj);
        obj.truncate(size as usize);
        if let Err(e) = r {
            tracing::warn!(entry = %rel, error = %e, "cannot write to the chunk cache");
            return;
        }
        {
            let mut ix = self.lock();
            ix.add(&rel, size);
            ix.stats.inserted += 1;
        }
        self.evict();
    }

    /// Removes a cached object that [`ChunkCache::get`] returned and that failed
    /// authentication: it counts as a miss, not a hit.
    pub(crate) fn refuse(&self, key_id: &str, id: &str) {
        if let Some(rel) = rel(key_id, id) {
            self.remove(&rel);
            let mut ix = self.lock();
            ix.stats.corrupt += 1;
            ix.stats.hits = ix.stats.hits.saturating_sub(1);
            ix.stats.misses += 1;
        }
    }

    /// Removes a chunk's entry (one just inserted that turned out not to be the chunk).
    pub(crate) fn remove_chunk(&self, key_id: &str, id: &str) {
        if let Some(rel) = rel(key_id, id) {
            self.remove(&rel);
        }
    }

    fn remove(&self, rel: &str) {
        self.lock().forget(rel);
        let _ = std::fs::remove_file(self.dir.join(rel));
    }

    /// Removes least recently used entries until the total fits the bound.
    fn evict(&self) {
        self.evict_down_to(self.max_bytes);
    }

    /// Gives disk space back to a restore that needs it on the same filesystem (a full disk on
    /// the node must not turn a restore into a cold start while the cache holds room): removes
    /// least recently used entries until `bytes` are freed or the cache is empty. Returns the
    /// bytes of the entries removed.
    pub fn yield_space(&self, bytes: u64) -> u64 {
        let held = self.lock().stats.bytes;
        self.evict_down_to(held.saturating_sub(bytes));
        held.saturating_sub(self.lock().stats.bytes)
    }

    /// Removes least recently used entries until the index holds at most `bound` bytes.
    fn evict_down_to(&self, bound: u64) {
        loop {
            let victim = {
                let mut ix = self.lock();
                if ix.stats.bytes <= bound {
                    return;
                }
                let v = ix.pop_oldest();
                if v.is_some() {
                    ix.stats.evicted += 1;
                }
                v
            };
            match victim {
                Some(rel) => {
                    let _ = std::fs::remove_file(self.dir.join(rel));
                }
                None => return,
            }
        }
    }
}

/// What the cache leaves free on its filesystem: more than the room a restore keeps beyond its
/// files (the agent's margin, 16 MiB), so that the cache never takes that margin.
pub const KEEP_FREE_BYTES: u64 = 32 << 20;

/// The bytes an unprivileged writer may still use on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// A staging file this old is a leftover of a writer that died, not a write in progress.
const STAGING_LEFTOVER: Duration = Duration::from_secs(600);

/// Entries under `dir` (`<key>/<fan-out>/<id>`) as (relative path, size, modified); staging
/// files (`<id>#<digits>`) left by dead writers are removed.
fn scan(dir: &Path, out: &mut Vec<(String, u64, SystemTime)>) {
    let Ok(keys) = std::fs::read_dir(dir) else {
        return;
    };
    for k in keys.flatten() {
        let Ok(fans) = std::fs::read_dir(k.path()) else {
            continue;
        };
        for f in fans.flatten() {
            let Ok(objs) = std::fs::read_dir(f.path()) else {
                continue;
            };
            for o in objs.flatten() {
                let name = o.file_name();
                let (Some(kn), Some(fname), Some(oname)) = (
                    k.file_name().to_str().map(str::to_owned),
                    f.file_name().to_str().map(str::to_owned),
                    name.to_str(),
                ) else {
                    continue;
                };
                let Ok(meta) = o.metadata() else {
                    continue;
                };
                if oname.contains('#') {
                    // Another process may be writing it right now: only old ones are leftovers.
                    let old = meta
                        .modified()
                        .ok()
                        .and_then(|m| m.elapsed().ok())
                        .is_some_and(|age| age > STAGING_LEFTOVER);
                    if old {
                        let _ = std::fs::remove_file(o.path());
                    }
                    continue;
                }
                if meta.is_file() {
                    let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    out.push((format!("{kn}/{fname}/{oname}"), meta.len(), modified));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache holding `n` entries of `size` bytes each, the first written the longest ago.
    fn cache_of(n: u64, size: u64) -> (tempfile::TempDir, ChunkCache, Vec<PathBuf>) {
        let tmp = tempfile::tempdir().unwrap();
        let key = "0123456789abcdef";
        let start = SystemTime::now() - Duration::from_secs(3600);
        let mut paths = Vec::new();
        for i in 0..n {
            let id = format!("{i:064x}");
            let path = tmp.path().join(rel(key, &id).unwrap());
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(size).unwrap();
            f.set_modified(start + Duration::from_secs(i)).unwrap();
            paths.push(path);
        }
        let cache = ChunkCache::open(tmp.path(), u64::MAX).unwrap();
        (tmp, cache, paths)
    }

    #[test]
    fn the_cache_yields_its_oldest_entries_to_a_restore_that_needs_the_room() {
        let (_tmp, cache, paths) = cache_of(4, 1000);
        assert_eq!(cache.stats().bytes, 4000);
        // 1500 bytes asked: the two oldest entries go (whole entries), the newer two stay.
        assert_eq!(cache.yield_space(1500), 2000);
        assert!(!paths[0].exists() && !paths[1].exists());
        assert!(paths[2].exists() && paths[3].exists());
        assert_eq!(cache.stats().bytes, 2000);
        assert_eq!(cache.stats().evicted, 2);
        // More than it holds: all of it, and no more than it held.
        assert_eq!(cache.yield_space(1 << 30), 2000);
        assert_eq!(cache.stats().entries, 0);
        assert_eq!(cache.yield_space(1), 0);
    }
}
