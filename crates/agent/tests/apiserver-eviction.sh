#!/usr/bin/env bash
# stasisd as an eviction responder (lifecycle.k8s.io/v1alpha1, KEP-4563) against a real
# kube-apiserver with the EvictionRequestAPI gate on (etcd + kube-apiserver from scripts/cluster's
# cache; no kubelet, no runc): the status handling, which the API server validates. An
# EvictionRequest for a pod bound to the agent's node; tests/lib/evictor.sh stands in for the
# evictionrequest controller Kubernetes does not ship (and the imperative evictor). Checks: the
# agent stays quiet until its entry is Active, then reports a heartbeat and its completion in its
# own status.responders[] entry, accepted by the API server's rules; with nothing to checkpoint
# (the pod's container is not on this node's runtime) its completion says why, and the eviction
# goes on: the imperative evictor evicts the pod. A pod on another node gets no answer from this
# agent. The checkpoint itself, and the replacement's restore, are the e2e's (evictions.sh, 6).
#
# Usage: apiserver-eviction.sh <stasisd>
# Exit 0: pass. 1: a check failed. 77: skipped (the Kubernetes binaries missing).
set -euo pipefail

stasisd=$1
# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need apiserver-eviction
# shellcheck source=tests/lib/evictor.sh
. "$root/tests/lib/evictor.sh"

apiserver_start --disable-admission-plugins ServiceAccount \
    --feature-gates EvictionRequestAPI=true --runtime-config lifecycle.k8s.io/v1alpha1=true
# the agent's log when a check failed (the scratch directory goes with the API server)
agent_log() { echo "--- stasisd log (tail)" >&2; tail -25 "$work/stasisd.log" >&2; }

kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl create namespace stasis >/dev/null
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: test-node}
---
apiVersion: v1
kind: Node
metadata: {name: other-node}
EOF
# pod NAME NODE: bound to NODE, naming stasis as its eviction responder (the webhook's part),
# with a running container in its status (the kubelet's part)
pod() {
    kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: default, labels: {app: counter}}
spec:
  nodeName: $2
  containers: [{name: counter, image: counter}]
  evictionResponders: [{name: stasis.dev/checkpoint, priority: 1000}]
EOF
    kubectl patch pod "$1" --subresource=status --type=merge -p \
        '{"status": {"phase": "Running", "containerStatuses": [{"name": "counter", "image": "counter", "imageID": "", "ready": true, "restartCount": 0, "started": true, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "containerID": "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}]}}' >/dev/null
}
pod p1 test-node
pod p2 other-node
if kubectl get pod p1 -o json | jq -e '.spec.evictionResponders[0].name == "stasis.dev/checkpoint"' >/dev/null; then
    pass "the API server keeps the pod's spec.evictionResponders (gate on)"
else
    fail "the API server keeps the pod's spec.evictionResponders (gate on)"
fi

head -c 32 /dev/urandom >"$work/cluster-key"
NODE_NAME=test-node RUST_LOG=info,kube=warn "$stasisd" --store "file://$work/store" \
    --cluster-key "$work/cluster-key" --runc-root "$work/runc" --socket "$work/run/agent.sock" \
    --plans-dir "$work/run/plans" --images-dir "$work/images" --work-dir "$work/work" \
    --log-format json >"$work/stasisd.log" 2>&1 &
stop_at_exit $!
if wait_for 30 grep -q 'answering Evictions' "$work/stasisd.log"; then
    pass "stasisd answers Evictions once the API server serves them"
else
    fail "stasisd answers Evictions once the API server serves them"; agent_log; exit 1
fi

# no kubelet here: the pod evicted (deletionTimestamp set) is removed by hand, as its kubelet would
reap() { until kubectl get pod "$1" -o jsonpath='{.metadata.deletionTimestamp}' 2>/dev/null | grep -q .; do sleep 0.2; done
         kubectl delete pod "$1" --grace-period=0 --force >/dev/null 2>&1; }
reap p1 & reaper=$!
if evictor_run default p1 60; then
    pass "the EvictionRequest for p1 ended in its eviction, after stasis's answer"
else
    fail "the EvictionRequest for p1 ended in its eviction, after stasis's answer"
fi
kill "$reaper" 2>/dev/null || true
# (its first heartbeat came before the completion, which here follows at once: the entry at the
# end holds both, in the API's order)
if jq -e '.startTime <= .heartbeatTime and .heartbeatTime <= .completionTime' <<<"$EVICTOR_ENTRY" >/dev/null; then
    pass "stasis reported in its own status entry: startTime <= heartbeatTime <= completionTime ($EVICTOR_ENTRY)"
else
    fail "stasis reported in its own status entry: startTime <= heartbeatTime <= completionTime ($EVICTOR_ENTRY)"
fi
if [[ $EVICTOR_RESPONDED == "stasis took no final checkpoint: "*"the eviction goes on" ]]; then
    pass "stasis completed, saying why there is no checkpoint ($EVICTOR_RESPONDED)"
else
    fail "stasis completed, saying why there is no checkpoint (got: '$EVICTOR_RESPONDED')"
fi
if grep -q '"eviction responder done"' "$work/stasisd.log"; then
    pass "stasisd logged its answer"
else
    fail "stasisd logged its answer"
fi

# A pod on another node: this agent leaves its Eviction alone (its entry stays without reports).
reap p2 & reaper=$!
before=$(grep -c '"eviction: taking the final checkpoint"\|"eviction responder done"' "$work/stasisd.log" || true)
if ! evictor_run default p2 8 >/dev/null && [[ -z $EVICTOR_RESPONDED && $EVICTOR_HEARTBEATS == 0 ]]; then
    pass "no answer for a pod on another node"
else
    fail "no answer for a pod on another node (got: '$EVICTOR_RESPONDED', $EVICTOR_HEARTBEATS heartbeats)"
fi
kill "$reaper" 2>/dev/null || true
after=$(grep -c '"eviction: taking the final checkpoint"\|"eviction responder done"' "$work/stasisd.log" || true)
[[ $before == "$after" ]] && pass "... and nothing in its log about it" || fail "... and nothing in its log about it"

if ((failures)); then
    agent_log
    echo "$failures check(s) failed"
    exit 1
fi
echo "apiserver-eviction: all checks passed"
