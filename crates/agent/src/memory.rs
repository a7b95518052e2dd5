//! The memory trigger: a checkpoint of a pod before the kernel's OOM killer or the kubelet's
//! node-pressure eviction throws its work away.
//!
//! Every poll (`STASIS_MEMORY_POLL_MS`, default 1000) the agent reads the memory cgroup of each
//! container of the running, opted-in pods of its node whose policy has
//! `triggers.memoryPercent`, and (every fifth poll) its own Node's `MemoryPressure` condition.
//! A container whose working set reached the policy's share of its limit, or a node under
//! memory pressure for a policy with `triggers.nodeMemoryPressure`, asks for a `PodCheckpoint`
//! with reason `MemoryPressure`; `stasis_core::memory` decides whether one is created now (none
//! while one of the pod's checkpoints is in flight, at most one per `min_gap`). The checkpoint
//! runs through this agent's own `PodCheckpoint` watcher like any other; once published it is the
//! one the OOM restart in place restores (docs/design.md §12.5a).
//!
//! The cgroup directories come from runc's state (`cgroup_paths`: v1's `memory` entry, v2's
//! unified `""` entry), read through `STASIS_HOST_ROOT` like every node path the agent reads.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde::Deserialize;
use stasis_api::{
    CheckpointPhase, CheckpointPolicy, CheckpointReason, PodCheckpoint, PodCheckpointSpec,
};
use stasis_core::memory::{self as core_memory, CgroupVersion, Reading, Verdict};
use stasis_core::policy::Interval;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::status::PodKey;

/// The node is asked for its conditions once per this many polls.
const NODE_EVERY: u32 = 5;

/// What the watcher needs of the cluster and the node.
pub struct MemoryContext {
    pub client: Client,
    pub node: String,
    pub runtime_class: String,
    pub pods: Store<Pod>,
    pub policies: Store<CheckpointPolicy>,
    pub metrics: Arc<Metrics>,
    /// runc's state directory (`<root>/<container id>/state.json`).
    pub runc_root: PathBuf,
}

/// What a policy asks of the memory trigger for one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Wants {
    /// The lowest `memoryPercent` among the policies selecting the pod.
    pub percent: Option<i32>,
    /// Whether a selecting policy wants a checkpoint on node memory pressure.
    pub node_pressure: bool,
    /// The heartbeat interval (`None`: `auto`), for the rate limit.
    pub heartbeat: Option<Duration>,
}

/// The running, opted-in pods of `node` whose policies want the memory trigger.
pub fn memory_targets(
    pods: &[Arc<Pod>],
    policies: &[Arc<CheckpointPolicy>],
    node: &str,
    runtime_class: &str,
) -> Vec<(PodKey, Wants)> {
    let mut out = Vec::new();
    for p in pods {
        let spec = p.spec.as_ref();
        if spec.and_then(|s| s.node_name.as_deref()) != Some(node)
            || spec.and_then(|s| s.runtime_class_name.as_deref()) != Some(runtime_class)
            || p.metadata.deletion_timestamp.is_some()
            || p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
        {
            continue;
        }
        let ns = p.namespace().unwrap_or_default();
        let mut wants = Wants {
            percent: None,
            node_pressure: false,
            heartbeat: None,
        };
        let mut selected = false;
        for pol in policies.iter().filter(|pol| {
            pol.metadata.namespace.as_deref() == Some(ns.as_str())
                && crate::selector::matches(&pol.spec.selector, p.labels())
        }) {
            selected = true;
            let t = &pol.spec.triggers;
            if let Some(pct) = t.memory_percent {
                wants.percent = Some(wants.percent.map_or(pct, |w| w.min(pct)));
            }
            wants.node_pressure |= t.node_memory_pressure;
            if let Ok(Interval::Fixed(d)) = pol.spec.interval() {
                wants.heartbeat = Some(wants.heartbeat.map_or(d, |w| w.min(d)));
            }
        }
        if selected && (wants.percent.is_some() || wants.node_pressure) {
            out.push((
                PodKey {
                    namespace: ns,
                    name: p.name_any(),
                    uid: p.metadata.uid.clone().unwrap_or_default(),
                },
                wants,
            ));
        }
    }
    out
}

/// The memory cgroup of a container, from runc's `state.json`.
pub fn memory_cgroup(state_json: &[u8]) -> Option<(CgroupVersion, PathBuf)> {
    #[derive(Deserialize)]
    struct State {
        #[serde(default)]
        cgroup_paths: BTreeMap<String, String>,
    }
    let s: State = serde_json::from_slice(state_json).ok()?;
    if let Some(d) = s.cgroup_paths.get("memory") {
        return Some((CgroupVersion::V1, PathBuf::from(d)));
    }
    s.cgroup_paths
        .get("")
        .map(|d| (CgroupVersion::V2, PathBuf::from(d)))
}

