#!/usr/bin/env bash
# stasisd against a real kube-apiserver (etcd + kube-apiserver from scripts/cluster's cache, no
# kubelet) with real runc and CRIU: Pod objects bound to a Node object stand for the pods, and a
# counter container started with runc carries their UIDs in its CRI annotations, which is all the
# agent needs. Checks: /readyz 503 until every cache has listed (stasis's CRDs are installed only
# after the agent started), 200 after; node labels (ready, arch) and their removal on SIGTERM; a PodCheckpoint
# taken to Succeeded with its status fields, stamped from the lineage record that names the pod's
# UID as holder; a pod with copied lineage annotations, and a pod without the stasis RuntimeClass,
# refused before any freeze; the namespace's wrapped data key Secret; the manifest digest in the
# PodCheckpoint's status; a PodRestore prepared to Ready with its plan file when the record's
# digest matches; a PodRestore refused when the lineage record (the controller's) holds another
# manifest digest (reason CheckpointDamaged) or does not list the checkpoint; fencing (a lineage record claimed by another holder at a
# newer generation turns the old holder's next checkpoint into Failed/Fenced); a PodRestore of a missing checkpoint → Failed with
# the reason and Event CheckpointDamaged; the wrapper's `restored` report → PodRestore Restored and a Restored Event; a
# termination checkpoint over the socket recorded as a PodCheckpoint (reason Termination); a
# PodRestore created before its pod is bound, prepared once the pod lands; after a restart, a
# checkpoint the agent was taking marked Failed and a restore it was fetching prepared again.
#
# Usage: apiserver-agent.sh <stasisd> <stasis-runc> <lineage> <record-name>
#   (run as root under a reaping subreaper; the record name is
#   stasis_api::lineage::record_name(<lineage>))
# Exit 0: pass. 1: a check failed. 77: skipped (binaries, root, CRIU or the image missing).
set -euo pipefail

stasisd=$1
wrapper=$2
lineage=$3
record_name=$4
# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need apiserver-agent
if [[ $(id -u) != 0 ]] || ! command -v runc >/dev/null || [[ ! -x $root/target/images/counter/rootfs/stasis-counter ]]; then
    echo "SKIP apiserver-agent: needs root, runc and the counter image (scripts/build-counter-image)"
    exit 77
fi

runc_root="/run/stasis-agent-test-api-$$"
agent_pid=
cleanup() {
    local rc=$?
    if [[ $rc != 0 && -f $work/stasisd.log ]]; then
        echo "--- stasisd log (tail)" >&2; tail -25 "$work/stasisd.log" >&2
    fi
    [[ -n $agent_pid ]] && kill "$agent_pid" 2>/dev/null || true
    runc --root "$runc_root" delete --force c1 >/dev/null 2>&1 || true
    rm -rf "$runc_root"
    [[ -z $agent_pid ]] || stop_at_exit "$agent_pid"
    apiserver_stop
}
trap cleanup EXIT
# (no ServiceAccount admission: without a controller-manager no namespace has its default
# ServiceAccount, which it would require of every pod)
APISERVER_OWN_TRAP=1 apiserver_start --disable-admission-plugins ServiceAccount
metrics_port="$(free_port)"

jp() { kubectl get "$1" "$2" ${3:+-n "$3"} -o jsonpath="$4" 2>/dev/null; }
# phase_is <kind> <name> <phase> (in namespace default); node_ready: the label is true.
phase_is() { test "$(jp "$1" "$2" default '{.status.phase}')" = "$3"; }
node_ready() { test "$(jp node test-node '' '{.metadata.labels.stasis\.dev/ready}')" = true; }

# (stasis's CRDs come after the agent has started: its /readyz waits for their lists)
kubectl create namespace stasis >/dev/null
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: test-node}
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: stasis}
handler: stasis
EOF
pod() { # pod <name> [annotations-json]
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: default, labels: {app: counter}, annotations: ${2:-{\}}}
spec:
  nodeName: test-node
  runtimeClassName: stasis
  containers: [{name: counter, image: "stasis-counter:dev", imagePullPolicy: Never}]
