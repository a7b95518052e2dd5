//! One archive member: its name checked component by component, what it asks for, and the
//! check of a whole archive before anything is touched.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use rustix::fs::Timespec;
use tracing::debug;

use super::{Checked, Flavor};
use crate::error::EngineError;
use crate::tarball::{Header, Reader};

/// What one archive member asks for.
#[derive(Debug)]
pub(super) struct Member {
    /// The member's name, as checked normal components (empty: the archive's root, `./`).
    pub(super) path: Vec<OsString>,
    pub(super) kind: Kind,
    pub(super) mode: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) mtime: Option<Timespec>,
    pub(super) atime: Option<Timespec>,
    pub(super) xattrs: Vec<(OsString, Vec<u8>)>,
    pub(super) opaque: bool,
    /// GNU's PAX sparse format 1.0: the data starts with the map; the file is this long.
    pub(super) sparse_size: Option<u64>,
    /// The length of the member's data in the archive.
    pub(super) size: u64,
}

#[derive(Debug)]
pub(super) enum Kind {
    File,
    Dir,
    Symlink(Vec<u8>),
    HardLink(Vec<OsString>),
    Fifo,
    Whiteout,
}

pub(super) fn display(path: &[OsString]) -> String {
    if path.is_empty() {
        return "./".into();
    }
    let mut s = String::from("./");
    for (i, c) in path.iter().enumerate() {
        if i > 0 {
            s.push('/');
        }
        s.push_str(&c.to_string_lossy());
    }
    s
}

/// An archive member's name as normal components; `None` names what is refused and why.
pub(super) fn components(raw: &[u8]) -> Result<Vec<OsString>, &'static str> {
    if raw.first() == Some(&b'/') {
        return Err("an absolute name");
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("a name with a `..` component"),
            c => out.push(OsString::from_vec(c.to_vec())),
        }
    }
    Ok(out)
}

/// Seconds with an optional fraction, as PAX writes times (`1796126083.636657327`).
pub(super) fn pax_time(v: &[u8]) -> Option<Timespec> {
    let s = std::str::from_utf8(v).ok()?;
    let (sec, frac) = s.split_once('.').unwrap_or((s, ""));
    let tv_sec: i64 = sec.parse().ok()?;
    let mut nsec = 0i64;
    for (i, d) in frac.bytes().take(9).enumerate() {
        if !d.is_ascii_digit() {
            return None;
        }
        nsec += i64::from(d - b'0') * 10i64.pow(8 - i as u32);
    }
    // A negative time with a fraction counts down from the second before.
    let (tv_sec, nsec) = if tv_sec < 0 && nsec > 0 {
        (tv_sec - 1, 1_000_000_000 - nsec)
    } else {
        (tv_sec, nsec)
    };
    Some(Timespec {
        tv_sec,
        tv_nsec: nsec as _,
    })
}

