//! Reads the archives GNU tar writes for a container's filesystem changes (POSIX pax format,
//! with GNU long names accepted), one member at a time.
//!
//! A reader of its own, not the `tar` crate's, because of how PAX records are framed. A record
//! is `<length> <key>=<value>\n`, and its length, not a newline, says where it ends: values are
//! binary. GNU tar stores extended attributes that way (`SCHILY.xattr.trusted.overlay.origin` is
//! a file handle; `security.capability` a bit mask; `user.*` whatever the tenant wrote), and any
//! of them may hold a `\n`. The `tar` crate splits the records at newlines, so such an archive
//! became unreadable at random (an overlay's origin handle differs from run to run), and a
//! tenant's attribute value could forge records (a `size` that moves where the next header is
//! read from). Here a record is taken by its length, whole or not at all.
//!
//! Only what a restore needs is read: the header fields, local PAX records (`x`), GNU long
//! names (`L`, `K`). A PAX global header (`g`) is refused: GNU tar as stasis runs it never
//! writes one, and its meaning would reach every later member.

use std::io::{self, Read, Seek, SeekFrom};

const BLOCK: u64 = 512;
/// The most an extension member (PAX records, a GNU long name) may hold. Each extended
/// attribute value is at most 64 KiB (XATTR_SIZE_MAX), and a name at most PATH_MAX.
const MAX_EXTENSION: u64 = 8 << 20;

/// One member of the archive, with the PAX records and long names that precede it applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    /// The name (PAX `path`, a GNU long name, or the header's prefix and name).
    pub path: Vec<u8>,
    /// The link target of a symlink or hard link (PAX `linkpath`, a GNU long link name, or the
    /// header's).
    pub link: Vec<u8>,
    /// The type flag (`b'0'` a file, `b'5'` a directory, ...).
    pub typeflag: u8,
    pub mode: u64,
    pub uid: u64,
    pub gid: u64,
    /// Whole seconds, from the header (a PAX `mtime` with its fraction is in `pax`).
    pub mtime: u64,
    /// The length of the member's data in the archive (PAX `size` where given).
    pub size: u64,
    pub dev_major: u64,
    pub dev_minor: u64,
    /// The member's PAX records, in order (a later record of the same key overrides).
    pub pax: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Header {
    /// Bytes of data that follow the header in an archive: none for links, directories and
    /// devices, whatever their size field says (as GNU tar reads them).
    pub(crate) fn data_len(&self) -> u64 {
        match self.typeflag {
            b'1' | b'2' | b'3' | b'4' | b'5' | b'6' => 0,
            _ => self.size,
        }
    }

    /// A character device 0/0: how an overlay upper directory records a deletion.
    pub(crate) fn is_overlay_whiteout(&self) -> bool {
        self.typeflag == b'3' && self.dev_major == 0 && self.dev_minor == 0
    }
}

#[cfg(test)]
impl Header {
    /// The last value a PAX record gave `key`.
    pub(crate) fn pax_value(&self, key: &[u8]) -> Option<&[u8]> {
        self.pax
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Splits PAX extended header data into its records, each taken by the length it states.
pub(crate) fn pax_records(mut data: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let digits = data
            .iter()
            .position(|b| *b == b' ')
            .filter(|n| (1..=20).contains(n))
            .ok_or_else(|| invalid("a PAX record without its length"))?;
        let len: usize = std::str::from_utf8(&data[..digits])
            .ok()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid("a PAX record with an unreadable length"))?;
        if len <= digits + 2 || len > data.len() {
            return Err(invalid(format!(
                "a PAX record whose length ({len}) does not fit the {} bytes left",
                data.len()
            )));
        }
        let record = &data[digits + 1..len];
        let Some(kv) = record.strip_suffix(b"\n") else {
            return Err(invalid(
                "a PAX record that does not end where its length says",
            ));
        };
        let eq = kv
            .iter()
            .position(|b| *b == b'=')
            .ok_or_else(|| invalid("a PAX record without `=`"))?;
        out.push((kv[..eq].to_vec(), kv[eq + 1..].to_vec()));
        data = &data[len..];
    }
    Ok(out)
}

