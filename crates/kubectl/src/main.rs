//! `kubectl-stasis`: the kubectl plugin for stasis. On PATH, kubectl runs it as `kubectl stasis`.
//!
//! - `status [POD | KIND/NAME]`: for each opted-in pod its lineage, the age, size and freeze of
//!   its last checkpoint, when the next heartbeat is due, and why it cold-started;
//! - `checkpoint POD`: a `PodCheckpoint`, followed with a progress line until it ends;
//! - `restore POD --from CHECKPOINT`: a `PodRestore`, refused with the reason when the user may
//!   not restore;
//! - `why POD`: the admission decision, the pod's `PodRestore`s and stasis's Events about it;
//! - `list [POD | KIND/NAME]`: the checkpoints, newest first;
//! - `export POD|CHECKPOINT -f FILE`: the kubelet's checkpoint archive (KEP-2008) of a pod's
//!   newest checkpoint or a named one, as `stasis export` writes it (needs the permission to
//!   restore, and the namespace's data key: [`export`]);
//! - `advise`: for each opted-in workload, the checks of its readiness for evictions on spot
//!   capacity and the arithmetic of an eviction with and without stasis (advice: exit 0 with
//!   findings).
//!
//! Tables as kubectl prints them; `-o json` and `-o yaml` print the same data as objects. The
//! cluster and namespace come from the kubeconfig (`KUBECONFIG`, `--context`), or `-n`.

mod actions;
mod advise;
mod export;
mod read;
mod table;
mod view;
mod why;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};
use serde::Serialize;
use stasis_api::PodCheckpoint;

use crate::read::Scope;
use crate::table::{bytes, human_duration, Table};
use crate::view::PodStatus;

