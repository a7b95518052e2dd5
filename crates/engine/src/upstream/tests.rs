use super::writer::Writer;
use super::*;
use crate::tarball::Header;
use std::path::PathBuf;

const T: u64 = 1_764_547_200;

/// An image directory like a container checkpoint's: two CRIU files and an overlay capture
/// with a whiteout.
fn image_with_changes(dir: &Path) -> ImageDir {
    let image = ImageDir::new(dir);
    std::fs::create_dir_all(image.criu()).unwrap();
    std::fs::write(image.criu().join("inventory.img"), b"inventory").unwrap();
    std::fs::write(image.criu().join("pages-1.img"), vec![7u8; 8192]).unwrap();
    std::fs::write(
        image.criu().join("dump.log"),
        b"(00.001) Dumping finished successfully\n",
    )
    .unwrap();
    std::fs::create_dir_all(image.rootfs_dir()).unwrap();
    let mut w = Writer::new(File::create(image.rootfs_diff()).unwrap());
    w.append(&Header::dir("./", T), &mut io::empty()).unwrap();
    w.append(
        &Header::file("./data/state", 5, 0o644, T),
        &mut &b"hello"[..],
    )
    .unwrap();
    w.append(
        &Header::whiteout(b"./etc/motd".to_vec(), T),
        &mut io::empty(),
    )
    .unwrap();
    w.finish().unwrap();
    image
}

fn info() -> ExportInfo {
    ExportInfo {
        config: ContainerConfig {
            id: "abc123".into(),
            name: "counter".into(),
            rootfs_image_ref: "sha256:0123".into(),
            runtime: "io.containerd.runc.v2".into(),
            created_time: "2026-12-01T00:00:00Z".into(),
            checkpointed_time: "2026-12-01T00:00:01Z".into(),
            ..Default::default()
        },
        annotations: BTreeMap::from([(
            "io.kubernetes.cri.container-name".to_owned(),
            "counter".to_owned(),
        )]),
        mtime: T,
    }
}

fn names(archive: &Path) -> Vec<String> {
    let mut r = Reader::new(BufReader::new(File::open(archive).unwrap()));
    let mut out = Vec::new();
    while let Some(h) = r.next().unwrap() {
        out.push(String::from_utf8_lossy(&h.path).into_owned());
    }
    out
}

#[test]
fn an_export_has_the_kubelet_layout_and_imports_back_to_the_same_images() {
    let dir = tempfile::tempdir().unwrap();
    let image = image_with_changes(&dir.path().join("ck"));
    let out = dir.path().join("checkpoint.tar");
    let report = export(&image, Some(RootfsMethod::OverlayUpper), &info(), &out).unwrap();
    assert_eq!((report.images, report.rootfs_whiteouts), (3, 1));
    assert_eq!(
        names(&out),
        [
            "config.dump",
            "spec.dump",
            "checkpoint/",
            "checkpoint/dump.log",
            "dump.log",
            "checkpoint/inventory.img",
            "checkpoint/pages-1.img",
            "rootfs-diff.tar",
        ]
    );
    // An existing file is never replaced.
    assert!(export(&image, None, &info(), &out).is_err());

    let back = ImageDir::new(dir.path().join("imported"));
    let imported = import(&out, &back).unwrap();
    assert_eq!(imported.config, info().config);
    assert_eq!(imported.annotations, info().annotations);
    assert_eq!(imported.images, 3);
    assert_eq!(imported.ignored, ["dump.log"]);
    for f in ["inventory.img", "pages-1.img"] {
        assert_eq!(
            std::fs::read(back.criu().join(f)).unwrap(),
            std::fs::read(image.criu().join(f)).unwrap()
        );
    }
    let rootfs = imported.rootfs.unwrap();
    assert_eq!(
        (rootfs.method, rootfs.deleted),
        (RootfsMethod::OverlayUpper, 1)
    );
    let mut r = Reader::new(BufReader::new(File::open(back.rootfs_diff()).unwrap()));
    let mut seen = Vec::new();
    while let Some(h) = r.next().unwrap() {
        seen.push((String::from_utf8_lossy(&h.path).into_owned(), h.typeflag));
    }
    assert_eq!(
        seen,
        [
            ("./".to_owned(), b'5'),
            ("./data/state".to_owned(), b'0'),
            ("./etc/motd".to_owned(), b'3'),
        ]
    );
    assert!(!back.rootfs_dir().join("layer.tar").exists());
}

