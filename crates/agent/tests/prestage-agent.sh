#!/usr/bin/env bash
# Pre-staging between two stasisd agents against a real kube-apiserver (etcd + kube-apiserver,
# no kubelet) and a real S3 server (s3s-fs), with real runc and CRIU. Node objects node-a and
# node-b stand for two workers; agent A (node-a) checkpoints a runc counter container whose CRI
# annotations carry the UID of Pod counter-a (namespace default, bound to node-a); agent B
# (node-b) is the likely receiver. B runs no pod of namespace default and first gets its data
# keys only from a key broker that answers nothing: it holds no data key at all (stricter than
# the broker's rule, which would refuse it default's key for want of a pod of default there), so
# what it pre-stages it fetches without a key. Checks:
# - nothing is pre-staged while node-a is healthy;
# - node-a cordoned: B fetches counter-a's latest checkpoint into its chunk cache (metrics, log
#   line, Event) without asking for a key, and the cache holds the chunks as stored (no
#   plaintext of the images);
# - a newer checkpoint: B fetches only its new chunks (bytes fetched against the first);
# - node-a uncordoned: a checkpoint taken after that is not pre-staged;
# - B restarted with the cluster key (as the broker hands a node the key once a pod of the
#   namespace is bound to it: the replacement counter-r), its cache kept on disk: a restore on
#   node-b of the pre-staged checkpoint, with every chunk object deleted from the bucket, is
#   prepared to Ready: every chunk came from the cache (hits, no miss).
#
# Usage: prestage-agent.sh <stasisd> <stasis-runc> <lineage> <record-name>
# Exit 0: pass. 1: a check failed. 77: skipped (binaries, root, CRIU, s3s-fs or the image missing).
set -euo pipefail

stasisd=$1
wrapper=$2
lineage=$3
record_name=$4
# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need prestage-agent
s3s=$(newest 's3s-fs-*/bin/s3s-fs')
if [[ $(id -u) != 0 ]] || ! command -v runc >/dev/null || [[ -z $s3s ]] ||
    [[ ! -x $root/target/images/counter/rootfs/stasis-counter ]]; then
    echo "SKIP prestage-agent: needs root, runc, s3s-fs (scripts/build-platform s3s-fs) and the counter image (scripts/build-counter-image)"
    exit 77
fi

runc_root="/run/stasis-prestage-test-$$"
cleanup() {
    local rc=$?
    if [[ $rc != 0 || $failures != 0 ]]; then
        for a in a b; do
            [[ -f $work/$a/stasisd.log ]] && { echo "--- agent $a log (tail)" >&2; tail -15 "$work/$a/stasisd.log" >&2; }
        done
    fi
    runc --root "$runc_root" delete --force c1 >/dev/null 2>&1 || true
    rm -rf "$runc_root"
    apiserver_stop
}
trap cleanup EXIT
APISERVER_OWN_TRAP=1 apiserver_start --disable-admission-plugins ServiceAccount

jp() { kubectl get "$1" "$2" ${3:+-n "$3"} -o jsonpath="$4" 2>/dev/null; }
phase_is() { test "$(jp "$1" "$2" default '{.status.phase}')" = "$3"; }
# metric <agent a|b> <series>: its value (0 when absent)
metric() {
    curl -fsS "http://127.0.0.1:$(cat "$work/$1/port")/metrics" 2>/dev/null |
        awk -v n="$2" '$1 == n {v = $2} END {print v + 0}'
}
metric_above() { (($(metric "$1" "$2") > $3)); }

# The S3 server: a directory whose subdirectories are buckets.
mkdir -p "$work/s3/stasis-test"
s3_port=$(free_port)
"$s3s" --host 127.0.0.1 --port "$s3_port" --access-key stasis --secret-key stasis-secret "$work/s3" \
    >"$work/s3s.log" 2>&1 &
stop_at_exit $!
export AWS_ENDPOINT_URL="http://127.0.0.1:$s3_port" AWS_ACCESS_KEY_ID=stasis \
    AWS_SECRET_ACCESS_KEY=stasis-secret AWS_REGION=us-east-1

kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl wait --for condition=established --timeout=30s \
    crd/checkpointpolicies.stasis.dev crd/podcheckpoints.stasis.dev crd/podrestores.stasis.dev >/dev/null
kubectl create namespace stasis >/dev/null
for n in node-a node-b; do
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $n}
EOF
    # (no kubelet, no node controller: the Ready condition is written here, and the not-ready
    # taint the API server puts on a new node is removed)
    kubectl patch node "$n" --subresource=status --type=merge -p \
        '{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"test"}]}}' >/dev/null
    kubectl taint node "$n" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
done
kubectl apply -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: stasis}
handler: stasis
EOF
pod() { # pod <name> <node>
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: default, labels: {app: counter}}
spec:
  nodeName: $2
  runtimeClassName: stasis
  containers: [{name: counter, image: "stasis-counter:dev", imagePullPolicy: Never}]
