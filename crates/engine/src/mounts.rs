//! The mounts of this process's mount namespace, read from `/proc/self/mountinfo`, and the
//! cleanup of what a failed CRIU leaves mounted in its directories (its cgroup yard: a tmpfs
//! `.criu.cgyard.*` with the cgroup hierarchies mounted inside, left in the work directory of a
//! restore that failed). A directory with a mount under it cannot be removed, from this mount
//! namespace or from another one (a container's view of a host directory): the unmount must
//! happen where the mount is.

use std::path::{Path, PathBuf};

/// mountinfo escapes space, tab, newline and backslash as `\ooo` (octal).
pub fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The mount points at or under `dir` in `mountinfo` (its text), deepest first.
pub fn points_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut v: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(std::ffi::OsStr::from_bytes(&unescape(m))))
        .filter(|m| m.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// The mount points at or under `dir` in this process's mount namespace, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|info| points_under(&info, dir))
        .unwrap_or_default()
}

/// Detaches (`MNT_DETACH`) every mount at or under `dir`, deepest first; what was unmounted, and
/// what could not be with why.
pub fn unmount_under(dir: &Path) -> Unmounted {
    let mut done = Unmounted::default();
    for m in mounts_under(dir) {
        match nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => done.unmounted.push(m),
            Err(e) => done.failed.push((m, e.to_string())),
        }
    }
    done
}

/// What [`unmount_under`] did.
#[derive(Debug, Default)]
pub struct Unmounted {
    pub unmounted: Vec<PathBuf>,
    pub failed: Vec<(PathBuf, String)>,
}

impl Unmounted {
    pub fn is_empty(&self) -> bool {
        self.unmounted.is_empty() && self.failed.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_octal_and_leaves_the_rest() {
        assert_eq!(unescape("/a\\040b"), b"/a b");
        assert_eq!(unescape("/plain"), b"/plain");
        assert_eq!(unescape("/end\\"), b"/end\\");
        assert_eq!(unescape("/x\\09"), b"/x\\09");
    }

    /// A failed restore's cgroup yard, as CRIU 4.2 left it in a lazy restore's work dir.
    #[test]
    fn the_mounts_under_a_dir_deepest_first() {
        let info = "\
30 1 0:25 / / rw - ext4 /dev/vda rw
41 30 0:40 / /run/stasis/lazy/u/app/.criu.cgyard.Ab12 rw - tmpfs none rw
42 41 0:41 / /run/stasis/lazy/u/app/.criu.cgyard.Ab12/memory rw - cgroup cgroup rw,memory
43 30 0:42 / /run/stasis/lazy/u/app2 rw - tmpfs none rw
44 30 0:43 / /run/stasis/lazy/u/a\\040b rw - tmpfs none rw
";
        let dir = Path::new("/run/stasis/lazy/u/app");
        assert_eq!(
            points_under(info, dir),
            vec![
                PathBuf::from("/run/stasis/lazy/u/app/.criu.cgyard.Ab12/memory"),
                PathBuf::from("/run/stasis/lazy/u/app/.criu.cgyard.Ab12"),
            ]
        );
        assert_eq!(
            points_under(info, Path::new("/run/stasis/lazy/u/a b")),
            vec![PathBuf::from("/run/stasis/lazy/u/a b")]
        );
        assert!(points_under(info, Path::new("/elsewhere")).is_empty());
    }
}
