//! The stand-ins of `bench/scale.sh` (the control plane at scale, on simulated nodes):
//!
//! ```text
//! scale_sim agents --records-namespace stasis-system [--work-ms 200] [--concurrency 64]
//! scale_sim pods --namespace NS --namespaces K --count P --rate 50 --nodes N [--per-owner 10]
//! ```
//!
//! `agents` plays every node's agent. Simulated (kwok) nodes run no containers, so nothing is
//! frozen, dumped or uploaded: for each new `PodCheckpoint` it makes the agent's API calls and
//! nothing else, with the fields the agent writes (`crates/agent/src/status.rs`,
//! `k8s/cluster.rs`): a list of the lineage records held by the source pod's UID (the agent's
//! stamp: lineage and generation), the status `Running` (node, `sourcePodUID`, lineage,
//! generation, start time), after `--work-ms` a get of that record (the fence before
//! publishing), then `Succeeded` with a new checkpoint reference of that lineage and a manifest
//! digest of the agent's form, each by forced server-side apply as `stasisd`. The controller
//! publishes it under its usual rules (holder, node, lineage, digest). One watch of all
//! `PodCheckpoint`s stands in for the agents' per-node watches.
//!
//! `pods` creates `--count` pods with `runtimeClassName: stasis`, bound to the simulated nodes
//! (`--node-prefix`0 … N-1: no scheduler runs), in namespaces `NS-0` … `NS-<K-1>` (the controller
//! caps lineage records per namespace, 1,000 by default), at `--rate` per second, through the API
//! server and so through stasis's webhook. Each belongs to a `ReplicaSet` it creates first (so the
//! webhook finds a verified workload identity), and the pods are created as the ReplicaSet
//! controller's service account (impersonated), as a real ReplicaSet's pods are. Prints the
//! create latencies (p50, p99, max) as the client sees them.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Config, Resource, ResourceExt};
use serde_json::json;
use stasis_api::lineage::RECORD_KEY;
use stasis_api::names::{self, reason};
use stasis_api::{CheckpointPhase, PodCheckpoint};
use stasis_core::lineage::Lineage;
use stasis_core::CheckpointId;
use tokio::sync::Semaphore;

/// The agent's field manager (`stasis_agent::k8s::MANAGER`).
const AGENT_MANAGER: &str = "stasisd";

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Play every node's agent: mark each new PodCheckpoint Running, then Succeeded.
    Agents {
        /// stasis's namespace (where the lineage records are).
        #[arg(long)]
        records_namespace: String,
        /// Time between Running and Succeeded (the checkpoint's work, which nothing does here).
        #[arg(long, default_value_t = 200)]
        work_ms: u64,
        /// Checkpoints handled at once.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
    },
    /// Create pods of the stasis RuntimeClass at a steady rate, through the webhook.
    Pods {
        /// Namespace prefix: the pods go to `<namespace>-0` … `<namespace>-<namespaces - 1>`.
        #[arg(long)]
        namespace: String,
        #[arg(long, default_value_t = 1)]
        namespaces: u64,
        #[arg(long)]
        count: u64,
        /// Pod creations per second.
        #[arg(long, default_value_t = 50.0)]
        rate: f64,
        /// Simulated nodes the pods are bound to, round robin.
        #[arg(long)]
        nodes: u64,
        #[arg(long, default_value = "kwok-node-")]
        node_prefix: String,
        /// Pods per ReplicaSet.
        #[arg(long, default_value_t = 10)]
        per_owner: u64,
        /// Name prefix of the pods and ReplicaSets.
        #[arg(long, default_value = "scale")]
        prefix: String,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    match Cli::parse().cmd {
        Cmd::Agents {
            records_namespace,
            work_ms,
            concurrency,
        } => agents(records_namespace, work_ms, concurrency).await,
        Cmd::Pods {
            namespace,
            namespaces,
            count,
            rate,
            nodes,
            node_prefix,
            per_owner,
            prefix,
        } => {
            let p = PodsArgs {
                namespace,
                namespaces: namespaces.max(1),
                count,
                rate,
                nodes,
                node_prefix,
                per_owner: per_owner.max(1),
                prefix,
            };
            pods(p).await
        }
    }
}

#[derive(Default)]
struct Counts {
    succeeded: AtomicU64,
    failed: AtomicU64,
    errors: AtomicU64,
}

impl Counts {
    fn line(&self) -> String {
        format!(
            "stand-in agents: {} checkpoints marked Succeeded, {} Failed (no record or fenced), {} API errors",
            self.succeeded.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed)
        )
    }
}

