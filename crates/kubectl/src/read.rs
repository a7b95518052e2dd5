//! The commands that only read: `status`, `list` and `why`, and how a pod or a workload named on
//! the command line becomes a set of pods.

use anyhow::{anyhow, bail, Result};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ListParams;
use kube::core::Selector;
use kube::{Api, Client, ResourceExt};
use stasis_api::{CheckpointPolicy, PodCheckpoint, PodRestore};

use crate::actions::api_error;
use crate::advise;
use crate::view::{self, PodStatus};
use crate::why::{self, Why};

/// A namespaced kind this plugin reads (typed: its dynamic type is `()`).
pub trait Namespaced:
    kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
}
impl<K> Namespaced for K where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
{
}

/// Where to look: one namespace, or all of them.
#[derive(Clone, Debug)]
pub enum Scope {
    Namespace(String),
    All,
}

impl Scope {
    pub fn api<K: Namespaced>(&self, client: &Client) -> Api<K> {
        match self {
            Scope::Namespace(ns) => Api::namespaced(client.clone(), ns),
            Scope::All => Api::all(client.clone()),
        }
    }

    fn namespace(&self) -> Result<&str> {
        match self {
            Scope::Namespace(ns) => Ok(ns),
            Scope::All => {
                bail!("name a namespace (-n) for one pod or workload, not --all-namespaces")
            }
        }
    }
}

/// The pods a target names: a pod (`web-0`, `pod/web-0`) or the pods of a workload
/// (`deployment/web`, `statefulset/db`, `daemonset/x`, `replicaset/x`, `job/x`); none: every pod of
/// stasis's RuntimeClass in scope.
pub async fn pods(
    client: &Client,
    scope: &Scope,
    target: Option<&str>,
    runtime_class: &str,
) -> Result<Vec<Pod>> {
    let Some(target) = target else {
        let all = scope
            .api::<Pod>(client)
            .list(&ListParams::default())
            .await
            .map_err(|e| api_error(e, "listing pods"))?;
        return Ok(all
            .items
            .into_iter()
            .filter(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.runtime_class_name.as_deref())
                    == Some(runtime_class)
            })
            .collect());
    };
    let ns = scope.namespace()?;
    let (kind, name) = target.split_once('/').unwrap_or(("pod", target));
    let selector: Option<LabelSelector> = match kind.to_ascii_lowercase().as_str() {
        "pod" | "pods" | "po" => {
            let p = Api::<Pod>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await
                .map_err(|e| api_error(e, "reading the pod"))?;
            return match p {
                Some(p) => Ok(vec![p]),
                None if !target.contains('/') => Err(anyhow!(
                    "pod {ns}/{name} not found (for a workload name its kind: deployment/{name}, statefulset/{name})"
                )),
                None => Err(anyhow!("pod {ns}/{name} not found")),
            };
        }
        "deployment" | "deployments" | "deploy" => {
            get_sel::<Deployment>(client, ns, name, |d| Some(d.spec.selector.clone())).await?
        }
        "statefulset" | "statefulsets" | "sts" => {
            get_sel::<StatefulSet>(client, ns, name, |d| Some(d.spec.selector.clone())).await?
        }
        "daemonset" | "daemonsets" | "ds" => {
            get_sel::<DaemonSet>(client, ns, name, |d| Some(d.spec.selector.clone())).await?
        }
        "replicaset" | "replicasets" | "rs" => {
            get_sel::<ReplicaSet>(client, ns, name, |d| Some(d.spec.selector.clone())).await?
        }
        "job" | "jobs" => {
            get_sel::<Job>(client, ns, name, |d| {
                d.spec.as_ref().and_then(|s| s.selector.clone())
            })
            .await?
        }
        other => bail!(
            "{other}/{name}: a pod, or a deployment, statefulset, daemonset, replicaset or job"
        ),
    };
    let selector = selector.ok_or_else(|| anyhow!("{kind}/{name} has no selector"))?;
    let sel =
        Selector::try_from(selector).map_err(|e| anyhow!("{kind}/{name}: its selector: {e}"))?;
    let lp = ListParams::default().labels_from(&sel);
    Ok(Api::<Pod>::namespaced(client.clone(), ns)
        .list(&lp)
        .await
        .map_err(|e| api_error(e, "listing pods"))?
        .items)
}

async fn get_sel<K: Namespaced>(
    client: &Client,
    ns: &str,
    name: &str,
    sel: impl Fn(&K) -> Option<LabelSelector>,
) -> Result<Option<LabelSelector>> {
    let what = format!("{} {ns}/{name}", K::kind(&()));
    let obj = Api::<K>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(|e| api_error(e, &what))?;
    Ok(sel(&obj))
}