/// Reads a memory cgroup's usage, limit and stat (`dir` as the node names it).
pub fn read_cgroup(version: CgroupVersion, dir: &Path) -> Result<Reading, String> {
    let dir = stasis_engine::tools::host_path(dir);
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{}: {e}", dir.join(f).display()))
    };
    let [usage, limit, stat] = version.files();
    Reading::parse(version, &read(usage)?, &read(limit)?, &read(stat)?).map_err(|e| e.to_string())
}

/// Why a pod is checkpointed.
#[derive(Debug, Clone, PartialEq)]
pub enum Cause {
    /// A container's working set reached the policy's share of its limit.
    Container {
        container: String,
        reading: Reading,
        percent: i32,
    },
    /// The node reports `MemoryPressure`.
    Node,
}

fn mib(b: u64) -> u64 {
    b >> 20
}

impl Cause {
    fn kind(&self) -> &'static str {
        match self {
            Cause::Container { .. } => "ContainerLimit",
            Cause::Node => "NodePressure",
        }
    }

    fn text(&self, node: &str) -> String {
        match self {
            Cause::Container {
                container,
                reading,
                percent,
            } => format!(
                "container {container}'s working set {} MiB reached {:.0}% of its {} MiB memory limit (the policy's threshold is {percent}%)",
                mib(reading.working_set_bytes),
                reading.percent().unwrap_or_default(),
                mib(reading.limit_bytes.unwrap_or_default()),
            ),
            Cause::Node => format!(
                "node {node} reports MemoryPressure: the kubelet may evict pods without a grace period"
            ),
        }
    }
}

/// The first container of the pod over `percent` (app containers of the pod in runc's root).
fn container_over(root: &Path, pod_uid: &str, percent: i32) -> Option<Cause> {
    let all = crate::resolve::list(root);
    for c in crate::resolve::pod_containers(&all, pod_uid) {
        let Ok(raw) = std::fs::read(root.join(&c.id).join("state.json")) else {
            continue;
        };
        let Some((version, dir)) = memory_cgroup(&raw) else {
            continue;
        };
        match read_cgroup(version, &dir) {
            Ok(r) if r.over(percent) => {
                let name = match c.kind() {
                    crate::resolve::Kind::App(p) => p.container_name,
                    _ => c.id.clone(),
                };
                return Some(Cause::Container {
                    container: name,
                    reading: r,
                    percent,
                });
            }
            Ok(_) => {}
            Err(e) => debug!(container = %c.id, error = %e, "memory cgroup not readable"),
        }
    }
    None
}

/// What the API says of a pod's checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Facts {
    /// One is pending or running.
    in_flight: bool,
    /// When the last memory checkpoint that did not fail was created (Unix ms).
    last_memory: Option<u64>,
    /// When the last failed memory checkpoint was created (Unix ms).
    last_memory_failed: Option<u64>,
    /// The duration of the last succeeded checkpoint.
    last_cost: Option<Duration>,
}

fn checkpoint_facts(cks: &[PodCheckpoint], pod_uid: &str) -> Facts {
    let mine = cks.iter().filter(|c| {
        c.spec.source_pod_uid.as_deref() == Some(pod_uid)
            || c.status.as_ref().and_then(|s| s.source_pod_uid.as_deref()) == Some(pod_uid)
    });
    let mut f = Facts::default();
    let mut last_cost = None::<(u64, Duration)>;
    for c in mine {
        let phase = c.status.as_ref().and_then(|s| s.phase);
        if matches!(
            phase,
            None | Some(CheckpointPhase::Pending) | Some(CheckpointPhase::Running)
        ) {
            f.in_flight = true;
        }
        let created = c
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_millisecond().max(0) as u64);
        if c.spec.reason == CheckpointReason::MemoryPressure {
            if phase == Some(CheckpointPhase::Failed) {
                f.last_memory_failed = f.last_memory_failed.max(created);
            } else {
                f.last_memory = f.last_memory.max(created);
            }
        }
        if let (Some(CheckpointPhase::Succeeded), Some(total), Some(at)) = (
            phase,
            c.status.as_ref().and_then(|s| s.total_millis),
            created,
        ) {
            if last_cost.is_none_or(|(t, _)| at > t) {
                last_cost = Some((at, Duration::from_millis(total.max(0) as u64)));
            }
        }
    }
    f.last_cost = last_cost.map(|(_, d)| d);
    f
}

