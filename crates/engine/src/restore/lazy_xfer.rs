//! CRIU's page-xfer protocol, the part a page server for `criu lazy-pages` speaks (CRIU's
//! `criu/page-xfer.c`): the daemon sends `PS_IOV_GET(nr_pages, vaddr, pid)` for pages a process
//! faulted on or that its background transfer wants next, and reads the answers in the order it
//! asked (it keeps one queue of reads, first in first out); each answer is a `PS_IOV_ADD_F`
//! header with `PE_PRESENT` (it may carry fewer pages than asked, never more) followed by the
//! pages. At the end it sends `PS_IOV_CLOSE` (or `PS_IOV_FORCE_CLOSE` on a socket it was given
//! with `--ps-socket`) and waits for a 32-bit status.
//!
//! Every message is CRIU's `struct page_server_iov { u32 cmd; u64 nr_pages; u64 vaddr; u64
//! dst_id; }` in the machine's byte order and C layout (4 bytes of padding after `cmd`: 32 bytes).
//! `cmd` holds the operation in its low 16 bits and flags above; for `PS_IOV_GET` the `dst_id`
//! is the task's id in the images (`pagemap-<id>.img`), not encoded with a type.

/// `PS_IOV_ADD_F`: pages follow, with pagemap flags in the command's high bits.
pub const PS_IOV_ADD_F: u32 = 6;
/// `PS_IOV_GET`: the lazy-pages daemon asks for pages.
pub const PS_IOV_GET: u32 = 7;
/// `PS_IOV_CLOSE`: the daemon is done; answer with a status.
pub const PS_IOV_CLOSE: u32 = 0x1023;
/// `PS_IOV_FORCE_CLOSE`: as `PS_IOV_CLOSE`, on a socket that the daemon was handed.
pub const PS_IOV_FORCE_CLOSE: u32 = 0x1024;
/// `PE_PRESENT`: the pages are in the answer.
pub const PE_PRESENT: u32 = 1 << 2;

const PS_CMD_BITS: u32 = 16;
const PS_CMD_MASK: u32 = (1 << PS_CMD_BITS) - 1;

/// The size of one message header on the wire.
pub const IOV_LEN: usize = 32;

/// One `struct page_server_iov`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Iov {
    pub cmd: u32,
    pub nr_pages: u64,
    pub vaddr: u64,
    pub dst_id: u64,
}

impl Iov {
    pub fn decode(b: &[u8; IOV_LEN]) -> Self {
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Iov {
            cmd: u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes")),
            nr_pages: u64_at(8),
            vaddr: u64_at(16),
            dst_id: u64_at(24),
        }
    }

    pub fn encode(&self) -> [u8; IOV_LEN] {
        let mut b = [0u8; IOV_LEN];
        b[0..4].copy_from_slice(&self.cmd.to_ne_bytes());
        b[8..16].copy_from_slice(&self.nr_pages.to_ne_bytes());
        b[16..24].copy_from_slice(&self.vaddr.to_ne_bytes());
        b[24..32].copy_from_slice(&self.dst_id.to_ne_bytes());
        b
    }

    /// The operation, without its flags.
    pub fn op(&self) -> u32 {
        self.cmd & PS_CMD_MASK
    }

    /// The answer header to a `PS_IOV_GET` for `nr_pages` pages at `vaddr` of task `pid`.
    pub fn pages(pid: u64, vaddr: u64, nr_pages: u64) -> Self {
        Iov {
            cmd: (PE_PRESENT << PS_CMD_BITS) | PS_IOV_ADD_F,
            nr_pages,
            vaddr,
            dst_id: pid,
        }
    }
}

/// What the lazy-pages daemon asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Pages `[vaddr, vaddr + nr_pages * page size)` of task `pid` (its id in the images).
    Get { pid: u64, vaddr: u64, nr_pages: u64 },
    /// The end of the session; answered with a status.
    Close,
    /// Anything else (a dump's commands): not served here.
    Other(u32),
}

impl From<Iov> for Request {
    fn from(i: Iov) -> Self {
        match i.op() {
            PS_IOV_GET => Request::Get {
                pid: i.dst_id,
                vaddr: i.vaddr,
                nr_pages: i.nr_pages,
            },
            _ if i.cmd == PS_IOV_CLOSE || i.cmd == PS_IOV_FORCE_CLOSE => Request::Close,
            _ => Request::Other(i.cmd),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_request_decodes_from_criu_layout() {
        // As CRIU's request_remote_pages() sends it (x86_64, little endian): cmd, 4 bytes of
        // padding, nr_pages, vaddr, dst_id = the task's id.
        let mut wire = Vec::new();
        wire.extend_from_slice(&7u32.to_le_bytes());
        wire.extend_from_slice(&[0xAA; 4]);
        wire.extend_from_slice(&16u64.to_le_bytes());
        wire.extend_from_slice(&0x7f00_dead_0000u64.to_le_bytes());
        wire.extend_from_slice(&1u64.to_le_bytes());
        let iov = Iov::decode(wire.as_slice().try_into().unwrap());
        assert_eq!(
            Request::from(iov),
            Request::Get {
                pid: 1,
                vaddr: 0x7f00_dead_0000,
                nr_pages: 16
            }
        );
    }

    #[test]
    fn the_answer_header_is_add_f_with_present() {
        let b = Iov::pages(42, 0x1000, 3).encode();
        // encode_ps_cmd(PS_IOV_ADD_F, PE_PRESENT) = 4 << 16 | 6
        assert_eq!(u32::from_le_bytes(b[0..4].try_into().unwrap()), 0x0004_0006);
        assert_eq!(&b[4..8], &[0; 4]);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 0x1000);
        assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()), 42);
        assert_eq!(Iov::decode(&b), Iov::pages(42, 0x1000, 3));
    }

    #[test]
    fn close_and_unknown_commands() {
        let iov = |cmd| Iov {
            cmd,
            nr_pages: 0,
            vaddr: 0,
            dst_id: 0,
        };
        assert_eq!(Request::from(iov(0x1023)), Request::Close);
        assert_eq!(Request::from(iov(0x1024)), Request::Close);
        // PS_IOV_OPEN2 and PS_IOV_ADD_F belong to a dump, not to a lazy restore.
        assert_eq!(Request::from(iov(4)), Request::Other(4));
        assert_eq!(
            Request::from(iov((PE_PRESENT << 16) | 6)),
            Request::Other(0x0004_0006)
        );
    }
}