/// Every object of a kind in scope.
pub async fn all<K: Namespaced>(client: &Client, scope: &Scope) -> Result<Vec<K>> {
    let plural = K::plural(&()).into_owned();
    Ok(scope
        .api::<K>(client)
        .list(&ListParams::default())
        .await
        .map_err(|e| api_error(e, &format!("listing {plural}")))?
        .items)
}

/// `status`: one row per pod.
pub async fn status(
    client: &Client,
    scope: &Scope,
    target: Option<&str>,
    runtime_class: &str,
) -> Result<Vec<PodStatus>> {
    let pods = pods(client, scope, target, runtime_class).await?;
    if pods.is_empty() {
        return Ok(Vec::new());
    }
    let checkpoints: Vec<PodCheckpoint> = all(client, scope).await?;
    let policies: Vec<CheckpointPolicy> = all(client, scope).await?;
    let now = now_ms();
    let mut rows: Vec<PodStatus> = pods
        .iter()
        .map(|p| view::pod_status(p, &checkpoints, &policies, now))
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.pod).cmp(&(&b.namespace, &b.pod)));
    Ok(rows)
}

/// `list`: the checkpoints in scope (of the pods a target names, when given), newest first.
pub async fn list(
    client: &Client,
    scope: &Scope,
    target: Option<&str>,
    runtime_class: &str,
) -> Result<Vec<PodCheckpoint>> {
    let mut checkpoints: Vec<PodCheckpoint> = all(client, scope).await?;
    if let Some(t) = target {
        let pods = pods(client, scope, Some(t), runtime_class).await?;
        let rows: Vec<PodStatus> = pods
            .iter()
            .map(|p| view::pod_status(p, &[], &[], 0))
            .collect();
        let lineages: Vec<String> = rows.iter().filter_map(|r| r.lineage.clone()).collect();
        let names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
        checkpoints.retain(|c| {
            let lineage = c.status.as_ref().and_then(|s| s.lineage.as_ref());
            names.contains(&c.spec.source_pod_name) || lineage.is_some_and(|l| lineages.contains(l))
        });
    }
    Ok(view::newest_first(checkpoints))
}

/// `why`: the admission decision of a pod and what followed.
pub async fn why(client: &Client, scope: &Scope, pod: &str) -> Result<Why> {
    let ns = scope.namespace()?;
    let p = Api::<Pod>::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .map_err(|e| api_error(e, &format!("pod {ns}/{pod}")))?;
    let restores: Vec<PodRestore> = all(client, scope).await?;
    // (by UID too: a pod of the same name before this one had Events of its own)
    let uid = p
        .metadata
        .uid
        .as_deref()
        .map_or(String::new(), |u| format!(",involvedObject.uid={u}"));
    let lp = ListParams::default().fields(&format!(
        "involvedObject.name={pod},involvedObject.kind=Pod{uid}"
    ));
    let events = Api::<Event>::namespaced(client.clone(), ns)
        .list(&lp)
        .await
        .map_err(|e| api_error(e, "listing the pod's Events"))?
        .items;
    Ok(why::why(&p, &restores, &events, now_ms()))
}

/// `advise`: the objects its advice is made of, each kind listed once. Nodes are cluster-wide
/// and a namespace user usually may not list them: the report says so, it is not an error.
pub async fn advise(client: &Client, scope: &Scope, runtime_class: &str) -> Result<advise::Facts> {
    let pods = pods(client, scope, None, runtime_class).await?;
    let scope_name = match scope {
        Scope::Namespace(ns) => format!("namespace {ns}"),
        Scope::All => "all namespaces".to_owned(),
    };
    let mut facts = advise::Facts {
        scope: scope_name,
        pods: Vec::new(),
        budgets: Vec::new(),
        nodes: Ok(Vec::new()),
        policies: Vec::new(),
        checkpoints: Vec::new(),
        restores: Vec::new(),
        now_ms: now_ms(),
    };
    if pods.is_empty() {
        return Ok(facts);
    }
    facts.pods = pods;
    facts.nodes = match Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(l) => Ok(l.items),
        Err(kube::Error::Api(s)) if s.code == 403 => Err(s.message.clone()),
        Err(e) => return Err(api_error(e, "listing nodes")),
    };
    facts.budgets = all(client, scope).await?;
    facts.policies = all(client, scope).await?;
    facts.checkpoints = all(client, scope).await?;
    facts.restores = all(client, scope).await?;
    Ok(facts)
}

/// Now in Unix milliseconds, as the API's times are compared here (the project's one wall clock).
pub fn now_ms() -> i64 {
    stasis_core::time::now_ms() as i64
}