EOF
    jp pod "$1" default '{.metadata.uid}'
}
uid_a=$(pod counter-a)
# The controller's lineage record (what the agent stamps with): held by counter-a's UID in
# namespace default, at generation <1>; <2> is the holder-UID label; <3> the published
# checkpoints (JSON list of {id, generation, created_unix_ms, manifest_digest}), default $published.
published='[]'
record() {
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: $record_name
  namespace: stasis
  labels: {stasis.dev/lineage-record: "true", stasis.dev/namespace: default, stasis.dev/holder-uid: "$2"}
data:
  lineage.json: '{"id":"$lineage","workload":"default_pod_counter-a","generation":$1,"holder":"tok","orphaned":false,"checkpoints":${3:-$published},"failures":[],"bad":[]}'
EOF
}
record 1 "$uid_a"

# The source pod's container: runc, with CRI annotations naming counter-a's UID; stdout on a pipe.
cri_counter_bundle "$work/b1" "$uid_a" counter-a STATE_MB=16 INTERVAL_MS=100
runc --root "$runc_root" run -d --bundle "$work/b1" c1 > >(cat >>"$work/c1.out") 2>&1
wait_for 20 grep -q 'count=3' "$work/c1.out" || fail "the counter counts"

# The agent.
head -c 32 /dev/urandom >"$work/cluster-key"
containerd_dropin "$work/containerd/conf.d" "$wrapper"
NODE_NAME=test-node RUST_LOG=info,kube=warn "$stasisd" --store "file://$work/store" \
    --cluster-key "$work/cluster-key" --runc-root "$runc_root" --socket "$work/run/agent.sock" \
    --plans-dir "$work/run/plans" --images-dir "$work/images" --work-dir "$work/work" \
    --metrics-addr "127.0.0.1:$metrics_port" --runtime-binary "$wrapper" \
    --containerd-config "$work/containerd/conf.d" --check-interval 2 --log-format json \
    >"$work/stasisd.log" 2>&1 &
agent_pid=$!
sleep 1
kill -0 "$agent_pid" 2>/dev/null || { echo "FAIL: stasisd exited at once"; exit 1; }

if wait_for 30 node_ready; then
    pass "node labelled stasis.dev/ready=true, cpu-arch=$(jp node test-node '' '{.metadata.labels.stasis\.dev/cpu-arch}')"
else
    fail "node ready label: $(kubectl get node test-node -o jsonpath='{.metadata.labels}')"
fi
# The admin server: alive at once; ready only once every cache has its first list. The pods'
# list comes at once, the PodCheckpoints' and PodRestores' cannot while their CRDs are missing.
readyz() { curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$metrics_port/readyz" 2>&1; }
if wait_for 30 grep -q '"pods of this node known"' "$work/stasisd.log" &&
    curl -fsS "http://127.0.0.1:$metrics_port/livez" >/dev/null; then
    sleep 2
    code=$(readyz)
    if [[ $code == 503 ]]; then
        pass "/livez ok; /readyz 503 with the pods listed and the PodCheckpoint and PodRestore lists missing"
    else
        fail "/readyz before the CRDs exist: $code, not 503"
    fi
else
    fail "/livez, or the node's pods listed: $(grep -c . "$work/stasisd.log") log lines"
fi
kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl wait --for condition=established --timeout=30s \
    crd/checkpointpolicies.stasis.dev crd/podcheckpoints.stasis.dev crd/podrestores.stasis.dev >/dev/null
t0=$SECONDS
readyz_ok() { test "$(readyz)" = 200; }
if wait_for 60 readyz_ok; then
    pass "/readyz 200 $((SECONDS - t0)) s after the CRDs are established (the watches' backoff)"
else
    fail "/readyz after the CRDs: $(readyz)"
fi

sleep 2
echo "info stasisd idle with its watchers: VmRSS $(awk '/^VmRSS/{print int($2/1024)}' /proc/$agent_pid/status) MiB"
ckpt() { # ckpt <name>: a PodCheckpoint of counter-a
    kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: $1, namespace: default}
spec: {sourcePodName: counter-a, reason: Manual, timeoutSeconds: 120}
EOF
}
ckpt first
if wait_for 60 phase_is podcheckpoint first Succeeded; then
    ref=$(jp podcheckpoint first default '{.status.checkpointRef}')
    st=$(kubectl get podcheckpoint first -o json | jq -c '.status | {node, sizeBytes, lineage, generation, sourcePodUID, freezeMillis, ready: .conditions[0].reason}')
    pass "PodCheckpoint Succeeded: $ref $st"
    [[ $ref == "$lineage/"* ]] || fail "checkpointRef names the pod's lineage: $ref"
    echo "$st" | jq -e --arg uid "$uid_a" '.node == "test-node" and .sizeBytes > 16000000 and .generation == 1 and .sourcePodUID == $uid and .ready == "CheckpointCompleted"' >/dev/null ||
        fail "PodCheckpoint status fields: $st"