/// The watcher's state between polls.
struct Watcher {
    ctx: MemoryContext,
    /// Pod UID → no API look-up before this time (rate-limited or in flight).
    quiet_until: HashMap<String, u64>,
    node_pressure: bool,
}

impl Watcher {
    async fn node_under_pressure(&self) -> bool {
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        match api.get(&self.ctx.node).await {
            Ok(n) => n
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "MemoryPressure" && c.status == "True"),
            Err(e) => {
                debug!(error = %e, "cannot read this node's conditions");
                self.node_pressure
            }
        }
    }

    async fn poll(&mut self, round: u32) {
        if round % NODE_EVERY == 0 {
            let now = self.node_under_pressure().await;
            if now != self.node_pressure {
                info!(node = %self.ctx.node, pressure = now, "node MemoryPressure condition changed");
            }
            self.node_pressure = now;
        }
        let targets = memory_targets(
            &self.ctx.pods.state(),
            &self.ctx.policies.state(),
            &self.ctx.node,
            &self.ctx.runtime_class,
        );
        let now = stasis_core::time::now_ms();
        self.quiet_until.retain(|_, until| *until > now);
        for (pod, wants) in targets {
            if self.quiet_until.contains_key(&pod.uid) {
                continue;
            }
            let cause = if wants.node_pressure && self.node_pressure {
                Some(Cause::Node)
            } else {
                let root = self.ctx.runc_root.clone();
                match wants.percent {
                    Some(pct) => {
                        let uid = pod.uid.clone();
                        tokio::task::spawn_blocking(move || container_over(&root, &uid, pct))
                            .await
                            .ok()
                            .flatten()
                    }
                    None => None,
                }
            };
            if let Some(cause) = cause {
                self.act(&pod, &wants, cause).await;
            }
        }
    }

    /// Creates the checkpoint unless one is in flight or the last memory checkpoint is recent.
    async fn act(&mut self, pod: &PodKey, wants: &Wants, cause: Cause) {
        let api: Api<PodCheckpoint> = Api::namespaced(self.ctx.client.clone(), &pod.namespace);
        let lp = ListParams::default().fields(&format!("spec.sourcePodName={}", pod.name));
        let cks = match api.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                warn!(pod = %pod.name, error = %e, "cannot list the pod's checkpoints");
                self.ctx.metrics.error("kube");
                return;
            }
        };
        let f = checkpoint_facts(&cks, &pod.uid);
        let gap = core_memory::min_gap(wants.heartbeat, f.last_cost);
        let now = stasis_core::time::now_ms();
        // A failed one (the pod was not registered yet, the store was down) is retried after
        // the shortest gap, not the full one.
        let verdict = match core_memory::verdict(f.in_flight, f.last_memory, gap, now) {
            Verdict::Checkpoint => {
                core_memory::verdict(false, f.last_memory_failed, core_memory::MIN_GAP, now)
            }
            v => v,
        };
        match verdict {
            Verdict::InFlight => {
                self.quiet_until.insert(pod.uid.clone(), now + 2_000);
            }
            Verdict::RateLimited { until_unix_ms } => {
                debug!(pod = %pod.name, until_unix_ms, "memory checkpoint rate-limited");
                self.quiet_until.insert(pod.uid.clone(), until_unix_ms);
            }
            Verdict::Checkpoint => {
                self.quiet_until.insert(pod.uid.clone(), now + 2_000);
                self.create(&api, pod, &cause).await;
            }
        }
    }

    async fn create(&self, api: &Api<PodCheckpoint>, pod: &PodKey, cause: &Cause) {
        let base: String = pod.name.chars().take(200).collect();
        let name = format!("{base}-memory-{:08x}", rand::random::<u32>());
        let mut c = PodCheckpoint::new(
            &name,
            PodCheckpointSpec {
                source_pod_name: pod.name.clone(),
                source_pod_uid: Some(pod.uid.clone()),
                reason: CheckpointReason::MemoryPressure,
                timeout_seconds: None,
            },
        );
        // Run by this agent's own watcher (no created-by label); the node label lets the API
        // server accept it from this node's agent (as a notice's checkpoints).
        c.metadata.labels = Some(BTreeMap::from([(
            stasis_api::names::NODE.to_owned(),
            self.ctx.node.clone(),
        )]));
        match api.create(&crate::k8s::created_by_agent(), &c).await {
            Ok(_) => {
                let why = cause.text(&self.ctx.node);
                info!(pod = %pod.name, namespace = %pod.namespace, checkpoint = %name, "{why}: checkpoint started");
                self.ctx.metrics.memory_trigger(cause.kind());
                let msg = format!(
                    "{why}: checkpoint {name} started, so that an OOM kill or an eviction resumes from it"
                );
                let ev = crate::status::pod_event(
                    pod,
                    stasis_api::names::event::MEMORY_PRESSURE,
                    &msg,
                    true,
                    &self.ctx.node,
                    crate::status::now(),
                );
                let events: Api<k8s_openapi::api::core::v1::Event> =
                    Api::namespaced(self.ctx.client.clone(), &pod.namespace);
                if let Err(e) = events.create(&crate::k8s::created_by_agent(), &ev).await {
                    warn!(pod = %pod.name, error = %e, "cannot create an Event");
                }
            }
            Err(e) => {
                warn!(pod = %pod.name, error = %e, "cannot create the memory checkpoint");
                self.ctx.metrics.error("kube");
            }
        }
    }
}

