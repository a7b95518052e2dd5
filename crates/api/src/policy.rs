//! `CheckpointPolicy`: which pods stasis checkpoints, how often, and what it may do with them.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a `CheckpointPolicy` asks for. Pods it selects (and that run with
/// `runtimeClassName: stasis`) are checkpointed on a heartbeat and on the triggers below, and
/// their replacements are restored from the latest checkpoint of the lineage they claim.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "stasis.dev",
    version = "v1alpha1",
    kind = "CheckpointPolicy",
    namespaced,
    status = "CheckpointPolicyStatus",
    shortname = "ckptpolicy",
    category = "stasis",
    printcolumn = r#"{"name":"Interval","type":"string","jsonPath":".spec.interval"}"#,
    printcolumn = r#"{"name":"KeepLast","type":"integer","jsonPath":".spec.retention.keepLast"}"#,
    printcolumn = r#"{"name":"Pods","type":"integer","jsonPath":".status.selectedPods"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointPolicySpec {
    /// Pods (in this namespace) the policy applies to. An empty selector selects every pod of
    /// the namespace that runs with `runtimeClassName: stasis`.
    pub selector: LabelSelector,

    /// Time between heartbeat checkpoints of one pod: a duration such as `30s`, `5m`, `1h30m`
    /// (units `ms`, `s`, `m`, `h`; at least 1s), or `auto`: per pod, Young/Daly's optimum from
    /// what its checkpoints cost (freeze and upload) and how often pods of its node pool are
    /// interrupted, kept within the freeze budget (`status.autoIntervals` shows each choice).
    #[schemars(
        regex(pattern = r"^(auto|([0-9]+(ms|s|m|h))+)$"),
        extend("x-kubernetes-validations" = [{
            "rule": "self == 'auto' || !self.matches('^([0-9]+(ms|s|m|h))+$') || duration(self) >= duration('1s')",
            "message": "interval: at least 1s"
        }])
    )]
    pub interval: String,

    /// Take a final checkpoint when a selected pod is stopped gracefully (drain, preemption,
    /// deletion with a grace period), bounded by the time left in its grace period.
    #[serde(default = "default_true")]
    pub on_termination: bool,

    /// How many checkpoints to keep, counted per lineage (one lineage per running pod).
    #[serde(default)]
    pub retention: Retention,

    /// Checkpoints on events other than the heartbeat.
    #[serde(default)]
    pub triggers: Triggers,

    /// Names of pod volumes declared safe to restore with: writable PersistentVolumes or
    /// hostPath volumes whose contents outlive the pod and are not captured. Without this, a pod
    /// with such a volume cold-starts, since its memory would pair with disk at a later instant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub safe_volumes: Vec<String>,

    /// Restore also after a container exited with an error (a crash). Off by default: the
    /// crashed process's memory may hold the cause of the crash.
    #[serde(default)]
    pub restore_on_crash: bool,

    /// After the final checkpoint an EvictionRequest asks stasis for (or a spot notice's), keep
    /// the pod frozen from its capture until the eviction stops it (at most 60 s; for a notice,
    /// until the instance stops), so that it does no work its replacement will do again. Off by
    /// default: a pod that serves stops answering from the capture (and during the upload)
    /// until it is evicted. Pods with CUDA processes are not held.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hold_until_evicted: bool,

    /// Largest share of the liveness probe's budget
    /// (`periodSeconds * failureThreshold - timeoutSeconds`) a heartbeat freeze may take; a
    /// checkpoint expected to freeze longer is skipped with an Event. Default 0.5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 1.0))]
    pub max_freeze_fraction: Option<f64>,

    /// Where checkpoints go and which key encrypts them; the chart's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageRef>,
}

fn default_true() -> bool {
    true
}

/// Retention, per lineage.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Complete checkpoints kept per lineage, newest first (the latest is never deleted).
    #[serde(default = "default_keep_last")]
    #[schemars(range(min = 1, max = 1000))]
    pub keep_last: i32,
    /// Checkpoints older than this duration (e.g. `24h`) are deleted, except each lineage's
    /// latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub max_age: Option<String>,
}

