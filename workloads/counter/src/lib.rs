//! The pure parts of `stasis-counter`: its state, how a block's contents follow from the block's
//! index and the tick that last wrote it, verification, and the knobs' arithmetic.
//!
//! The state is one contiguous allocation of `STATE_MB` MiB cut into blocks of `BLOCK_KB` KiB.
//! Block `i` last written at tick `t` holds the output of a SplitMix64 generator seeded by
//! `(i, t)`: incompressible, cheap to regenerate, and any changed byte is detected. The metadata
//! (the tick that last wrote each block) lives in memory too, so a restore that brings back the
//! data but not the metadata (or the reverse) is detected as well.

use std::fmt;

/// Words (u64) per KiB.
const WORDS_PER_KIB: usize = 1024 / 8;

/// Configuration from the environment (see the README in `main.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub state_mb: usize,
    pub block_kb: usize,
    pub interval_ms: u64,
    pub dirty_pct: u32,
    pub sample_blocks: usize,
    pub listen_port: Option<u16>,
    pub stream_port: Option<u16>,
    pub oom_trigger_file: Option<String>,
}

impl Config {
    /// Reads the configuration through `get` (the environment in the binary).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
        fn num<T: std::str::FromStr>(
            get: &impl Fn(&str) -> Option<String>,
            key: &str,
            default: Option<T>,
        ) -> Result<Option<T>, String> {
            match get(key).filter(|v| !v.trim().is_empty()) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("{key}={v:?} is not a valid number")),
            }
        }
        let c = Config {
            state_mb: num(&get, "STATE_MB", Some(64))?.unwrap_or(64),
            block_kb: num(&get, "BLOCK_KB", Some(64))?.unwrap_or(64),
            interval_ms: num(&get, "INTERVAL_MS", Some(100))?.unwrap_or(100),
            dirty_pct: num(&get, "DIRTY_PCT", Some(5))?.unwrap_or(5),
            sample_blocks: num(&get, "SAMPLE_BLOCKS", Some(16))?.unwrap_or(16),
            listen_port: num(&get, "LISTEN_PORT", None)?,
            stream_port: num(&get, "STREAM_PORT", None)?,
            oom_trigger_file: get("OOM_TRIGGER_FILE").filter(|v| !v.is_empty()),
        };
        if c.state_mb == 0 {
            return Err("STATE_MB must be at least 1".into());
        }
        if c.block_kb == 0 || (c.state_mb * 1024) % c.block_kb != 0 {
            return Err(format!(
                "BLOCK_KB={} must be at least 1 and divide STATE_MB*1024={}",
                c.block_kb,
                c.state_mb * 1024
            ));
        }
        if c.dirty_pct > 100 {
            return Err(format!("DIRTY_PCT={} must be 0..=100", c.dirty_pct));
        }
        Ok(c)
    }

    pub fn blocks(&self) -> usize {
        self.state_mb * 1024 / self.block_kb
    }
}

/// SplitMix64 finaliser.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The generator whose output is the content of block `index` written at `tick`.
#[derive(Debug, Clone)]
pub struct BlockRng(u64);

impl BlockRng {
    pub fn new(index: usize, tick: u64) -> BlockRng {
        BlockRng(mix(
            mix(index as u64 ^ 0x5354_4153_4953_0000) ^ tick.wrapping_mul(GOLDEN)
        ))
    }
    #[inline]
    pub fn next_word(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }
}

/// Which block tick `tick` rewrites (spread over the state, not sequential).
pub fn block_for_tick(tick: u64, blocks: usize) -> usize {
    (mix(tick ^ 0x7469_636b) % blocks as u64) as usize
}

/// The blocks a "dirty" request at `count` rewrites: a contiguous range of `pct` percent of the
/// blocks (at least one when `pct > 0`), starting at a position that varies with `count`.
pub fn dirty_range(count: u64, pct: u32, blocks: usize) -> std::ops::Range<usize> {
    let n = (blocks * pct as usize).div_ceil(100).min(blocks);
    if n == 0 {
        return 0..0;
    }
    let start = (mix(count ^ 0x6469_7274) % (blocks - n + 1) as u64) as usize;
    start..start + n
}

/// A mismatch found by verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Corruption {
    /// The block's bytes differ from what its (index, tick) generate.
    Data {
        block: usize,
        tick: u64,
        byte_offset: usize,
    },
    /// The block's recorded tick is later than the current count.
    Metadata { block: usize, tick: u64, count: u64 },
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Corruption::Data {
                block,
                tick,
                byte_offset,
            } => write!(
                f,
                "block {block} (written at tick {tick}) differs at byte {byte_offset} of the block"
            ),
            Corruption::Metadata { block, tick, count } => write!(
                f,
                "block {block} claims to be written at tick {tick}, after the current count {count}"
            ),
        }
    }
}

/// The counter's state: the data, the tick that last wrote each block, and the count.
pub struct State {
    words: Vec<u64>,
    ticks: Vec<u64>,
    block_words: usize,
    pub count: u64,
}

