//! `stasis list`.

use std::process::ExitCode;

use serde::Serialize;
use stasis_core::WorkloadName;
use stasis_store::{Key, Store};

use super::{runtime, store_options, Access};
use crate::args::ListArgs;
use crate::output::{self, bytes};

#[derive(Debug, Serialize)]
struct Entry {
    reference: String,
    workload: String,
    id: String,
    created_at: String,
    /// Checkpoint size, when the manifest could be read with the key.
    logical_bytes: Option<u64>,
    /// `container <id>` or `process <pid>`, when the manifest could be read with the key.
    source: Option<String>,
    /// A pod checkpoint's containers (in capture order); absent for one container.
    #[serde(skip_serializing_if = "Option::is_none")]
    containers: Option<Vec<String>>,
    /// Why the manifest could not be read with the key (damaged, another key), if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

pub fn run(args: ListArgs) -> anyhow::Result<ExitCode> {
    let store = Store::open_with(&args.store, store_options(Access::Read))?;
    let workload = args.workload.map(WorkloadName::new).transpose()?;
    // Sizes need the manifests, which need the key; without it the names are still listed. A
    // key given explicitly must load.
    let key = match &args.key {
        Some(p) => Some(Key::load(p)?),
        None => Key::default_path()
            .ok()
            .filter(|p| p.exists())
            .and_then(|p| Key::load(&p).ok()),
    };
    let rt = runtime()?;
    let list = rt.block_on(store.list(workload.as_ref()))?;
    let mut entries = Vec::with_capacity(list.len());
    for c in list {
        let reference = c.reference();
        let (manifest, problem) = match &key {
            Some(k) => match rt.block_on(store.read_manifest(k, &reference)) {
                Ok(m) => (Some(m), None),
                Err(e) => (None, Some(e.to_string())),
            },
            None => (None, None),
        };
        let containers = manifest
            .as_ref()
            .and_then(|m| m.pod_containers().ok().flatten())
            .map(|names| names.into_iter().map(str::to_owned).collect::<Vec<_>>());
        entries.push(Entry {
            reference: reference.to_string(),
            workload: c.workload.to_string(),
            id: c.id.to_string(),
            created_at: c.id.created_rfc3339(),
            logical_bytes: manifest.as_ref().map(|m| m.logical_bytes()),
            source: manifest.as_ref().map(|m| match (&m.source, &containers) {
                (_, Some(names)) => format!("pod, {} containers: {}", names.len(), names.join(",")),
                (stasis_core::Source::Container { container_id }, None) => {
                    format!("container {container_id}")
                }
                (stasis_core::Source::Process { pid }, None) => format!("process {pid}"),
            }),
            containers,
            problem,
        });
    }
    output::emit(&entries, || {
        if entries.is_empty() {
            return "no checkpoints".into();
        }
        let mut s = format!(
            "{:<50} {:>10}  {:<24}  {}\n",
            "CHECKPOINT", "SIZE", "CREATED", "SOURCE"
        );
        for e in &entries {
            s.push_str(&format!(
                "{:<50} {:>10}  {:<24}  {}\n",
                e.reference,
                e.logical_bytes.map_or("-".into(), bytes),
                e.created_at,
                e.source.as_deref().unwrap_or(if e.problem.is_some() {
                    "UNREADABLE"
                } else {
                    "-"
                })
            ));
        }
        for e in &entries {
            if let Some(p) = &e.problem {
                s.push_str(&format!("warning: {}: {p}\n", e.reference));
            }
        }
        s.trim_end().to_owned()
    });
    Ok(ExitCode::SUCCESS)
}
