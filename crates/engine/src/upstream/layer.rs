//! A container's filesystem changes, between stasis's capture of an overlay upper directory
//! (whiteouts are character devices 0/0, an opaque directory has `trusted.overlay.opaque=y`)
//! and an OCI image layer, the `rootfs-diff.tar` of a kubelet checkpoint archive (a whiteout is
//! an empty file `.wh.<name>`, an opaque directory holds an empty `.wh..wh..opq`).
//!
//! Both directions rewrite headers only; file data is copied as it is. Names are not judged
//! here: the converted archive goes through the restore's own check (`unpack::check`), which
//! refuses absolute names, `..`, devices and links that leave the tree.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use super::writer::Writer;
use crate::tarball::{Header, Reader};

const OPAQUE: &[u8] = b"SCHILY.xattr.trusted.overlay.opaque";
const OVERLAY_XATTRS: &[u8] = b"SCHILY.xattr.trusted.overlay.";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// What a conversion wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    pub entries: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
}

/// `(parent with its trailing '/', or empty; last component)` of a member name, with a
/// leading `./` and trailing `/` set aside.
fn split(path: &[u8]) -> (&[u8], &[u8]) {
    let p = path.strip_suffix(b"/").unwrap_or(path);
    match p.iter().rposition(|b| *b == b'/') {
        Some(i) => (&p[..=i], &p[i + 1..]),
        None => (&p[..0], p),
    }
}

fn open(src: &Path) -> io::Result<Reader<BufReader<File>>> {
    Ok(Reader::new(BufReader::with_capacity(
        1 << 20,
        File::open(src)?,
    )))
}

fn create(dst: &Path) -> io::Result<Writer<BufWriter<File>>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    Ok(Writer::new(BufWriter::with_capacity(1 << 20, f)))
}

/// stasis's overlay upper capture (`src`) → an OCI layer (`dst`, created).
pub(super) fn upper_to_layer(src: &Path, dst: &Path) -> io::Result<Counts> {
    let mut r = open(src)?;
    let mut w = create(dst)?;
    let mut n = Counts::default();
    while let Some(h) = r.next()? {
        n.entries += 1;
        if h.is_overlay_whiteout() {
            let (parent, name) = split(&h.path);
            let mut e = Header::file("", 0, 0o644, h.mtime);
            e.path = [parent, WHITEOUT_PREFIX, name].concat();
            (e.uid, e.gid) = (h.uid, h.gid);
            w.append(&e, &mut io::empty())?;
            n.whiteouts += 1;
            continue;
        }
        let opaque = h.typeflag == b'5'
            && h.pax
                .iter()
                .any(|(k, v)| k == OPAQUE && v.as_slice() == b"y");
        let mut e = h.clone();
        // Overlay's own attributes (opaque, origin, redirect...) mean nothing in a layer.
        e.pax.retain(|(k, _)| !k.starts_with(OVERLAY_XATTRS));
        w.append(&e, &mut r.data())?;
        if opaque {
            let dir = h.path.strip_suffix(b"/").unwrap_or(&h.path);
            let mut m = Header::file("", 0, 0o644, h.mtime);
            m.path = [dir, b"/", OPAQUE_MARKER].concat();
            w.append(&m, &mut io::empty())?;
            n.opaque_dirs += 1;
        }
    }
    w.finish()?;
    Ok(n)
}

/// An OCI layer (`src`, plain or gzip-compressed) plus a CRI-O style list of deleted paths →
/// stasis's overlay upper form (`dst`, created).
pub(super) fn layer_to_upper(src: &Path, dst: &Path, deleted: &[String]) -> io::Result<Counts> {
    let plain = decompressed(src)?;
    let src = plain.as_deref().unwrap_or(src);
    let mut n = Counts::default();

    // Pass 1: the directories a marker makes opaque.
    let mut opaque: HashSet<Vec<u8>> = HashSet::new();
    let mut r = open(src)?;
    while let Some(h) = r.next()? {
        let (parent, name) = split(&h.path);
        if name == OPAQUE_MARKER {
            opaque.insert(parent.strip_suffix(b"/").unwrap_or(parent).to_vec());
        }
    }

    let mut w = create(dst)?;
    for d in deleted {
        let p = d.trim_start_matches('/');
        w.append(
            &Header::whiteout(p.as_bytes().to_vec(), 0),
            &mut io::empty(),
        )?;
        n.whiteouts += 1;
    }
    // Pass 2: each opaque directory marked once, before anything inside it is put there.
    let mut marked: HashSet<Vec<u8>> = HashSet::new();
    let mut r = open(src)?;
    while let Some(h) = r.next()? {
        let (parent, name) = split(&h.path);
        let parent_dir = parent.strip_suffix(b"/").unwrap_or(parent).to_vec();
        if opaque.contains(&parent_dir) && !marked.contains(&parent_dir) {
            let mut d = Header::dir("", h.mtime);
            d.path = [&parent_dir[..], b"/"].concat();
            d.pax.push((OPAQUE.to_vec(), b"y".to_vec()));
            w.append(&d, &mut io::empty())?;
            marked.insert(parent_dir.clone());
            n.opaque_dirs += 1;
            n.entries += 1;
        }
        if name == OPAQUE_MARKER {
            continue;
        }
        n.entries += 1;
        if let Some(gone) = name.strip_prefix(WHITEOUT_PREFIX) {
            w.append(
                &Header::whiteout([parent, gone].concat(), h.mtime),
                &mut io::empty(),
            )?;
            n.whiteouts += 1;
            continue;
        }
        let mut e = h.clone();
        let own = h.path.strip_suffix(b"/").unwrap_or(&h.path).to_vec();
        if h.typeflag == b'5' && opaque.contains(&own) && marked.insert(own) {
            e.pax.push((OPAQUE.to_vec(), b"y".to_vec()));
            n.opaque_dirs += 1;
        }
        w.append(&e, &mut r.data())?;
    }
    w.finish()?;
    if let Some(p) = plain {
        let _ = std::fs::remove_file(p);
    }
    Ok(n)
}

