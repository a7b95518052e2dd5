//! Pod checkpoints (several containers under one manifest, design §12.3a) through the CLI, with
//! real runc and CRIU: two counter containers captured at one instant by the engine's
//! `checkpoint_pod` and published the way the agent publishes a pod (each container's images
//! under `containers/<name>/`, the pod index `pod.json`, the `stasis.dev/containers` label);
//! then `stasis inspect` and `list` show the containers, `restore` and `export` refuse without
//! `--container` (naming the containers), `restore --container` continues one counter, and an
//! export of one container imports back and restores. Run under `tini -s --`.

mod common;

use std::collections::BTreeMap;

use stasis_core::manifest::{
    pod_container_dir, Manifest, PodContainer, PodIndex, POD_CONTAINERS_LABEL, POD_INDEX_FILE,
};
use stasis_core::{CheckpointId, Requirements, Timings, WorkloadName, SCHEMA_VERSION};
use stasis_engine::checkpoint::{checkpoint_pod, PodCheckpoint, PodMember};
use stasis_engine::image::ImageDir;
use stasis_store::{Key, NoProgress, Store};

use common::*;

const NAMES: [&str; 2] = ["app", "side"];

/// Captures the running containers `ids` (named [`NAMES`] in the pod) in stop mode and
/// publishes them as the pod checkpoint `pod/<id>`, as the agent's executor does.
fn publish_pod(w: &World, ids: [&str; 2]) -> String {
    let dir = w.path("pod-images");
    let images: Vec<ImageDir> = NAMES
        .iter()
        .map(|n| ImageDir::new(dir.join(pod_container_dir(n))))
        .collect();
    let members: Vec<PodMember<'_>> = ids
        .iter()
        .zip(&images)
        .map(|(id, image)| PodMember { id, image })
        .collect();
    let captured = checkpoint_pod(&PodCheckpoint {
        runc: &w.runc(),
        members: &members,
        leave_running: false,
        tcp_established: true,
    })
    .expect("checkpoint_pod");
    let first = captured[0].source.clone();
    let mut timings = Timings::default();
    let mut processes = Vec::new();
    let mut containers = Vec::new();
    for (name, c) in NAMES.iter().zip(captured) {
        timings.frozen_ms = timings.frozen_ms.max(c.timings.frozen_ms);
        timings.dump_ms += c.timings.dump_ms;
        processes.extend(c.processes.iter().cloned());
        containers.push(PodContainer {
            name: (*name).to_owned(),
            source: c.source,
            processes: c.processes,
            rootfs: c.rootfs,
            image_digest: c.image_digest,
            gpu_processes: c.gpu_processes,
        });
    }
    std::fs::write(
        dir.join(POD_INDEX_FILE),
        serde_json::to_vec(&PodIndex { containers }).unwrap(),
    )
    .unwrap();
    let id = CheckpointId::from_parts(1_700_000_000_000, 7);
    let draft = Manifest {
        schema_version: SCHEMA_VERSION,
        workload: WorkloadName::new("pod".to_owned()).unwrap(),
        created_at: id.created_rfc3339(),
        id,
        key_id: String::new(),
        source: first,
        leave_running: false,
        requirements: Requirements {
            node: stasis_engine::node::fingerprint(),
            needs_runc: true,
            image_digest: None,
            declared: BTreeMap::new(),
        },
        processes,
        rootfs: None,
        timings,
        stats: Default::default(),
        files: Vec::new(),
        gpu_processes: 0,
        labels: BTreeMap::from([(POD_CONTAINERS_LABEL.to_owned(), NAMES.join(","))]),
    };
    let store = Store::open(&w.store).unwrap();
    let key = Key::load(&w.key).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let m = rt
        .block_on(store.put_checkpoint(&key, draft, &dir, &NoProgress))
        .expect("publish the pod checkpoint");
    std::fs::remove_dir_all(&dir).unwrap();
    m.reference().to_string()
}