/// A numeric header field: octal (space or NUL padded), or GNU's base-256 for large values.
fn number(field: &[u8], what: &str) -> io::Result<u64> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        if field[0] != 0x80 {
            return Err(invalid(format!("a negative or oversized {what}")));
        }
        let mut v: u64 = 0;
        for b in &field[1..] {
            v = v
                .checked_mul(256)
                .and_then(|v| v.checked_add(u64::from(*b)))
                .ok_or_else(|| invalid(format!("an oversized {what}")))?;
        }
        return Ok(v);
    }
    let text: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(|b| *b != 0 && *b != b' ')
        .collect();
    if text.is_empty() {
        return Ok(0);
    }
    std::str::from_utf8(&text)
        .ok()
        .and_then(|s| u64::from_str_radix(s, 8).ok())
        .ok_or_else(|| {
            invalid(format!(
                "an unreadable {what} ({})",
                String::from_utf8_lossy(&text)
            ))
        })
}

/// A NUL-terminated text field.
fn text(field: &[u8]) -> &[u8] {
    field.split(|b| *b == 0).next().unwrap_or_default()
}

fn decimal(v: &[u8], what: &str) -> io::Result<u64> {
    std::str::from_utf8(v)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid(format!("an unreadable PAX {what}")))
}

/// Reads an archive member by member: [`Reader::next`] gives a member's header, then
/// [`Reader::data`] its data (whatever is left unread is skipped by the next call).
pub(crate) struct Reader<R> {
    inner: R,
    /// Data of the current member not yet read.
    left: u64,
    /// Padding after it, up to the next block.
    pad: u64,
    done: bool,
}

impl<R: Read + Seek> Reader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            left: 0,
            pad: 0,
            done: false,
        }
    }

    fn skip(&mut self, n: u64) -> io::Result<()> {
        // Small gaps are read through (a seek drops a buffered reader's buffer); large ones
        // seeked over, so checking a many-GiB archive reads only its headers.
        if n <= 64 << 10 {
            let got = io::copy(&mut (&mut self.inner).take(n), &mut io::sink())?;
            if got != n {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the archive ends inside a member",
                ));
            }
        } else {
            self.inner.seek(SeekFrom::Current(n as i64))?;
        }
        Ok(())
    }

    /// Reads a whole extension member's data (bounded).
    fn extension(&mut self, size: u64, what: &str) -> io::Result<Vec<u8>> {
        if size > MAX_EXTENSION {
            return Err(invalid(format!(
                "a {what} of {size} bytes (at most {MAX_EXTENSION} are read)"
            )));
        }
        let mut buf = vec![0u8; size as usize];
        self.inner.read_exact(&mut buf)?;
        self.skip((BLOCK - size % BLOCK) % BLOCK)?;
        Ok(buf)
    }

    /// The next member's header; `None` at the end of the archive.
    pub(crate) fn next(&mut self) -> io::Result<Option<Header>> {
        if self.done {
            return Ok(None);
        }
        let rest = self.left + self.pad;
        self.skip(rest)?;
        (self.left, self.pad) = (0, 0);
        let mut pax: Option<Vec<(Vec<u8>, Vec<u8>)>> = None;
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        loop {
            let mut block = [0u8; BLOCK as usize];
            match self.inner.read_exact(&mut block) {
                Ok(()) => {}
                // An archive may end without its two zero blocks (as others read it).
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    if pax.is_some() || long_name.is_some() || long_link.is_some() {
                        return Err(invalid("the archive ends after an extension header"));
                    }
                    self.done = true;
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
            if block.iter().all(|b| *b == 0) {
                if pax.is_some() || long_name.is_some() || long_link.is_some() {
                    return Err(invalid("the archive ends after an extension header"));
                }
                self.done = true;
                return Ok(None);
            }
            let stated = number(&block[148..156], "header checksum")?;
            let sum: u64 = block
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    if (148..156).contains(&i) {
                        32
                    } else {
                        u64::from(*b)
                    }
                })
                .sum();
            if stated != sum {
                return Err(invalid("a header whose checksum does not match"));
            }
            let typeflag = block[156];
            let size = number(&block[124..136], "size")?;
            match typeflag {
                b'x' => {
                    if pax.is_some() {
                        return Err(invalid("two PAX headers for one member"));
                    }
                    let data = self.extension(size, "PAX header")?;
                    pax = Some(pax_records(&data)?);
                    continue;
                }
                b'L' | b'K' => {
                    let slot = if typeflag == b'L' {
                        &mut long_name
                    } else {
                        &mut long_link
                    };
                    if slot.is_some() {
                        return Err(invalid("two GNU long names for one member"));
                    }
                    let data = self.extension(size, "GNU long name")?;
                    *slot = Some(text(&data).to_vec());
                    continue;
                }
                b'g' => {
                    return Err(invalid(
                        "a PAX global header (GNU tar as stasis runs it never writes one)",
                    ))
                }
                _ => {}
            }
            let ustar = &block[257..263] == b"ustar\0";
            let mut path = Vec::new();
            if ustar && block[345] != 0 {
                path.extend_from_slice(text(&block[345..500]));
                path.push(b'/');
            }
            path.extend_from_slice(text(&block[..100]));
            let pax = pax.unwrap_or_default();
            let mut h = Header {
                path: long_name.unwrap_or(path),
                link: long_link.unwrap_or_else(|| text(&block[157..257]).to_vec()),
                typeflag,
                mode: number(&block[100..108], "mode")?,
                uid: number(&block[108..116], "owner")?,
                gid: number(&block[116..124], "group")?,
                mtime: number(&block[136..148], "mtime")?,
                size,
                dev_major: number(&block[329..337], "device major")?,
                dev_minor: number(&block[337..345], "device minor")?,
                pax: Vec::new(),
            };
            for (k, v) in &pax {
                match k.as_slice() {
                    b"path" => h.path = v.clone(),
                    b"linkpath" => h.link = v.clone(),
                    b"size" => h.size = decimal(v, "size")?,
                    b"uid" => h.uid = decimal(v, "uid")?,
                    b"gid" => h.gid = decimal(v, "gid")?,
                    _ => {}
                }
            }
            h.pax = pax;
            let data = h.data_len();
            self.left = data;
            self.pad = (BLOCK - data % BLOCK) % BLOCK;
            return Ok(Some(h));
        }
    }

    /// The current member's data.
    pub(crate) fn data(&mut self) -> Data<'_, R> {
        Data { reader: self }
    }
}