/// A gzip-compressed layer (containerd writes `application/vnd.oci.image.layer.v1.tar+gzip`)
/// decompressed next to it; `None` when it is a plain archive.
fn decompressed(src: &Path) -> io::Result<Option<std::path::PathBuf>> {
    let mut magic = [0u8; 2];
    let mut f = File::open(src)?;
    if f.read(&mut magic)? < 2 || magic != [0x1f, 0x8b] {
        return Ok(None);
    }
    let out = src.with_extension("plain.tar");
    let mut dst = BufWriter::new(
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&out)?,
    );
    let gz = flate2::read::MultiGzDecoder::new(BufReader::new(File::open(src)?));
    io::copy(&mut BufReader::new(gz), &mut dst)?;
    dst.flush()?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[(Header, &[u8])]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut w = Writer::new(std::fs::File::create(f.path()).unwrap());
        for (e, data) in entries {
            w.append(e, &mut &data[..]).unwrap();
        }
        w.finish().unwrap();
        f
    }

    fn members(p: &Path) -> Vec<(String, u8, bool)> {
        let mut r = open(p).unwrap();
        let mut out = Vec::new();
        while let Some(h) = r.next().unwrap() {
            let opaque = h.pax.iter().any(|(k, v)| k == OPAQUE && v == b"y");
            out.push((
                String::from_utf8_lossy(&h.path).into_owned(),
                h.typeflag,
                opaque,
            ));
        }
        out
    }

    fn dev(path: &str) -> Header {
        Header::whiteout(path.as_bytes().to_vec(), 0)
    }

    #[test]
    fn whiteouts_and_opaque_dirs_round_trip_through_a_layer() {
        let mut opaque = Header::dir("./var/cache/", 0);
        opaque.pax.push((OPAQUE.to_vec(), b"y".to_vec()));
        opaque.pax.push((
            b"SCHILY.xattr.trusted.overlay.origin".to_vec(),
            vec![0, 10, 1],
        ));
        let upper = archive(&[
            (Header::dir("./", 0), b""),
            (Header::file("./etc/app.conf", 2, 0o644, 0), b"ok"),
            (dev("./etc/removed"), b""),
            (opaque, b""),
            (Header::file("./var/cache/new", 1, 0o600, 0), b"x"),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let layer = dir.path().join("layer.tar");
        let n = upper_to_layer(upper.path(), &layer).unwrap();
        assert_eq!((n.whiteouts, n.opaque_dirs), (1, 1));
        assert_eq!(
            members(&layer),
            [
                ("./".into(), b'5', false),
                ("./etc/app.conf".into(), b'0', false),
                ("./etc/.wh.removed".into(), b'0', false),
                ("./var/cache/".into(), b'5', false),
                ("./var/cache/.wh..wh..opq".into(), b'0', false),
                ("./var/cache/new".into(), b'0', false),
            ]
        );

        let back = dir.path().join("upper.tar");
        let n = layer_to_upper(&layer, &back, &[]).unwrap();
        assert_eq!((n.whiteouts, n.opaque_dirs), (1, 1));
        assert_eq!(
            members(&back),
            [
                ("./".into(), b'5', false),
                ("./etc/app.conf".into(), b'0', false),
                ("./etc/removed".into(), b'3', false),
                ("./var/cache/".into(), b'5', true),
                ("./var/cache/new".into(), b'0', false),
            ]
        );
        let checked = crate::unpack::check(&back, crate::unpack::Flavor::OverlayUpper);
        assert!(checked.is_ok(), "{checked:?}");
    }

    #[test]
    fn an_opaque_marker_after_the_dirs_children_marks_the_dir_before_them() {
        // Layers need not put the marker first; its directory must be opaque before anything
        // is put in it, or the restore would empty it after.
        let layer = archive(&[
            (Header::file("opt/a", 1, 0o644, 0), b"a"),
            (Header::file("opt/.wh..wh..opq", 0, 0o644, 0), b""),
            (Header::dir("opt/", 0), b""),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let back = dir.path().join("upper.tar");
        layer_to_upper(layer.path(), &back, &["/etc/shadow-".into()]).unwrap();
        assert_eq!(
            members(&back),
            [
                ("etc/shadow-".into(), b'3', false),
                ("opt/".into(), b'5', true),
                ("opt/a".into(), b'0', false),
                ("opt/".into(), b'5', false),
            ]
        );
    }

    #[test]
    fn a_gzip_layer_is_read_like_a_plain_one() {
        let plain = archive(&[(Header::file("f", 2, 0o644, 0), b"hi")]);
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("layer.tar");
        let mut enc = flate2::write::GzEncoder::new(File::create(&gz).unwrap(), Default::default());
        io::copy(&mut File::open(plain.path()).unwrap(), &mut enc).unwrap();
        enc.finish().unwrap();
        let back = dir.path().join("upper.tar");
        layer_to_upper(&gz, &back, &[]).unwrap();
        assert_eq!(members(&back), [("f".into(), b'0', false)]);
        assert!(!dir.path().join("layer.plain.tar").exists());
    }
}
