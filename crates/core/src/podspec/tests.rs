use super::*;
use serde_json::json;

fn source_spec() -> Value {
    json!({
        "nodeName": "worker-1",
        "serviceAccountName": "trainer",
        "serviceAccount": "trainer",
        "securityContext": {"runAsNonRoot": true},
        "hostNetwork": false,
        "runtimeClassName": "stasis",
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}],
        "volumes": [
            {"name": "data", "emptyDir": {}},
            token_volume("kube-api-access-x7k2p"),
            {"name": "cfg", "configMap": {"name": "cfg"}}
        ],
        "containers": [{
            "name": "counter",
            "image": "stasis-counter:dev",
            "command": ["/counter"],
            "args": ["--state-mib", "256"],
            "env": [{"name": "A", "value": "1"}],
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10},
            "resources": {"limits": {"memory": "512Mi"}},
            "terminationMessagePath": "/dev/termination-log",
            "securityContext": {"allowPrivilegeEscalation": false},
            "volumeMounts": [
                {"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true},
                {"name": "data", "mountPath": "/data"}
            ]
        }]
    })
}

/// The token volume exactly as the API server's ServiceAccount admission generates it.
fn token_volume(name: &str) -> Value {
    json!({"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}, "path": "namespace"}]}}
    ]}})
}

fn with(mut v: Value, f: impl FnOnce(&mut Value)) -> Value {
    f(&mut v);
    v
}

#[test]
fn generated_fields_do_not_change_the_hash() {
    let a = spec_hash(&source_spec());
    assert!(a.0.starts_with("blake3:") && a.0.len() == 7 + 64, "{a}");
    // The replacement: other node, other token volume suffix, other tolerations,
    // resources and probe timings changed, volumes in another order, an empty
    // securityContext.
    let b = with(source_spec(), |s| {
        s["nodeName"] = json!("worker-2");
        s["volumes"][1]["name"] = json!("kube-api-access-abcde");
        s["containers"][0]["volumeMounts"][0]["name"] = json!("kube-api-access-abcde");
        s["tolerations"] = json!([]);
        s["containers"][0]["livenessProbe"]["periodSeconds"] = json!(30);
        s["containers"][0]["resources"] = json!({"limits": {"memory": "1Gi"}});
        s["volumes"].as_array_mut().unwrap().reverse();
        s["hostNetwork"] = Value::Null;
        s["hostPID"] = json!(false);
        s["containers"][0]["workingDir"] = json!(null);
    });
    assert_eq!(spec_hash(&b), a);
}

