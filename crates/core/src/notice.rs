//! Cloud notices that a node is about to go: which cloud a node runs on, and what its instance
//! metadata service answers, read into one [`Notice`] shape. Pure: the agent's watcher
//! (`stasis_agent::notice`) does the requests.
//!
//! The requests and answers are the providers' documented ones:
//! - **AWS** (IMDSv2, a session token first): `spot/instance-action` (`{"action": "terminate",
//!   "time": "2017-09-18T08:22:00Z"}`, 404 while there is none; a two-minute warning),
//!   `events/recommendations/rebalance` (`{"noticeTime": …}`: elevated risk, no deadline), and
//!   `events/maintenance/scheduled` (a list; `State: active` events with `Code`, `NotBefore` as
//!   `21 Jan 2019 09:00:43 GMT`).
//! - **GCP** (`Metadata-Flavor: Google`): `instance/preempted` (`TRUE`/`FALSE`; a spot or
//!   preemptible VM has 30 s once it turns `TRUE`) and `instance/maintenance-event` (`NONE`,
//!   `MIGRATE_ON_HOST_MAINTENANCE`, `TERMINATE_ON_HOST_MAINTENANCE`), both long-polled with
//!   `wait_for_change=true`.
//! - **Azure** Scheduled Events (`Metadata: true`): `{"DocumentIncarnation": n, "Events": [{
//!   "EventId", "EventType": "Preempt" | "Terminate" | "Freeze" | "Reboot" | "Redeploy",
//!   "Resources": [vm names], "EventStatus": "Scheduled" | "Started", "NotBefore": "Mon, 19 Sep
//!   2016 18:29:47 GMT"}]}`; an event may be acknowledged (`StartRequests`) to let it start
//!   early, which the agent does only once its final checkpoints are published.

use serde::Deserialize;

/// The cloud a node runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    Aws,
    Gcp,
    Azure,
}

impl Provider {
    pub fn name(self) -> &'static str {
        match self {
            Provider::Aws => "aws",
            Provider::Gcp => "gcp",
            Provider::Azure => "azure",
        }
    }

    /// `aws`, `gcp` (or `gce`, `gke`), `azure` (or `aks`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "aws" | "eks" => Some(Provider::Aws),
            "gcp" | "gce" | "gke" => Some(Provider::Gcp),
            "azure" | "aks" => Some(Provider::Azure),
            _ => None,
        }
    }

    /// The cloud a node runs on, from its `spec.providerID` (`aws:///…`, `gce://…`,
    /// `azure:///…`), else from labels the managed offerings and Karpenter put on their nodes.
    pub fn of_node<'a>(
        provider_id: Option<&str>,
        labels: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<Self> {
        if let Some(id) = provider_id {
            let scheme = id.split("://").next().unwrap_or_default();
            match scheme {
                "aws" => return Some(Provider::Aws),
                "gce" => return Some(Provider::Gcp),
                "azure" => return Some(Provider::Azure),
                _ => {}
            }
        }
        labels.into_iter().find_map(|(k, _)| {
            if k.starts_with("eks.amazonaws.com/") || k.starts_with("karpenter.k8s.aws/") {
                Some(Provider::Aws)
            } else if k.starts_with("cloud.google.com/gke-") {
                Some(Provider::Gcp)
            } else if k.starts_with("kubernetes.azure.com/") {
                Some(Provider::Azure)
            } else {
                None
            }
        })
    }
}

/// What a notice announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoticeKind {
    /// A spot or preemptible instance is being reclaimed (AWS instance-action, GCP preempted,
    /// Azure Preempt).
    Reclaim,
    /// The instance is scheduled to stop, reboot, freeze or be retired for maintenance.
    Maintenance,
    /// AWS's rebalance recommendation: the instance is at elevated risk of interruption. No
    /// deadline; checkpoints are taken, the node is not marked.
    RebalanceRecommendation,
}

