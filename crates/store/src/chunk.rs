//! Chunking (FastCDC) and the chunk object format.
//!
//! ## Chunk boundaries
//!
//! FastCDC 2020 (the `fastcdc` crate's `v2020` cut function and gear table, normalisation
//! level 1) with min 512 KiB / average 1 MiB / max 4 MiB (chunks average about 1.3 MiB). Files
//! up to 512 KiB are one chunk; an empty file has none.
//!
//! Files are first split into 64 MiB segments at fixed offsets, and each segment is chunked on
//! its own (a chunk never spans a segment boundary), so several threads can chunk one large
//! memory image at once. Within a segment the cut points are exactly those of
//! `fastcdc::v2020::StreamCDC`; the streaming driver here reads 16 MiB blocks without
//! `StreamCDC`'s per-chunk buffer shuffling. Data that shifts (an insertion) resynchronises
//! within a chunk or two as usual, plus at most one extra chunk per segment.
//!
//! ## Chunk object
//!
//! ```text
//! offset  size  field
//! 0       1     magic 'S'
//! 1       1     format version (1)
//! 2       1     compression: 0 = none, 1 = zstd
//! 3       12    AES-GCM nonce (random)
//! 15      n     AES-256-GCM ciphertext of the (possibly compressed) chunk
//! 15+n    16    GCM tag
//! ```
//!
//! The associated data is the first three bytes followed by the 32 bytes of the chunk id, so a
//! chunk cannot be moved to another id nor its compression flag flipped. Compression is zstd level
//! 1; a chunk is stored uncompressed when a sample of it does not compress or when the whole does
//! not shrink by at least 1/32.
//!
//! On read: tag check (decrypt), decompress, keyed BLAKE3 of the plaintext compared with the id.

use std::cell::RefCell;
use std::io::Read;

use ring::aead;

use crate::key::Key;

pub const MIN_CHUNK: usize = 512 << 10;
/// Files are chunked in independent segments of this size (see the module docs).
pub const SEGMENT: u64 = 64 << 20;
pub const AVG_CHUNK: usize = 1 << 20;
pub const MAX_CHUNK: usize = stasis_core::manifest::MAX_CHUNK_LEN as usize;

/// Bytes before the ciphertext.
pub(crate) const HEADER_LEN: usize = 15;
pub(crate) const TAG_LEN: usize = 16;
/// The largest chunk object: a raw (uncompressed) chunk of [`MAX_CHUNK`] bytes. A reader
/// refuses a larger object before reading it, and in fact bounds each object by its own
/// chunk's length (`15 + len + 16`).
pub const MAX_CHUNK_OBJECT: u64 = (HEADER_LEN + MAX_CHUNK + TAG_LEN) as u64;

/// The largest object a chunk of `plain_len` bytes is stored as (stored raw).
pub(crate) fn max_object_len(plain_len: usize) -> u64 {
    (HEADER_LEN + plain_len + TAG_LEN) as u64
}

/// Whether an object of `obj_len` bytes can be the chunk of `plain_len` bytes that [`encode`]
/// writes: exactly the raw size, or (compressed) a non-empty ciphertext at least 1/32 smaller
/// than the plaintext. Deduplication checks this before relying on an existing object (a
/// cheap check: same-size garbage passes it and is caught when a restore authenticates it).
pub(crate) fn plausible_object_len(plain_len: usize, obj_len: u64) -> bool {
    let overhead = (HEADER_LEN + TAG_LEN) as u64;
    let plain = plain_len as u64;
    obj_len == overhead + plain
        || (plain_len > 64 && obj_len > overhead && obj_len <= overhead + plain - plain / 32)
}
const MAGIC: u8 = b'S';
const VERSION: u8 = 1;
const FLAG_RAW: u8 = 0;
const FLAG_ZSTD: u8 = 1;

const READ_BLOCK: usize = 16 << 20;

/// Alignment of object buffers (for O_DIRECT file I/O).
pub(crate) const ALIGN: usize = 4096;

