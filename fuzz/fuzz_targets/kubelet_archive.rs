//! A Kubernetes checkpoint archive as `stasis import` reads it (`engine::upstream::import`: the
//! members taken, CRIU image names, the JSON members, the layer turned into the overlay form and
//! checked as a restore checks it). Input: the archive. Seeds: archives shaped like containerd's
//! and CRI-O's (config.dump, spec.dump, checkpoint/, a rootfs-diff.tar with whiteouts and an
//! opaque directory, deleted.files).
//!
//! Run as root, the target first drops to uid/gid 65534: an import that wrote outside its image
//! directory must not be able to touch the machine's files.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stasis_engine::image::ImageDir;

fuzz_target!(|data: &[u8]| {
    let s = stasis_fuzz::fresh_dir(stasis_fuzz::unprivileged_scratch("kubelet-archive"));
    std::fs::create_dir_all(&s).expect("scratch");
    let archive = s.join("archive.tar");
    std::fs::write(&archive, data).expect("archive");
    std::fs::write(s.join("outside"), b"must stay").expect("outside file");
    let image = ImageDir::new(s.join("image"));

    if stasis_engine::upstream::import(&archive, &image).is_ok() {
        // What an accepted import made is only CRIU images and the checked changes.
        for e in std::fs::read_dir(image.criu()).expect("criu dir").flatten() {
            assert!(e.file_type().expect("type").is_file(), "{:?}", e.path());
        }
    }
    assert_eq!(
        std::fs::read(s.join("outside")).ok().as_deref(),
        Some(&b"must stay"[..]),
        "a file outside the image directory was changed"
    );
    let _ = std::fs::remove_dir_all(&s);
});