impl NoticeKind {
    pub fn name(self) -> &'static str {
        match self {
            NoticeKind::Reclaim => "Reclaim",
            NoticeKind::Maintenance => "Maintenance",
            NoticeKind::RebalanceRecommendation => "RebalanceRecommendation",
        }
    }

    /// Whether the node is going away: replacements should be scheduled elsewhere.
    pub fn node_ends(self) -> bool {
        !matches!(self, NoticeKind::RebalanceRecommendation)
    }
}

/// One notice, as the provider stated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub provider: Provider,
    pub kind: NoticeKind,
    /// Stable for one notice across polls (acted on once).
    pub id: String,
    /// When the instance goes (Unix ms), where the provider says.
    pub deadline_unix_ms: Option<i64>,
    /// The provider's own words (action, event code or type), for Events and logs.
    pub detail: String,
}

/// An answer that is not what the provider documents.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{provider} metadata: {what}")]
pub struct MalformedAnswer {
    pub provider: &'static str,
    pub what: String,
}

fn malformed(provider: Provider, what: impl Into<String>) -> MalformedAnswer {
    MalformedAnswer {
        provider: provider.name(),
        what: what.into(),
    }
}

/// `2017-09-18T08:22:00Z` (AWS instance-action and rebalance times).
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    crate::time::parse_rfc3339_nanos(s.trim()).and_then(|n| i64::try_from(n / 1_000_000).ok())
}

/// `Mon, 19 Sep 2016 18:29:47 GMT` (Azure) or `21 Jan 2019 09:00:43 GMT` (AWS scheduled events):
/// RFC 2822 dates, the day of the week optional.
pub fn parse_rfc2822_ms(s: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc2822(s.trim())
        .ok()
        .map(|t| t.timestamp_millis())
}

/// AWS `spot/instance-action` (the body of a 200; a 404 means no notice).
pub fn aws_instance_action(body: &str) -> Result<Notice, MalformedAnswer> {
    #[derive(Deserialize)]
    struct Action {
        action: String,
        time: String,
    }
    let a: Action = serde_json::from_str(body)
        .map_err(|e| malformed(Provider::Aws, format!("spot/instance-action: {e}")))?;
    let deadline = parse_rfc3339_ms(&a.time).ok_or_else(|| {
        malformed(
            Provider::Aws,
            format!("spot/instance-action: unreadable time {:?}", a.time),
        )
    })?;
    Ok(Notice {
        provider: Provider::Aws,
        kind: NoticeKind::Reclaim,
        id: format!("spot/{}/{}", a.action, a.time),
        deadline_unix_ms: Some(deadline),
        detail: format!("spot instance-action {}", a.action),
    })
}

/// AWS `events/recommendations/rebalance` (the body of a 200; a 404 means none).
pub fn aws_rebalance(body: &str) -> Result<Notice, MalformedAnswer> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Rebalance {
        notice_time: String,
    }
    let r: Rebalance = serde_json::from_str(body)
        .map_err(|e| malformed(Provider::Aws, format!("rebalance recommendation: {e}")))?;
    Ok(Notice {
        provider: Provider::Aws,
        kind: NoticeKind::RebalanceRecommendation,
        id: format!("rebalance/{}", r.notice_time),
        deadline_unix_ms: None,
        detail: "rebalance recommendation".into(),
    })
}

/// AWS `events/maintenance/scheduled`: the active events (completed and canceled ones are
/// history).
pub fn aws_scheduled_events(body: &str) -> Result<Vec<Notice>, MalformedAnswer> {
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Event {
        code: String,
        event_id: String,
        #[serde(default)]
        not_before: String,
        #[serde(default)]
        state: String,
    }
    let events: Vec<Event> = serde_json::from_str(body)
        .map_err(|e| malformed(Provider::Aws, format!("maintenance/scheduled: {e}")))?;
    Ok(events
        .into_iter()
        .filter(|e| e.state.is_empty() || e.state.eq_ignore_ascii_case("active"))
        .map(|e| Notice {
            provider: Provider::Aws,
            kind: NoticeKind::Maintenance,
            id: format!("scheduled/{}", e.event_id),
            deadline_unix_ms: parse_rfc2822_ms(&e.not_before),
            detail: format!("scheduled event {}", e.code),
        })
        .collect())
}