impl State {
    /// Allocates and fills every block as written at tick 0.
    pub fn new(state_mb: usize, block_kb: usize) -> State {
        let block_words = block_kb * WORDS_PER_KIB;
        let blocks = state_mb * 1024 / block_kb;
        let mut s = State {
            words: vec![0u64; blocks * block_words],
            ticks: vec![0u64; blocks],
            block_words,
            count: 0,
        };
        for i in 0..blocks {
            s.write_block(i, 0);
        }
        s
    }

    pub fn blocks(&self) -> usize {
        self.ticks.len()
    }

    pub fn block_bytes(&self) -> usize {
        self.block_words * 8
    }

    /// The tick that last wrote block `i`.
    pub fn block_tick(&self, i: usize) -> u64 {
        self.ticks[i]
    }

    fn block_mut(&mut self, i: usize) -> &mut [u64] {
        let w = self.block_words;
        &mut self.words[i * w..(i + 1) * w]
    }

    /// Rewrites block `i` as written at `tick`.
    pub fn write_block(&mut self, i: usize, tick: u64) {
        let mut rng = BlockRng::new(i, tick);
        for w in self.block_mut(i) {
            *w = rng.next_word();
        }
        self.ticks[i] = tick;
    }

    /// Checks block `i` against its recorded tick.
    pub fn verify_block(&self, i: usize) -> Result<(), Corruption> {
        let tick = self.ticks[i];
        if tick > self.count {
            return Err(Corruption::Metadata {
                block: i,
                tick,
                count: self.count,
            });
        }
        let w = self.block_words;
        let mut rng = BlockRng::new(i, tick);
        for (k, &word) in self.words[i * w..(i + 1) * w].iter().enumerate() {
            let expected = rng.next_word();
            if word != expected {
                let byte = (word ^ expected).to_le_bytes().iter().position(|&b| b != 0);
                return Err(Corruption::Data {
                    block: i,
                    tick,
                    byte_offset: k * 8 + byte.unwrap_or(0),
                });
            }
        }
        Ok(())
    }

    /// Checks every block.
    pub fn verify_all(&self) -> Result<(), Corruption> {
        (0..self.blocks()).try_for_each(|i| self.verify_block(i))
    }

    /// Checks the `n` blocks of the rotating sample for tick `tick`.
    pub fn verify_sample(&self, tick: u64, n: usize) -> Result<(), Corruption> {
        let blocks = self.blocks();
        let n = n.min(blocks);
        let start = ((tick as u128 * n as u128) % blocks as u128) as usize;
        (0..n).try_for_each(|k| self.verify_block((start + k) % blocks))
    }

    /// One tick: advance the count, rewrite one block, check the rotating sample.
    pub fn tick(&mut self, sample: usize) -> Result<(), Corruption> {
        self.count += 1;
        let b = block_for_tick(self.count, self.blocks());
        self.write_block(b, self.count);
        self.verify_sample(self.count, sample)
    }

    /// Rewrites a contiguous `pct` percent of the blocks at the current count.
    pub fn dirty(&mut self, pct: u32) -> std::ops::Range<usize> {
        let r = dirty_range(self.count, pct, self.blocks());
        for i in r.clone() {
            self.write_block(i, self.count);
        }
        r
    }

    /// Test hook: flips one byte of the data.
    pub fn flip_byte(&mut self, byte: usize) {
        let (w, b) = (byte / 8, byte % 8);
        self.words[w] ^= 0xffu64 << (8 * b);
    }

    /// Test hook: overwrite the recorded tick of block `i`.
    pub fn set_block_tick(&mut self, i: usize, tick: u64) {
        self.ticks[i] = tick;
    }
}

