//! Command-line arguments. Doc comments are the help text.
// Placeholders such as `<workload>` in the help text are not HTML.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// stasis: checkpoint a running container or process tree into an encrypted, deduplicated store,
/// and restore it later, here or on another machine that reads the same store.
#[derive(Debug, Parser)]
#[command(
    name = "stasis",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Global {
    /// Output format: human-readable text, or one JSON document on stdout for scripts.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Human, env = "STASIS_OUTPUT")]
    pub output: Output,
    /// More log output on stderr (-v info, -vv debug). `STASIS_LOG` takes a full filter.
    #[arg(long, short, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Structured (JSON) logs on stderr.
    #[arg(long, global = true)]
    pub log_json: bool,
    /// No progress bars.
    #[arg(long, short, global = true)]
    pub quiet: bool,
    /// Seconds an s3:// store request may take, retries included, before the command fails
    /// (an endpoint that never answers).
    #[arg(
        long,
        global = true,
        env = "STASIS_STORE_TIMEOUT",
        default_value_t = 30.0,
        value_name = "SECS"
    )]
    pub store_timeout: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Human,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Checkpoint a running container or process tree into a store.
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Restore a checkpoint: into a new runc container, or as a process tree.
    Restore(RestoreArgs),
    /// List the checkpoints in a store.
    List(ListArgs),
    /// Show a checkpoint's manifest: sizes, chunk reuse, fingerprint, process tree.
    Inspect(InspectArgs),
    /// Delete old checkpoints (keeping the newest N per workload) and unreferenced chunks.
    Gc(GcArgs),
    /// Manage encryption keys.
    #[command(subcommand)]
    Key(KeyCmd),
    /// Check whether this machine can checkpoint and restore, and say how to fix what is missing.
    Doctor(DoctorArgs),
    /// Write a checkpoint as a Kubernetes checkpoint archive (the kubelet's
    /// `checkpoint-<pod>_<namespace>-<container>-<time>.tar`, which checkpointctl reads).
    Export(ExportArgs),
    /// Store a Kubernetes checkpoint archive (from the kubelet's checkpoint API, or `stasis
    /// export`) as a checkpoint that `stasis restore` restores on any machine.
    Import(ImportArgs),
    /// Advice for the opted-in workloads of a namespace or the cluster on spot capacity: runs
    /// the kubectl plugin (`kubectl stasis advise`: kubectl-stasis, on PATH) with these
    /// arguments (-n NS, -A, -o json|yaml, --context).
    Advise(AdviseArgs),
}

/// `stasis advise`'s arguments, the kubectl plugin's own.
#[derive(Debug, Args)]
pub struct AdviseArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<std::ffi::OsString>,
}

/// Where checkpoints are kept and how they are encrypted.
#[derive(Debug, Args, Clone)]
pub struct StoreArgs {
    /// Store URL: file:///path (or a plain absolute path), or s3://bucket/prefix.
    #[arg(long, env = "STASIS_STORE")]
    pub store: String,
    /// Key file. Default: $STASIS_KEY_FILE, else the default key (created on first use).
    #[arg(long, env = "STASIS_KEY_FILE")]
    pub key: Option<PathBuf>,
}

