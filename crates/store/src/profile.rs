//! Stage costs of the chunk pipeline, one core, for `bench/large.sh` (through the
//! `large_profile` example). Not an API: it exists so that the benchmark measures the store's
//! own code, not a copy of it.

use std::path::Path;
use std::time::Instant;

use crate::chunk::{self, Chunker, HEADER_LEN};
use crate::key::Key;

/// Seconds one core spends per stage over a set of files, and how much it went through.
#[derive(Debug, Default, Clone, Copy)]
pub struct StageTimes {
    pub bytes: u64,
    pub chunks: u64,
    /// Reading the files and cutting chunks (FastCDC), including the copy into chunk buffers.
    pub chunk_s: f64,
    /// Keyed BLAKE3 of each chunk (its address).
    pub hash_s: f64,
    /// zstd probe (and compression where it pays) plus AES-256-GCM sealing.
    pub encode_s: f64,
    /// Authentication, decryption and decompression: what a restore pays per chunk.
    pub decode_s: f64,
}

/// Runs every stage over `files` on the calling thread, chunk by chunk.
pub fn stages(key: &Key, files: &[&Path], compress: bool) -> std::io::Result<StageTimes> {
    let mut t = StageTimes::default();
    let mut chunker = Chunker::new();
    for path in files {
        let f = std::fs::File::open(path)?;
        let start = Instant::now();
        let (mut hash, mut encode, mut decode) = (0.0, 0.0, 0.0);
        let mut failed = None;
        chunker.run(f, |_, buf| {
            let plain = buf.len() - HEADER_LEN;
            let s = Instant::now();
            let id = key.chunk_hash(&buf.data()[HEADER_LEN..]);
            hash += s.elapsed().as_secs_f64();
            let s = Instant::now();
            let mut obj = chunk::encode(key, &id, buf, compress);
            encode += s.elapsed().as_secs_f64();
            let s = Instant::now();
            let hex = id.to_hex();
            if let Err(e) = chunk::decode(key, hex.as_str(), plain, obj.data_mut()) {
                failed = Some(e);
                return false;
            }
            decode += s.elapsed().as_secs_f64();
            t.bytes += plain as u64;
            t.chunks += 1;
            true
        })?;
        if let Some(e) = failed {
            return Err(std::io::Error::other(e));
        }
        t.chunk_s += start.elapsed().as_secs_f64() - hash - encode - decode;
        t.hash_s += hash;
        t.encode_s += encode;
        t.decode_s += decode;
    }
    Ok(t)
}