/// The line printed each tick and served on `LISTEN_PORT`.
pub fn status_line(count: u64, corrupt: bool) -> String {
    format!(
        "count={count} state={}",
        if corrupt { "CORRUPT" } else { "ok" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| pairs.iter().find(|(pk, _)| pk == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn config_defaults_and_errors() {
        let c = cfg(&[]).unwrap();
        assert_eq!(
            (c.state_mb, c.block_kb, c.interval_ms, c.dirty_pct),
            (64, 64, 100, 5)
        );
        assert_eq!(c.blocks(), 1024);
        assert_eq!(c.listen_port, None);
        let c = cfg(&[
            ("STATE_MB", "2"),
            ("LISTEN_PORT", "8080"),
            ("OOM_TRIGGER_FILE", "/tmp/x"),
        ])
        .unwrap();
        assert_eq!((c.state_mb, c.listen_port), (2, Some(8080)));
        assert_eq!(c.oom_trigger_file.as_deref(), Some("/tmp/x"));
        assert!(cfg(&[("STATE_MB", "0")]).is_err());
        assert!(cfg(&[("STATE_MB", "x")]).is_err());
        assert!(cfg(&[("DIRTY_PCT", "101")]).is_err());
        assert!(cfg(&[("BLOCK_KB", "3")]).is_err());
    }

    #[test]
    fn block_content_follows_index_and_tick() {
        let a: Vec<u64> = {
            let mut r = BlockRng::new(3, 7);
            (0..64).map(|_| r.next_word()).collect()
        };
        let again: Vec<u64> = {
            let mut r = BlockRng::new(3, 7);
            (0..64).map(|_| r.next_word()).collect()
        };
        let other_tick: Vec<u64> = {
            let mut r = BlockRng::new(3, 8);
            (0..64).map(|_| r.next_word()).collect()
        };
        let other_index: Vec<u64> = {
            let mut r = BlockRng::new(4, 7);
            (0..64).map(|_| r.next_word()).collect()
        };
        assert_eq!(a, again);
        assert_ne!(a, other_tick);
        assert_ne!(a, other_index);
        // (index, tick) pairs that sum the same still differ.
        let mut r1 = BlockRng::new(1, 2);
        let mut r2 = BlockRng::new(2, 1);
        assert_ne!(r1.next_word(), r2.next_word());
    }

    #[test]
    fn block_content_looks_incompressible() {
        // Every byte value appears about equally often in 1 MiB of output.
        let mut hist = [0u32; 256];
        let mut r = BlockRng::new(0, 0);
        for _ in 0..(1 << 17) {
            for b in r.next_word().to_le_bytes() {
                hist[b as usize] += 1;
            }
        }
        let expect = (1u32 << 20) / 256;
        assert!(hist
            .iter()
            .all(|&h| h > expect * 9 / 10 && h < expect * 11 / 10));
    }

    #[test]
    fn fresh_state_verifies_and_ticks_stay_ok() {
        let mut s = State::new(1, 4);
        assert_eq!(s.blocks(), 256);
        assert_eq!(s.block_bytes(), 4096);
        s.verify_all().unwrap();
        for _ in 0..1000 {
            s.tick(16).unwrap();
        }
        assert_eq!(s.count, 1000);
        s.verify_all().unwrap();
        assert!((0..s.blocks()).any(|i| s.block_tick(i) > 0));
    }

    #[test]
    fn verification_detects_a_flipped_byte() {
        let mut s = State::new(1, 4);
        for _ in 0..10 {
            s.tick(4).unwrap();
        }
        let byte = 37 * 4096 + 1234;
        s.flip_byte(byte);
        assert_eq!(
            s.verify_all(),
            Err(Corruption::Data {
                block: 37,
                tick: s.block_tick(37),
                byte_offset: 1234
            })
        );
        // A full rotation of the sample reaches the bad block too.
        let found = (s.count + 1..s.count + 1 + 256).any(|t| s.verify_sample(t, 4).is_err());
        assert!(found);
    }

    #[test]
    fn verification_detects_wrong_metadata() {
        let mut s = State::new(1, 4);
        s.tick(1).unwrap();
        let b = block_for_tick(1, s.blocks());
        assert_eq!(s.block_tick(b), 1);
        // Data as at tick 1 but metadata saying tick 0: mismatch.
        s.set_block_tick(b, 0);
        assert!(matches!(s.verify_block(b), Err(Corruption::Data { .. })));
        // A tick from the future is refused before reading the data.
        s.set_block_tick(b, 5);
        assert_eq!(
            s.verify_block(b),
            Err(Corruption::Metadata {
                block: b,
                tick: 5,
                count: 1
            })
        );
    }

    #[test]
    fn dirty_range_is_contiguous_sized_and_in_bounds() {
        for blocks in [1usize, 7, 100, 1024, 32768] {
            for pct in [0u32, 1, 5, 50, 100] {
                for count in [0u64, 1, 99, 123_456] {
                    let r = dirty_range(count, pct, blocks);
                    let want = (blocks * pct as usize).div_ceil(100);
                    assert_eq!(r.len(), want, "blocks={blocks} pct={pct}");
                    assert!(r.end <= blocks);
                }
            }
        }
        assert_eq!(dirty_range(5, 100, 10), 0..10);
        // The start moves with the count.
        let starts: std::collections::HashSet<usize> =
            (0..50).map(|c| dirty_range(c, 5, 1024).start).collect();
        assert!(starts.len() > 10);
    }

    #[test]
    fn dirty_rewrites_exactly_the_range() {
        let mut s = State::new(1, 4);
        for _ in 0..3 {
            s.tick(0).unwrap();
        }
        let before: Vec<u64> = (0..s.blocks()).map(|i| s.block_tick(i)).collect();
        let r = s.dirty(10);
        assert_eq!(r.len(), 26);
        for (i, &was) in before.iter().enumerate() {
            let want = if r.contains(&i) { 3 } else { was };
            assert_eq!(s.block_tick(i), want);
        }
        s.verify_all().unwrap();
    }

    #[test]
    fn status_line_format() {
        assert_eq!(status_line(42, false), "count=42 state=ok");
        assert_eq!(status_line(7, true), "count=7 state=CORRUPT");
    }
}