#[test]
fn security_relevant_changes_change_the_hash() {
    let base = spec_hash(&source_spec());
    type Change = Box<dyn Fn(&mut Value)>;
    let changes: Vec<(&str, Change)> = vec![
        (
            "image",
            Box::new(|s| s["containers"][0]["image"] = json!("evil:latest")),
        ),
        (
            "command",
            Box::new(|s| s["containers"][0]["command"] = json!(["/bin/sh"])),
        ),
        (
            "args",
            Box::new(|s| s["containers"][0]["args"] = json!(["--dump-secrets"])),
        ),
        (
            "container securityContext",
            Box::new(|s| s["containers"][0]["securityContext"] = json!({"privileged": true})),
        ),
        (
            "pod securityContext",
            Box::new(|s| s["securityContext"] = json!({"runAsUser": 0})),
        ),
        (
            "service account",
            Box::new(|s| {
                s["serviceAccountName"] = json!("admin");
                s["serviceAccount"] = json!("admin");
            }),
        ),
        (
            "extra volume",
            Box::new(|s| {
                s["volumes"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "host", "hostPath": {"path": "/"}}))
            }),
        ),
        (
            "volume source",
            Box::new(|s| s["volumes"][2]["configMap"]["name"] = json!("other")),
        ),
        (
            "mount",
            Box::new(|s| s["containers"][0]["volumeMounts"][1]["mountPath"] = json!("/etc")),
        ),
        ("hostPID", Box::new(|s| s["hostPID"] = json!(true))),
        (
            "extra container",
            Box::new(|s| {
                s["containers"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "sidecar", "image": "x"}))
            }),
        ),
        (
            "init container",
            Box::new(|s| s["initContainers"] = json!([{"name": "init", "image": "x"}])),
        ),
        (
            "exec liveness probe",
            Box::new(|s| {
                s["containers"][0]["livenessProbe"] =
                    json!({"exec": {"command": ["cat", "/proc/1/environ"]}})
            }),
        ),
        (
            "exec readiness probe",
            Box::new(|s| {
                s["containers"][0]["readinessProbe"] =
                    json!({"exec": {"command": ["sh", "-c", "cat /proc/1/fd/*"]}})
            }),
        ),
        (
            "startup probe",
            Box::new(|s| s["containers"][0]["startupProbe"] = json!({"tcpSocket": {"port": 9}})),
        ),
        (
            "grpc probe",
            Box::new(|s| s["containers"][0]["livenessProbe"] = json!({"grpc": {"port": 9}})),
        ),
        (
            "postStart hook",
            Box::new(|s| {
                s["containers"][0]["lifecycle"] =
                    json!({"postStart": {"exec": {"command": ["/bin/sh", "-c", "x"]}}})
            }),
        ),
        (
            "preStop hook",
            Box::new(|s| {
                s["containers"][0]["lifecycle"] =
                    json!({"preStop": {"httpGet": {"path": "/dump", "port": 1}}})
            }),
        ),
        (
            "literal env value",
            Box::new(|s| s["containers"][0]["env"][0]["value"] = json!("2")),
        ),
        (
            "env var added",
            Box::new(|s| {
                s["containers"][0]["env"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "LD_PRELOAD", "value": "/data/x.so"}))
            }),
        ),
        (
            "env from a secret",
            Box::new(|s| {
                s["containers"][0]["env"][0] = json!({"name": "A", "valueFrom":
                    {"secretKeyRef": {"name": "other", "key": "k"}}})
            }),
        ),
        (
            "envFrom",
            Box::new(|s| {
                s["containers"][0]["envFrom"] = json!([{"configMapRef": {"name": "evil"}}])
            }),
        ),
        (
            "imagePullPolicy",
            Box::new(|s| s["containers"][0]["imagePullPolicy"] = json!("Always")),
        ),
        (
            "ephemeral container",
            Box::new(|s| s["ephemeralContainers"] = json!([{"name": "debug", "image": "busybox"}])),
        ),
        (
            "token volume mounted elsewhere",
            Box::new(|s| s["containers"][0]["volumeMounts"][0]["mountPath"] = json!("/etc/app")),
        ),
        (
            "token volume with another source",
            Box::new(|s| {
                s["volumes"][1]["projected"]["sources"][1]["configMap"]["name"] =
                    json!("attacker-config")
            }),
        ),
        (
            "token volume writable",
            Box::new(|s| s["containers"][0]["volumeMounts"][0]["readOnly"] = json!(false)),
        ),
    ];
    for (what, change) in changes {
        let changed = with(source_spec(), change);
        assert_ne!(spec_hash(&changed), base, "{what} did not change the hash");
    }
}

#[test]
fn service_account_defaults() {
    let none = json!({"containers": [{"name": "a", "image": "i"}]});
    let default =
        json!({"serviceAccountName": "default", "containers": [{"name": "a", "image": "i"}]});
    let legacy = json!({"serviceAccount": "default", "containers": [{"name": "a", "image": "i"}]});
    assert_eq!(spec_hash(&none), spec_hash(&default));
    assert_eq!(spec_hash(&legacy), spec_hash(&default));
}

