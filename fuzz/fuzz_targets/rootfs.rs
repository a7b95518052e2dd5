//! The captured filesystem archive as a restore applies it (`rootfs::apply`: the whole archive
//! checked first, then applied through descriptors confined to the target), into a fresh target
//! that holds an image's usual traps (an absolute symlink to the host's `/etc`, a relative one,
//! a directory, a file). Input: 1 byte (bit 0: overlay upper, else changed-since-start), 2 bytes
//! (little endian) of path-list length, the NUL-separated path list, then the archive. Seeds are
//! GNU tar archives made the way `rootfs::capture` makes them (xattrs, whiteouts, an opaque
//! directory, hard links, a sparse file, symlinks).
//!
//! Run as root, the target first drops to uid/gid 65534 (fuzz/run.sh gives it its directories):
//! a confinement bug found here must not be able to touch the machine's files.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stasis_core::manifest::RootfsMethod;
use stasis_engine::image::ImageDir;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let method = if data[0] & 1 == 1 {
        RootfsMethod::OverlayUpper
    } else {
        RootfsMethod::ChangedSinceStart
    };
    let n = usize::from(u16::from_le_bytes([data[1], data[2]])).min(data.len() - 3);
    let (paths, archive) = data[3..].split_at(n);

    let s = stasis_fuzz::fresh_dir(stasis_fuzz::unprivileged_scratch("rootfs"));
    let image = ImageDir::new(s.join("image"));
    std::fs::create_dir_all(image.rootfs_dir()).expect("image dir");
    std::fs::write(image.rootfs_diff(), archive).expect("archive");
    std::fs::write(image.rootfs_paths(), paths).expect("paths");
    let target = s.join("target");
    std::fs::create_dir_all(target.join("etc/app")).expect("target");
    std::fs::write(target.join("etc/app/conf"), b"old").expect("target file");
    std::os::unix::fs::symlink("/etc", target.join("hostetc")).expect("symlink");
    std::os::unix::fs::symlink("../..", target.join("etc/up")).expect("symlink");
    std::fs::write(s.join("outside"), b"must stay").expect("outside file");

    let _ = stasis_engine::rootfs::apply(&image, method, &target);

    // Nothing outside the target changed: the file next to it is intact.
    assert_eq!(
        std::fs::read(s.join("outside")).ok().as_deref(),
        Some(&b"must stay"[..]),
        "a file outside the target was changed"
    );
    let _ = std::fs::remove_dir_all(&s);
});