/// An archive with `config.dump`, an inventory and then `extra`.
fn hostile(dir: &Path, extra: &[(Header, &[u8])]) -> PathBuf {
    let p = dir.join("hostile.tar");
    let _ = std::fs::remove_file(&p);
    let mut w = Writer::new(File::create(&p).unwrap());
    let config = br#"{"id":"x","name":"y"}"#;
    w.append(
        &Header::file("config.dump", config.len() as u64, 0o600, T),
        &mut &config[..],
    )
    .unwrap();
    w.append(
        &Header::file("checkpoint/inventory.img", 1, 0o600, T),
        &mut &b"i"[..],
    )
    .unwrap();
    for (e, data) in extra {
        w.append(e, &mut &data[..]).unwrap();
    }
    w.finish().unwrap();
    p
}

fn refusal(dir: &Path, extra: &[(Header, &[u8])]) -> String {
    let p = hostile(dir, extra);
    let target = dir.join(format!("t{}", rand_suffix()));
    match import(&p, &ImageDir::new(&target)) {
        Ok(_) => panic!("imported"),
        Err(e) => e.to_string(),
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn hostile_archives_are_refused_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut link = Header::file("checkpoint/pages-1.img", 0, 0o777, T);
    link.typeflag = b'2';
    link.link = b"/etc/shadow".to_vec();
    let e = refusal(d, &[(link, b"")]);
    assert!(
        e.contains("checkpoint/pages-1.img") && e.contains("only files and directories"),
        "{e}"
    );

    for name in [
        "checkpoint/../../etc/passwd",
        "checkpoint/sub/x.img",
        "checkpoint/.hidden",
    ] {
        let e = refusal(d, &[(Header::file(name, 1, 0o600, T), b"x")]);
        assert!(e.contains(name), "{name}: {e}");
    }

    let big = vec![b' '; (MAX_JSON + 1) as usize];
    let e = refusal(
        d,
        &[(Header::file("spec.dump", big.len() as u64, 0o600, T), &big)],
    );
    assert!(e.contains("spec.dump") && e.contains("at most"), "{e}");

    // A layer naming a path outside the rootfs is refused at import, before it is stored.
    let layer = d.join("layer-src.tar");
    let mut w = Writer::new(File::create(&layer).unwrap());
    w.append(
        &Header::file("../../etc/cron.d/x", 1, 0o644, T),
        &mut &b"x"[..],
    )
    .unwrap();
    w.finish().unwrap();
    let bytes = std::fs::read(&layer).unwrap();
    let e = refusal(
        d,
        &[(
            Header::file("rootfs-diff.tar", bytes.len() as u64, 0o600, T),
            &bytes,
        )],
    );
    assert!(
        e.contains("rootfs-diff.tar") && e.contains("etc/cron.d/x"),
        "{e}"
    );

    // Deleted paths that climb out are refused too.
    let list = br#"["/../../etc/passwd"]"#;
    let e = refusal(
        d,
        &[(
            Header::file("deleted.files", list.len() as u64, 0o600, T),
            &list[..],
        )],
    );
    assert!(e.contains("etc/passwd"), "{e}");
}

#[test]
fn an_archive_without_its_parts_says_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.tar");
    Writer::new(File::create(&p).unwrap()).finish().unwrap();
    let e = import(&p, &ImageDir::new(dir.path().join("a")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.dump") && e.contains("missing"), "{e}");

    let p = dir.path().join("config-only.tar");
    let mut w = Writer::new(File::create(&p).unwrap());
    w.append(&Header::file("config.dump", 2, 0o600, T), &mut &b"{}"[..])
        .unwrap();
    w.finish().unwrap();
    let e = import(&p, &ImageDir::new(dir.path().join("b")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("inventory.img") && e.contains("no CRIU checkpoint"),
        "{e}"
    );
}