EOF
    jp pod "$1" default '{.metadata.uid}'
}
uid_a=$(pod counter-a node-a)
# The controller's lineage record (what agent A stamps with), held by counter-a's UID; <1>: the
# published checkpoints (what a restore is checked against).
record() {
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: $record_name
  namespace: stasis
  labels: {stasis.dev/lineage-record: "true", stasis.dev/namespace: default, stasis.dev/holder-uid: "$uid_a"}
data:
  lineage.json: '{"id":"$lineage","workload":"default_pod_counter-a","generation":1,"holder":"tok","orphaned":false,"checkpoints":${1:-[]},"failures":[],"bad":[]}'
EOF
}
record

# (one 64 KiB block of its state rewritten every 4 s: a checkpoint seconds after another shares
# most chunks)
cri_counter_bundle "$work/b1" "$uid_a" counter-a STATE_MB=16 INTERVAL_MS=4000
runc --root "$runc_root" run -d --bundle "$work/b1" c1 > >(cat >>"$work/c1.out") 2>&1
wait_for 20 grep -q 'count=' "$work/c1.out" || fail "the counter counts"

head -c 32 /dev/urandom >"$work/cluster-key"
# The key broker node-b asks for data keys: a CA and a token it accepts, at a port where nothing
# answers, so no key request succeeds.
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$work/broker.key" -out "$work/broker-ca.crt" \
    -days 1 -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>/dev/null
echo not-a-token >"$work/broker-token"
no_broker=(--key-broker-url "https://localhost:$(free_port)" --key-broker-ca "$work/broker-ca.crt"
    --key-broker-token "$work/broker-token")
containerd_dropin "$work/containerd/conf.d" "$wrapper"
agent() { # agent <a|b> <node> <runc root> <key flags...>
    local d=$work/$1 node=$2 runc_dir=$3
    shift 3
    mkdir -p "$d/runc"
    [[ -f $d/port ]] || free_port >"$d/port"
    NODE_NAME=$node RUST_LOG=info,kube=warn,stasis_agent::k8s::prestage=debug "$stasisd" --store "s3://stasis-test/ckpt" \
        "$@" --runc-root "$runc_dir" --socket "$d/run/agent.sock" \
        --plans-dir "$d/run/plans" --images-dir "$d/images" --work-dir "$d/work" \
        --chunk-cache-dir "$d/cache" --chunk-cache-bytes $((1 << 30)) --cloud-provider none \
        --metrics-addr "127.0.0.1:$(cat "$d/port")" --runtime-binary "$wrapper" \
        --containerd-config "$work/containerd/conf.d" --check-interval 2 --log-format json \
        >>"$d/stasisd.log" 2>&1 &
    echo $! >"$d/pid"
    stop_at_exit $!
}
agent a node-a "$runc_root" --cluster-key "$work/cluster-key"
agent b node-b "$work/b/runc" "${no_broker[@]}"
node_ready() { test "$(jp node "$1" '' '{.metadata.labels.stasis\.dev/ready}')" = true; }
wait_for 30 node_ready node-a && wait_for 30 node_ready node-b ||
    fail "both nodes labelled ready: $(kubectl get nodes -o jsonpath='{.items[*].metadata.labels}')"

ckpt() { # ckpt <name>: a PodCheckpoint of counter-a; its reference once Succeeded
    kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: $1, namespace: default}
spec: {sourcePodName: counter-a, reason: Manual, timeoutSeconds: 120}
EOF
    wait_for 60 phase_is podcheckpoint "$1" Succeeded || fail "PodCheckpoint $1: $(kubectl get podcheckpoint "$1" -o json | jq -c .status)"
    jp podcheckpoint "$1" default '{.status.checkpointRef}'
}
staged=stasis_agent_prestaged_checkpoints_total
staged_bytes=stasis_agent_prestaged_bytes_total

ref1=$(ckpt first)
[[ -n $ref1 ]] || fail "PodCheckpoint first Succeeded"
sleep 6
if (($(metric b $staged) == 0)); then
    pass "node-a healthy: nothing pre-staged on node-b after $ref1"
else
    fail "pre-staged while node-a was healthy: $(metric b $staged)"
fi

kubectl cordon node-a >/dev/null
t0=$(date +%s%N)
if wait_for 30 metric_above b $staged 0; then
    bytes1=$(metric b $staged_bytes)
    line=$(grep '"checkpoint pre-staged"' "$work/b/stasisd.log" | head -1)
    pass "node-a cordoned: node-b pre-staged $ref1 in $((($(date +%s%N) - t0) / 1000000)) ms, $bytes1 bytes fetched: $(jq -c '.fields | {checkpoint_ref, chunks, cached_already, fetched_bytes, ms}' <<<"$line")"
    [[ $(jq -r .fields.checkpoint_ref <<<"$line") == "$ref1" ]] || fail "the pre-staged checkpoint is $ref1: $line"
    if grep -q 'no data key for namespace' "$work/b/stasisd.log"; then
        fail "node-b asked for a data key: $(grep 'no data key for namespace' "$work/b/stasisd.log" | head -2)"
    else
        pass "node-b, holding no data key, pre-staged without asking for one"
    fi
