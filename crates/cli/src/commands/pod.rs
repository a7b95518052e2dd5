//! Pod checkpoints (several containers under one manifest, design §12.3a) as the CLI sees them:
//! which container a command works on, the pod index, and one container's part of the
//! checkpoint seen as a one-container checkpoint, so that restore and export treat it exactly
//! as they treat one.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use stasis_core::manifest::{
    pod_container_dir, FileEntry, Manifest, PodIndex, POD_CONTAINERS_LABEL, POD_INDEX_FILE,
};
use stasis_core::names::manifest as label;

/// The container of `m` a command works on: `None` for a one-container checkpoint (which
/// `--container` may name, if it names that container), the chosen name for a pod checkpoint,
/// which needs `--container` (`verb` and `how` say what the command does, for the error).
pub(crate) fn choose(
    m: &Manifest,
    container: Option<&str>,
    verb: &str,
) -> anyhow::Result<Option<String>> {
    let exact = m.reference();
    let names = m.pod_containers().with_context(|| exact.to_string())?;
    match (names, container) {
        (None, None) => Ok(None),
        (None, Some(c)) => match m.labels.get(label::CONTAINER_NAME) {
            Some(own) if own == c => Ok(None),
            own => bail!(
                "{exact} is a checkpoint of one container{}: leave out --container",
                own.map_or_else(String::new, |n| format!(" ({n})"))
            ),
        },
        (Some(names), Some(c)) if names.contains(&c) => Ok(Some(c.to_owned())),
        (Some(names), chosen) => {
            let what = match chosen {
                Some(c) => format!("has no container {c:?}"),
                None => "is a checkpoint of a pod".to_owned(),
            };
            bail!(
                "{exact} {what}: it holds the containers {}. Choose one with --container NAME to {verb} it; stasis {verb} works on one container at a time (a whole pod is restored on Kubernetes by a PodRestore; outside it, restore each container into its own bundle)",
                names.join(", ")
            )
        }
    }
}

/// The pod index of the pod checkpoint `m`, fetched into `dir`, checked against `m`.
pub(crate) fn read_index(dir: &Path, m: &Manifest) -> anyhow::Result<PodIndex> {
    let path = dir.join(POD_INDEX_FILE);
    let raw = std::fs::read(&path).with_context(|| {
        format!(
            "{}: the pod checkpoint's index {POD_INDEX_FILE} is missing",
            m.reference()
        )
    })?;
    let index: PodIndex = serde_json::from_slice(&raw)
        .with_context(|| format!("{}: its pod index cannot be read", m.reference()))?;
    index
        .check(m)
        .with_context(|| format!("{}: its pod index", m.reference()))?;
    Ok(index)
}

/// Container `name`'s part of the pod checkpoint `m`, as the manifest of a one-container
/// checkpoint: its source, processes, rootfs capture, image digest and files (relative to its
/// directory, [`part_dir`]); the same reference, node and declared versions.
pub(crate) fn part(m: &Manifest, index: &PodIndex, name: &str) -> anyhow::Result<Manifest> {
    let Some(c) = index.containers.iter().find(|c| c.name == name) else {
        bail!("{}: its pod index has no container {name:?}", m.reference());
    };
    let prefix = format!("{}/", pod_container_dir(name));
    let mut labels = m.labels.clone();
    labels.remove(POD_CONTAINERS_LABEL);
    labels.insert(label::CONTAINER_NAME.to_owned(), name.to_owned());
    let mut requirements = m.requirements.clone();
    requirements.image_digest = c.image_digest.clone();
    Ok(Manifest {
        source: c.source.clone(),
        processes: c.processes.clone(),
        rootfs: c.rootfs.clone(),
        gpu_processes: c.gpu_processes,
        requirements,
        files: m
            .files
            .iter()
            .filter_map(|f| {
                Some(FileEntry {
                    path: f.path.strip_prefix(&prefix)?.to_owned(),
                    ..f.clone()
                })
            })
            .collect(),
        labels,
        ..m.clone()
    })
}

/// Where container `name`'s images are in a pod checkpoint fetched into `dir`.
pub(crate) fn part_dir(dir: &Path, name: &str) -> PathBuf {
    dir.join(pod_container_dir(name))
}