fn default_keep_last() -> i32 {
    3
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_last: default_keep_last(),
            max_age: None,
        }
    }
}

/// Checkpoints on events other than the heartbeat.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Triggers {
    /// Checkpoint a pod when one of its containers' working set (usage less inactive page
    /// cache, as the kubelet counts it) reaches this percentage of its memory limit, before an
    /// OOM kill throws the work away; the restart in place then restores that checkpoint. At
    /// most one such checkpoint per pod per max(30s, 10 × its last checkpoint's duration, a
    /// quarter of the interval), none while one is in flight. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub memory_percent: Option<i32>,
    /// Checkpoint the pods of a node whose kubelet reports the `MemoryPressure` condition (it
    /// is about to evict pods, without a grace period under a hard threshold), rate-limited as
    /// `memoryPercent`. Default true.
    #[serde(default = "default_true")]
    pub node_memory_pressure: bool,
    /// Checkpoint every selected pod of a node, most valuable first, when the node's cloud
    /// announces its end (a spot reclaim or preemption, maintenance that stops it, AWS's
    /// rebalance recommendation); the node is labelled `stasis.dev/notice` and loses
    /// `stasis.dev/ready`, so replacements go elsewhere. Default true.
    #[serde(default = "default_true")]
    pub spot_notice: bool,
}

impl Default for Triggers {
    fn default() -> Self {
        Self {
            memory_percent: None,
            node_memory_pressure: true,
            spot_notice: true,
        }
    }
}

/// Store and key for a policy's checkpoints.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageRef {
    /// Store URL (`s3://bucket/prefix`, `file:///path`); the chart's store when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Name of a Secret in stasis's own namespace holding the store credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
    /// Name of the data key (in stasis's namespace, wrapped by the cluster key); the
    /// namespace's key when absent. Workload pods can never mount it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_name: Option<String>,
}

/// What the controller observed about a policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointPolicyStatus {
    /// `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pods currently selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_pods: Option<i32>,
    /// `Ready`: the spec is valid and applied (reason `Active`), or refused (`InvalidSpec`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// With `interval: auto`: the interval chosen for each selected pod and what it was chosen
    /// from (at most 20 pods, by name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub auto_intervals: Vec<AutoIntervalStatus>,
}

/// The automatic interval of one pod and its inputs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoIntervalStatus {
    /// The pod.
    pub pod: String,
    /// Its node's pool (`<name>` or `<name>/spot`, from the node's labels; `default`).
    pub node_pool: String,
    /// The interval chosen, in milliseconds.
    pub interval_millis: i64,
    /// Young/Daly's optimum before the bounds, in milliseconds.
    pub optimum_millis: i64,
    /// The checkpoint cost used: mean freeze + upload of the pod's last checkpoints, in
    /// milliseconds.
    pub cost_millis: i64,
    /// Whether the cost was measured (false: no checkpoint yet, a default was assumed).
    pub cost_measured: bool,
    /// Mean time between interruptions of a pod of this pool, in seconds.
    pub mtbf_seconds: i64,
    /// Interruptions of pods of this pool the controller saw (within a week).
    pub interruptions: i64,
    /// Pod-time observed in this pool, in seconds (observed time × pods running there).
    pub exposure_seconds: i64,
    /// What bounded the interval, if anything: `Minimum`, `CheckpointCost`, `FreezeBudget`,
    /// `Maximum`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<String>,
}

