//! The controller's chunk garbage collection (`stasis_controller::gc`) against a real
//! kube-apiserver (etcd + kube-apiserver from scripts/build-platform's cache, started by
//! `tests/lib/apiserver.sh`) holding the cluster key and the namespaces' data key Secrets, and a
//! real S3 server (s3s-fs) holding the checkpoints: orphan chunks of a deleted checkpoint are
//! swept, chunks of kept checkpoints (of every namespace) stay, nothing is swept while an upload
//! holds its lease, a namespace whose data key does not unwrap is left alone; and with two
//! `stasis-controller` processes only the one holding the leader lease collects. Skipped,
//! visibly, when the binaries are not built.

#[path = "../../store/tests/common/draft.rs"]
mod draft;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams};
use stasis_controller::gc::{self, GcSetup, Outcome};
use stasis_store::{Key, NoProgress, Store};
use stasis_testkit::s3::S3Server;

const HOME: &str = "stasis-system";
const CLUSTER_KEY: &str = "stasis-cluster-key";

/// etcd and kube-apiserver as `tests/lib/apiserver.sh` starts them, stopped on drop.
struct ApiServer {
    work: PathBuf,
    pids: Vec<String>,
}

impl ApiServer {
    fn start(test: &str) -> Option<ApiServer> {
        let lib = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/lib/apiserver.sh");
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                r#"set -e; . "{lib}"; apiserver_need {test}; APISERVER_OWN_TRAP=1 APISERVER_NAMESPACE={HOME} apiserver_start >&2; echo "$work"; echo "${{harness_pids[*]}}""#
            ))
            .stderr(Stdio::inherit())
            .output()
            .expect("run bash");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if out.status.code() == Some(77) {
            stasis_testkit::cannot_run(test, "kube-apiserver", stdout.trim());
            return None;
        }
        assert!(
            out.status.success(),
            "the API server did not start: {stdout}"
        );
        let mut lines = stdout.lines();
        let work = PathBuf::from(lines.next().unwrap());
        let pids = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        Some(ApiServer { work, pids })
    }

    fn kubeconfig(&self) -> PathBuf {
        self.work.join("kubeconfig")
    }

    async fn client(&self) -> kube::Client {
        let kc = kube::config::Kubeconfig::read_from(self.kubeconfig()).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(cfg).unwrap()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for p in &self.pids {
            let _ = Command::new("kill").arg(p).status();
        }
        std::thread::sleep(Duration::from_millis(500));
        for p in &self.pids {
            let _ = Command::new("kill").args(["-9", p]).status();
        }
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// A checkpoint of workload `w` whose one file is `len` bytes of incompressible data from `seed`.
async fn put(
    store: &Store,
    key: &Key,
    dir: &Path,
    w: &str,
    len: usize,
    seed: u64,
) -> stasis_core::Manifest {
    let data = draft::pseudo_random(len, seed);
    let img = dir.join(format!("img-{}", rand_name()));
    std::fs::create_dir_all(&img).unwrap();
    std::fs::write(img.join("pages-1.img"), data).unwrap();
    std::thread::sleep(Duration::from_millis(2)); // ids strictly increase
    let ms = stasis_core::time::now_ms();
    let draft = draft::draft_with_id(w, stasis_core::CheckpointId::from_parts(ms, 1));
    store
        .put_checkpoint(key, draft, &img, &NoProgress)
        .await
        .unwrap()
}

fn rand_name() -> String {
    format!("{:x}", rand::random::<u64>())
}

/// The chunk objects of `key` in the server's directory.
fn chunks(bucket: &Path, key: &Key) -> Vec<String> {
    let dir = bucket.join("chunks").join(key.id());
    let mut out = Vec::new();
    for sub in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(sub.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            out.push(f.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

fn ids(m: &stasis_core::Manifest) -> Vec<String> {
    let mut v: Vec<String> = m.chunk_ids().map(str::to_owned).collect();
    v.sort();
    v.dedup();
    v
}

struct World {
    api: ApiServer,
    client: kube::Client,
    _s3: S3Server,
    dir: tempfile::TempDir,
    url: String,
}

impl World {
    fn bucket(&self) -> PathBuf {
        self.dir.path().join("s3/ckpts/gc")
    }
    fn setup(&self, grace: Duration) -> GcSetup {
        GcSetup {
            client: self.client.clone(),
            namespace: HOME.into(),
            cluster_key_secret: CLUSTER_KEY.into(),
            store: Store::open(&self.url).unwrap(),
            interval: Duration::from_secs(1),
            grace,
        }
    }
}

async fn world(test: &str) -> Option<World> {
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("s3/ckpts")).unwrap();
    let s3 = S3Server::start(test, &dir.path().join("s3"))?;
    let api = ApiServer::start(test)?;
    // (one test per binary: the store reads its S3 settings from the environment)
    for (k, v) in s3.client_env() {
        std::env::set_var(k, v);
    }
    let client = api.client().await;
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(HOME.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    stasis_controller::cluster_key::ensure(&client, HOME, CLUSTER_KEY, true)
        .await
        .unwrap();
    Some(World {
        api,
        client,
        _s3: s3,
        dir,
        url: "s3://ckpts/gc".into(),
    })
}

async fn data_key(w: &World, ns: &str) -> Key {
    let ring = stasis_controller::broker::load_ring(&w.client, HOME, CLUSTER_KEY)
        .await
        .unwrap();
    let k = stasis_api::keys::load_or_create(&w.client, HOME, ns, &ring)
        .await
        .unwrap();
    Key::from_secret(&k)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_sweeps_what_no_kept_checkpoint_names() {
    let test = "the_controller_sweeps_what_no_kept_checkpoint_names";
    let Some(w) = world(test).await else { return };
    let store = Store::open(&w.url).unwrap();
    let (ka, kb) = (data_key(&w, "team-a").await, data_key(&w, "team-b").await);
    let tmp = w.dir.path();

    // team-a: two checkpoints, the older one dropped by retention (its manifest deleted, as the
    // controller's retention does); team-b: one kept checkpoint.
    let old = put(&store, &ka, tmp, "team-a_pod_x", 300_000, 1).await;
    let kept = put(&store, &ka, tmp, "team-a_pod_x", 300_000, 2).await;
    let other = put(&store, &kb, tmp, "team-b_pod_y", 300_000, 3).await;
    store.delete_checkpoint(&old.reference()).await.unwrap();
    let orphans: Vec<String> = ids(&old)
        .into_iter()
        .filter(|c| !ids(&kept).contains(c))
        .collect();
    assert!(!orphans.is_empty());
    let bucket = w.bucket();
    let mut both = ids(&old);
    both.extend(ids(&kept));
    both.sort();
    both.dedup();
    assert_eq!(
        chunks(&bucket, &ka),
        both,
        "the chunks as the server holds them"
    );

    // An upload in flight: its writer's lease, as `put_checkpoint` writes it before its first
    // chunk. Nothing is swept while it lives.
    let now = stasis_core::time::now_ms();
    let lease = bucket
        .join("leases/team-a_pod_x")
        .join(format!("{}.json", rand_name()));
    std::fs::create_dir_all(lease.parent().unwrap()).unwrap();
    std::fs::write(
        &lease,
        format!(r#"{{"holder":"node-1/pid 7","purpose":"put","started_unix_ms":{now},"renewed_unix_ms":{now},"ttl_ms":600000}}"#),
    )
    .unwrap();
    let r = gc::run_once(&w.setup(Duration::ZERO)).await;
    assert_eq!(r.outcome, Outcome::Skipped, "{r:?}");
    assert_eq!(r.chunks_swept, 0, "{r:?}");
    assert!(
        r.skipped.values().any(|why| why.contains("in progress")),
        "{r:?}"
    );
    for c in &orphans {
        assert!(chunks(&bucket, &ka).contains(c), "swept under a live lease");
    }

    // The upload ends. Two collectors at once: the store's GC lock lets one sweep at a time,
    // and between them every orphan goes exactly once.
    std::fs::remove_file(&lease).unwrap();
    let (s1, s2) = (w.setup(Duration::ZERO), w.setup(Duration::ZERO));
    let (r1, r2) = tokio::join!(gc::run_once(&s1), gc::run_once(&s2));
    println!("two collectors: {r1:?} / {r2:?}");
    for r in [&r1, &r2] {
        assert!(matches!(r.outcome, Outcome::Swept | Outcome::Busy), "{r:?}");
    }
    assert_eq!(
        r1.chunks_swept + r2.chunks_swept,
        orphans.len() as u64,
        "{r1:?} {r2:?}"
    );
    assert!(r1.bytes_swept + r2.bytes_swept > 0);
    let left = chunks(&bucket, &ka);
    assert_eq!(
        left,
        ids(&kept),
        "team-a keeps exactly its kept checkpoint's chunks"
    );
    assert_eq!(chunks(&bucket, &kb), ids(&other), "team-b's chunks stay");
    // Both kept checkpoints still read back whole.
    for (k, m) in [(&ka, &kept), (&kb, &other)] {
        let out = tmp.join(format!("out-{}", rand_name()));
        store
            .get_checkpoint(k, &m.reference(), &out, &NoProgress)
            .await
            .unwrap();
    }

    // A namespace whose data key does not unwrap (not the cluster key's): its chunks are left,
    // the run says so, the other namespaces are still collected.
    let bad = Secret {
        metadata: ObjectMeta {
            name: Some(stasis_api::keys::secret_name("team-c")),
            labels: Some([(stasis_api::names::NAMESPACE.to_owned(), "team-c".to_owned())].into()),
            ..Default::default()
        },
        data: Some(
            [(
                stasis_api::keys::SECRET_FIELD.to_owned(),
                ByteString(vec![1; 61]),
            )]
            .into(),
        ),
        ..Default::default()
    };
    Api::<Secret>::namespaced(w.client.clone(), HOME)
        .create(&PostParams::default(), &bad)
        .await
        .unwrap();
    let r = gc::run_once(&w.setup(Duration::ZERO)).await;
    assert_eq!(r.outcome, Outcome::Skipped, "{r:?}");
    assert_eq!(r.namespaces, 2, "{r:?}");
    assert!(r.skipped["team-c"].contains("does not unwrap"), "{r:?}");

    // Two stasis-controller processes: only the leader collects. A new orphan in team-b.
    let dropped = put(&store, &kb, tmp, "team-b_pod_y", 200_000, 4).await;
    store.delete_checkpoint(&dropped.reference()).await.unwrap();
    assert!(chunks(&bucket, &kb).len() > ids(&other).len());
    Api::<Secret>::namespaced(w.client.clone(), HOME)
        .delete(
            &stasis_api::keys::secret_name("team-c"),
            &Default::default(),
        )
        .await
        .unwrap();
    let crds = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/helm/stasis/crds/stasis.dev.yaml"
    );
    let st = Command::new("kubectl")
        .env("KUBECONFIG", w.api.kubeconfig())
        .args(["apply", "--server-side", "-f", crds])
        .stdout(Stdio::null())
        .status();
    assert!(st.is_ok_and(|s| s.success()), "kubectl apply the CRDs");
    let mut controllers: Vec<(Child, PathBuf)> = ["c-1", "c-2"]
        .iter()
        .map(|id| {
            let log = tmp.join(format!("{id}.log"));
            let child = Command::new(env!("CARGO_BIN_EXE_stasis-controller"))
                .args(["--no-webhook", "--lease-seconds", "5"])
                .args([
                    "--metrics-addr",
                    &format!("127.0.0.1:{}", stasis_testkit::free_port()),
                ])
                .env("KUBECONFIG", w.api.kubeconfig())
                .env("POD_NAMESPACE", HOME)
                .env("POD_NAME", id)
                .env("STASIS_STORE_URL", &w.url)
                .env("STASIS_CLUSTER_KEY_SECRET", CLUSTER_KEY)
                .env("STASIS_GC_INTERVAL_SECONDS", "1")
                .env("STASIS_GC_GRACE_SECONDS", "0")
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            (child, log)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while chunks(&bucket, &kb) != ids(&other) {
        assert!(
            Instant::now() < deadline,
            "the leader did not sweep team-b's orphans in 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A few more periods, then count who collected.
    std::thread::sleep(Duration::from_secs(3));
    let runs: Vec<usize> = controllers
        .iter_mut()
        .map(|(c, log)| {
            let _ = c.kill();
            let _ = c.wait();
            let text = std::fs::read_to_string(log).unwrap();
            text.lines()
                .filter(|l| l.contains("chunk garbage collection") && l.contains("chunks_swept"))
                .count()
        })
        .collect();
    println!("collections per controller: {runs:?}");
    assert!(
        runs.iter().filter(|&&n| n > 0).count() == 1,
        "exactly one controller (the leader) collects: {runs:?}\n{}\n{}",
        std::fs::read_to_string(&controllers[0].1).unwrap(),
        std::fs::read_to_string(&controllers[1].1).unwrap()
    );
    assert_eq!(chunks(&bucket, &ka), ids(&kept));
}