#[derive(Parser, Debug)]
#[command(
    name = "kubectl-stasis",
    bin_name = "kubectl stasis",
    version,
    about = "stasis: checkpoints of pods, and restores from them"
)]
struct Cli {
    /// Namespace (default: the kubeconfig context's)
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    /// Every namespace (status, list and advise)
    #[arg(short = 'A', long, global = true)]
    all_namespaces: bool,
    /// The kubeconfig file (default: KUBECONFIG, then ~/.kube/config)
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use
    #[arg(long, global = true)]
    context: Option<String>,
    /// Act as this user (impersonation, as kubectl's --as)
    #[arg(long = "as", global = true)]
    as_user: Option<String>,
    /// Act as a member of this group (repeat for more; with --as)
    #[arg(long = "as-group", global = true)]
    as_group: Vec<String>,
    /// Output format: a table (default), json or yaml
    #[arg(short = 'o', long, global = true, value_enum)]
    output: Option<Format>,
    /// The RuntimeClass that opts pods in (the chart's `runtimeClass.name`)
    #[arg(
        long,
        global = true,
        default_value = "stasis",
        env = "STASIS_RUNTIME_CLASS"
    )]
    runtime_class: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    Json,
    Yaml,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Lineage, last checkpoint (age, size, freeze), next heartbeat and restore decision of
    /// opted-in pods: all of the namespace, one pod, or a workload's (deployment/web)
    Status { target: Option<String> },
    /// Checkpoint a pod now and follow the checkpoint until it ends
    Checkpoint {
        pod: String,
        /// Upper bound on the whole checkpoint, in seconds (the agent's default when unset)
        #[arg(long)]
        timeout_seconds: Option<i32>,
        /// Create it and return without following it
        #[arg(long)]
        no_wait: bool,
    },
    /// Restore a checkpoint into a pod (needs the stasis-restorer role in the namespace)
    Restore {
        /// The pod that resumes from the checkpoint
        pod: String,
        /// The checkpoint: a PodCheckpoint's name, or a reference LINEAGE/ID (as list shows)
        #[arg(long)]
        from: String,
        /// Ask the API server, create nothing
        #[arg(long)]
        dry_run: bool,
    },
    /// Why a pod was restored or cold-started: the decision at its creation and stasis's Events
    Why { pod: String },
    /// Checkpoints, newest first: all of the namespace, or of a pod or workload
    List { target: Option<String> },
    /// Write a pod's newest checkpoint (or a named PodCheckpoint) as the kubelet's checkpoint
    /// archive, which checkpointctl reads (needs the stasis-restorer role in the namespace, and
    /// the namespace's data key: see --key-file)
    Export(export::ExportArgs),
    /// For each opted-in workload: what makes it lose work on spot capacity (grace period
    /// against the provider's notice, toleration and affinity, disruption budget,
    /// do-not-disrupt), its checkpoint's cost, the loss per eviction and the goodput with and
    /// without stasis at its node pool's eviction rate, with where each figure came from
    Advise,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // With both of rustls's providers linked (a workspace build), none is the default: the
    // first TLS connection would panic. Choose ring, as the agent and the controller do.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    if matches!(cli.command, Command::Export(_)) {
        // The export's scratch directory holds the pod's memory in plaintext: a signal removes
        // it (stasis export's handling). Only this thread exists yet, as the handling needs.
        stasis_cli::signals::install();
    }
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let (client, default_ns) = connect(
        cli.kubeconfig.as_deref(),
        cli.context.as_deref(),
        &cli.as_user,
        &cli.as_group,
    )
    .await?;
    let ns = cli.namespace.clone().unwrap_or(default_ns);
    let scope = if cli.all_namespaces {
        Scope::All
    } else {
        Scope::Namespace(ns.clone())
    };
    let rc = cli.runtime_class.as_str();
    match &cli.command {
        Command::Status { target } => {
            let rows = read::status(&client, &scope, target.as_deref(), rc).await?;
            emit(
                cli.output,
                &rows,
                || status_table(&rows, cli.all_namespaces),
                &scope,
            )
        }
        Command::List { target } => {
            let items = read::list(&client, &scope, target.as_deref(), rc).await?;
            emit(
                cli.output,
                &as_list(&items),
                || list_table(&items, cli.all_namespaces),
                &scope,
            )
        }
        Command::Advise => {
            let facts = read::advise(&client, &scope, rc).await?;
            let report = advise::report(&facts);
            emit(
                cli.output,
                &report,
                || advise::render(&report, cli.all_namespaces),
                &scope,
            )
        }
        Command::Why { pod } => {
            let w = read::why(&client, &scope, pod).await?;
            emit(cli.output, &w, || why::render(&w, rc), &scope)
        }
        Command::Checkpoint {
            pod,
            timeout_seconds,
            no_wait,
        } => {
            // follow a little longer than the checkpoint's own bound (the agent's default: 10 min)
            let bound = timeout_seconds.filter(|t| *t > 0).map_or(600, |t| t as u64) + 60;
            let follow = (!no_wait).then_some(Duration::from_secs(bound));
            let c = actions::checkpoint(&client, &ns, pod, *timeout_seconds, follow, rc).await?;
            emit(
                cli.output,
                &c,
                || format!("podcheckpoint.stasis.dev/{}\n", c.name_any()),
                &scope,
            )
        }
        Command::Export(a) => {
            let out = export::export(&client, &ns, a, rc).await?;
            emit(cli.output, &out, || format!("{}\n", out.summary()), &scope)
        }
        Command::Restore { pod, from, dry_run } => {
            let r = actions::restore(&client, &ns, pod, from, *dry_run).await?;
            let when = if r.spec.target_pod_uid.is_some() {
                // Its containers were created already, unless it is still pending.
                "if its container has not been created yet; to restore into a new pod, run this before creating it"
            } else {
                "once it is created (its container waits until its node's agent has fetched the checkpoint)"
            };
            let text = format!(
                "podrestore.stasis.dev/{} created{}: pod {pod} resumes from {} {when} (kubectl stasis why {pod})\n",
                r.name_any(),
                if *dry_run { " (server dry run)" } else { "" },
                r.spec.checkpoint_ref
            );
            emit(cli.output, &r, || text.clone(), &scope)
        }
    }
}

/// A client for the kubeconfig's context (or `context`), and its namespace; in a pod without a
/// kubeconfig, the pod's service account. `as_user` and `as_groups` impersonate.
async fn connect(
    kubeconfig: Option<&std::path::Path>,
    context: Option<&str>,
    as_user: &Option<String>,
    as_groups: &[String],
) -> Result<(Client, String)> {
    if let Some(path) = kubeconfig {
        let kc = Kubeconfig::read_from(path)
            .with_context(|| format!("--kubeconfig {}", path.display()))?;
        return client_for(kc, context, as_user, as_groups).await;
    }
    let config = match (context, Kubeconfig::read()) {
        (ctx, Ok(kc)) => return client_for(kc, ctx, as_user, as_groups).await,
        (Some(ctx), Err(e)) => {
            return Err(e).with_context(|| format!("--context {ctx}: no kubeconfig"))
        }
        (None, Err(_)) => Config::infer()
            .await
            .context("no kubeconfig (KUBECONFIG, ~/.kube/config) and not in a pod")?,
    };
    finish_client(config, as_user, as_groups)
}

