//! Puts a captured filesystem archive into a fresh rootfs without ever leaving it.
//!
//! The target is the new container's rootfs, seen from the host's mount namespace (the merged
//! overlay containerd mounted, or a plain directory). Its symlinks belong to the image and point
//! wherever the image says, including absolute paths that mean the *host's* files here. So no
//! path is ever resolved from the host's `/`: the target is opened once, every parent directory
//! is resolved from that descriptor with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)` (symlinks resolve as they would inside the container, `..` stops at the
//! rootfs, no mount is crossed), and every change is an `*at` call on that parent with a single
//! name that is never followed: files are created `O_EXCL|O_NOFOLLOW`, whatever stood at a name
//! (a symlink included) is removed through descriptors before something else is put there,
//! symlink text is only ever written as data.
//!
//! The archive is checked whole before anything is touched ([`check`]): absolute names, `..`,
//! device nodes (other than overlay whiteouts), hard links leaving the tree and unsupported
//! entry types are refused, naming the entry. Extended attributes are restored only in the
//! namespaces a container may set itself (`user.*`, `security.capability`); the overlay opaque
//! marker is interpreted, never set.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;
use tracing::debug;

use crate::error::EngineError;
use crate::tarball::{Header, Reader};

/// How the archive was captured, which decides what whiteouts and opaque markers mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// An overlay upper directory: character devices 0/0 are deletions, directories marked
    /// `trusted.overlay.opaque=y` hide what the image had in them.
    OverlayUpper,
    /// Entries of a plain directory: no whiteouts, no opaque directories.
    Plain,
}

/// An archive that passed [`check`].
#[derive(Debug)]
pub(crate) struct Checked {
    archive: PathBuf,
    flavor: Flavor,
}

/// What one archive member asks for.
#[derive(Debug)]
struct Member {
    /// The member's name, as checked normal components (empty: the archive's root, `./`).
    path: Vec<OsString>,
    kind: Kind,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: Option<Timespec>,
    atime: Option<Timespec>,
    xattrs: Vec<(OsString, Vec<u8>)>,
    opaque: bool,
    /// GNU's PAX sparse format 1.0: the data starts with the map; the file is this long.
    sparse_size: Option<u64>,
    /// The length of the member's data in the archive.
    size: u64,
}

#[derive(Debug)]
enum Kind {
    File,
    Dir,
    Symlink(Vec<u8>),
    HardLink(Vec<OsString>),
    Fifo,
    Whiteout,
}