/// GCP `instance/preempted`: `TRUE` once the VM is being preempted.
pub fn gcp_preempted(body: &str, seen_unix_ms: i64) -> Result<Option<Notice>, MalformedAnswer> {
    match body.trim() {
        "TRUE" => Ok(Some(Notice {
            provider: Provider::Gcp,
            kind: NoticeKind::Reclaim,
            id: "preempted".into(),
            // Preemption gives a spot or preemptible VM 30 s from the notice.
            deadline_unix_ms: Some(seen_unix_ms + 30_000),
            detail: "instance preempted".into(),
        })),
        "FALSE" => Ok(None),
        other => Err(malformed(
            Provider::Gcp,
            format!("instance/preempted: {other:?}"),
        )),
    }
}

/// GCP `instance/maintenance-event`: a host maintenance that terminates the VM is a notice; a
/// live migration is not (the VM keeps running, its memory with it).
pub fn gcp_maintenance_event(body: &str) -> Result<Option<Notice>, MalformedAnswer> {
    match body.trim() {
        "NONE" | "MIGRATE_ON_HOST_MAINTENANCE" => Ok(None),
        "TERMINATE_ON_HOST_MAINTENANCE" => Ok(Some(Notice {
            provider: Provider::Gcp,
            kind: NoticeKind::Maintenance,
            id: "maintenance/TERMINATE_ON_HOST_MAINTENANCE".into(),
            deadline_unix_ms: None,
            detail: "host maintenance terminates the instance".into(),
        })),
        other => Err(malformed(
            Provider::Gcp,
            format!("instance/maintenance-event: {other:?}"),
        )),
    }
}

/// Azure Scheduled Events: the events that affect `vm_name` and end or pause it. `Freeze`
/// (a pause of seconds) and `Reboot`/`Redeploy` lose memory or stall the pod as a termination
/// would; all are notices. Events for other VMs of the scale set are not ours.
pub fn azure_scheduled_events(body: &str, vm_name: &str) -> Result<Vec<Notice>, MalformedAnswer> {
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Doc {
        #[serde(default)]
        events: Vec<Event>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Event {
        event_id: String,
        event_type: String,
        #[serde(default)]
        resources: Vec<String>,
        #[serde(default)]
        not_before: String,
    }
    let doc: Doc = serde_json::from_str(body)
        .map_err(|e| malformed(Provider::Azure, format!("scheduled events: {e}")))?;
    Ok(doc
        .events
        .into_iter()
        .filter(|e| e.resources.iter().any(|r| r.eq_ignore_ascii_case(vm_name)))
        .filter_map(|e| {
            let kind = match e.event_type.as_str() {
                "Preempt" => NoticeKind::Reclaim,
                "Terminate" | "Freeze" | "Reboot" | "Redeploy" => NoticeKind::Maintenance,
                _ => return None,
            };
            Some(Notice {
                provider: Provider::Azure,
                kind,
                id: e.event_id.clone(),
                deadline_unix_ms: parse_rfc2822_ms(&e.not_before),
                detail: format!("scheduled event {}", e.event_type),
            })
        })
        .collect())
}

/// A Kubernetes memory quantity (`512Mi`, `8Gi`, `1.5G`, `129e6`, `128974848`) in bytes; `None`
/// when unreadable. Used to rank pods, so fractions of a byte do not matter.
pub fn memory_quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let factor: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        _ => return None,
    };
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some((v * factor) as u64)
}

