//! The agent socket's line codec, both ways: a request line as the agent reads it
//! (`codec::read_message` with its size limit, then `server::decode_request`), and a response
//! line as the runtime wrapper's client reads it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stasis_node_api::{codec, server, Request, Response};

fuzz_target!(|data: &[u8]| {
    let mut r = std::io::Cursor::new(data);
    let _ = codec::read_message::<_, serde_json::Value>(&mut r);
    let mut r = std::io::Cursor::new(data);
    if let Ok(req) = codec::read_message::<_, Request>(&mut r) {
        // What parses must encode again within the limit it was read with.
        let mut out = Vec::new();
        codec::write_message(&mut out, &req).expect("a request that was read can be written");
    }
    let _ = server::decode_request(data);
    let mut r = std::io::Cursor::new(data);
    let _ = codec::read_message::<_, Response>(&mut r);
});