else
    fail "PodCheckpoint first: $(kubectl get podcheckpoint first -o json | jq -c .status)"
    ref=
fi
# What the controller does when it publishes: the checkpoint, with the manifest digest the agent
# reported, enters the lineage record. Also listed: a checkpoint whose manifest is not in the
# store (published, then deleted from the bucket).
digest=$(jp podcheckpoint first default '{.status.manifestDigest}')
if [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]]; then
    pass "the PodCheckpoint names its manifest digest: $digest"
else
    fail "manifestDigest in the PodCheckpoint status: '$digest'"
fi
gone="$lineage/20200101T000000.000Z-00000000"
entry() { jq -nc --arg id "${1#*/}" --arg d "$2" '{id: $id, generation: 1, created_unix_ms: 1, manifest_digest: $d}'; }
published="[$(entry "$ref" "$digest"),$(entry "$gone" "sha256:$(printf '%064d' 0)")]"
record 1 "$uid_a"
if [[ $(kubectl get secret stasis-key-default -n stasis -o jsonpath='{.data.wrapped}' | base64 -d | wc -c) == 61 ]]; then
    pass "namespace data key kept wrapped in stasis/stasis-key-default"
else
    fail "wrapped data key Secret"
fi

# A pod that copies counter-a's lineage annotations is not counter-a: no record names it, so
# its checkpoint is refused before anything is frozen.
pod counter-e "{\"stasis.dev/lineage\": \"$lineage\", \"stasis.dev/generation\": \"1\"}" >/dev/null
kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: forged, namespace: default}
spec: {sourcePodName: counter-e, reason: Manual}
EOF
if wait_for 30 phase_is podcheckpoint forged Failed &&
    [[ $(jp podcheckpoint forged default '{.status.conditions[0].reason}') == Fenced ]] &&
    jp podcheckpoint forged default '{.status.conditions[0].message}' | grep -q 'no lineage record names this pod'; then
    pass "a pod with copied lineage annotations is not checkpointed: $(jp podcheckpoint forged default '{.status.conditions[0].message}')"
else
    fail "forged stamp: $(kubectl get podcheckpoint forged -o json | jq -c .status)"
fi
# A pod that did not opt in (no runtimeClassName) is never frozen.
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: plain, namespace: default}
spec:
  nodeName: test-node
  containers: [{name: c, image: "stasis-counter:dev", imagePullPolicy: Never}]
---
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: plain, namespace: default}
spec: {sourcePodName: plain, reason: Manual}
EOF
if wait_for 30 phase_is podcheckpoint plain Failed &&
    jp podcheckpoint plain default '{.status.conditions[0].message}' | grep -q 'did not opt in'; then
    pass "a pod without the stasis RuntimeClass is refused: $(jp podcheckpoint plain default '{.status.conditions[0].message}')"
else
    fail "opt-in: $(kubectl get podcheckpoint plain -o json | jq -c .status)"
fi

# podrestore <pod> <checkpoint ref> [<pod UID>]: a PodRestore of that name into that pod, for that
# UID as the webhook writes it when the pod exists; without one, the agent prepares it only for
# a pod the webhook marked stasis.dev/restore-request=<name> (a creator who may restore)
podrestore() {
    kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodRestore
metadata: {name: $1, namespace: default}
spec: {checkpointRef: "$2", targetPodName: $1, sourcePodName: counter-a${3:+, targetPodUID: "$3"}}
EOF
}
# A replacement pod and its PodRestore: prepared to Ready, with the per-pod plan file.
uid_b=$(pod counter-b)
podrestore counter-b "$ref" "$uid_b"
if wait_for 60 phase_is podrestore counter-b Ready &&
    [[ -f $work/run/plans/pod_${uid_b}_counter.json && -f $work/images/$uid_b/counter/criu/inventory.img ]]; then
    pass "PodRestore Ready ($(jp podrestore counter-b default '{.status.message}')); plan file and images on the node"
else
    fail "PodRestore counter-b: $(kubectl get podrestore counter-b -o json | jq -c .status); plans: $(ls "$work/run/plans" 2>&1)"
fi

