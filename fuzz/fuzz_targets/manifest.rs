//! A manifest object as a reader gets it from the bucket: the envelope (format, key id, MAC)
//! opened with a fixed key, and the manifest JSON behind it parsed and validated. Seeds are real
//! envelopes (their MAC is valid) and bare manifests, so both the envelope checks and the
//! manifest parser and `Manifest::validate` are reached. The same bytes go through the reader
//! without the key (`envelope::unverified_chunks`, pre-staging's), which anyone who can write to
//! the bucket reaches: it must refuse or return ids and lengths the cache can use safely.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stasis_core::Manifest;

fuzz_target!(|data: &[u8]| {
    let key = stasis_fuzz::key();
    let (w, id) = stasis_fuzz::checkpoint();
    if let Ok(m) = stasis_store::envelope::open(&key, "fuzz", &w, &id, data) {
        // What a reader does next: size the work from the validated manifest.
        assert!(m.validate().is_ok());
        let _ = m.chunk_count();
        let _ = m.logical_bytes();
    }
    if let Ok(u) = stasis_store::envelope::unverified_chunks("fuzz", &w, &id, data) {
        assert_eq!(u.key_id.len(), 16);
        assert!(u.chunks.iter().all(|(_, c)| c.id.len() == 64
            && c.id.bytes().all(|b| b.is_ascii_hexdigit())
            && c.len >= 1
            && c.len <= stasis_core::manifest::MAX_CHUNK_LEN));
        let _ = u.max_object_bytes();
    }
    if let Ok(m) = serde_json::from_slice::<Manifest>(data) {
        if m.validate().is_ok() {
            // Validated numbers are bounded and consistent.
            assert_eq!(m.stats.chunks as usize, m.chunk_count());
            assert_eq!(m.stats.logical_bytes, m.logical_bytes());
            assert!(m.files.iter().all(|f| f
                .chunks
                .iter()
                .all(|c| c.len >= 1 && c.len <= stasis_core::manifest::MAX_CHUNK_LEN)));
        }
    }
});