async fn agents(records_ns: String, work_ms: u64, concurrency: usize) -> Result<()> {
    let client = Client::try_default().await?;
    let counts = Arc::new(Counts::default());
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let c = counts.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(10)).await;
            println!("{}", c.line());
        }
    });
    let mut seen: HashSet<(String, String)> = HashSet::new();
    let api: Api<PodCheckpoint> = Api::all(client.clone());
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    loop {
        let ck = tokio::select! {
            ev = events.try_next() => match ev? { Some(ck) => ck, None => break },
            _ = tokio::signal::ctrl_c() => break,
        };
        let new = ck.status.as_ref().and_then(|s| s.phase).is_none()
            || ck.status.as_ref().and_then(|s| s.phase) == Some(CheckpointPhase::Pending);
        let key = (ck.namespace().unwrap_or_default(), ck.name_any());
        if !new || !seen.insert(key) {
            continue;
        }
        let (client, ns, counts) = (client.clone(), records_ns.clone(), counts.clone());
        let permit = slots.clone().acquire_owned().await?;
        tokio::spawn(async move {
            match play(&client, &ns, &ck, work_ms).await {
                Ok(true) => counts.succeeded.fetch_add(1, Ordering::Relaxed),
                Ok(false) => counts.failed.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    eprintln!("stand-in agent: {}: {e:#}", ck.name_any());
                    counts.errors.fetch_add(1, Ordering::Relaxed)
                }
            };
            drop(permit);
        });
    }
    println!("{}", counts.line());
    Ok(())
}

/// The agent's stamp: the lineage and generation of the record that names the pod as holder in
/// its namespace (a held one before an orphaned one, then the newest generation).
fn stamp(records: &[ConfigMap], ns: &str, uid: &str) -> Option<(Lineage, String)> {
    records
        .iter()
        .filter(|cm| {
            let l = cm.labels();
            l.get(names::NAMESPACE).map(String::as_str) == Some(ns)
                && l.get(names::HOLDER_UID).map(String::as_str) == Some(uid)
        })
        .filter_map(|cm| {
            let raw = cm.data.as_ref()?.get(RECORD_KEY)?;
            Some((serde_json::from_str::<Lineage>(raw).ok()?, cm.name_any()))
        })
        .max_by_key(|(l, _)| (!l.orphaned, l.generation))
}