/// Reads what a member asks for (not its data), refusing what this extractor never does.
pub(super) fn member(h: &Header, flavor: Flavor) -> Result<Member, String> {
    let mut path_raw = h.path.clone();
    let mut xattrs = Vec::new();
    let mut opaque = false;
    let (mut mtime, mut atime) = (None, None);
    let (mut sparse_major, mut sparse_minor, mut sparse_name, mut sparse_size) =
        (None, None, None, None);
    for (k, v) in &h.pax {
        if let Some(name) = k.strip_prefix(b"SCHILY.xattr.") {
            if name == b"trusted.overlay.opaque" && flavor == Flavor::OverlayUpper {
                opaque = v == b"y";
            } else if name.starts_with(b"user.") || name == b"security.capability" {
                xattrs.push((OsStr::from_bytes(name).to_owned(), v.to_vec()));
            } else {
                debug!(
                    xattr = %String::from_utf8_lossy(name),
                    "extended attribute not restored: only user.* and security.capability are"
                );
            }
        } else {
            match k.as_slice() {
                b"mtime" => mtime = pax_time(v),
                b"atime" => atime = pax_time(v),
                b"GNU.sparse.major" => sparse_major = Some(v.to_vec()),
                b"GNU.sparse.minor" => sparse_minor = Some(v.to_vec()),
                b"GNU.sparse.name" => sparse_name = Some(v.to_vec()),
                b"GNU.sparse.realsize" => {
                    sparse_size = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok());
                    if sparse_size.is_none() {
                        return Err("a sparse file with an unreadable size".into());
                    }
                }
                k if k.starts_with(b"GNU.sparse.") => {
                    return Err(format!(
                        "a sparse file in a format stasis does not read ({}); only GNU's PAX format 1.0 is",
                        String::from_utf8_lossy(k)
                    ))
                }
                _ => {}
            }
        }
    }
    if sparse_major.is_some() || sparse_minor.is_some() || sparse_name.is_some() {
        if sparse_major.as_deref() != Some(b"1") || sparse_minor.as_deref() != Some(b"0") {
            return Err(
                "a sparse file in a format stasis does not read; only GNU's PAX format 1.0 is"
                    .into(),
            );
        }
        match (sparse_name, sparse_size) {
            (Some(name), Some(_)) => path_raw = name,
            _ => return Err("a sparse file without its name or size".into()),
        }
    } else {
        sparse_size = None;
    }
    let path = components(&path_raw)?;
    let kind = match h.typeflag {
        b'0' | b'\0' | b'7' => Kind::File,
        b'5' => Kind::Dir,
        b'2' => {
            if h.link.is_empty() {
                return Err("a symlink without a target".into());
            }
            Kind::Symlink(h.link.clone())
        }
        b'1' => {
            if h.link.is_empty() {
                return Err("a hard link without a target".into());
            }
            let target = components(&h.link).map_err(|why| {
                format!(
                    "a hard link to {why} ({}): it would leave the rootfs",
                    String::from_utf8_lossy(&h.link)
                )
            })?;
            if target.is_empty() {
                return Err("a hard link to the archive's root".into());
            }
            Kind::HardLink(target)
        }
        b'6' => Kind::Fifo,
        b'3' if flavor == Flavor::OverlayUpper && h.is_overlay_whiteout() => Kind::Whiteout,
        b'3' | b'4' => {
            return Err(format!(
                "a device node ({} {}:{}): a restore never creates devices",
                if h.typeflag == b'3' { "char" } else { "block" },
                h.dev_major,
                h.dev_minor
            ))
        }
        b'S' => {
            return Err(
                "a sparse file in GNU's old format; only GNU's PAX format 1.0 is read".into(),
            )
        }
        other => {
            return Err(format!(
                "an entry of unsupported type {:?}",
                char::from(other)
            ))
        }
    };
    if path.is_empty() && !matches!(kind, Kind::Dir) {
        return Err("the archive's root is not a directory".into());
    }
    if sparse_size.is_some() && !matches!(kind, Kind::File) {
        return Err("sparse data on an entry that is not a file".into());
    }
    let id = |v: u64, what: &str| -> Result<u32, String> {
        u32::try_from(v).map_err(|_| format!("{what} {v} is out of range"))
    };
    let mode = (h.mode & 0o7777) as u32;
    let uid = id(h.uid, "owner")?;
    let gid = id(h.gid, "group")?;
    if mtime.is_none() {
        let t = h.mtime;
        mtime = Some(Timespec {
            tv_sec: i64::try_from(t).map_err(|_| format!("mtime {t} is out of range"))?,
            tv_nsec: 0,
        });
    }
    Ok(Member {
        path,
        kind,
        mode,
        uid,
        gid,
        mtime,
        atime,
        xattrs,
        opaque,
        sparse_size,
        size: h.size,
    })
}

/// The archive, buffered with `buf` bytes: large for reading it through, small for the
/// header-only check, whose every seek drops the buffer.
pub(super) fn open_archive(
    archive: &Path,
    buf: usize,
) -> Result<Reader<std::io::BufReader<std::fs::File>>, EngineError> {
    let f = std::fs::File::open(archive).map_err(EngineError::io(archive))?;
    Ok(Reader::new(std::io::BufReader::with_capacity(buf, f)))
}

pub(super) fn refuse(
    archive: &Path,
    entry: impl Into<String>,
    reason: impl Into<String>,
) -> EngineError {
    EngineError::RootfsEntry {
        archive: archive.to_path_buf(),
        entry: entry.into(),
        reason: reason.into(),
    }
}

/// Reads the whole archive and refuses it, naming the entry, if any member is something a
/// restore never does. Nothing is touched.
pub(crate) fn check(archive: &Path, flavor: Flavor) -> Result<Checked, EngineError> {
    let mut ar = open_archive(archive, 8 << 10)?;
    let unreadable = |e: std::io::Error| refuse(archive, "(archive)", format!("unreadable: {e}"));
    // Headers only: file data is seeked over, not read.
    while let Some(h) = ar.next().map_err(unreadable)? {
        member(&h, flavor).map_err(|why| {
            refuse(
                archive,
                String::from_utf8_lossy(&h.path).into_owned(),
                format!("{why}; the archive was refused before anything was changed"),
            )
        })?;
    }
    Ok(Checked {
        archive: archive.to_path_buf(),
        flavor,
    })
}