/// The poll period: `STASIS_MEMORY_POLL_MS` (at least 100 ms), else one second.
pub fn poll_period() -> Duration {
    std::env::var("STASIS_MEMORY_POLL_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(1), |ms| {
            Duration::from_millis(ms.max(100))
        })
}

/// Watches until `stop`.
pub async fn run(ctx: MemoryContext, stop: Arc<AtomicBool>) {
    let period = poll_period();
    info!(
        poll_ms = period.as_millis() as u64,
        "watching memory of opted-in pods and the node's MemoryPressure"
    );
    stasis_api::cache::wait_ready(&ctx.pods).await;
    let mut w = Watcher {
        ctx,
        quiet_until: HashMap::new(),
        node_pressure: false,
    };
    let mut round = 0u32;
    while !stop.load(Ordering::Relaxed) {
        w.poll(round).await;
        round = round.wrapping_add(1);
        tokio::time::sleep(period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, node: &str, phase: &str, app: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                             "labels": {"app": app}},
                "spec": {"nodeName": node, "runtimeClassName": "stasis",
                         "containers": [{"name": "c", "image": "i"}]},
                "status": {"phase": phase}
            }))
            .unwrap(),
        )
    }

    fn policy(name: &str, app: &str, triggers: serde_json::Value) -> Arc<CheckpointPolicy> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
                "metadata": {"name": name, "namespace": "ml"},
                "spec": {"selector": {"matchLabels": {"app": app}}, "interval": "2m",
                         "triggers": triggers}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn targets_and_what_their_policies_want() {
        let pods = vec![
            pod("a", "w1", "Running", "train"),
            pod("b", "w1", "Running", "serve"),
            pod("pending", "w1", "Pending", "train"),
            pod("elsewhere", "w2", "Running", "train"),
            pod("unselected", "w1", "Running", "other"),
        ];
        let pols = vec![
            policy("p1", "train", json!({"memoryPercent": 90})),
            policy(
                "p2",
                "train",
                json!({"memoryPercent": 80, "nodeMemoryPressure": false}),
            ),
            policy("p3", "serve", json!({"nodeMemoryPressure": false})),
        ];
        let t = memory_targets(&pods, &pols, "w1", "stasis");
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0.name, "a");
        assert_eq!(
            t[0].1,
            Wants {
                percent: Some(80),
                node_pressure: true,
                heartbeat: Some(Duration::from_secs(120)),
            }
        );
        // Node pressure is on by default: a policy without memoryPercent still selects.
        let t = memory_targets(&pods, &[policy("p", "serve", json!({}))], "w1", "stasis");
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].1.percent, None);
        assert!(t[0].1.node_pressure);
    }

    #[test]
    fn memory_cgroup_of_both_versions() {
        let v1 = br#"{"cgroup_paths":{"cpu":"/sys/fs/cgroup/cpu/k/c","memory":"/sys/fs/cgroup/memory/k/c"}}"#;
        assert_eq!(
            memory_cgroup(v1),
            Some((
                CgroupVersion::V1,
                PathBuf::from("/sys/fs/cgroup/memory/k/c")
            ))
        );
        let v2 = br#"{"cgroup_paths":{"":"/sys/fs/cgroup/k/c"}}"#;
        assert_eq!(
            memory_cgroup(v2),
            Some((CgroupVersion::V2, PathBuf::from("/sys/fs/cgroup/k/c")))
        );
        assert_eq!(memory_cgroup(b"{}"), None);
        assert_eq!(memory_cgroup(b"not json"), None);
    }

    /// The v1 path against the kernel itself: a memory cgroup with a 64 MiB limit, 40 MiB of
    /// tmpfs pages charged to it by a shell that joined it (shmem is not page cache the kernel
    /// could drop: it is in the working set).
    #[test]
    fn reads_a_real_cgroup_v1_memory_controller() {
        let base = Path::new("/sys/fs/cgroup/memory");
        if !base.join("memory.usage_in_bytes").exists() {
            eprintln!("SKIPPED: no cgroup v1 memory controller at {} (the v2 path is tested on fixture files)", base.display());
            return;
        }
        let dir = base.join(format!("stasis-memory-test-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&dir) {
            eprintln!("SKIPPED: cannot create {} ({e}): needs root", dir.display());
            return;
        }
        let shm = PathBuf::from(format!(
            "/dev/shm/stasis-memory-test-{}",
            std::process::id()
        ));
        struct Cleanup(PathBuf, PathBuf);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.1);
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let _cleanup = Cleanup(dir.clone(), shm.clone());
        std::fs::write(dir.join("memory.limit_in_bytes"), "67108864").unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && head -c 41943040 /dev/zero > {}",
                dir.display(),
                shm.display()
            ))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let r = read_cgroup(CgroupVersion::V1, &dir).unwrap();
        let pct = r.percent().unwrap();
        assert_eq!(r.limit_bytes, Some(64 << 20));
        assert!((60.0..90.0).contains(&pct), "{r:?}: {pct:.1}%");
        assert!(r.over(60) && !r.over(90), "{r:?}");
        // Without the pages, the working set falls back under the threshold.
        std::fs::remove_file(&shm).unwrap();
        let r = read_cgroup(CgroupVersion::V1, &dir).unwrap();
        assert!(!r.over(60), "{r:?}");
    }

    /// The v2 path against fixture files laid out as the kernel does (this machine runs v1).
    #[test]
    fn reads_a_v2_cgroup_directory() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("memory.current"), "230686720\n").unwrap();
        std::fs::write(d.path().join("memory.max"), "268435456\n").unwrap();
        std::fs::write(
            d.path().join("memory.stat"),
            "anon 220200960\nfile 10485760\ninactive_file 8388608\nactive_file 2097152\n",
        )
        .unwrap();
        let r = read_cgroup(CgroupVersion::V2, d.path()).unwrap();
        assert_eq!(r.working_set_bytes, 230_686_720 - 8_388_608);
        assert!(r.over(80));
        let e = read_cgroup(CgroupVersion::V1, d.path()).unwrap_err();
        assert!(e.contains("memory.usage_in_bytes"), "{e}");
    }

    fn ck(
        reason: CheckpointReason,
        phase: Option<CheckpointPhase>,
        at: &str,
        total: i64,
    ) -> PodCheckpoint {
        serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "x", "namespace": "ml", "creationTimestamp": at},
            "spec": {"sourcePodName": "a", "sourcePodUID": "uid-a",
                     "reason": serde_json::to_value(reason).unwrap()},
            "status": match phase {
                None => json!(null),
                Some(p) => json!({"phase": p, "totalMillis": total}),
            }
        }))
        .unwrap()
    }

    #[test]
    fn facts_from_the_pods_checkpoints() {
        let t0 = "2026-12-01T10:00:00Z";
        let t1 = "2026-12-01T10:05:00Z";
        let cks = vec![
            ck(
                CheckpointReason::Heartbeat,
                Some(CheckpointPhase::Succeeded),
                t0,
                900,
            ),
            ck(
                CheckpointReason::MemoryPressure,
                Some(CheckpointPhase::Succeeded),
                t1,
                1_500,
            ),
        ];
        let ms = |t: &str| stasis_core::time::parse_rfc3339_nanos(t).unwrap() as u64 / 1_000_000;
        let f = checkpoint_facts(&cks, "uid-a");
        assert!(!f.in_flight);
        assert_eq!(f.last_memory, Some(ms(t1)));
        assert_eq!(f.last_memory_failed, None);
        assert_eq!(f.last_cost, Some(Duration::from_millis(1_500)));
        let mut more = cks.clone();
        more.push(ck(CheckpointReason::Heartbeat, None, t1, 0));
        assert!(
            checkpoint_facts(&more, "uid-a").in_flight,
            "a checkpoint without status is in flight"
        );
        let t2 = "2026-12-01T10:06:00Z";
        more = cks.clone();
        more.push(ck(
            CheckpointReason::MemoryPressure,
            Some(CheckpointPhase::Failed),
            t2,
            0,
        ));
        let f = checkpoint_facts(&more, "uid-a");
        assert_eq!(
            (f.last_memory, f.last_memory_failed),
            (Some(ms(t1)), Some(ms(t2)))
        );
        assert_eq!(checkpoint_facts(&cks, "uid-other"), Facts::default());
    }
}