/// One checkpoint, as the agent of its source pod's node writes it. `Ok(false)`: marked Failed.
async fn play(client: &Client, records_ns: &str, ck: &PodCheckpoint, work_ms: u64) -> Result<bool> {
    let ns = ck.namespace().unwrap_or_default();
    let name = ck.name_any();
    let api: Api<PodCheckpoint> = Api::namespaced(client.clone(), &ns);
    let uid = ck.spec.source_pod_uid.clone().unwrap_or_default();
    // The controller labels its heartbeats with the pod's node; the agent of that node takes it.
    let node = ck.labels().get(names::NODE).cloned().unwrap_or_default();
    let records: Api<ConfigMap> = Api::namespaced(client.clone(), records_ns);
    let lp = ListParams::default().labels(&format!(
        "{}=true,{}={uid}",
        names::LINEAGE_RECORD,
        names::HOLDER_UID
    ));
    let held = records.list(&lp).await?.items;
    let Some((lineage, record)) = stamp(&held, &ns, &uid) else {
        let why = format!("no lineage record names this pod (UID {uid}) as its holder");
        apply(
            &api,
            &name,
            json!({"phase": "Failed", "node": node,
            "conditions": [ready(false, reason::CHECKPOINT_FAILED, &why)]}),
        )
        .await?;
        return Ok(false);
    };
    let started = now();
    let running = json!({
        "phase": "Running", "node": node, "sourcePodUID": uid, "lineage": lineage.id.to_string(),
        "generation": lineage.generation, "startTime": started,
        "conditions": [ready(false, reason::CHECKPOINT_IN_PROGRESS, "freezing, dumping and uploading")],
    });
    apply(&api, &name, running.clone()).await?;
    tokio::time::sleep(Duration::from_millis(work_ms)).await;
    // The fence before publishing: the record still names this pod, at this generation.
    let current = records.get_opt(&record).await?;
    let fenced = match current
        .as_ref()
        .and_then(|cm| stamp(std::slice::from_ref(cm), &ns, &uid))
    {
        Some((l, _)) if l.id == lineage.id && l.generation == lineage.generation => None,
        Some((l, _)) => Some(format!(
            "lineage {} is at generation {}, not {}",
            l.id, l.generation, lineage.generation
        )),
        None => Some(format!("lineage {} no longer names this pod", lineage.id)),
    };
    if let Some(why) = fenced {
        let mut s = running;
        s["phase"] = json!("Failed");
        s["conditions"] = json!([ready(false, reason::FENCED, &why)]);
        apply(&api, &name, s).await?;
        return Ok(false);
    }
    let id = CheckpointId::from_parts(now_ms(), rand::random());
    let reference = format!("{}/{}", lineage.id, id.as_str());
    let mut s = running;
    let done = json!({
        "phase": "Succeeded", "sizeBytes": 0, "uploadedBytes": 0, "checkpointRef": reference,
        // (no manifest exists: a digest of the form the agent reports)
        "manifestDigest": format!("sha256:{}", hex::encode(rand::random::<[u8; 32]>())),
        "freezeMillis": 0, "dumpMillis": 0, "uploadMillis": 0, "totalMillis": work_ms,
        "completionTime": now(),
        "conditions": [ready(true, reason::CHECKPOINT_COMPLETED, &format!("{reference} (simulated: nothing captured)"))],
    });
    for (k, v) in done.as_object().into_iter().flatten() {
        s[k] = v.clone();
    }
    apply(&api, &name, s).await?;
    Ok(true)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn now() -> String {
    let ms = now_ms();
    let (y, mo, d, h, mi, s) = stasis_core::time::civil_from_unix((ms / 1000) as i64);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

fn ready(ok: bool, reason: &str, message: &str) -> serde_json::Value {
    json!({"type": "Ready", "status": if ok { "True" } else { "False" }, "reason": reason,
        "message": message, "lastTransitionTime": now()})
}

/// Writes a `PodCheckpoint`'s status by forced server-side apply as `stasisd`, as the agent does.
async fn apply(api: &Api<PodCheckpoint>, name: &str, status: serde_json::Value) -> Result<()> {
    let patch = json!({
        "apiVersion": PodCheckpoint::api_version(&()),
        "kind": PodCheckpoint::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(AGENT_MANAGER).force();
    api.patch_status(name, &params, &Patch::Apply(&patch))
        .await
        .with_context(|| format!("status of {name}"))?;
    Ok(())
}

struct PodsArgs {
    namespace: String,
    namespaces: u64,
    count: u64,
    rate: f64,
    nodes: u64,
    node_prefix: String,
    per_owner: u64,
    prefix: String,
}

async fn pods(a: PodsArgs) -> Result<()> {
    let admin = Client::try_default().await?;
    let mut cfg = Config::infer().await?;
    cfg.auth_info.impersonate =
        Some("system:serviceaccount:kube-system:replicaset-controller".into());
    let as_rs_controller = Client::try_from(cfg)?;
    let owners = a.count.div_ceil(a.per_owner);
    let mut uids = Vec::with_capacity(owners as usize);
    for w in 0..owners {
        let ns = format!("{}-{}", a.namespace, w % a.namespaces);
        let rs_api: Api<ReplicaSet> = Api::namespaced(admin.clone(), &ns);
        let name = format!("{}-w{w:05}", a.prefix);
        let rs: ReplicaSet = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"rs": name}},
                "template": {"metadata": {"labels": {"rs": name, "app": "scale"}},
                    "spec": {"containers": [{"name": "app", "image": "registry.invalid/scale:1"}]}},
            },
        }))?;
        let rs = match rs_api.create(&PostParams::default(), &rs).await {
            Ok(rs) => rs,
            Err(kube::Error::Api(e)) if e.code == 409 => rs_api.get(&name).await?,
            Err(e) => return Err(e.into()),
        };
        uids.push((ns, name, rs.uid().unwrap_or_default()));
    }
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(a.count as usize)));
    let errors = Arc::new(AtomicU64::new(0));
    let period = Duration::from_secs_f64(1.0 / a.rate.max(0.01));
    let mut tick = tokio::time::interval(period);
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(a.count as usize);
    for i in 0..a.count {
        tick.tick().await;
        let (ns, rs, rs_uid) = &uids[(i / a.per_owner) as usize];
        let pod = pod(&a, i, rs, rs_uid)?;
        let api: Api<Pod> = Api::namespaced(as_rs_controller.clone(), ns);
        let (latencies, errors) = (latencies.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            match api.create(&PostParams::default(), &pod).await {
                Ok(_) => latencies.lock().unwrap().push(t.elapsed()),
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => {
                    if errors.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("pod create: {e}");
                    }
                }
            }
        }));
    }
    futures::future::join_all(tasks).await;
    let took = t0.elapsed().as_secs_f64();
    let mut l = latencies.lock().unwrap().clone();
    l.sort();
    let q = |p: f64| {
        l.get(((l.len() as f64 * p).ceil() as usize).saturating_sub(1))
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    println!(
        "pods: {} created in {took:.1} s ({:.1}/s asked {:.0}/s), {} errors; create latency ms p50 {:.1} p90 {:.1} p99 {:.1} max {:.1}",
        l.len(),
        l.len() as f64 / took,
        a.rate,
        errors.load(Ordering::Relaxed),
        q(0.5),
        q(0.9),
        q(0.99),
        q(1.0)
    );
    Ok(())
}

fn pod(a: &PodsArgs, i: u64, rs: &str, rs_uid: &str) -> Result<Pod> {
    let labels = BTreeMap::from([("app", "scale"), ("rs", rs)]);
    Ok(serde_json::from_value(json!({
        // Named as the ReplicaSet controller names its pods: the API server generates the name
        // (before admission) from the ReplicaSet's.
        "metadata": {
            "generateName": format!("{rs}-"),
            "labels": labels,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                "uid": rs_uid, "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": {
            "runtimeClassName": "stasis",
            "nodeName": format!("{}{}", a.node_prefix, i % a.nodes.max(1)),
            "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": "registry.invalid/scale:1"}],
        },
    }))?)
}
