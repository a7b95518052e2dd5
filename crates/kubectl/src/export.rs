//! `kubectl stasis export POD|CHECKPOINT -f FILE`: the checkpoint archive the kubelet's
//! checkpoint API writes (KEP-2008), of a pod's newest succeeded checkpoint or of a named
//! `PodCheckpoint`, written by the same code as `stasis export`
//! ([`stasis_cli::commands::archive::export_archive`]).
//!
//! An archive is the pod's memory in plaintext, so exporting needs what restoring needs: the
//! user may create `podrestores` in the namespace (asked of the API server first, refused with
//! the same reason as `restore`). The data key comes from the cluster, read with the user's
//! own credentials: the namespace's `stasis-key-<namespace>` Secret unwrapped with the cluster
//! key Secret, both in stasis's namespace (which stasis's operators may read, and no namespace
//! user under the chart's roles), or from `--key-file` (the namespace's data key as a `stasis
//! key` file, handed over by an operator). docs/design.md §9.10.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context as _, Result};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use stasis_api::keys::{self, ClusterKey};
use stasis_api::{CheckpointPhase, PodCheckpoint};
use stasis_cli::commands::archive::{export_archive, Exported};
use stasis_cli::commands::Opened;
use stasis_store::{Key, Store, StoreOptions};

use crate::actions::{api_error, may_not_restore, resolve_checkpoint};
use crate::read::{self, Scope};

/// What to export, and where the key and the store are.
#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// A pod (its newest succeeded checkpoint) or a PodCheckpoint's name
    pub target: String,
    /// The archive to write (refuses to overwrite). Default: the kubelet's name for it, in the
    /// current directory
    #[arg(long = "file", short = 'f')]
    pub file: Option<PathBuf>,
    /// For a checkpoint of a pod with several containers: the container to export (an archive
    /// holds one container, as the kubelet writes it)
    #[arg(long, value_name = "NAME")]
    pub container: Option<String>,
    /// The store the cluster's checkpoints are in (the chart's store.url), with S3 credentials
    /// from the usual AWS_* variables
    #[arg(long, env = "STASIS_STORE")]
    pub store: String,
    /// The namespace's data key as a `stasis key` file, instead of reading it from the cluster
    #[arg(long, env = "STASIS_KEY_FILE")]
    pub key_file: Option<PathBuf>,
    /// stasis's namespace (where the data key Secrets are)
    #[arg(long, default_value = "stasis-system", env = "STASIS_NAMESPACE")]
    pub stasis_namespace: String,
    /// The cluster key Secret in stasis's namespace (the chart's `<release>-cluster-key`, or
    /// keys.clusterKeySecret)
    #[arg(long, default_value = "stasis-cluster-key")]
    pub cluster_key_secret: String,
    /// Scratch directory the checkpoint is fetched into (plaintext; removed afterwards)
    #[arg(long, env = "STASIS_WORK_DIR", default_value_os_t = std::env::temp_dir())]
    pub work_dir: PathBuf,
}

/// Exports `a.target` of namespace `ns`; see the module docs.
pub async fn export(
    client: &Client,
    ns: &str,
    a: &ExportArgs,
    runtime_class: &str,
) -> Result<Exported> {
    let reference = checkpoint_of(client, ns, &a.target, runtime_class).await?;
    if let Some(denied) = may_not_restore(client, ns).await? {
        bail!("exporting a checkpoint needs the permission to restore it: {denied}");
    }
    let key = match &a.key_file {
        Some(path) => Key::load(path).with_context(|| format!("--key-file {}", path.display()))?,
        None => data_key(client, ns, a).await?,
    };
    let store = Store::open_with(
        &a.store,
        StoreOptions {
            create: false,
            ..StoreOptions::default()
        },
    )
    .with_context(|| format!("--store {}", a.store))?;
    let (container, file, work_dir) = (a.container.clone(), a.file.clone(), a.work_dir.clone());
    // The export fetches on a runtime of its own and writes the archive synchronously: off
    // this one.
    tokio::task::spawn_blocking(move || {
        // A signal stops the fetch in order, and the plaintext scratch directory goes with it.
        let _orderly = stasis_cli::signals::Orderly::enter();
        let opened = Opened::with(key, store, &reference)?;
        let bars = stasis_cli::progress::Bars::new(true);
        export_archive(&opened, container.as_deref(), file, &work_dir, &bars)
    })
    .await
    .map_err(|e| anyhow!("the export stopped: {e}"))?
}

/// The checkpoint reference `target` names: a `PodCheckpoint` (which must have succeeded), else
/// the newest succeeded checkpoint of the pod of that name (of its lineage, as `list` shows).
async fn checkpoint_of(
    client: &Client,
    ns: &str,
    target: &str,
    runtime_class: &str,
) -> Result<String> {
    let named = Api::<PodCheckpoint>::namespaced(client.clone(), ns)
        .get_opt(target)
        .await
        .map_err(|e| api_error(e, &format!("podcheckpoint {ns}/{target}")))?;
    if named.is_some() {
        return Ok(resolve_checkpoint(client, ns, target).await?.0);
    }
    let scope = Scope::Namespace(ns.to_owned());
    let newest = read::list(client, &scope, Some(target), runtime_class)
        .await?
        .into_iter()
        .filter_map(|c| c.status)
        .find(|s| s.phase == Some(CheckpointPhase::Succeeded) && s.checkpoint_ref.is_some());
    newest.and_then(|s| s.checkpoint_ref).ok_or_else(|| {
        anyhow!("pod {ns}/{target} has no succeeded checkpoint (kubectl stasis list {target}), and no PodCheckpoint has that name")
    })
}

/// The data key of `ns`: its Secret unwrapped with the cluster key ring, both read from stasis's
/// namespace with the user's credentials.
async fn data_key(client: &Client, ns: &str, a: &ExportArgs) -> Result<Key> {
    let home = &a.stasis_namespace;
    let secrets = Api::<Secret>::namespaced(client.clone(), home);
    let how = format!(
        "the archive is decrypted here with the namespace's data key: reading it needs get on Secrets {} and {} in namespace {home} (stasis's operators), or --key-file with the namespace's data key",
        keys::secret_name(ns),
        a.cluster_key_secret
    );
    let get = |name: String| {
        let (secrets, how) = (secrets.clone(), how.clone());
        async move {
            secrets.get(&name).await.map_err(|e| match e {
                kube::Error::Api(s) if s.code == 403 || s.code == 404 => {
                    anyhow!("Secret {home}/{name}: {}; {how}", s.message)
                }
                e => api_error(e, &format!("Secret {home}/{name}")),
            })
        }
    };
    let ring = ClusterKey::from_secret(&get(a.cluster_key_secret.clone()).await?)
        .with_context(|| {
            format!(
                "Secret {home}/{} is not a cluster key: is it stasis's cluster key Secret (--cluster-key-secret)?",
                a.cluster_key_secret
            )
        })?;
    let secret = get(keys::secret_name(ns)).await?;
    let data_key = keys::unwrap_secret(&ring, ns, &secret).with_context(|| {
        format!(
            "the data key of namespace {ns} does not unwrap with the cluster key in Secret {home}/{}",
            a.cluster_key_secret
        )
    })?;
    Ok(Key::from_secret(&data_key))
}