pub(crate) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// An object buffer whose bytes start at an [`ALIGN`]-aligned address and that has room to be
/// zero-padded to a multiple of [`ALIGN`], so it can be written or read with O_DIRECT.
pub(crate) struct ChunkBuf {
    vec: Vec<u8>,
    off: usize,
}

/// Capacity of pooled buffers: the largest chunk object, padded, plus alignment slack.
const POOLED_CAP: usize = (HEADER_LEN + MAX_CHUNK + TAG_LEN).div_ceil(ALIGN) * ALIGN + ALIGN;
/// Buffers kept for reuse. Fresh memory is expensive here (first-touch page faults cost more
/// than the encryption), so chunk buffers are recycled; at most this many are kept.
const POOL_MAX: usize = 24;
static POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// Frees the recycled chunk buffers (a long-lived process, such as the node agent, calls this
/// between checkpoints so an idle process does not keep them resident).
pub fn release_buffer_pool() {
    if let Ok(mut pool) = POOL.lock() {
        pool.clear();
        pool.shrink_to_fit();
    }
}

impl Drop for ChunkBuf {
    fn drop(&mut self) {
        if self.vec.capacity() == POOLED_CAP {
            let mut v = std::mem::take(&mut self.vec);
            v.clear();
            if let Ok(mut pool) = POOL.lock() {
                if pool.len() < POOL_MAX {
                    pool.push(v);
                }
            }
        }
    }
}

impl ChunkBuf {
    /// An empty buffer with room for an object of up to `max_obj` bytes (plus padding).
    pub(crate) fn with_room(max_obj: usize) -> Self {
        let need = round_up(max_obj, ALIGN) + ALIGN;
        let mut vec: Vec<u8> = if need <= POOLED_CAP {
            POOL.lock()
                .ok()
                .and_then(|mut p| p.pop())
                .unwrap_or_else(|| Vec::with_capacity(POOLED_CAP))
        } else {
            Vec::with_capacity(need)
        };
        let off = vec.as_ptr().align_offset(ALIGN).min(ALIGN);
        vec.resize(off, 0);
        ChunkBuf { vec, off }
    }

    /// Wraps bytes that need no alignment.
    pub(crate) fn from_vec(vec: Vec<u8>) -> Self {
        ChunkBuf { vec, off: 0 }
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.vec[self.off..]
    }

    pub(crate) fn data_mut(&mut self) -> &mut [u8] {
        &mut self.vec[self.off..]
    }

    pub(crate) fn len(&self) -> usize {
        self.vec.len() - self.off
    }

    pub(crate) fn extend(&mut self, s: &[u8]) {
        self.vec.extend_from_slice(s);
    }

    /// Sets the object length to `n`, zero-filling new bytes.
    pub(crate) fn set_len(&mut self, n: usize) {
        self.vec.resize(self.off + n, 0);
    }

    /// Whether the data starts at an aligned address (always, unless the allocator surprised us).
    pub(crate) fn is_aligned(&self) -> bool {
        (self.data().as_ptr() as usize) % ALIGN == 0
    }

    /// The object bytes zero-padded to a multiple of [`ALIGN`] (the padding is not part of the
    /// object; a writer truncates the file to [`ChunkBuf::len`]).
    pub(crate) fn padded(&mut self) -> &[u8] {
        let len = self.len();
        self.vec.resize(self.off + round_up(len, ALIGN), 0);
        let padded = &self.vec[self.off..];
        debug_assert!(padded.len() >= len);
        padded
    }

    pub(crate) fn truncate(&mut self, n: usize) {
        self.vec.truncate(self.off + n);
    }

    pub(crate) fn into_bytes(mut self) -> bytes::Bytes {
        let len = self.len();
        let off = self.off;
        bytes::Bytes::from(std::mem::take(&mut self.vec)).slice(off..off + len)
    }
}