#[test]
fn a_pod_checkpoint_is_inspected_restored_and_exported_one_container_at_a_time() {
    let test = "a_pod_checkpoint_is_inspected_restored_and_exported_one_container_at_a_time";
    if !ready(test) {
        return;
    }
    let mut w = World::new();
    let app = w.start("pod-app", &["STATE_MB=8"]);
    let side = w.start("pod-side", &["STATE_MB=8"]);
    app.wait_count(2);
    side.wait_count(2);
    let reference = publish_pod(&w, ["pod-app", "pod-side"]);
    let (app_stop, side_stop) = (app.last_count(), side.last_count());
    w.kill("pod-app");
    w.kill("pod-side");

    // inspect: each container, in the table and in JSON.
    let m = w.stasis(&["inspect", &reference, "-o", "json"]).json();
    let cs = m["containers"].as_array().expect("containers in JSON");
    assert_eq!(cs.len(), 2, "{m}");
    for (c, (name, id)) in cs.iter().zip(NAMES.iter().zip(["pod-app", "pod-side"])) {
        assert_eq!(c["name"], *name, "{c}");
        assert_eq!(c["source"]["container_id"], id, "{c}");
        assert_eq!(c["processes"][0]["command"], "stasis-counter", "{c}");
        assert!(c["rootfs"]["method"].is_string(), "{c}");
        assert!(c["image_digest"].as_str().unwrap().starts_with("sha256:"));
    }
    let table = w.stasis(&["inspect", &reference]).expect_ok("inspect");
    println!("stasis inspect:\n{table}");
    assert!(table.contains("containers   2"), "{table}");
    for name in NAMES {
        let line = table
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no line for {name}:\n{table}"));
        assert!(
            line.contains("1 processes") && line.contains("sha256:"),
            "{line}"
        );
    }
    let list = w.stasis(&["list", "-o", "json"]).json();
    assert_eq!(list[0]["containers"], serde_json::json!(NAMES), "{list}");
    let listed = w.stasis(&["list"]).expect_ok("list");
    assert!(listed.contains("pod, 2 containers: app,side"), "{listed}");

    // restore without --container: refused, naming the containers and the way to choose.
    let (run, _) = w.restore(&reference, "pod-none", &["STATE_MB=8"], &[]);
    let e = run.expect_err("a restore of a pod checkpoint without --container");
    assert!(
        e.contains("app, side") && e.contains("--container NAME"),
        "{e}"
    );
    assert_eq!(w.status("pod-none"), None, "a container was made");
    let (run, _) = w.restore(
        &reference,
        "pod-x",
        &["STATE_MB=8"],
        &["--container", "nope"],
    );
    assert!(run
        .expect_err("--container nope")
        .contains("no container \"nope\""));

    // The container's own image digest (from the pod index) is checked against the bundle's.
    let other = format!("sha256:{}", "0".repeat(64));
    let (run, _) = w.restore(
        &reference,
        "pod-y",
        &["STATE_MB=8"],
        &["--container", "side", "--image-digest", &other],
    );
    let e = run.expect_err("a restore into a bundle of another image");
    assert!(e.contains("image_digest"), "{e}");
    assert_eq!(w.status("pod-y"), None, "a container was made");

    // restore --container side: that counter continues.
    let (run, r) = w.restore(
        &reference,
        "pod-side-2",
        &["STATE_MB=8"],
        &["--container", "side"],
    );
    run.expect_ok("restore --container side");
    continues(&r, side_stop);
    w.kill("pod-side-2");

    // export: refused without --container; one container's archive imports and restores.
    let archive = w.path("app.tar");
    let e = export(&w, &reference, &[], &archive)
        .expect_err("an export of a pod checkpoint without --container");
    assert!(
        e.contains("app, side") && e.contains("--container NAME"),
        "{e}"
    );
    assert!(!archive.exists());
    let report = export(
        &w,
        &reference,
        &["--container", "app", "-o", "json"],
        &archive,
    )
    .json();
    assert!(report["images"].as_u64().unwrap() > 5, "{report}");
    w.stasis(&[
        "import",
        archive.to_str().unwrap(),
        "--workload",
        "imported",
    ])
    .expect_ok("import");
    let imported = w
        .stasis(&["inspect", "imported/latest", "-o", "json"])
        .json();
    assert_eq!(
        imported["labels"]["stasis.dev/container-name"], "app",
        "{imported}"
    );
    assert!(imported.get("containers").is_none(), "{imported}");
    let (run, r) = w.restore("imported/latest", "pod-app-2", &["STATE_MB=8"], &[]);
    run.expect_ok("restore of the imported app container");
    continues(&r, app_stop);
}

/// `stasis export <reference> --file <archive> <extra>`.
fn export(w: &World, reference: &str, extra: &[&str], archive: &std::path::Path) -> Run {
    let mut args = vec!["export", reference, "--file", archive.to_str().unwrap()];
    args.extend_from_slice(extra);
    w.stasis(&args)
}

/// The restored counter `r` goes on from where its original was stopped (at `stopped`, by the
/// stop-mode capture: the last lines may still have been in the pipe) and counts on, intact.
fn continues(r: &Container, stopped: u64) {
    r.wait_count(3);
    let counts = r.counts();
    assert!(
        counts[0] > 0 && counts[0] <= stopped + 1 && counts[0] + 5 >= stopped,
        "{} restored at count {} (its original stopped at {stopped})",
        r.id,
        counts[0]
    );
    assert!(counts.windows(2).all(|p| p[1] == p[0] + 1), "{counts:?}");
    assert!(!r.corrupt(), "{:?}", r.lines());
}
