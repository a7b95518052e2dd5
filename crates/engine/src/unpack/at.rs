//! Changes to the target made through descriptors: every parent resolved from the rootfs's
//! descriptor inside it, every change one `*at` call on a single name that is never followed.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;

use super::member::Member;

/// The resolution every path of the target gets: inside it, as the container would see it.
pub(super) fn in_root() -> ResolveFlags {
    ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV
}

/// Opening a directory that must not itself be a symlink.
pub(super) fn dir_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW
}

/// Opening a parent directory: a symlink as its last component is followed like the others
/// (inside the root, by [`in_root`]), as the container would follow it.
pub(super) fn parent_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC
}

pub(super) fn join(path: &[OsString]) -> PathBuf {
    path.iter().collect()
}

/// Opens the directory `path` (components) of the target, resolved inside it; with `create`,
/// missing directories are made (mode 0755, as tar does for parents it was not given).
pub(super) fn open_dir(root: &OwnedFd, path: &[OsString], create: bool) -> Result<OwnedFd, Errno> {
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
pub(super) fn set_meta(fd: impl AsFd, m: &Member) -> Result<(), Errno> {
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

pub(super) fn times(m: &Member) -> Timestamps {
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
pub(super) fn write_data(
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
pub(super) fn map_number(r: &mut impl Read, consumed: &mut u64) -> std::io::Result<u64> {
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
pub(super) fn write_file(
    f: &mut std::fs::File,
    entry: &mut impl Read,
    m: &Member,
) -> std::io::Result<()> {
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