impl AutoIntervalStatus {
    /// What the status says of a pod's automatic interval.
    pub fn of(pod: &str, c: &stasis_core::interval::Choice) -> Self {
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self {
            pod: pod.to_owned(),
            node_pool: c.pool.key(),
            interval_millis: ms(c.auto.interval),
            optimum_millis: ms(c.auto.optimum),
            cost_millis: ms(c.auto.cost),
            cost_measured: c.auto.measured,
            mtbf_seconds: i64::try_from(c.auto.mtbf.as_secs()).unwrap_or(i64::MAX),
            interruptions: i64::try_from(c.interruptions).unwrap_or(i64::MAX),
            exposure_seconds: i64::try_from(c.exposure.as_secs()).unwrap_or(i64::MAX),
            bound: c.auto.bound.map(|b| b.name().to_owned()),
        }
    }
}

/// The pool of a node, from its labels (`interval: auto`).
pub fn node_pool(node: &k8s_openapi::api::core::v1::Node) -> stasis_core::interval::NodePool {
    stasis_core::interval::NodePool::of_labels(
        node.metadata
            .labels
            .iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v.as_str())),
    )
}

/// The measured freeze and upload of a pod's succeeded checkpoints, oldest first
/// (`interval: auto`'s cost).
pub fn measured_costs<'a>(
    checkpoints: impl IntoIterator<Item = &'a crate::PodCheckpoint>,
) -> Vec<stasis_core::interval::Measured> {
    let mut v: Vec<(_, stasis_core::interval::Measured)> = checkpoints
        .into_iter()
        .filter_map(|c| {
            let s = c.status.as_ref()?;
            if s.phase != Some(crate::CheckpointPhase::Succeeded) {
                return None;
            }
            let ms = |m: Option<i64>| m.and_then(|m| u64::try_from(m).ok());
            Some((
                s.start_time.as_ref().map(|t| t.0),
                stasis_core::interval::Measured {
                    freeze_ms: ms(s.freeze_millis)?,
                    upload_ms: ms(s.upload_millis).unwrap_or(0),
                },
            ))
        })
        .collect();
    v.sort_by_key(|(start, _)| *start);
    v.into_iter().map(|(_, m)| m).collect()
}

/// Most pods listed in `status.autoIntervals`.
pub const MAX_AUTO_STATUSES: usize = 20;

/// Whether a checkpoint counts for a pod's cost: of its namespace, and of the pod itself
/// (`spec.sourcePodUID`, else the agent's status) or of the lineage it continues (its
/// `stasis.dev/lineage` annotation: a replacement's checkpoints cost what its predecessors' did).
fn counts_for(c: &crate::PodCheckpoint, pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    if c.metadata.namespace != pod.metadata.namespace {
        return false;
    }
    let uid = pod.metadata.uid.as_deref();
    let status = c.status.as_ref();
    let source = c
        .spec
        .source_pod_uid
        .as_deref()
        .or_else(|| status?.source_pod_uid.as_deref());
    let lineage = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(crate::names::LINEAGE))
        .map(String::as_str);
    (uid.is_some() && source == uid)
        || (lineage.is_some() && status.and_then(|s| s.lineage.as_deref()) == lineage)
}

fn choice<'a>(
    pod: &k8s_openapi::api::core::v1::Pod,
    checkpoints: impl IntoIterator<Item = &'a crate::PodCheckpoint>,
    log: &stasis_core::interval::EvictionLog,
    max_freeze_fraction: f64,
    now_unix_ms: u64,
) -> Option<stasis_core::interval::Choice> {
    let node = pod.spec.as_ref()?.node_name.as_deref()?;
    let pool = log.pool_of(node)?.clone();
    let measured = measured_costs(checkpoints.into_iter().filter(|c| counts_for(c, pod)));
    Some(log.choose(&pool, &measured, max_freeze_fraction, now_unix_ms))
}

/// `interval: auto` for one running pod: notes it on its node in `log` (so that its end counts
/// in that node's pool) and chooses its interval from the costs of its own checkpoints and of
/// its lineage's (`checkpoints` may hold any: only those count). `None` while its node's pool is not noted (the caller reads the
/// Node and notes it first) or it has no node.
pub fn choose_auto<'a>(
    pod: &k8s_openapi::api::core::v1::Pod,
    checkpoints: impl IntoIterator<Item = &'a crate::PodCheckpoint>,
    log: &mut stasis_core::interval::EvictionLog,
    max_freeze_fraction: f64,
    now_unix_ms: u64,
) -> Option<stasis_core::interval::Choice> {
    if let (Some(uid), Some(node)) = (
        pod.metadata.uid.as_deref(),
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
    ) {
        log.note_pod(uid, node);
    }
    choice(pod, checkpoints, log, max_freeze_fraction, now_unix_ms)
}