else
    fail "node-a cordoned: nothing pre-staged on node-b; node-b: $(kubectl get node node-b -o json | jq -c '{labels: .metadata.labels, spec, conditions: .status.conditions}')"
    bytes1=0
fi
# The cache holds the objects as the store has them: compressed and encrypted, no plaintext of
# the images (the counter's name is in CRIU's images of its process).
cached=$(find "$work/b/cache" -type f | wc -l)
if ((cached > 0)) && ! grep -rqa stasis-counter "$work/b/cache"; then
    pass "node-b's chunk cache holds $cached encrypted objects ($(du -sm "$work/b/cache" | cut -f1) MiB), no plaintext of the images"
else
    fail "chunk cache contents: $cached files, plaintext: $(grep -rla stasis-counter "$work/b/cache" | head -3)"
fi
if wait_for 10 sh -c "kubectl get events -n default --field-selector involvedObject.name=counter-a,reason=Prestaged -o jsonpath='{.items[0].message}' | grep -q node-b"; then
    pass "Event on counter-a: $(kubectl get events -n default --field-selector involvedObject.name=counter-a,reason=Prestaged -o jsonpath='{.items[0].message}')"
else
    fail "a Prestaged Event on counter-a"
fi

# A newer checkpoint of a pod on the at-risk node: only its new chunks move.
ref2=$(ckpt second)
[[ -n $ref2 ]] || fail "PodCheckpoint second Succeeded"
if wait_for 30 metric_above b $staged 1; then
    bytes2=$(($(metric b $staged_bytes) - bytes1))
    line=$(grep '"checkpoint pre-staged"' "$work/b/stasisd.log" | grep -F "$ref2" | head -1)
    pass "a newer checkpoint $ref2 pre-staged with $bytes2 bytes fetched (the first: $bytes1): $(jq -c '.fields | {chunks, cached_already, fetched}' <<<"$line")"
    ((bytes2 * 2 < bytes1)) || fail "the newer checkpoint moved only its new chunks: $bytes2 of $bytes1 bytes"
else
    fail "the newer checkpoint $ref2 was not pre-staged"
fi

# node-a recovers: what it publishes next stays in the bucket.
kubectl uncordon node-a >/dev/null
wait_for 10 grep -q '"the node recovered' "$work/b/stasisd.log" || fail "node-b saw node-a recover"
ref3=$(ckpt third)
[[ -n $ref3 ]] || fail "PodCheckpoint third Succeeded"
sleep 6
if (($(metric b $staged) == 2)); then
    pass "node-a uncordoned: its next checkpoint $ref3 is not pre-staged"
else
    fail "pre-staged after the uncordon: $(metric b $staged) checkpoints"
fi

# The replacement counter-r is bound to node-b: the broker now hands node-b default's key.
# Here node-b's agent restarts with the cluster key; its chunk cache stays on disk.
kill "$(cat "$work/b/pid")"
wait_for 15 sh -c "! kill -0 $(cat "$work/b/pid") 2>/dev/null" || fail "node-b's agent stops on SIGTERM"
agent b node-b "$work/b/runc" --cluster-key "$work/cluster-key"
if wait_for 20 metric_above b stasis_agent_chunk_cache_bytes 0; then
    pass "node-b's agent restarted with the cluster key, its cache kept: $(metric b stasis_agent_chunk_cache_bytes) bytes"
else
    fail "node-b's agent restarted with its cache: $(tail -5 "$work/b/stasisd.log")"
fi

# A restore on node-b of the pre-staged checkpoint, every chunk object gone from the bucket.
digest=$(jp podcheckpoint second default '{.status.manifestDigest}')
record "[$(jq -nc --arg id "${ref2#*/}" --arg d "$digest" '{id: $id, generation: 1, created_unix_ms: 1, manifest_digest: $d}')]"
removed=$(find "$work/s3/stasis-test/ckpt/chunks" -type f | wc -l)
find "$work/s3/stasis-test/ckpt/chunks" -type f -delete
hits=$(metric b stasis_agent_chunk_cache_hits_total)
misses=$(metric b stasis_agent_chunk_cache_misses_total)
uid_r=$(pod counter-r node-b)
kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodRestore
metadata: {name: counter-r, namespace: default}
spec: {checkpointRef: "$ref2", targetPodName: counter-r, sourcePodName: counter-a, targetPodUID: "$uid_r"}
EOF
if wait_for 60 phase_is podrestore counter-r Ready && [[ -f $work/b/run/plans/pod_${uid_r}_counter.json ]]; then
    sleep 6 # (the cache's counters reach /metrics within 5 s)
    pass "restore on node-b with the $removed chunk objects deleted from the bucket: Ready ($(jp podrestore counter-r default '{.status.message}')); chunk cache hits $hits -> $(metric b stasis_agent_chunk_cache_hits_total), misses $misses -> $(metric b stasis_agent_chunk_cache_misses_total)"
    (($(metric b stasis_agent_chunk_cache_misses_total) == misses)) || fail "no chunk was missed in the cache"
else
    fail "restore from the cache: $(kubectl get podrestore counter-r -o json | jq -c .status)"
fi

((failures == 0)) || exit 1