#[test]
fn containers_sorted_init_containers_ordered() {
    let ab = json!({"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]});
    let ba = json!({"containers": [{"name": "b", "image": "2"}, {"name": "a", "image": "1"}]});
    assert_eq!(spec_hash(&ab), spec_hash(&ba));
    let i_ab =
        json!({"initContainers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]});
    let i_ba =
        json!({"initContainers": [{"name": "b", "image": "2"}, {"name": "a", "image": "1"}]});
    assert_ne!(spec_hash(&i_ab), spec_hash(&i_ba));
}

#[test]
fn normalised_form_is_readable() {
    let n = normalise(&source_spec());
    assert_eq!(n["serviceAccountName"], "trainer");
    assert!(n.get("nodeName").is_none());
    assert!(n.get("hostNetwork").is_none());
    assert_eq!(n["volumes"].as_array().unwrap().len(), 2);
    let c = &n["containers"][0];
    assert!(c.get("resources").is_none());
    assert_eq!(c["env"][0]["name"], "A");
    assert_eq!(
        c["livenessProbe"],
        json!({"httpGet": {"path": "/healthz", "port": 8080}})
    );
    assert_eq!(c["volumeMounts"].as_array().unwrap().len(), 1);
    assert_eq!(
        normalise(&json!(null)),
        json!({"serviceAccountName": "default"})
    );
}

#[test]
fn a_projected_volume_named_like_the_token_is_hashed_unless_generated() {
    // An attacker's volume named kube-api-access-x, mounted over an application path.
    let forged = |name: &str| {
        json!({
            "volumes": [{"name": name, "projected": {"sources": [
                {"configMap": {"name": "attacker", "items": [{"key": "k", "path": "hook.sh"}]}}
            ]}}],
            "containers": [{"name": "a", "image": "i", "volumeMounts": [
                {"name": name, "mountPath": "/app/hooks", "readOnly": true}
            ]}]
        })
    };
    let none = json!({"containers": [{"name": "a", "image": "i"}]});
    assert_ne!(spec_hash(&forged("kube-api-access-x")), spec_hash(&none));
    assert!(generated_token_volumes(forged("kube-api-access-x").as_object().unwrap()).is_empty());
    // The generated one, whatever its suffix, is left out.
    let generated = |name: &str| {
        json!({
            "volumes": [token_volume(name)],
            "containers": [{"name": "a", "image": "i", "volumeMounts": [
                {"name": name, "mountPath": SERVICE_ACCOUNT_PATH, "readOnly": true}
            ]}]
        })
    };
    assert_eq!(
        spec_hash(&generated("kube-api-access-abcde")),
        spec_hash(&none)
    );
    assert_eq!(
        spec_hash(&generated("kube-api-access-abcde")),
        spec_hash(&generated("kube-api-access-fghij"))
    );
    // Another name with the generated shape is an ordinary volume.
    assert_ne!(spec_hash(&generated("tokens")), spec_hash(&none));
}

#[test]
fn volume_classification() {
    let spec = json!({
        "volumes": [
            {"name": "scratch", "emptyDir": {}},
            {"name": "cfg", "configMap": {"name": "c"}},
            token_volume("kube-api-access-zz"),
            {"name": "db", "persistentVolumeClaim": {"claimName": "db"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": true}},
            {"name": "host", "hostPath": {"path": "/var/log"}},
            {"name": "host-ro", "hostPath": {"path": "/etc"}},
            {"name": "eph", "ephemeral": {"volumeClaimTemplate": {}}},
            {"name": "share", "nfs": {"server": "s", "path": "/"}}
        ],
        "containers": [{"name": "a", "volumeMounts": [
            {"name": "db", "mountPath": "/db"},
            {"name": "host", "mountPath": "/h"},
            {"name": "host-ro", "mountPath": "/e", "readOnly": true}
        ]}, {"name": "b", "volumeMounts": [
            {"name": "host", "mountPath": "/h", "readOnly": true}
        ]}]
    });
    let facts = volume_facts(&spec);
    assert_eq!(facts.len(), 8, "token volume left out");
    let kind = |n: &str| facts.iter().find(|f| f.name == n).unwrap().clone();
    assert_eq!(kind("scratch").kind, VolumeKind::Captured);
    assert_eq!(kind("cfg").kind, VolumeKind::Provided);
    assert!(kind("models").read_only);
    assert!(
        !kind("host").read_only,
        "one writable mount makes it writable"
    );
    assert!(kind("host-ro").read_only);
    assert_eq!(kind("share").kind, VolumeKind::Other("nfs".into()));
    assert_eq!(
        unsafe_volumes(&facts, &[]),
        vec!["db", "host", "eph", "share"]
    );
    assert_eq!(
        unsafe_volumes(&facts, &["db".into(), "share".into()]),
        vec!["host", "eph"]
    );
}