/// A client for a kubeconfig's context (`context`, or its current one).
async fn client_for(
    kc: Kubeconfig,
    context: Option<&str>,
    as_user: &Option<String>,
    as_groups: &[String],
) -> Result<(Client, String)> {
    let opts = KubeConfigOptions {
        context: context.map(str::to_owned),
        ..Default::default()
    };
    let config = Config::from_custom_kubeconfig(kc, &opts)
        .await
        .context("reading the kubeconfig")?;
    finish_client(config, as_user, as_groups)
}

/// The client, impersonating `as_user` (and `as_groups`) when given, and the namespace.
fn finish_client(
    mut config: Config,
    as_user: &Option<String>,
    as_groups: &[String],
) -> Result<(Client, String)> {
    if as_user.is_some() {
        config.auth_info.impersonate = as_user.clone();
        config.auth_info.impersonate_groups = (!as_groups.is_empty()).then(|| as_groups.to_vec());
    }
    let ns = config.default_namespace.clone();
    Ok((
        Client::try_from(config).context("connecting to the API server")?,
        ns,
    ))
}

/// Prints `value` as JSON or YAML, or the table `text` makes.
fn emit<T: Serialize>(
    format: Option<Format>,
    value: &T,
    text: impl FnOnce() -> String,
    scope: &Scope,
) -> Result<()> {
    let out = match format {
        Some(Format::Json) => serde_json::to_string_pretty(value)? + "\n",
        Some(Format::Yaml) => serde_yaml::to_string(value)?,
        None => {
            let t = text();
            if t.is_empty() {
                match scope {
                    Scope::Namespace(ns) => format!("No resources found in {ns} namespace.\n"),
                    Scope::All => "No resources found\n".to_owned(),
                }
            } else {
                t
            }
        }
    };
    print!("{out}");
    Ok(())
}

/// A kubectl-style `List` of the checkpoints.
fn as_list(items: &[PodCheckpoint]) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items})
}

fn age(secs: u64) -> String {
    human_duration(Duration::from_secs(secs))
}

fn status_table(rows: &[PodStatus], all_ns: bool) -> String {
    let mut head = vec![
        "pod",
        "lineage",
        "checkpoints",
        "last",
        "size",
        "freeze",
        "next due",
        "decision",
        "reason",
    ];
    if all_ns {
        head.insert(0, "namespace");
    }
    let mut t = Table::new(&head);
    for r in rows {
        let last = r.last_checkpoint.as_ref();
        let mut cells = vec![
            r.pod.clone(),
            r.lineage.clone().unwrap_or_default(),
            r.checkpoints.to_string(),
            last.map_or(String::new(), |l| format!("{} ago", age(l.age_seconds))),
            last.and_then(|l| l.size_bytes).map_or(String::new(), bytes),
            last.and_then(|l| l.freeze_millis)
                .map_or(String::new(), |m| format!("{m}ms")),
            match (r.next_due_seconds, &r.policy) {
                (Some(0), _) => "now".into(),
                (Some(s), _) => format!("in {}", age(s)),
                (None, Some(_)) => "?".into(),
                (None, None) => "no policy".into(),
            },
            r.decision.clone().unwrap_or_default(),
            r.cold_start_reason
                .clone()
                .or_else(|| r.restored_from.as_ref().map(|f| format!("from {f}")))
                .unwrap_or_default(),
        ];
        if all_ns {
            cells.insert(0, r.namespace.clone());
        }
        t.row(cells);
    }
    if t.is_empty() {
        String::new()
    } else {
        t.render()
    }
}

fn list_table(items: &[PodCheckpoint], all_ns: bool) -> String {
    let mut head = vec![
        "name",
        "pod",
        "reason",
        "phase",
        "checkpoint",
        "size",
        "freeze",
        "node",
        "age",
    ];
    if all_ns {
        head.insert(0, "namespace");
    }
    let now = read::now_ms();
    let mut t = Table::new(&head);
    for c in items {
        let s = c.status.clone().unwrap_or_default();
        let created = c.metadata.creation_timestamp.as_ref().map_or(now, view::ms);
        let mut cells = vec![
            c.name_any(),
            c.spec.source_pod_name.clone(),
            format!("{:?}", c.spec.reason),
            s.phase.map_or(String::new(), |p| format!("{p:?}")),
            s.checkpoint_ref.unwrap_or_default(),
            s.size_bytes.map_or(String::new(), bytes),
            s.freeze_millis.map_or(String::new(), |m| format!("{m}ms")),
            s.node.unwrap_or_default(),
            age(u64::try_from((now - created) / 1000).unwrap_or(0)),
        ];
        if all_ns {
            cells.insert(0, c.namespace().unwrap_or_default());
        }
        t.row(cells);
    }
    if t.is_empty() {
        String::new()
    } else {
        t.render()
    }
}
