//! A chunk object as a reader gets it from the bucket, decoded with a fixed key: input = 32
//! bytes of chunk id, 4 bytes (little endian) of the length the manifest gives, then the
//! object. Seeds are real chunk objects (raw and zstd).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 36 {
        return;
    }
    let id: String = data[..32].iter().map(|b| format!("{b:02x}")).collect();
    let len = u32::from_le_bytes([data[32], data[33], data[34], data[35]]) as usize;
    let mut obj = data[36..].to_vec();
    let key = stasis_fuzz::key();
    if let Ok(plain) = stasis_store::chunk::decode(&key, &id, len, &mut obj) {
        assert_eq!(plain.as_slice().len(), len);
    }
});
