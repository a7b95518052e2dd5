//! A minimal POSIX pax archive writer: ustar headers, with a local PAX header (`x`) carrying
//! whatever does not fit a ustar field or has no field (long names, extended attributes, GNU's
//! sparse records). Keys and values are bytes, written by their length (as `tarball` reads
//! them), so an attribute name or value that is not UTF-8, or holds a `\n`, survives.

use std::io::{self, Write};

use crate::tarball::Header;

const BLOCK: usize = 512;

impl Header {
    /// A regular file's header.
    pub(super) fn file(path: &str, size: u64, mode: u64, mtime: u64) -> Self {
        Self {
            path: path.as_bytes().to_vec(),
            link: Vec::new(),
            typeflag: b'0',
            mode,
            uid: 0,
            gid: 0,
            mtime,
            size,
            dev_major: 0,
            dev_minor: 0,
            pax: Vec::new(),
        }
    }

    /// A directory's header.
    pub(super) fn dir(path: &str, mtime: u64) -> Self {
        Self {
            typeflag: b'5',
            mode: 0o755,
            ..Self::file(path, 0, 0o755, mtime)
        }
    }

    /// A character device 0/0 (an overlay whiteout).
    pub(super) fn whiteout(path: Vec<u8>, mtime: u64) -> Self {
        Self {
            path,
            typeflag: b'3',
            mode: 0,
            ..Self::file("", 0, 0, mtime)
        }
    }
}

/// Writes members to `out`; [`Writer::finish`] writes the two zero blocks that end an archive.
pub(super) struct Writer<W: Write> {
    out: W,
    written: u64,
}

impl<W: Write> Writer<W> {
    pub(super) fn new(out: W) -> Self {
        Self { out, written: 0 }
    }

    /// Writes `e`'s header(s), then exactly [`Header::data_len`] bytes from `data`, then the
    /// padding. `path`, `linkpath` and `size` PAX records are written when the ustar header
    /// cannot hold them (those in `e.pax` are left out).
    pub(super) fn append(&mut self, e: &Header, data: &mut impl io::Read) -> io::Result<()> {
        let size = e.data_len();
        let mut records: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        if e.path.len() > 99 {
            records.push((b"path".to_vec(), e.path.clone()));
        }
        if e.link.len() > 99 {
            records.push((b"linkpath".to_vec(), e.link.clone()));
        }
        if size > 0o77_777_777_777 {
            records.push((b"size".to_vec(), size.to_string().into_bytes()));
        }
        records.extend(
            e.pax
                .iter()
                .filter(|(k, _)| !matches!(k.as_slice(), b"path" | b"linkpath" | b"size"))
                .cloned(),
        );
        if !records.is_empty() {
            let body = pax_body(&records);
            let name = b"././@PaxHeader";
            let h = header(
                name,
                b"",
                b'x',
                0o644,
                0,
                0,
                e.mtime,
                body.len() as u64,
                0,
                0,
            );
            self.raw(&h)?;
            self.raw(&body)?;
            self.pad(body.len() as u64)?;
        }
        let h = header(
            &e.path[..e.path.len().min(99)],
            &e.link[..e.link.len().min(99)],
            e.typeflag,
            e.mode,
            e.uid,
            e.gid,
            e.mtime,
            size.min(0o77_777_777_777),
            e.dev_major,
            e.dev_minor,
        );
        self.raw(&h)?;
        let copied = io::copy(&mut io::Read::take(&mut *data, size), &mut self.out)?;
        if copied != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: {copied} of {} bytes",
                    String::from_utf8_lossy(&e.path),
                    size
                ),
            ));
        }
        self.written += copied;
        self.pad(size)
    }

    pub(super) fn finish(mut self) -> io::Result<(W, u64)> {
        self.raw(&[0u8; 2 * BLOCK])?;
        self.out.flush()?;
        Ok((self.out, self.written))
    }

    fn raw(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self, len: u64) -> io::Result<()> {
        let n = (BLOCK - (len % BLOCK as u64) as usize) % BLOCK;
        self.raw(&[0u8; BLOCK][..n])
    }
}

/// `<length> <key>=<value>\n` per record, the length counting itself.
fn pax_body(records: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in records {
        let rest = 1 + k.len() + 1 + v.len() + 1; // ' ' key '=' value '\n'
        let mut len = rest + 1;
        while len != rest + len.to_string().len() {
            len = rest + len.to_string().len();
        }
        out.extend_from_slice(len.to_string().as_bytes());
        out.push(b' ');
        out.extend_from_slice(k);
        out.push(b'=');
        out.extend_from_slice(v);
        out.push(b'\n');
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn header(
    name: &[u8],
    link: &[u8],
    typeflag: u8,
    mode: u64,
    uid: u64,
    gid: u64,
    mtime: u64,
    size: u64,
    dev_major: u64,
    dev_minor: u64,
) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], mode & 0o7777);
    octal(&mut h[108..116], uid.min(0o7_777_777));
    octal(&mut h[116..124], gid.min(0o7_777_777));
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], mtime.min(0o77_777_777_777));
    h[156] = typeflag;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], dev_major.min(0o7_777_777));
    octal(&mut h[337..345], dev_minor.min(0o7_777_777));
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    octal(&mut h[148..155], sum);
    h
}

/// Zero-padded octal, NUL-terminated, filling the field.
fn octal(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    field[..digits].copy_from_slice(&s.as_bytes()[s.len() - digits..]);
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_lengths_count_themselves() {
        for v in [0usize, 1, 5, 6, 7, 90, 95, 96, 97, 990, 995] {
            let body = pax_body(&[(b"k".to_vec(), vec![b'a'; v])]);
            let len: usize = std::str::from_utf8(body.split(|b| *b == b' ').next().unwrap())
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(len, body.len(), "value of {v} bytes");
        }
    }

    #[test]
    fn what_it_writes_the_engines_reader_reads_back() {
        let mut w = Writer::new(Vec::new());
        let long = "d/".repeat(80) + "file";
        let mut e = Header::file(&long, 3, 0o640, 1_700_000_000);
        e.pax
            .push((b"SCHILY.xattr.user.k".to_vec(), b"line\nbreak\0".to_vec()));
        w.append(&e, &mut &b"abc"[..]).unwrap();
        w.append(&Header::whiteout(b"gone".to_vec(), 0), &mut io::empty())
            .unwrap();
        let (bytes, _) = w.finish().unwrap();

        let mut r = crate::tarball::Reader::new(io::Cursor::new(bytes));
        let h = r.next().unwrap().unwrap();
        assert_eq!(h.path, long.as_bytes());
        assert_eq!(h.mode, 0o640);
        assert_eq!(
            h.pax_value(b"SCHILY.xattr.user.k"),
            Some(&b"line\nbreak\0"[..])
        );
        let mut data = Vec::new();
        io::Read::read_to_end(&mut r.data(), &mut data).unwrap();
        assert_eq!(data, b"abc");
        let h = r.next().unwrap().unwrap();
        assert_eq!((h.path.as_slice(), h.typeflag), (&b"gone"[..], b'3'));
        assert!(r.next().unwrap().is_none());
    }
}