fn display(path: &[OsString]) -> String {
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
fn components(raw: &[u8]) -> Result<Vec<OsString>, &'static str> {
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
fn pax_time(v: &[u8]) -> Option<Timespec> {
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
fn member(h: &Header, flavor: Flavor) -> Result<Member, String> {
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
        b'3' if flavor == Flavor::OverlayUpper && h.dev_major == 0 && h.dev_minor == 0 => {
            Kind::Whiteout
        }
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
fn open_archive(
    archive: &Path,
    buf: usize,
) -> Result<Reader<std::io::BufReader<std::fs::File>>, EngineError> {
    let f = std::fs::File::open(archive).map_err(EngineError::io(archive))?;
    Ok(Reader::new(std::io::BufReader::with_capacity(buf, f)))
}

fn refuse(archive: &Path, entry: impl Into<String>, reason: impl Into<String>) -> EngineError {
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

/// The resolution every path of the target gets: inside it, as the container would see it.
fn in_root() -> ResolveFlags {
    ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV
}

/// Opening a directory that must not itself be a symlink.
fn dir_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW
}

/// Opening a parent directory: a symlink as its last component is followed like the others
/// (inside the root, by [`in_root`]), as the container would follow it.
fn parent_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC
}

fn join(path: &[OsString]) -> PathBuf {
    path.iter().collect()
}

/// Opens the directory `path` (components) of the target, resolved inside it; with `create`,
/// missing directories are made (mode 0755, as tar does for parents it was not given).
fn open_dir(root: &OwnedFd, path: &[OsString], create: bool) -> Result<OwnedFd, Errno> {
    if path.is_empty() {
        return rustix::fs::openat(root, ".", dir_flags(), Mode::empty());
    }
    match rustix::fs::openat2(root, join(path), parent_flags(), Mode::empty(), in_root()) {
        Err(Errno::NOENT) if create => {}
        r => return r,
    }
    // Made one missing component at a time, each from its resolved parent.
    let mut dir = rustix::fs::openat(root, ".", dir_flags(), Mode::empty())?;
    for i in 0..path.len() {
        match rustix::fs::openat2(
            root,
            join(&path[..=i]),
            parent_flags(),
            Mode::empty(),
            in_root(),
        ) {
            Ok(fd) => dir = fd,
            Err(Errno::NOENT) => {
                // EEXIST here: a dangling symlink stands in the way; it is refused by the caller.
                rustix::fs::mkdirat(&dir, &path[i], Mode::from_raw_mode(0o755))?;
                dir = rustix::fs::openat2(
                    &dir,
                    &path[i],
                    dir_flags(),
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                )?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(dir)
}

/// Removes `name` in `dir`, whatever it is; a directory with everything in it, through
/// descriptors (never following a symlink, never crossing onto another filesystem).
pub(crate) fn remove_at(dir: &OwnedFd, name: &OsStr) -> Result<(), Errno> {
    let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(Errno::NOENT) => return Ok(()),
        r => r?,
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory {
        let sub = rustix::fs::openat2(
            dir,
            name,
            dir_flags(),
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
        )?;
        empty_dir(&sub)?;
        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
    } else {
        rustix::fs::unlinkat(dir, name, AtFlags::empty())
    }
}

/// Removes everything in the directory `dir`.
pub(crate) fn empty_dir(dir: &OwnedFd) -> Result<(), Errno> {
    for name in list_dir(dir)? {
        remove_at(dir, &name)?;
    }
    Ok(())
}

/// The names in a directory (without `.` and `..`).
pub(crate) fn list_dir(dir: &OwnedFd) -> Result<Vec<OsString>, Errno> {
    let mut names = Vec::new();
    for e in rustix::fs::Dir::read_from(dir)? {
        let e = e?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsStr::from_bytes(n).to_owned());
        }
    }
    Ok(names)
}

/// Owner, mode, allowed xattrs and times on an open file or directory. Owner first: a chown
/// clears setuid bits and file capabilities.
fn set_meta(fd: impl AsFd, m: &Member) -> Result<(), Errno> {
    let fd = fd.as_fd();
    rustix::fs::fchown(
        fd,
        Some(rustix::fs::Uid::from_raw(m.uid)),
        Some(rustix::fs::Gid::from_raw(m.gid)),
    )?;
    rustix::fs::fchmod(fd, Mode::from_raw_mode(m.mode))?;
    for (name, value) in &m.xattrs {
        rustix::fs::fsetxattr(fd, name.as_os_str(), value, XattrFlags::empty())?;
    }
    rustix::fs::futimens(fd, &times(m))
}

fn times(m: &Member) -> Timestamps {
    let omit = Timespec {
        tv_sec: 0,
        tv_nsec: rustix::fs::UTIME_OMIT,
    };
    Timestamps {
        last_access: m.atime.unwrap_or(omit),
        last_modification: m.mtime.unwrap_or(omit),
    }
}

/// Writes a file's data, leaving holes where the data is zeros (so sparse files stay sparse);
/// returns the file's length.
fn write_data(
    f: &mut std::fs::File,
    r: &mut impl Read,
    mut pos: u64,
    len: u64,
) -> std::io::Result<u64> {
    const BLOCK: usize = 4096;
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = len;
    f.seek(SeekFrom::Start(pos))?;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = r.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the archive ends inside the file's data",
            ));
        }
        // Runs of data are written at once, runs of zero blocks skipped.
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let zero = |c: &[u8]| c.iter().all(|b| *b == 0);
            let first_zero = rest.chunks(BLOCK).next().is_some_and(zero);
            let run = rest
                .chunks(BLOCK)
                .take_while(|c| zero(c) == first_zero)
                .map(<[u8]>::len)
                .sum::<usize>();
            if first_zero {
                f.seek(SeekFrom::Current(run as i64))?;
            } else {
                f.write_all(&rest[..run])?;
            }
            rest = &rest[run..];
        }
        pos += n as u64;
        left -= n as u64;
    }
    Ok(pos)
}

/// One decimal number of the PAX sparse 1.0 map, ending with a newline.
fn map_number(r: &mut impl Read, consumed: &mut u64) -> std::io::Result<u64> {
    let mut digits = Vec::new();
    loop {
        let mut b = [0u8];
        r.read_exact(&mut b)?;
        *consumed += 1;
        match b[0] {
            b'\n' => break,
            d if d.is_ascii_digit() && digits.len() < 20 => digits.push(d),
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "malformed sparse map",
                ))
            }
        }
    }
    std::str::from_utf8(&digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed sparse map"))
}

