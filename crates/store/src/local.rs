//! Direct I/O for chunk objects of a local (`file://`) store.
//!
//! On the machines stasis runs on (VMs), filling the page cache costs more CPU than encrypting
//! the data: a buffered write of 1 GiB to ext4 takes 0.8–2.4 s of kernel time, a cold buffered
//! read 1.9 s, while the same with `O_DIRECT` takes about 0.25 s and runs at the disk's speed
//! (1.2 GB/s write, 1.8 GB/s read measured here). So a local store writes and reads chunk
//! objects with `O_DIRECT` from 4096-aligned buffers, with the same layout and the same atomic
//! publish as `object_store`'s `LocalFileSystem` (a staging file `<name>#<digits>`, which
//! listings ignore, renamed into place). Where the filesystem refuses `O_DIRECT` (tmpfs) it
//! falls back to buffered I/O for good. Manifests, leases and listings go through
//! `object_store` as usual.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::chunk::{round_up, ChunkBuf, ALIGN};

#[derive(Debug)]
pub(crate) struct DirectIo {
    root: PathBuf,
    enabled: AtomicBool,
}

fn is_unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::EOPNOTSUPP)
}

impl DirectIo {
    pub(crate) fn new(root: PathBuf) -> Self {
        DirectIo {
            root,
            enabled: AtomicBool::new(true),
        }
    }

    pub(crate) fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn direct(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    fn disable(&self, why: &io::Error) {
        if self.enabled.swap(false, Ordering::Relaxed) {
            tracing::debug!(root = %self.root.display(), error = %why, "O_DIRECT not supported here; using buffered I/O");
        }
    }

    /// Writes an object atomically (staging file, then rename).
    pub(crate) fn put(&self, rel: &str, obj: &mut ChunkBuf) -> io::Result<()> {
        let dest = self.path(rel);
        let dir = dest.parent().unwrap_or(&self.root).to_owned();
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let staging = dir.join(format!("{name}#{}", rand::random::<u32>() | 1));
        let r = self.write_staging(&dir, &staging, obj);
        let r = r.and_then(|()| std::fs::rename(&staging, &dest));
        if r.is_err() {
            let _ = std::fs::remove_file(&staging);
        }
        r
    }

    fn write_staging(&self, dir: &Path, staging: &Path, obj: &mut ChunkBuf) -> io::Result<()> {
        let len = obj.len();
        if self.direct() && obj.is_aligned() {
            match open_new(dir, staging, true) {
                Ok(f) => {
                    let padded = obj.padded();
                    let r = f
                        .write_all_at(padded, 0)
                        .and_then(|()| f.set_len(len as u64));
                    match r {
                        Ok(()) => return Ok(()),
                        Err(e) if is_unsupported(&e) => {
                            self.disable(&e);
                            drop(f);
                            let _ = std::fs::remove_file(staging);
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) if is_unsupported(&e) => self.disable(&e),
                Err(e) => return Err(e),
            }
        }
        let f = open_new(dir, staging, false)?;
        f.write_all_at(&obj.data()[..len], 0)
    }

    /// Reads a whole object of at most `limit` bytes. The size is taken from the open file's
    /// metadata before anything is read, and the read stops at that size, so a larger (or
    /// growing) file costs no memory.
    pub(crate) fn get(&self, rel: &str, limit: u64) -> io::Result<Fetched> {
        let p = self.path(rel);
        if self.direct() {
            match open_read(&p, true) {
                Ok(f) => match read_direct(&f, limit) {
                    Ok(b) => return Ok(b),
                    Err(e) if is_unsupported(&e) => self.disable(&e),
                    Err(e) => return Err(e),
                },
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Fetched::Missing),
                Err(e) if is_unsupported(&e) => self.disable(&e),
                Err(e) => return Err(e),
            }
        }
        let f = match open_read(&p, false) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Fetched::Missing),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        if len > limit {
            return Ok(Fetched::TooLarge(len));
        }
        let mut v = Vec::with_capacity(len as usize);
        io::Read::read_to_end(&mut io::Read::take(&f, len), &mut v)?;
        Ok(Fetched::Data(ChunkBuf::from_vec(v)))
    }
}

/// What reading an object found.
pub(crate) enum Fetched {
    Missing,
    /// Larger than the limit: its size; nothing was read.
    TooLarge(u64),
    Data(ChunkBuf),
}

fn open_new(dir: &Path, p: &Path, direct: bool) -> io::Result<File> {
    let open = || {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true).mode(0o644);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(p)
    };
    match open() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)?;
            open()
        }
        r => r,
    }
}

fn open_read(p: &Path, direct: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(p)
}

fn read_direct(f: &File, limit: u64) -> io::Result<Fetched> {
    let len = f.metadata()?.len();
    if len > limit {
        return Ok(Fetched::TooLarge(len));
    }
    let len = len as usize;
    let padded = round_up(len, ALIGN).max(ALIGN);
    let mut buf = ChunkBuf::with_room(padded);
    if !buf.is_aligned() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    buf.set_len(padded);
    let mut done = 0usize;
    while done < padded {
        let n = f.read_at(&mut buf.data_mut()[done..padded], done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
        if done % ALIGN != 0 {
            break; // end of file
        }
    }
    buf.truncate(done.min(len));
    Ok(Fetched::Data(buf))
}
