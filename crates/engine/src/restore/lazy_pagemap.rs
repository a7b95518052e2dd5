//! CRIU's pagemap images, read for a lazy restore: where each page of a task lies in its
//! `pages-<id>.img`, and which pages the restore maps itself (the eager ones) rather than
//! leaving them to userfaultfd.
//!
//! A pagemap image (`criu/pagemap.c`, `images/pagemap.proto`) is CRIU's image framing: the
//! common magic `0x54564319`, the pagemap magic `0x56084025`, then entries of a 32-bit length and
//! a protobuf message: first a `pagemap_head { pages_id = 1 }` naming `pages-<pages_id>.img`,
//! then `pagemap_entry { vaddr = 1, compat_nr_pages = 2, in_parent = 3, flags = 4, nr_pages = 5 }`
//! in address order. Pages of entries with `PE_PRESENT` are stored in the pages image one after
//! the other in that order. A plain `criu dump` (no `--lazy-pages`) marks the pages of private
//! anonymous mappings other than the stack `PE_LAZY | PE_PRESENT`: still in the pages image, and
//! skipped by a `criu restore --lazy-pages`, which leaves them to the lazy-pages daemon.

/// `PE_PARENT`: the pages are in a parent checkpoint (not used by stasis).
pub const PE_PARENT: u32 = 1 << 0;
/// `PE_LAZY`: the pages may be restored on demand.
pub const PE_LAZY: u32 = 1 << 1;
/// `PE_PRESENT`: the pages are in the pages image.
pub const PE_PRESENT: u32 = 1 << 2;

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;

/// One entry of a pagemap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub flags: u32,
    /// Where the entry's first page is in the pages image (for present entries).
    pub offset: u64,
}

/// One task's (or shared memory object's) pagemap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageMap {
    /// The pages image: `pages-<pages_id>.img`.
    pub pages_id: u32,
    pub entries: Vec<Entry>,
}

impl PageMap {
    /// Parses a pagemap image; the error says what is wrong with it.
    pub fn parse(b: &[u8], page_size: u64) -> Result<Self, String> {
        let u32_at = |i: usize| -> Result<u32, String> {
            b.get(i..i + 4)
                .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
                .ok_or_else(|| "truncated".to_owned())
        };
        if u32_at(0)? != IMG_COMMON_MAGIC || u32_at(4)? != PAGEMAP_MAGIC {
            return Err("not a CRIU pagemap image (wrong magic)".into());
        }
        let mut at = 8;
        let mut messages = Vec::new();
        while at < b.len() {
            let len = u32_at(at)? as usize;
            let body = b
                .get(at + 4..at + 4 + len)
                .ok_or_else(|| format!("entry at byte {at} is cut short"))?;
            messages.push(fields(body)?);
            at += 4 + len;
        }
        let mut messages = messages.into_iter();
        let head = messages.next().ok_or("no pagemap_head")?;
        let pages_id = u32::try_from(field(&head, 1).ok_or("pagemap_head without pages_id")?)
            .map_err(|_| "pages_id out of range")?;
        let mut entries = Vec::new();
        let mut offset = 0u64;
        for m in messages {
            let vaddr = field(&m, 1).ok_or("pagemap_entry without vaddr")?;
            let nr_pages = field(&m, 5).or_else(|| field(&m, 2)).unwrap_or(0);
            // Images older than the flags field: in_parent or present.
            let flags = match field(&m, 4) {
                Some(f) => u32::try_from(f).map_err(|_| "flags out of range")?,
                None if field(&m, 3).unwrap_or(0) != 0 => PE_PARENT,
                None => PE_PRESENT,
            };
            let len = nr_pages
                .checked_mul(page_size)
                .ok_or("nr_pages out of range")?;
            entries.push(Entry {
                vaddr,
                nr_pages,
                flags,
                offset,
            });
            if flags & PE_PRESENT != 0 {
                offset = offset.checked_add(len).ok_or("pages image too large")?;
            }
        }
        Ok(PageMap { pages_id, entries })
    }

    /// Bytes of the pages image the entries need.
    pub fn pages_bytes(&self, page_size: u64) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.flags & PE_PRESENT != 0)
            .map(|e| e.nr_pages * page_size)
            .sum()
    }

    /// Where up to `nr_pages` pages from `vaddr` lie in the pages image: `(offset, pages)` for
    /// the run that one present entry holds (fewer pages than asked when the entry ends first:
    /// the daemon asks again for the rest), `None` when `vaddr` is not in a present entry.
    pub fn locate(&self, vaddr: u64, nr_pages: u64, page_size: u64) -> Option<(u64, u64)> {
        let i = self.entries.partition_point(|e| e.vaddr <= vaddr);
        let e = self.entries.get(i.checked_sub(1)?)?;
        let end = e.vaddr + e.nr_pages * page_size;
        if vaddr >= end || e.flags & PE_PRESENT == 0 || vaddr % page_size != 0 {
            return None;
        }
        let skip = (vaddr - e.vaddr) / page_size;
        let n = nr_pages.min(e.nr_pages - skip);
        (n > 0).then_some((e.offset + skip * page_size, n))
    }

    /// Byte ranges of the pages image that `criu restore --lazy-pages` reads itself (present,
    /// not lazy): all of them for a shared memory pagemap, whose pages are never lazy.
    pub fn eager_ranges(&self, page_size: u64, all: bool) -> Vec<(u64, u64)> {
        self.entries
            .iter()
            .filter(|e| e.flags & PE_PRESENT != 0 && (all || e.flags & PE_LAZY == 0))
            .map(|e| (e.offset, e.nr_pages * page_size))
            .collect()
    }
}