/// A decoded chunk: borrowed from the object buffer (stored raw) or decompressed.
#[derive(Debug)]
/// A decoded chunk's plaintext: in the object's buffer (raw) or decompressed.
pub enum Plain<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Plain<'_> {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Plain::Borrowed(s) => s,
            Plain::Owned(v) => v,
        }
    }
}

/// Level-1 normalised FastCDC masks for a 1 MiB average (as `StreamCDC::new` computes them).
fn masks() -> (u64, u64, u64, u64) {
    let bits = fastcdc::v2020::logarithm2(AVG_CHUNK as u32);
    let mask_s = fastcdc::v2020::MASKS[(bits + 1) as usize];
    let mask_l = fastcdc::v2020::MASKS[(bits - 1) as usize];
    (mask_s, mask_l, mask_s << 1, mask_l << 1)
}

/// Streams a reader into content-defined chunks. Each chunk comes in its own buffer with
/// [`HEADER_LEN`] bytes of room in front and [`TAG_LEN`] bytes of spare capacity behind, so it can
/// be encrypted in place and sent as one object body.
pub(crate) struct Chunker {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    gear: Gear,
}

/// The FastCDC 2020 gear tables and masks for our sizes.
pub(crate) struct Gear {
    gear: Box<[u64; 256]>,
    gear_ls: Box<[u64; 256]>,
    mask_s: u64,
    mask_l: u64,
    mask_s_ls: u64,
    mask_l_ls: u64,
}

impl Gear {
    pub(crate) fn new() -> Self {
        let (mask_s, mask_l, mask_s_ls, mask_l_ls) = masks();
        let (gear, gear_ls) = fastcdc::v2020::get_gear_with_seed(0);
        Gear {
            gear,
            gear_ls,
            mask_s,
            mask_l,
            mask_s_ls,
            mask_l_ls,
        }
    }

    /// The length of the next chunk of `src`: exactly `fastcdc::v2020::cut`, written so the
    /// compiler drops the bounds checks from the inner loop (about 1.5x faster).
    pub(crate) fn cut(&self, src: &[u8]) -> usize {
        let mut remaining = src.len();
        if remaining <= MIN_CHUNK {
            return remaining;
        }
        let mut center = AVG_CHUNK;
        if remaining > MAX_CHUNK {
            remaining = MAX_CHUNK;
        } else if remaining < center {
            center = remaining;
        }
        let (gear, gear_ls) = (&*self.gear, &*self.gear_ls);
        let mut hash: u64 = 0;
        let start = (MIN_CHUNK / 2) * 2;
        let end1 = (center / 2) * 2;
        if start < end1 {
            let (ms_ls, ms) = (self.mask_s_ls, self.mask_s);
            for (k, pair) in src[start..end1].chunks_exact(2).enumerate() {
                hash = (hash << 2).wrapping_add(gear_ls[pair[0] as usize]);
                if hash & ms_ls == 0 {
                    return start + 2 * k;
                }
                hash = hash.wrapping_add(gear[pair[1] as usize]);
                if hash & ms == 0 {
                    return start + 2 * k + 1;
                }
            }
        }
        let s2 = start.max(end1);
        let end2 = (remaining / 2) * 2;
        if s2 < end2 {
            let (ml_ls, ml) = (self.mask_l_ls, self.mask_l);
            for (k, pair) in src[s2..end2].chunks_exact(2).enumerate() {
                hash = (hash << 2).wrapping_add(gear_ls[pair[0] as usize]);
                if hash & ml_ls == 0 {
                    return s2 + 2 * k;
                }
                hash = hash.wrapping_add(gear[pair[1] as usize]);
                if hash & ml == 0 {
                    return s2 + 2 * k + 1;
                }
            }
        }
        remaining
    }
}

impl Chunker {
    pub(crate) fn new() -> Self {
        Chunker {
            buf: vec![0u8; READ_BLOCK],
            start: 0,
            end: 0,
            gear: Gear::new(),
        }
    }