/// Writes a member's data into `f`.
fn write_file(f: &mut std::fs::File, entry: &mut impl Read, m: &Member) -> std::io::Result<()> {
    let Some(real) = m.sparse_size else {
        let end = write_data(f, entry, 0, m.size)?;
        return f.set_len(end);
    };
    // GNU's PAX sparse 1.0: count, then offset/size pairs, one number a line, padded to 512;
    // then the data of each region in order.
    let mut consumed = 0u64;
    let count = map_number(entry, &mut consumed)?;
    let mut regions = Vec::new();
    for _ in 0..count {
        let off = map_number(entry, &mut consumed)?;
        let len = map_number(entry, &mut consumed)?;
        if off.checked_add(len).is_none_or(|end| end > real) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "sparse region beyond the file's size",
            ));
        }
        regions.push((off, len));
    }
    let pad = (512 - consumed % 512) % 512;
    std::io::copy(&mut entry.take(pad), &mut std::io::sink())?;
    for (off, len) in regions {
        write_data(f, entry, off, len)?;
    }
    f.set_len(real)
}

impl Checked {
    /// Puts the archive into `target` (see the module's description).
    pub(crate) fn apply(&self, target: &Path) -> Result<(), EngineError> {
        let root = rustix::fs::open(target, dir_flags(), Mode::empty())
            .map_err(|e| EngineError::io(target)(e.into()))?;
        let mut ar = open_archive(&self.archive, 1 << 20)?;
        let unreadable =
            |e: std::io::Error| refuse(&self.archive, "(archive)", format!("unreadable: {e}"));
        // Directories get their owner, mode and times once everything in them is there.
        let mut dirs = Vec::new();
        while let Some(h) = ar.next().map_err(unreadable)? {
            let m = member(&h, self.flavor).map_err(|why| {
                refuse(
                    &self.archive,
                    String::from_utf8_lossy(&h.path).into_owned(),
                    why,
                )
            })?;
            self.put(&root, &mut ar.data(), &m)
                .map_err(|why| refuse(&self.archive, display(&m.path), why))?;
            if matches!(m.kind, Kind::Dir) {
                dirs.push(m);
            }
        }
        for m in dirs.iter().rev() {
            let r = match m.path.split_last() {
                None => set_meta(&root, m),
                Some((name, parent)) => match open_dir(&root, parent, false).and_then(|p| {
                    rustix::fs::openat2(
                        &p,
                        name,
                        dir_flags(),
                        Mode::empty(),
                        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                    )
                }) {
                    // Replaced or deleted by a later entry: nothing to set.
                    Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => Ok(()),
                    r => r.and_then(|fd| set_meta(&fd, m)),
                },
            };
            r.map_err(|e| {
                refuse(
                    &self.archive,
                    display(&m.path),
                    format!("setting owner, mode and times: {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// Applies one member.
    fn put(&self, root: &OwnedFd, entry: &mut impl Read, m: &Member) -> Result<(), String> {
        let Some((name, parent_path)) = m.path.split_last() else {
            // The archive's root: the target itself.
            if m.opaque {
                empty_dir(root).map_err(|e| format!("emptying the opaque root: {e}"))?;
            }
            return Ok(());
        };
        let name = name.as_os_str();
        if matches!(m.kind, Kind::Whiteout) {
            // Nothing to delete where the parent is missing.
            return match open_dir(root, parent_path, false) {
                Err(Errno::NOENT | Errno::NOTDIR) => Ok(()),
                Err(e) => Err(format!("opening its directory: {e}")),
                Ok(dir) => remove_at(&dir, name).map_err(|e| format!("deleting it: {e}")),
            };
        }
        let dir = open_dir(root, parent_path, true).map_err(|e| match e {
            Errno::EXIST | Errno::NOTDIR => format!(
                "its directory {} is not a directory inside the rootfs (a symlink out of it, or a file)",
                display(parent_path)
            ),
            e => format!("opening its directory: {e}"),
        })?;
        let existing = match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Some(rustix::fs::FileType::from_raw_mode(st.st_mode)),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(format!("looking at what is there: {e}")),
        };
        let replace = |dir: &OwnedFd| {
            if existing.is_some() {
                remove_at(dir, name).map_err(|e| format!("removing what was there: {e}"))
            } else {
                Ok(())
            }
        };
        match &m.kind {
            Kind::Whiteout => unreachable!("handled above"),
            Kind::Dir => {
                if existing != Some(rustix::fs::FileType::Directory) {
                    // A symlink (or anything else) where the archive has a directory is
                    // replaced, never followed.
                    replace(&dir)?;
                    rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700))
                        .map_err(|e| format!("making the directory: {e}"))?;
                } else if m.opaque {
                    let sub = rustix::fs::openat2(
                        &dir,
                        name,
                        dir_flags(),
                        Mode::empty(),
                        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                    )
                    .map_err(|e| format!("opening the opaque directory: {e}"))?;
                    empty_dir(&sub).map_err(|e| format!("emptying the opaque directory: {e}"))?;
                }
                Ok(())
            }
            Kind::File => {
                replace(&dir)?;
                let fd = rustix::fs::openat(
                    &dir,
                    name,
                    OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::WRONLY
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| format!("creating the file: {e}"))?;
                let mut f = std::fs::File::from(fd);
                write_file(&mut f, entry, m).map_err(|e| format!("writing the file: {e}"))?;
                set_meta(&f, m).map_err(|e| format!("setting owner, mode, xattrs and times: {e}"))
            }
            Kind::Symlink(text) => {
                replace(&dir)?;
                rustix::fs::symlinkat(OsStr::from_bytes(text), &dir, name)
                    .map_err(|e| format!("making the symlink: {e}"))?;
                self.link_meta(&dir, name, m)
            }
            Kind::HardLink(target) => {
                let (tname, tparent) = target.split_last().expect("checked: not the root");
                if tparent == parent_path && tname == name {
                    return Ok(());
                }
                let tdir = open_dir(root, tparent, false).map_err(|e| {
                    format!(
                        "opening the link target's directory {}: {e}",
                        display(tparent)
                    )
                })?;
                replace(&dir)?;
                rustix::fs::linkat(&tdir, tname, &dir, name, AtFlags::empty())
                    .map_err(|e| format!("linking to {}: {e}", display(target)))
            }
            Kind::Fifo => {
                replace(&dir)?;
                rustix::fs::mknodat(
                    &dir,
                    name,
                    rustix::fs::FileType::Fifo,
                    Mode::from_raw_mode(0o600),
                    0,
                )
                .map_err(|e| format!("making the FIFO: {e}"))?;
                // Opened without blocking for a writer, only to set its metadata.
                let fd = rustix::fs::openat(
                    &dir,
                    name,
                    OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| format!("opening the FIFO: {e}"))?;
                set_meta(&fd, m).map_err(|e| format!("setting owner, mode and times: {e}"))
            }
        }
    }

    /// Owner and times of a symlink (never followed; symlinks have no mode, and no xattrs a
    /// container may set).
    fn link_meta(&self, dir: &OwnedFd, name: &OsStr, m: &Member) -> Result<(), String> {
        rustix::fs::chownat(
            dir,
            name,
            Some(rustix::fs::Uid::from_raw(m.uid)),
            Some(rustix::fs::Gid::from_raw(m.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| format!("setting the symlink's owner: {e}"))?;
        rustix::fs::utimensat(dir, name, &times(m), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| format!("setting the symlink's times: {e}"))
    }
}

/// Deletes every entry of `target` whose path relative to it is not in `keep` (a plain
/// rootfs's paths at checkpoint time), through descriptors, not crossing onto other
/// filesystems.
pub(crate) fn delete_not_in(
    target: &Path,
    keep: &std::collections::HashSet<&[u8]>,
) -> Result<(), EngineError> {
    fn prune(
        dir: &OwnedFd,
        prefix: &[u8],
        dev: u64,
        keep: &std::collections::HashSet<&[u8]>,
    ) -> Result<(), (Vec<u8>, Errno)> {
        for name in list_dir(dir).map_err(|e| (prefix.to_vec(), e))? {
            let mut rel = prefix.to_vec();
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(name.as_bytes());
            if !keep.contains(rel.as_slice()) {
                remove_at(dir, &name).map_err(|e| (rel, e))?;
                continue;
            }
            let st = rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| (rel.clone(), e))?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
                && st.st_dev == dev
            {
                let sub = rustix::fs::openat2(
                    dir,
                    &name,
                    dir_flags(),
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                )
                .map_err(|e| (rel.clone(), e))?;
                prune(&sub, &rel, dev, keep)?;
            }
        }
        Ok(())
    }
    let root = rustix::fs::open(target, dir_flags(), Mode::empty())
        .map_err(|e| EngineError::io(target)(e.into()))?;
    let dev = rustix::fs::fstat(&root)
        .map_err(|e| EngineError::io(target)(e.into()))?
        .st_dev;
    prune(&root, b"", dev, keep).map_err(|(rel, e)| {
        EngineError::io(target.join(OsStr::from_bytes(&rel)))(std::io::Error::from(e))
    })
}