/// The `status.autoIntervals` of a policy with `interval: auto`: its running pods of
/// `runtime_class` it selects, by name, at most [`MAX_AUTO_STATUSES`], whose node's pool is known.
pub fn auto_statuses<'a>(
    policy: &CheckpointPolicy,
    pods: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Pod>,
    checkpoints: &[&crate::PodCheckpoint],
    runtime_class: &str,
    log: &stasis_core::interval::EvictionLog,
    now_unix_ms: u64,
) -> Vec<AutoIntervalStatus> {
    use kube::core::SelectorExt;
    let Ok(selector) = kube::core::Selector::try_from(policy.spec.selector.clone()) else {
        return Vec::new();
    };
    let mut selected: Vec<&k8s_openapi::api::core::v1::Pod> = pods
        .into_iter()
        .filter(|p| p.metadata.namespace == policy.metadata.namespace)
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_deref())
                == Some(runtime_class)
        })
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| selector.matches(p.metadata.labels.as_ref().unwrap_or(&Default::default())))
        .collect();
    selected.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    selected
        .into_iter()
        .filter_map(|p| {
            let c = choice(
                p,
                checkpoints.iter().copied(),
                log,
                policy.spec.freeze_fraction(),
                now_unix_ms,
            )?;
            Some(AutoIntervalStatus::of(p.metadata.name.as_deref()?, &c))
        })
        .take(MAX_AUTO_STATUSES)
        .collect()
}

impl CheckpointPolicySpec {
    /// The interval, checked by stasis-core's rule: a duration, or `auto`.
    pub fn interval(
        &self,
    ) -> Result<stasis_core::policy::Interval, stasis_core::policy::PolicyError> {
        stasis_core::policy::parse_interval_spec(&self.interval)
    }

    /// A fixed heartbeat interval (`auto` has none: [`Self::interval`]).
    pub fn heartbeat(&self) -> Result<std::time::Duration, stasis_core::policy::PolicyError> {
        stasis_core::policy::parse_interval(&self.interval)
    }