/// What a command works on: the checkpoint itself, or one container's part of a pod
/// checkpoint; fetched into a scratch directory.
pub(crate) struct Fetched {
    /// The checkpoint, or the container's part ([`part`]).
    pub manifest: Manifest,
    /// Its images: the scratch directory, or the container's directory in it.
    pub dir: PathBuf,
}

/// Fetches `opened`'s checkpoint into `scratch` and narrows it to `container` (see [`choose`]).
pub(crate) fn fetch(
    opened: &super::Opened,
    container: Option<&str>,
    scratch: &Path,
    bars: &crate::progress::Bars,
) -> anyhow::Result<Fetched> {
    opened.fetch(scratch, bars)?;
    Ok(match container {
        None => Fetched {
            manifest: opened.manifest.clone(),
            dir: scratch.to_owned(),
        },
        Some(name) => {
            let index = read_index(scratch, &opened.manifest)?;
            Fetched {
                manifest: part(&opened.manifest, &index, name)?,
                dir: part_dir(scratch, name),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_core::manifest::PodContainer;
    use stasis_core::Source;

    fn pod_manifest() -> Manifest {
        let mut m: Manifest = serde_json::from_value(serde_json::json!({
            "schema_version": stasis_core::SCHEMA_VERSION,
            "workload": "w",
            "id": "20261202T000000.000Z-0000abcd",
            "created_at": "2026-12-02T00:00:00Z",
            "key_id": "k",
            "source": Source::Container { container_id: "a1".into() },
            "leave_running": true,
            "requirements": stasis_core::fingerprint::Requirements {
                node: Default::default(),
                needs_runc: true,
                image_digest: None,
                declared: Default::default(),
            },
            "processes": [],
            "rootfs": null,
            "timings": stasis_core::Timings::default(),
            "stats": stasis_core::manifest::StoreStats::default(),
            "files": [],
        }))
        .expect("a manifest");
        for (p, size) in [
            ("pod.json", 10),
            ("containers/app/criu/pages-1.img", 100),
            ("containers/side/criu/pages-1.img", 7),
        ] {
            m.files.push(FileEntry {
                path: p.into(),
                mode: 0o600,
                size,
                chunks: Vec::new(),
            });
        }
        m.labels
            .insert(POD_CONTAINERS_LABEL.into(), "app,side".into());
        m
    }

    #[test]
    fn a_pod_checkpoint_needs_a_container_named() {
        let m = pod_manifest();
        let e = choose(&m, None, "restore").unwrap_err().to_string();
        assert!(
            e.contains("app, side") && e.contains("--container NAME"),
            "{e}"
        );
        let e = choose(&m, Some("x"), "export").unwrap_err().to_string();
        assert!(
            e.contains("no container \"x\"") && e.contains("app, side"),
            "{e}"
        );
        assert_eq!(
            choose(&m, Some("side"), "restore").unwrap().as_deref(),
            Some("side")
        );

        let mut one = m.clone();
        one.labels.remove(POD_CONTAINERS_LABEL);
        assert_eq!(choose(&one, None, "restore").unwrap(), None);
        one.labels
            .insert(label::CONTAINER_NAME.into(), "app".into());
        assert_eq!(choose(&one, Some("app"), "restore").unwrap(), None);
        assert!(choose(&one, Some("side"), "restore").is_err());
    }

    #[test]
    fn a_part_is_a_one_container_checkpoint() {
        let m = pod_manifest();
        let index = PodIndex {
            containers: ["app", "side"]
                .map(|n| PodContainer {
                    name: n.into(),
                    source: Source::Container {
                        container_id: format!("{n}-id"),
                    },
                    processes: Vec::new(),
                    rootfs: None,
                    image_digest: Some(format!("sha256:{n}")),
                    gpu_processes: 0,
                })
                .to_vec(),
        };
        let p = part(&m, &index, "side").unwrap();
        assert_eq!(p.reference(), m.reference());
        assert_eq!(p.files.len(), 1);
        assert_eq!(p.files[0].path, "criu/pages-1.img");
        assert_eq!(p.logical_bytes(), 7);
        assert_eq!(p.requirements.image_digest.as_deref(), Some("sha256:side"));
        assert_eq!(p.pod_containers().unwrap(), None);
        assert_eq!(p.labels[label::CONTAINER_NAME], "side");
        assert!(
            matches!(&p.source, Source::Container { container_id } if container_id == "side-id")
        );
    }
}