/// Options shared by both kinds of checkpoint.
#[derive(Debug, Args, Clone)]
pub struct CheckpointCommon {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Workload name the checkpoint is filed under (default: from the container id or the
    /// process's command name).
    #[arg(long)]
    pub workload: Option<String>,
    /// Stop the workload after the checkpoint (default: leave it running).
    #[arg(long)]
    pub stop: bool,
    /// Do not checkpoint established TCP connections: CRIU neither dumps nor pauses them
    /// (`tcp-close`), and a restore gives the workload those sockets closed. By default their
    /// state is dumped, so a restore where they can continue keeps them (see `restore`).
    #[arg(long)]
    pub no_tcp_established: bool,
    /// Engine/model versions the workload declares (KEY=VALUE, repeatable); a restore must
    /// declare the same.
    #[arg(long = "declare", value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub declare: Vec<(String, String)>,
    /// Label stored with the checkpoint (KEY=VALUE, repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Scratch directory for the CRIU images before they are stored.
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum CheckpointCmd {
    /// Checkpoint a runc container by id (through `runc checkpoint`).
    Container {
        /// Container id.
        id: String,
        /// runc state root.
        #[arg(long, env = "STASIS_RUNC_ROOT", default_value = "/run/runc")]
        runc_root: PathBuf,
        #[command(flatten)]
        common: CheckpointCommon,
    },
    /// Checkpoint a process tree by its root pid (through CRIU's RPC).
    Process {
        /// Root pid of the tree.
        pid: i32,
        #[command(flatten)]
        common: CheckpointCommon,
    },
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Checkpoint reference: <workload>/<id> or <workload>/latest.
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Restore a process tree (CRIU RPC) instead of a container.
    #[arg(long, conflicts_with_all = ["bundle", "container_id"])]
    pub process: bool,
    /// A fresh bundle made from the same rootfs image (required for containers).
    #[arg(long, required_unless_present = "process")]
    pub bundle: Option<PathBuf>,
    /// Id of the new container (required for containers).
    #[arg(long, required_unless_present = "process")]
    pub container_id: Option<String>,
    /// For a checkpoint of a pod (several containers): the container (its name in the pod) to
    /// restore into the bundle, which must be made from that container's image.
    #[arg(long, value_name = "NAME", conflicts_with = "process")]
    pub container: Option<String>,
    /// runc state root.
    #[arg(long, env = "STASIS_RUNC_ROOT", default_value = "/run/runc")]
    pub runc_root: PathBuf,
    /// File the restored workload's stdout and stderr are appended to (default for containers:
    /// <bundle>/container.log; for processes: the original stdout/stderr, which must then be
    /// unchanged files).
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Close established TCP connections instead of restoring them. By default they are
    /// restored only where they can continue (a stop-mode checkpoint, or both ends in it, restored
    /// where their addresses exist) and closed elsewhere: in a new network namespace, on another
    /// machine, after a leave-running checkpoint. Listening sockets are always restored.
    #[arg(long)]
    pub no_tcp_established: bool,
    /// Engine/model versions this restore target declares (KEY=VALUE, repeatable).
    #[arg(long = "declare", value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub declare: Vec<(String, String)>,
    /// Digest of the image the bundle was made from, when its config.json has no
    /// `dev.stasis.image.digest` annotation.
    #[arg(long)]
    pub image_digest: Option<String>,
    /// Scratch directory the checkpoint is fetched into.
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
    /// Start the container before its memory has arrived: only the small files are fetched
    /// first, and pages come from the store as the processes touch them, the rest in the
    /// background (CRIU's lazy pages, userfaultfd). stasis stays until every page is in place.
    /// Containers only, not with CUDA processes.
    #[arg(long, conflicts_with_all = ["process", "container"])]
    pub lazy: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Store URL.
    #[arg(long, env = "STASIS_STORE")]
    pub store: String,
    /// Only this workload.
    #[arg(long)]
    pub workload: Option<String>,
    /// Key file, to show sizes (default: $STASIS_KEY_FILE, else the default key if it exists).
    #[arg(long, env = "STASIS_KEY_FILE")]
    pub key: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Checkpoint reference: <workload>/<id> or <workload>/latest.
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Scratch directory a pod checkpoint is fetched into, to read what each of its containers
    /// holds (its pod index is one of its files).
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Checkpoint reference: <workload>/<id> or <workload>/latest.
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Archive to write (refuses to overwrite). Default: the kubelet's name for it, in the
    /// current directory.
    #[arg(long = "file", short = 'f')]
    pub file: Option<PathBuf>,
    /// For a checkpoint of a pod (several containers): the container to export (an archive
    /// holds one container, as the kubelet writes it).
    #[arg(long, value_name = "NAME")]
    pub container: Option<String>,
    /// Scratch directory the checkpoint is fetched into.
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The checkpoint archive (a tar; its rootfs-diff.tar may be gzip-compressed).
    pub archive: PathBuf,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Workload name the checkpoint is filed under (default: the archive's container name).
    #[arg(long)]
    pub workload: Option<String>,
    /// Engine/model versions the workload declares (KEY=VALUE, repeatable); a restore target
    /// must declare the same.
    #[arg(long = "declare", value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub declare: Vec<(String, String)>,
    /// Scratch directory the archive is unpacked into.
    #[arg(long, env = "STASIS_WORK_DIR", default_value = "/var/lib/stasis/work")]
    pub work_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Checkpoints to keep per workload (the newest).
    #[arg(long)]
    pub keep_last: usize,
    /// Never delete chunks younger than this many seconds (protects checkpoints being written).
    #[arg(long, default_value_t = 900)]
    pub grace_secs: u64,
}

#[derive(Debug, Subcommand)]
pub enum KeyCmd {
    /// Write a new random key to FILE (mode 0600; refuses to overwrite).
    Generate {
        /// Where to write the key.
        file: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Also check that this store is reachable.
    #[arg(long, env = "STASIS_STORE")]
    pub store: Option<String>,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has an empty key"));
    }
    Ok((k.to_owned(), v.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn contract_shapes_parse() {
        let p = |s: &str| Cli::try_parse_from(s.split_whitespace());
        p("stasis checkpoint container c1 --store file:///s --runc-root /r --workload w --key /k --stop").unwrap();
        p("stasis checkpoint process 42 --store file:///s --workload w").unwrap();
        p("stasis restore w/latest --store file:///s --bundle /b --container-id c2 --runc-root /r --key /k").unwrap();
        p("stasis restore w/latest --store file:///s --process").unwrap();
        p("stasis restore w/latest --store file:///s --bundle /b --container-id c2 --container app").unwrap();
        p("stasis export w/latest --store file:///s --container app").unwrap();
        assert!(p("stasis restore w/latest --store file:///s --process --container app").is_err());
        p("stasis list --store file:///s -o json").unwrap();
        p("stasis inspect w/latest --store file:///s").unwrap();
        p("stasis gc --store file:///s --keep-last 2").unwrap();
        p("stasis key generate /tmp/k").unwrap();
        p("stasis doctor --output json").unwrap();
        p("stasis export w/latest --store file:///s -f /tmp/c.tar").unwrap();
        p("stasis import /tmp/c.tar --store file:///s --workload w --declare engine=x").unwrap();
        p("stasis advise").unwrap();
        assert!(p("stasis restore w/latest --store file:///s").is_err());
    }
}