    /// The freeze fraction, with its default.
    pub fn freeze_fraction(&self) -> f64 {
        self.max_freeze_fraction
            .unwrap_or(stasis_core::policy::DEFAULT_MAX_FREEZE_FRACTION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn costs_of_succeeded_checkpoints_oldest_first() {
        let ck = |start: &str, phase: &str, freeze: i64, upload: i64| -> crate::PodCheckpoint {
            serde_json::from_value(json!({
                "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
                "metadata": {"name": "c", "namespace": "ml"},
                "spec": {"sourcePodName": "p"},
                "status": {"phase": phase, "startTime": start, "freezeMillis": freeze,
                           "uploadMillis": upload}
            }))
            .unwrap()
        };
        let cks = [
            ck("2026-12-01T10:00:00.5Z", "Succeeded", 30, 300),
            ck("2026-12-01T10:00:00Z", "Succeeded", 10, 100),
            ck("2026-12-01T10:01:00Z", "Failed", 99, 999),
        ];
        let m = measured_costs(&cks);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].freeze_ms, m[0].upload_ms), (10, 100));
        assert_eq!((m[1].freeze_ms, m[1].upload_ms), (30, 300));
    }

    fn pod(name: &str, node: &str, app: &str) -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                         "labels": {"app": app}},
            "spec": {"nodeName": node, "runtimeClassName": "stasis",
                     "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    #[test]
    fn a_pods_auto_interval_and_the_policys_status() {
        let policy: CheckpointPolicy = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "CheckpointPolicy",
            "metadata": {"name": "auto", "namespace": "ml"},
            "spec": {"selector": {"matchLabels": {"app": "train"}}, "interval": "auto"}
        }))
        .unwrap();
        let (a, b, other) = (
            pod("a", "n1", "train"),
            pod("b", "n2", "train"),
            pod("c", "n1", "x"),
        );
        let ck: crate::PodCheckpoint = serde_json::from_value(json!({
            "apiVersion": "stasis.dev/v1alpha1", "kind": "PodCheckpoint",
            "metadata": {"name": "a-1", "namespace": "ml"},
            "spec": {"sourcePodName": "a", "sourcePodUID": "uid-a"},
            "status": {"phase": "Succeeded", "startTime": "2026-12-01T10:00:00Z",
                       "freezeMillis": 200, "uploadMillis": 800}
        }))
        .unwrap();
        let mut log = stasis_core::interval::EvictionLog::new(0);
        // n1's pool not noted yet: nothing chosen, but the pod is noted on its node.
        assert!(choose_auto(&a, [&ck], &mut log, 0.5, 1_000).is_none());
        log.note_node("n1", stasis_core::interval::NodePool::of_labels([]));
        let c = choose_auto(&a, [&ck], &mut log, 0.5, 60_000).unwrap();
        assert!(c.auto.measured);
        assert_eq!(c.auto.cost, std::time::Duration::from_secs(1));
        // b's node has no known pool, c is not selected: only a is listed.
        let st = auto_statuses(&policy, [&b, &other, &a], &[&ck], "stasis", &log, 60_000);
        assert_eq!(st.len(), 1);
        assert_eq!((st[0].pod.as_str(), st[0].cost_millis), ("a", 1_000));
        // a's end counts in n1's pool.
        assert!(log.record_end("uid-a", 61_000));
        // Its replacement continues the lineage: the lineage's checkpoints give its cost.
        let mut ck_l = ck.clone();
        ck_l.status.as_mut().unwrap().lineage = Some("ml_deploy_train".into());
        let mut a2 = pod("a2", "n1", "train");
        a2.metadata.annotations = Some(
            [(
                crate::names::LINEAGE.to_owned(),
                "ml_deploy_train".to_owned(),
            )]
            .into(),
        );
        let c = choose_auto(&a2, [&ck_l], &mut log, 0.5, 62_000).unwrap();
        assert!(c.auto.measured, "the lineage's cost");
        assert!(
            !choose_auto(&pod("b2", "n1", "train"), [&ck_l], &mut log, 0.5, 62_000)
                .unwrap()
                .auto
                .measured
        );
        // Another namespace's checkpoints never count.
        ck_l.metadata.namespace = Some("other".into());
        assert!(
            !choose_auto(&a2, [&ck_l], &mut log, 0.5, 62_000)
                .unwrap()
                .auto
                .measured
        );
    }

    #[test]
    fn auto_status_and_node_pool() {
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
            "metadata": {"name": "n", "labels": {"karpenter.sh/nodepool": "gpu",
                                                 "karpenter.sh/capacity-type": "spot"}}
        }))
        .unwrap();
        let pool = node_pool(&node);
        assert_eq!(pool.key(), "gpu/spot");
        let mut log = stasis_core::interval::EvictionLog::new(0);
        log.note_node("n", pool.clone());
        log.note_pod("uid", "n");
        let c = log.choose(&pool, &[], 0.5, 60_000);
        let st = AutoIntervalStatus::of("p", &c);
        assert_eq!(st.node_pool, "gpu/spot");
        assert!(!st.cost_measured);
        assert_eq!(st.cost_millis, 5_000);
        assert_eq!(st.exposure_seconds, 60);
        assert_eq!(st.mtbf_seconds, 6 * 3600 + 60);
        let v = serde_json::to_value(&st).unwrap();
        assert!(
            v.get("intervalMillis").is_some() && v.get("bound").is_none(),
            "{v}"
        );
    }
}