/// The varint and fixed 64-bit fields of a protobuf message, by number (length-delimited ones
/// are skipped: a pagemap has none).
fn fields(mut b: &[u8]) -> Result<Vec<(u32, u64)>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let (num, wire) = (u32::try_from(key >> 3).map_err(|_| "bad key")?, key & 7);
        let v = match wire {
            0 => varint(&mut b)?,
            1 => {
                let (v, rest) = b.split_at_checked(8).ok_or("truncated fixed64")?;
                b = rest;
                u64::from_le_bytes(v.try_into().expect("8 bytes"))
            }
            2 => {
                let n = usize::try_from(varint(&mut b)?).map_err(|_| "bad length")?;
                b = b.get(n..).ok_or("truncated field")?;
                continue;
            }
            5 => {
                let (v, rest) = b.split_at_checked(4).ok_or("truncated fixed32")?;
                b = rest;
                u64::from(u32::from_le_bytes(v.try_into().expect("4 bytes")))
            }
            w => return Err(format!("unsupported protobuf wire type {w}")),
        };
        out.push((num, v));
    }
    Ok(out)
}

fn field(m: &[(u32, u64)], num: u32) -> Option<u64> {
    m.iter().rev().find(|(n, _)| *n == num).map(|(_, v)| *v)
}

fn varint(b: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&c, rest) = b.split_first().ok_or("truncated varint")?;
        *b = rest;
        v |= u64::from(c & 0x7f) << shift;
        if c < 0x80 {
            return Ok(v);
        }
    }
    Err("varint too long".into())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A pagemap image as CRIU 4.x writes it: `entries` are (vaddr, nr_pages, flags).
    pub(crate) fn image(pages_id: u32, entries: &[(u64, u64, u32)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        b.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        let mut msg = |fields: &[(u32, u64)]| {
            let mut m = Vec::new();
            for (n, v) in fields {
                put_varint(&mut m, u64::from(n << 3));
                put_varint(&mut m, *v);
            }
            b.extend_from_slice(&(m.len() as u32).to_le_bytes());
            b.extend_from_slice(&m);
        };
        msg(&[(1, u64::from(pages_id))]);
        for (vaddr, n, flags) in entries {
            // compat_nr_pages 0 and nr_pages set, as CRIU 4.x writes them.
            msg(&[(1, *vaddr), (2, 0), (4, u64::from(*flags)), (5, *n)]);
        }
        b
    }

    const PS: u64 = 4096;

    #[test]
    fn parses_offsets_and_flags() {
        let img = image(
            2,
            &[
                (0x1000, 1, PE_PRESENT),
                (0x10000, 256, PE_PRESENT | PE_LAZY),
                (0x200000, 4, PE_PARENT),
                (0x300000, 2, PE_PRESENT | PE_LAZY),
            ],
        );
        let pm = PageMap::parse(&img, PS).unwrap();
        assert_eq!(pm.pages_id, 2);
        let offs: Vec<u64> = pm.entries.iter().map(|e| e.offset).collect();
        // The parent entry holds no pages in this image.
        assert_eq!(offs, vec![0, PS, 257 * PS, 257 * PS]);
        assert_eq!(pm.pages_bytes(PS), 259 * PS);
        assert_eq!(pm.eager_ranges(PS, false), vec![(0, PS)]);
        assert_eq!(pm.eager_ranges(PS, true).len(), 3);
    }

    #[test]
    fn locates_pages_within_one_entry() {
        let img = image(
            1,
            &[
                (0x1000, 1, PE_PRESENT),
                (0x10000, 16, PE_PRESENT | PE_LAZY),
                (0x40000, 4, PE_PARENT),
            ],
        );
        let pm = PageMap::parse(&img, PS).unwrap();
        assert_eq!(pm.locate(0x1000, 1, PS), Some((0, 1)));
        assert_eq!(pm.locate(0x12000, 4, PS), Some((PS + 2 * PS, 4)));
        // Cut at the entry's end: the daemon asks again for the rest.
        assert_eq!(pm.locate(0x1e000, 8, PS), Some((PS + 14 * PS, 2)));
        // A hole, a page past the entry, a parent entry, an unaligned address.
        assert_eq!(pm.locate(0x2000, 1, PS), None);
        assert_eq!(pm.locate(0x20000, 1, PS), None);
        assert_eq!(pm.locate(0x40000, 1, PS), None);
        assert_eq!(pm.locate(0x10001, 1, PS), None);
        assert_eq!(pm.locate(0x0, 1, PS), None);
    }

    #[test]
    fn refuses_what_is_not_a_pagemap() {
        assert!(PageMap::parse(b"", PS).is_err());
        assert!(PageMap::parse(&[0u8; 8], PS).is_err());
        let mut img = image(1, &[(0x1000, 1, PE_PRESENT)]);
        img.truncate(img.len() - 2);
        assert!(PageMap::parse(&img, PS).unwrap_err().contains("cut short"));
    }
}