# A PodRestore created before its pod is bound here (the webhook creates it at admission): left
# alone while no pod of that name is on the node, prepared once the pod lands.
podrestore counter-g "$ref"
sleep 2
early=$(jp podrestore counter-g default '{.status.phase}')
uid_g=$(pod counter-g '{"stasis.dev/restore-request": "counter-g"}')
if [[ -z $early ]] && wait_for 60 phase_is podrestore counter-g Ready &&
    [[ -f $work/run/plans/pod_${uid_g}_counter.json ]]; then
    pass "a PodRestore created before its pod: untouched until the pod is bound here, then Ready"
else
    fail "PodRestore before its pod (phase before the pod: '$early'): $(kubectl get podrestore counter-g -o json | jq -c .status)"
fi

# The manifest in the store is not the one the controller published (the record holds another
# digest: what a node holding the data key that rewrote the manifest would leave): refused as
# damage in the store, before anything is fetched; then a checkpoint the record does not list.
uid_d=$(pod counter-d)
record 1 "$uid_a" "[$(entry "$ref" "sha256:$(printf '%064d' 1)")]"
podrestore counter-d "$ref" "$uid_d"
if wait_for 60 phase_is podrestore counter-d Failed &&
    [ "$(jp podrestore counter-d default '{.status.conditions[?(@.type=="Ready")].reason}')" = CheckpointDamaged ] &&
    jp podrestore counter-d default '{.status.message}' | grep -q 'is not the one published' &&
    [[ ! -e $work/run/plans/pod_${uid_d}_counter.json && ! -e $work/images/$uid_d/counter ]]; then
    pass "a manifest other than the published one: PodRestore Failed/CheckpointDamaged, nothing fetched ($(jp podrestore counter-d default '{.status.message}'))"
else
    fail "manifest digest mismatch: $(kubectl get podrestore counter-d -o json | jq -c .status)"
fi
uid_f=$(pod counter-f)
record 1 "$uid_a" '[]'
podrestore counter-f "$ref" "$uid_f"
if wait_for 60 phase_is podrestore counter-f Failed &&
    jp podrestore counter-f default '{.status.message}' | grep -q 'not a published checkpoint' &&
    [[ ! -e $work/run/plans/pod_${uid_f}_counter.json ]]; then
    pass "a checkpoint the lineage record does not list is not restored ($(jp podrestore counter-f default '{.status.message}'))"
else
    fail "unpublished checkpoint: $(kubectl get podrestore counter-f -o json | jq -c .status)"
fi
record 1 "$uid_a"

# The node API as stasis-runc uses it: one JSON line each way.
node_api() {
    python3 - "$work/run/agent.sock" "$1" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(60); s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
try:
    print(s.makefile().readline().strip())
except Exception:
    pass
PY
}
# The wrapper's report of the restore: PodRestore Restored, a Restored Event, images removed.
node_api "{\"v\":1,\"op\":\"report\",\"container_id\":\"c2\",\"pod_uid\":\"$uid_b\",\"pod_namespace\":\"default\",\"pod_name\":\"counter-b\",\"container_name\":\"counter\",\"event\":{\"kind\":\"restored\",\"checkpoint_ref\":\"$ref\",\"restore_ms\":42}}" >/dev/null
if wait_for 30 phase_is podrestore counter-b Restored &&
    wait_for 10 sh -c "kubectl get events -n default --field-selector involvedObject.name=counter-b,reason=Restored -o name | grep -q ." &&
    wait_for 10 test ! -e "$work/images/$uid_b/counter"; then
    pass "report restored: PodRestore Restored, Event: $(kubectl get events -n default --field-selector involvedObject.name=counter-b,reason=Restored -o jsonpath='{.items[0].message}')"
else
    fail "report: $(kubectl get podrestore counter-b -o json | jq -c .status)"
fi

# A termination checkpoint (stasis-runc kill with SIGTERM), for a pod a policy selects.
kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: counter, namespace: default}
spec: {selector: {matchLabels: {app: counter}}, interval: 30s}
EOF
sleep 1
answer=$(node_api '{"v":1,"op":"final_checkpoint","container_id":"c1","deadline_ms":20000}')
final=$(kubectl get podcheckpoints -l stasis.dev/created-by=stasisd -o jsonpath='{.items[0].metadata.name}')
if [[ $answer == *'"result":"done"'* && -n $final ]] && wait_for 10 phase_is podcheckpoint "$final" Succeeded &&
    [[ $(jp podcheckpoint "$final" default '{.spec.reason}') == Termination ]]; then
    pass "final checkpoint: $answer, recorded as PodCheckpoint $final (Termination, Succeeded)"
else
    fail "final checkpoint: $answer; $(kubectl get podcheckpoints -o json | jq -c '[.items[] | {n: .metadata.name, s: .status.phase}]')"
