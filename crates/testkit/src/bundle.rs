//! Bundles of the counter workload, and the shapes containerd gives a pod's containers.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh counter bundle at `dest` (`scripts/make-bundle dest env...`: host network, the
/// rootfs copied from the counter image, the image digest annotation).
pub fn make_bundle(dest: &Path, env: &[&str]) -> PathBuf {
    make_bundle_with(&[], dest, env)
}

/// [`make_bundle`] with make-bundle's `options` (`--netns`, `--memory <MiB>`).
pub fn make_bundle_with(options: &[&str], dest: &Path, env: &[&str]) -> PathBuf {
    let out = Command::new(crate::repo().join("scripts/make-bundle"))
        .args(options)
        .arg(dest)
        .args(env)
        .output()
        .expect("run scripts/make-bundle");
    assert!(
        out.status.success(),
        "make-bundle {}: {}",
        dest.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    dest.to_path_buf()
}

/// Edits a bundle's `config.json` in place.
pub fn edit_config(bundle: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = bundle.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read config.json"))
            .expect("config.json is JSON");
    edit(&mut cfg);
    std::fs::write(&path, cfg.to_string()).expect("write config.json");
}

/// Adds `annotations` (a JSON object) to the bundle's config.
pub fn annotate(bundle: &Path, annotations: &serde_json::Value) {
    edit_config(bundle, |cfg| {
        for (k, v) in annotations.as_object().expect("annotations: an object") {
            cfg["annotations"][k] = v.clone();
        }
    });
}

/// The CRI annotations containerd gives the app container `counter` of pod `pod_name` (uid
/// `pod_uid`) in namespace `default`.
pub fn cri_app_annotations(pod_uid: &str, pod_name: &str) -> serde_json::Value {
    serde_json::json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-uid": pod_uid,
        "io.kubernetes.cri.sandbox-namespace": "default",
        "io.kubernetes.cri.sandbox-name": pod_name,
        "io.kubernetes.cri.container-name": "counter",
    })
}

/// Puts the container in the network namespace at `netns` (a pod's sandbox), or in a new one
/// of its own (`None`).
pub fn join_netns(bundle: &Path, netns: Option<&Path>) {
    edit_config(bundle, |cfg| {
        let ns = cfg["linux"]["namespaces"]
            .as_array_mut()
            .expect("linux.namespaces");
        ns.retain(|n| n["type"] != "network");
        ns.push(match netns {
            Some(p) => serde_json::json!({"type": "network", "path": p}),
            None => serde_json::json!({"type": "network"}),
        });
    });
}

/// The bundle's rootfs as containerd's overlayfs snapshotter makes it: the image (the
/// bundle's rootfs, moved to `lower/`) under an `upper/` that takes the container's changes,
/// mounted at `rootfs/`. Unmounted on drop.
pub struct Overlay {
    /// The mount point, `<bundle>/rootfs`.
    pub merged: PathBuf,
}

impl Overlay {
    /// Mounts the overlay over the bundle's rootfs.
    pub fn over(bundle: &Path) -> Self {
        Self::over_with(bundle, |_| {})
    }

    /// Mounts the overlay, after `lower` (the image's layer) has been changed by `image`.
    pub fn over_with(bundle: &Path, image: impl FnOnce(&Path)) -> Self {
        let merged = bundle.join("rootfs");
        let lower = bundle.join("lower");
        std::fs::rename(&merged, &lower).expect("move rootfs to lower");
        image(&lower);
        for d in ["rootfs", "upper", "work"] {
            std::fs::create_dir(bundle.join(d)).expect("overlay directories");
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            bundle.join("upper").display(),
            bundle.join("work").display()
        );
        let st = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&merged)
            .status()
            .expect("run mount");
        assert!(
            st.success(),
            "cannot mount an overlay at {}",
            merged.display()
        );
        Self { merged }
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        // Lazily: a container that still holds it must not keep the next test's world.
        let _ = Command::new("umount").arg("-l").arg(&self.merged).status();
    }
}