/// The data of the member [`Reader::next`] last gave; ends where the member does.
pub(crate) struct Data<'a, R> {
    reader: &'a mut Reader<R>,
}

impl<R: Read> Read for Data<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf
            .len()
            .min(usize::try_from(self.reader.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let n = self.reader.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the archive ends inside a member's data",
            ));
        }
        self.reader.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn record(k: &[u8], v: &[u8]) -> Vec<u8> {
        let body = k.len() + v.len() + 3; // ' ', '=', '\n'
        let mut len = body + 1;
        while len.to_string().len() + body != len {
            len += 1;
        }
        let mut r = format!("{len} ").into_bytes();
        r.extend_from_slice(k);
        r.push(b'=');
        r.extend_from_slice(v);
        r.push(b'\n');
        assert_eq!(r.len(), len);
        r
    }

    fn header(name: &[u8], typeflag: u8, size: u64) -> [u8; 512] {
        let mut b = [0u8; 512];
        b[..name.len()].copy_from_slice(name);
        b[100..107].copy_from_slice(b"0000644");
        b[108..115].copy_from_slice(b"0001750");
        b[116..123].copy_from_slice(b"0001751");
        b[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        b[136..147].copy_from_slice(b"14771623047");
        b[156] = typeflag;
        b[257..263].copy_from_slice(b"ustar\0");
        b[263..265].copy_from_slice(b"00");
        b[148..156].copy_from_slice(b"        ");
        let sum: u64 = b.iter().map(|x| u64::from(*x)).sum();
        b[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        b
    }

    fn member(out: &mut Vec<u8>, h: [u8; 512], data: &[u8]) {
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    #[test]
    fn binary_values_with_newlines_and_equals_signs_are_read_whole() {
        let value = b"\x00\xfb\n21 size=99999999\n=\x0a";
        let data = [
            record(b"SCHILY.xattr.trusted.overlay.origin", value),
            record(b"SCHILY.xattr.user.note", b"a\nb"),
        ]
        .concat();
        let mut ar = Vec::new();
        member(
            &mut ar,
            header(b"PaxHeaders/f", b'x', data.len() as u64),
            &data,
        );
        member(&mut ar, header(b"f", b'0', 5), b"hello");
        member(&mut ar, header(b"g", b'0', 3), b"bye");
        ar.extend_from_slice(&[0u8; 1024]);
        let mut r = Reader::new(Cursor::new(ar));
        let f = r.next().unwrap().unwrap();
        assert_eq!(f.path, b"f");
        assert_eq!(f.size, 5, "a forged record inside a value is no record");
        assert_eq!(
            f.pax_value(b"SCHILY.xattr.trusted.overlay.origin"),
            Some(&value[..])
        );
        assert_eq!(f.pax_value(b"SCHILY.xattr.user.note"), Some(&b"a\nb"[..]));
        let mut s = String::new();
        r.data().read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello");
        let g = r.next().unwrap().unwrap();
        assert_eq!((g.path.as_slice(), g.uid, g.gid), (&b"g"[..], 1000, 1001));
        assert!(g.pax.is_empty(), "records belong to one member only");
        assert!(r.next().unwrap().is_none());
    }

    #[test]
    fn pax_overrides_name_size_and_owner() {
        let data = [
            record(b"path", b"a/very/long/name"),
            record(b"size", b"3"),
            record(b"uid", b"4000000000"),
        ]
        .concat();
        let mut ar = Vec::new();
        member(&mut ar, header(b"x", b'x', data.len() as u64), &data);
        member(&mut ar, header(b"short", b'0', 3), b"abc");
        let mut r = Reader::new(Cursor::new(ar));
        let h = r.next().unwrap().unwrap();
        assert_eq!(
            (h.path.as_slice(), h.size, h.uid),
            (&b"a/very/long/name"[..], 3, 4_000_000_000)
        );
        assert!(
            r.next().unwrap().is_none(),
            "an archive without zero blocks ends"
        );
    }

    #[test]
    fn malformed_records_are_refused() {
        for bad in [
            &b"5 a=b\n"[..], // length too short for what follows
            b"99 a=b\n",     // longer than the data
            b"6 a=bc\n",     // does not end where its length says
            b"6 abc\n",      // no '='
            b"x a=b\n",      // no length
            b"6a=b\n",       // no space
            b"007 a=b",      // missing newline
        ] {
            assert!(
                pax_records(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            pax_records(b"6 a=b\n").unwrap(),
            vec![(b"a".to_vec(), b"b".to_vec())]
        );
    }

    #[test]
    fn a_bad_checksum_or_global_header_is_refused() {
        let mut h = header(b"f", b'0', 0);
        h[0] = b'g';
        assert!(Reader::new(Cursor::new(h.to_vec())).next().is_err());
        let g = header(b"g", b'g', 0);
        let e = Reader::new(Cursor::new(g.to_vec())).next().unwrap_err();
        assert!(e.to_string().contains("global"), "{e}");
    }

    #[test]
    fn unread_data_is_skipped_and_a_short_archive_is_an_error() {
        let mut ar = Vec::new();
        member(&mut ar, header(b"big", b'0', 100_000), &vec![7u8; 100_000]);
        member(&mut ar, header(b"next", b'5', 0), b"");
        let mut r = Reader::new(Cursor::new(ar.clone()));
        assert_eq!(r.next().unwrap().unwrap().path, b"big");
        assert_eq!(r.next().unwrap().unwrap().path, b"next");
        ar.truncate(512 + 1000);
        let mut r = Reader::new(Cursor::new(ar));
        r.next().unwrap().unwrap();
        assert!(r.data().read_to_end(&mut Vec::new()).is_err());
    }

    #[test]
    fn gnu_long_names_and_base_256_sizes() {
        let long = vec![b'n'; 300];
        let mut ar = Vec::new();
        let mut l = long.clone();
        l.push(0);
        member(&mut ar, header(b"././@LongLink", b'L', l.len() as u64), &l);
        member(&mut ar, header(b"trunc", b'5', 0), b"");
        let mut h = header(b"huge", b'0', 0);
        h[124..136].copy_from_slice(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        h[148..156].copy_from_slice(b"        ");
        let sum: u64 = h.iter().map(|x| u64::from(*x)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        member(&mut ar, h, b"hi");
        let mut r = Reader::new(Cursor::new(ar));
        assert_eq!(r.next().unwrap().unwrap().path, long);
        assert_eq!(r.next().unwrap().unwrap().size, 2);
    }
}