fi

# Fencing: the controller's lineage record says a newer claim (generation 2, another holder)
# exists.
record 2 ""
ckpt second
if wait_for 60 phase_is podcheckpoint second Failed &&
    [[ $(jp podcheckpoint second default '{.status.conditions[0].reason}') == Fenced ]]; then
    pass "after a newer claim (generation 2, another holder) the old holder's checkpoint is Failed/Fenced: $(jp podcheckpoint second default '{.status.conditions[0].message}')"
else
    fail "fencing: $(kubectl get podcheckpoint second -o json | jq -c .status)"
fi

# A restore of a checkpoint that does not exist: Failed, and a ColdStart Event on the pod.
uid_c=$(pod counter-c)
podrestore counter-c "$gone" "$uid_c"
# A checkpoint whose manifest is gone is damage in the store, an alarm (the typed reason
# CheckpointDamaged, on the PodRestore's Ready condition and the Event), never a plain failure the
# controller would answer by restoring older memory.
if wait_for 60 phase_is podrestore counter-c Failed &&
    [ "$(jp podrestore counter-c default '{.status.conditions[?(@.type=="Ready")].reason}')" = CheckpointDamaged ] &&
    wait_for 10 sh -c "kubectl get events -n default --field-selector involvedObject.name=counter-c,reason=CheckpointDamaged -o name | grep -q ."; then
    pass "a missing checkpoint: PodRestore Failed, reason and Event CheckpointDamaged ($(jp podrestore counter-c default '{.status.message}'))"
else
    fail "missing checkpoint: $(kubectl get podrestore counter-c -o json | jq -c .status)"
fi

metrics=$(curl -fsS "http://127.0.0.1:$metrics_port/metrics" || true)
if grep -q 'stasis_agent_checkpoints_total{result="succeeded"} 2' <<<"$metrics" &&
    grep -q 'stasis_agent_checkpoints_total{result="fenced"} 2' <<<"$metrics"; then
    pass "/metrics counts the checkpoints (2 succeeded, 2 fenced)"
else
    fail "/metrics"
fi

echo "info stasisd after the checkpoints and restores: VmRSS $(awk '/^VmRSS/{print int($2/1024)}' /proc/$agent_pid/status) MiB, VmHWM $(awk '/^VmHWM/{print int($2/1024)}' /proc/$agent_pid/status) MiB"
kill -TERM "$agent_pid"
for _ in $(seq 50); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
if [[ -z $(jp node test-node '' '{.metadata.labels.stasis\.dev/ready}') ]]; then
    pass "stasis.dev/ready removed on shutdown"
else
    fail "ready label still set after SIGTERM"
fi
agent_pid=

# A checkpoint the agent was taking when it stopped: failed when the agent starts again. A
# restore it was fetching: prepared again.
ckpt interrupted
kubectl patch podcheckpoint interrupted --subresource=status --type=merge \
    -p '{"status":{"phase":"Running","node":"test-node"}}' >/dev/null
uid_h=$(pod counter-h)
podrestore counter-h "$ref" "$uid_h"
kubectl patch podrestore counter-h --subresource=status --type=merge \
    -p '{"status":{"phase":"Fetching","node":"test-node"}}' >/dev/null
NODE_NAME=test-node "$stasisd" --store "file://$work/store" --cluster-key "$work/cluster-key" \
    --runc-root "$runc_root" --socket "$work/run/agent.sock" --plans-dir "$work/run/plans" \
    --images-dir "$work/images" --work-dir "$work/work" --metrics-addr "" \
    --runtime-binary "$wrapper" --containerd-config "$work/containerd/conf.d" \
    >>"$work/stasisd.log" 2>&1 &
agent_pid=$!
if wait_for 30 phase_is podcheckpoint interrupted Failed; then
    pass "a checkpoint interrupted by an agent restart is Failed: $(jp podcheckpoint interrupted default '{.status.conditions[0].message}')"
else
    fail "interrupted checkpoint: $(kubectl get podcheckpoint interrupted -o json | jq -c .status)"
fi
if wait_for 60 phase_is podrestore counter-h Ready && [[ -f $work/run/plans/pod_${uid_h}_counter.json ]]; then
    pass "a restore interrupted by an agent restart is prepared again: $(jp podrestore counter-h default '{.status.message}')"
else
    fail "interrupted restore: $(kubectl get podrestore counter-h -o json | jq -c .status)"
fi

((failures == 0)) || exit 1