    /// Calls `emit(offset, buffer)` for each chunk of `src`, in order. `emit` returns `false` to
    /// stop early.
    pub(crate) fn run<R: Read>(
        &mut self,
        mut src: R,
        mut emit: impl FnMut(u64, ChunkBuf) -> bool,
    ) -> std::io::Result<()> {
        self.start = 0;
        self.end = 0;
        let mut eof = false;
        let mut offset = 0u64;
        loop {
            if !eof && self.end - self.start < MAX_CHUNK {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                while self.end < self.buf.len() {
                    match src.read(&mut self.buf[self.end..]) {
                        Ok(0) => {
                            eof = true;
                            break;
                        }
                        Ok(n) => self.end += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            if self.start == self.end {
                return Ok(());
            }
            let cut = self.gear.cut(&self.buf[self.start..self.end]);
            let cut = cut.max(1).min(self.end - self.start);
            let mut out = ChunkBuf::with_room(HEADER_LEN + cut + TAG_LEN);
            out.set_len(HEADER_LEN);
            out.extend(&self.buf[self.start..self.start + cut]);
            self.start += cut;
            let at = offset;
            offset += cut as u64;
            if !emit(at, out) {
                return Ok(());
            }
        }
    }
}

thread_local! {
    static CCTX: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

fn with_cctx<T>(f: impl FnOnce(&mut zstd::bulk::Compressor<'static>) -> T) -> Option<T> {
    CCTX.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = zstd::bulk::Compressor::new(1).ok();
        }
        c.as_mut().map(f)
    })
}

/// Compresses a few 8 KiB samples; false when they do not shrink (random or encrypted data),
/// which spares a full compression attempt of incompressible chunks.
fn looks_compressible(data: &[u8]) -> bool {
    const SAMPLE: usize = 8 << 10;
    if data.len() < 4 * SAMPLE {
        return true;
    }
    let step = (data.len() - SAMPLE) / 3;
    let mut out = vec![0u8; SAMPLE + 512];
    let mut total = 0usize;
    for i in 0..4 {
        let s = &data[i * step..i * step + SAMPLE];
        match with_cctx(|c| c.compress_to_buffer(s, &mut out[..])) {
            Some(Ok(n)) => total += n,
            _ => total += SAMPLE,
        }
    }
    total < 4 * SAMPLE * 31 / 32
}

fn aad(flag: u8, id: &blake3::Hash) -> [u8; 35] {
    let mut a = [0u8; 35];
    a[0] = MAGIC;
    a[1] = VERSION;
    a[2] = flag;
    a[3..].copy_from_slice(id.as_bytes());
    a
}

/// Encodes a chunk buffer from [`Chunker`] (header room + plaintext) into its object bytes.
pub(crate) fn encode(key: &Key, id: &blake3::Hash, mut buf: ChunkBuf, compress: bool) -> ChunkBuf {
    let plain_len = buf.len() - HEADER_LEN;
    let mut flag = FLAG_RAW;
    if compress && plain_len > 64 && looks_compressible(&buf.data()[HEADER_LEN..]) {
        let limit = plain_len - plain_len / 32;
        let mut out = ChunkBuf::with_room(HEADER_LEN + limit + TAG_LEN);
        out.set_len(HEADER_LEN + limit);
        let r = with_cctx(|c| {
            c.compress_to_buffer(&buf.data()[HEADER_LEN..], &mut out.data_mut()[HEADER_LEN..])
        });
        if let Some(Ok(n)) = r {
            out.truncate(HEADER_LEN + n);
            buf = out;
            flag = FLAG_ZSTD;
        }
    }
    let mut nonce = [0u8; 12];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut nonce);
    let tag = key
        .aead()
        .seal_in_place_separate_tag(
            aead::Nonce::assume_unique_for_key(nonce),
            aead::Aad::from(aad(flag, id)),
            &mut buf.data_mut()[HEADER_LEN..],
        )
        .expect("AES-GCM sealing of a chunk under 64 GiB cannot fail");
    let d = buf.data_mut();
    d[0] = MAGIC;
    d[1] = VERSION;
    d[2] = flag;
    d[3..HEADER_LEN].copy_from_slice(&nonce);
    buf.extend(tag.as_ref());
    buf
}

/// Decodes and verifies a chunk object in place. `Err` carries the reason it is corrupt.
pub fn decode<'a>(
    key: &Key,
    id_hex: &str,
    expected_len: usize,
    obj: &'a mut [u8],
) -> Result<Plain<'a>, String> {
    let id = blake3::Hash::from_hex(id_hex).map_err(|_| "chunk id is not hex".to_string())?;
    if expected_len == 0 || expected_len > MAX_CHUNK {
        // Validated manifests never get here; the decompression buffer is sized from it.
        return Err(format!(
            "the manifest gives the chunk {expected_len} bytes, outside 1..={MAX_CHUNK}"
        ));
    }
    if obj.len() as u64 > max_object_len(expected_len) {
        return Err(format!(
            "object is {} bytes, more than the {} bytes a chunk of {expected_len} bytes is stored as",
            obj.len(),
            max_object_len(expected_len)
        ));
    }
    if obj.len() < HEADER_LEN + TAG_LEN {
        return Err(format!(
            "object is {} bytes, shorter than a chunk header",
            obj.len()
        ));
    }
    if obj[0] != MAGIC || obj[1] != VERSION {
        return Err(format!(
            "not a stasis chunk of format version {VERSION} (header {:02x} {:02x})",
            obj[0], obj[1]
        ));
    }
    let flag = obj[2];
    if flag != FLAG_RAW && flag != FLAG_ZSTD {
        return Err(format!("unknown compression flag {flag}"));
    }
    let mut nonce = [0u8; 12];
    nonce.copy_from_slice(&obj[3..HEADER_LEN]);
    let plain: &'a [u8] = key
        .aead()
        .open_in_place(
            aead::Nonce::assume_unique_for_key(nonce),
            aead::Aad::from(aad(flag, &id)),
            &mut obj[HEADER_LEN..],
        )
        .map_err(|_| {
            "authentication failed (tag mismatch: modified, truncated or another key)".to_string()
        })?;
    let plain = if flag == FLAG_RAW {
        Plain::Borrowed(plain)
    } else {
        let mut out: Vec<u8> = Vec::with_capacity(expected_len);
        let r = DCTX.with(|d| {
            let mut d = d.borrow_mut();
            if d.is_none() {
                *d = zstd::bulk::Decompressor::new().ok();
            }
            match d.as_mut() {
                Some(d) => d.decompress_to_buffer(plain, &mut out),
                None => Err(std::io::Error::other("cannot create a zstd context")),
            }
        });
        r.map_err(|e| format!("zstd decompression failed: {e}"))?;
        Plain::Owned(out)
    };
    let p = plain.as_slice();
    if p.len() != expected_len {
        return Err(format!(
            "plaintext is {} bytes, the manifest says {expected_len}",
            p.len()
        ));
    }
    if key.chunk_hash(p) != id {
        return Err("content does not hash to the chunk id".into());
    }
    Ok(plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn buf_of(data: &[u8]) -> ChunkBuf {
        let mut b = ChunkBuf::with_room(HEADER_LEN + data.len() + TAG_LEN);
        b.set_len(HEADER_LEN);
        b.extend(data);
        b
    }

    fn chunks_of(data: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let mut v = vec![];
        Chunker::new()
            .run(data, |o, b| {
                assert!(b.is_aligned());
                v.push((o, b.data()[HEADER_LEN..].to_vec()));
                true
            })
            .unwrap();
        v
    }

    #[test]
    fn fast_cut_equals_fastcdc_cut() {
        let g = Gear::new();
        let (ms, ml, msl, mll) = masks();
        let data = pseudo_random(12 << 20, 11);
        let mut zeros_then_random = vec![0u8; 700_000];
        zeros_then_random.extend_from_slice(&data[..3 << 20]);
        for src in [&data[..], &zeros_then_random[..], &vec![0u8; 5 << 20][..]] {
            for len in [
                0,
                1,
                100,
                MIN_CHUNK,
                MIN_CHUNK + 1,
                600_001,
                AVG_CHUNK + 3,
                3 << 20,
                src.len(),
            ] {
                for off in [0usize, 1, 77_777] {
                    if off + len > src.len() {
                        continue;
                    }
                    let s = &src[off..off + len];
                    let (_, want) =
                        fastcdc::v2020::cut(s, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK, ms, ml, msl, mll);
                    assert_eq!(g.cut(s), want, "len {len} off {off}");
                }
            }
        }
    }

    #[test]
    fn chunker_matches_stream_cdc() {
        let data = pseudo_random(20 << 20, 7);
        let ours = chunks_of(&data);
        let theirs: Vec<(u64, usize)> = fastcdc::v2020::StreamCDC::new(
            &data[..],
            MIN_CHUNK as u32,
            AVG_CHUNK as u32,
            MAX_CHUNK as u32,
        )
        .map(|c| {
            let c = c.unwrap();
            (c.offset, c.length)
        })
        .collect();
        assert_eq!(
            ours.iter().map(|(o, b)| (*o, b.len())).collect::<Vec<_>>(),
            theirs
        );
        let joined: Vec<u8> = ours.into_iter().flat_map(|(_, b)| b).collect();
        assert_eq!(joined, data);
        assert!(chunks_of(&[]).is_empty());
        assert_eq!(chunks_of(&[1, 2, 3]).len(), 1);
    }

    #[test]
    fn encode_decode_round_trip_and_tamper() {
        let key = Key::from_secret(&[9u8; 32]);
        for data in [
            pseudo_random(300_000, 3),
            vec![0u8; 300_000],
            b"tiny".to_vec(),
        ] {
            let id = key.chunk_hash(&data);
            let obj = encode(&key, &id, buf_of(&data), true).data().to_vec();
            assert!(plausible_object_len(data.len(), obj.len() as u64));
            let raw = (HEADER_LEN + data.len() + TAG_LEN) as u64;
            assert!(!plausible_object_len(data.len(), raw + 1));
            assert!(!plausible_object_len(data.len(), raw - 1));
            assert!(!plausible_object_len(
                data.len(),
                (HEADER_LEN + TAG_LEN) as u64
            ));
            let mut grown = obj.clone();
            grown.resize(HEADER_LEN + data.len() + TAG_LEN + 1, 0);
            assert!(decode(&key, &id.to_hex(), data.len(), &mut grown)
                .unwrap_err()
                .contains("more than"));
            assert!(decode(&key, &id.to_hex(), MAX_CHUNK + 1, &mut obj.clone())
                .unwrap_err()
                .contains("outside"));
            let mut o = obj.clone();
            let back = decode(&key, &id.to_hex(), data.len(), &mut o).unwrap();
            assert_eq!(back.as_slice(), &data[..]);

            let mut bad = obj.clone();
            let last = bad.len() - 20;
            bad[last] ^= 1;
            assert!(decode(&key, &id.to_hex(), data.len(), &mut bad)
                .unwrap_err()
                .contains("authentication failed"));
            let other = key.chunk_hash(b"other");
            assert!(decode(&key, &other.to_hex(), data.len(), &mut obj.clone()).is_err());
            let k2 = Key::from_secret(&[8u8; 32]);
            assert!(decode(&k2, &id.to_hex(), data.len(), &mut obj.clone()).is_err());
        }
        // zeros compress; random does not
        let z = vec![0u8; 1 << 20];
        assert!(encode(&key, &key.chunk_hash(&z), buf_of(&z), true).len() < 10_000);
        let r = pseudo_random(1 << 20, 5);
        let mut e = encode(&key, &key.chunk_hash(&r), buf_of(&r), true);
        assert_eq!(e.len(), r.len() + HEADER_LEN + TAG_LEN);
        assert!(e.is_aligned());
        let len = e.len();
        assert_eq!(e.padded().len(), round_up(len, ALIGN));
    }
}
