//! Framing: one JSON object per line (`\n`-terminated, no newline inside: serde_json never emits
//! one), at most [`MAX_MESSAGE`] bytes. One request per connection; the agent answers with one
//! line (except to `report`) and the connection closes.

use std::io::{self, BufRead, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The largest message either side accepts, newline included.
pub const MAX_MESSAGE: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("connection closed before a complete message")]
    Closed,
    #[error("message longer than {MAX_MESSAGE} bytes")]
    TooLarge,
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
}

impl CodecError {
    /// Whether the error is a read or write timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, CodecError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

/// Writes `msg` as one line and flushes.
pub fn write_message<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), CodecError> {
    let mut buf = serde_json::to_vec(msg)?;
    buf.push(b'\n');
    if buf.len() > MAX_MESSAGE {
        return Err(CodecError::TooLarge);
    }
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one line and parses it.
pub fn read_message<R: BufRead, T: DeserializeOwned>(r: &mut R) -> Result<T, CodecError> {
    let mut buf = Vec::with_capacity(512);
    let mut limited = io::Read::take(&mut *r, MAX_MESSAGE as u64 + 1);
    let n = limited.read_until(b'\n', &mut buf)?;
    if n == 0 || buf.last() != Some(&b'\n') {
        return Err(if n > MAX_MESSAGE {
            CodecError::TooLarge
        } else {
            CodecError::Closed
        });
    }
    Ok(serde_json::from_slice(&buf)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::*;

    #[test]
    fn lines_round_trip() {
        let mut out = Vec::new();
        write_message(&mut out, &Request::new(RequestBody::Ping)).unwrap();
        write_message(
            &mut out,
            &Response::new(ResponseBody::Pong { agent: "x".into() }),
        )
        .unwrap();
        assert_eq!(out.iter().filter(|b| **b == b'\n').count(), 2);
        let mut r = io::BufReader::new(&out[..]);
        let q: Request = read_message(&mut r).unwrap();
        assert_eq!(q.body, RequestBody::Ping);
        let a: Response = read_message(&mut r).unwrap();
        assert_eq!(a.body, ResponseBody::Pong { agent: "x".into() });
        assert!(matches!(
            read_message::<_, Request>(&mut r),
            Err(CodecError::Closed)
        ));
    }

    #[test]
    fn truncated_oversized_and_garbage_are_refused() {
        let mut r = io::BufReader::new(&b"{\"v\":1,\"op\":\"ping\"}"[..]);
        assert!(matches!(
            read_message::<_, Request>(&mut r),
            Err(CodecError::Closed)
        ));
        let big = vec![b' '; MAX_MESSAGE + 10];
        let mut r = io::BufReader::new(&big[..]);
        assert!(matches!(
            read_message::<_, Request>(&mut r),
            Err(CodecError::TooLarge)
        ));
        let mut r = io::BufReader::new(&b"not json\n"[..]);
        assert!(matches!(
            read_message::<_, Request>(&mut r),
            Err(CodecError::Malformed(_))
        ));
    }
}