/// What a pod is worth saving first when time is short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate<K> {
    pub key: K,
    /// GPU pods hold the most expensive state (weights in device memory, warmed engines).
    pub uses_gpu: bool,
    /// Its memory (limit, else request), bytes: the state a cold start would rebuild.
    pub memory_bytes: u64,
    /// When it started (Unix ms): of two alike, the longer-running one has more to lose.
    pub started_unix_ms: i64,
}

/// Orders pods most valuable first: GPU pods, then larger memory, then older.
pub fn most_valuable_first<K>(mut pods: Vec<Candidate<K>>) -> Vec<Candidate<K>> {
    pods.sort_by(|a, b| {
        b.uses_gpu
            .cmp(&a.uses_gpu)
            .then(b.memory_bytes.cmp(&a.memory_bytes))
            .then(a.started_unix_ms.cmp(&b.started_unix_ms))
    });
    pods
}

/// The time a checkpoint started now may take: until the deadline, less a margin for the
/// upload to finish before the instance goes; with no deadline, `fallback_s`.
pub fn checkpoint_budget_s(
    deadline_unix_ms: Option<i64>,
    now_unix_ms: i64,
    fallback_s: u64,
) -> u64 {
    match deadline_unix_ms {
        Some(d) => {
            let left_ms = (d - now_unix_ms).max(0) as u64;
            // 10% margin, at least 2 s, never below 1 s of budget.
            let margin = (left_ms / 10).max(2_000);
            (left_ms.saturating_sub(margin) / 1000).max(1)
        }
        None => fallback_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_from_provider_id_or_labels() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(
            Provider::of_node(Some("aws:///us-east-1a/i-0abc"), none),
            Some(Provider::Aws)
        );
        assert_eq!(
            Provider::of_node(Some("gce://proj/europe-west4-a/gke-pool-1"), none),
            Some(Provider::Gcp)
        );
        assert_eq!(
            Provider::of_node(
                Some("azure:///subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/aks-np/virtualMachines/0"),
                none
            ),
            Some(Provider::Azure)
        );
        assert_eq!(
            Provider::of_node(None, [("karpenter.k8s.aws/instance-family", "p5")]),
            Some(Provider::Aws)
        );
        assert_eq!(
            Provider::of_node(
                Some("kind://docker/x"),
                [("cloud.google.com/gke-spot", "true")]
            ),
            Some(Provider::Gcp)
        );
        assert_eq!(
            Provider::of_node(None, [("kubernetes.azure.com/scalesetpriority", "spot")]),
            Some(Provider::Azure)
        );
        assert_eq!(
            Provider::of_node(None, [("kubernetes.io/hostname", "w1")]),
            None
        );
    }

    #[test]
    fn aws_answers() {
        let n = aws_instance_action(r#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#)
            .unwrap();
        assert_eq!(n.kind, NoticeKind::Reclaim);
        assert_eq!(n.deadline_unix_ms, Some(1_505_722_920_000));
        assert!(aws_instance_action("<html>").is_err());
        assert!(aws_instance_action(r#"{"action": "stop", "time": "soon"}"#).is_err());
        let r = aws_rebalance(r#"{"noticeTime": "2020-10-27T08:22:00Z"}"#).unwrap();
        assert_eq!(r.kind, NoticeKind::RebalanceRecommendation);
        assert!(!r.kind.node_ends());
        let s = aws_scheduled_events(
            r#"[{"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot",
                 "Description": "scheduled reboot", "EventId": "instance-event-0d59937288b749b32",
                 "NotAfter": "21 Jan 2019 09:17:23 GMT", "State": "active"},
                {"NotBefore": "1 Jan 2019 09:00:43 GMT", "Code": "instance-stop",
                 "EventId": "instance-event-old", "State": "completed"}]"#,
        )
        .unwrap();
        assert_eq!(s.len(), 1, "completed events are history");
        assert_eq!(s[0].id, "scheduled/instance-event-0d59937288b749b32");
        assert_eq!(s[0].deadline_unix_ms, Some(1_548_061_243_000));
        assert_eq!(aws_scheduled_events("[]").unwrap(), vec![]);
    }

    #[test]
    fn gcp_answers() {
        let n = gcp_preempted("TRUE", 1_000).unwrap().unwrap();
        assert_eq!(
            (n.kind, n.deadline_unix_ms),
            (NoticeKind::Reclaim, Some(31_000))
        );
        assert_eq!(gcp_preempted("FALSE\n", 0).unwrap(), None);
        assert!(gcp_preempted("maybe", 0).is_err());
        assert_eq!(gcp_maintenance_event("NONE").unwrap(), None);
        assert_eq!(
            gcp_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE").unwrap(),
            None,
            "a live migration keeps the VM"
        );
        assert_eq!(
            gcp_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
                .unwrap()
                .unwrap()
                .kind,
            NoticeKind::Maintenance
        );
    }

    #[test]
    fn azure_answers_for_this_vm_only() {
        let doc = r#"{"DocumentIncarnation": 2, "Events": [
            {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
             "ResourceType": "VirtualMachine", "Resources": ["aks-spot-0"],
             "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
             "Description": "", "EventSource": "Platform", "DurationInSeconds": -1},
            {"EventId": "other", "EventType": "Terminate", "Resources": ["aks-spot-1"],
             "EventStatus": "Scheduled", "NotBefore": ""},
            {"EventId": "f", "EventType": "Freeze", "Resources": ["AKS-SPOT-0"],
             "EventStatus": "Scheduled", "NotBefore": ""}]}"#;
        let n = azure_scheduled_events(doc, "aks-spot-0").unwrap();
        assert_eq!(n.len(), 2);
        assert_eq!(n[0].kind, NoticeKind::Reclaim);
        assert_eq!(n[0].deadline_unix_ms, Some(1_474_309_787_000));
        assert_eq!(
            (n[1].kind, n[1].deadline_unix_ms),
            (NoticeKind::Maintenance, None)
        );
        assert_eq!(
            azure_scheduled_events(r#"{"DocumentIncarnation": 1, "Events": []}"#, "x").unwrap(),
            vec![]
        );
        assert!(azure_scheduled_events("nope", "x").is_err());
    }

    #[test]
    fn memory_quantities() {
        assert_eq!(memory_quantity_bytes("512Mi"), Some(512 << 20));
        assert_eq!(memory_quantity_bytes("8Gi"), Some(8 << 30));
        assert_eq!(memory_quantity_bytes("1.5G"), Some(1_500_000_000));
        assert_eq!(memory_quantity_bytes("129e6"), Some(129_000_000));
        assert_eq!(memory_quantity_bytes("128974848"), Some(128_974_848));
        assert_eq!(memory_quantity_bytes("12Xi"), None);
        assert_eq!(memory_quantity_bytes("-1Gi"), None);
    }

    #[test]
    fn gpu_then_memory_then_age() {
        let c = |k: &'static str, gpu, mem, started| Candidate {
            key: k,
            uses_gpu: gpu,
            memory_bytes: mem,
            started_unix_ms: started,
        };
        let order: Vec<_> = most_valuable_first(vec![
            c("small", false, 1 << 20, 0),
            c("big-new", false, 8 << 30, 100),
            c("gpu", true, 1 << 30, 50),
            c("big-old", false, 8 << 30, 10),
        ])
        .into_iter()
        .map(|c| c.key)
        .collect();
        assert_eq!(order, ["gpu", "big-old", "big-new", "small"]);
    }

    #[test]
    fn budget_leaves_a_margin_before_the_deadline() {
        assert_eq!(checkpoint_budget_s(Some(120_000), 0, 600), 108);
        assert_eq!(checkpoint_budget_s(Some(30_000), 0, 600), 27);
        assert_eq!(checkpoint_budget_s(Some(1_000), 0, 600), 1);
        assert_eq!(checkpoint_budget_s(Some(0), 5_000, 600), 1);
        assert_eq!(checkpoint_budget_s(None, 0, 600), 600);
    }
}
