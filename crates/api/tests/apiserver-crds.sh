#!/usr/bin/env bash
# Checks the committed CRDs against a real kube-apiserver: starts etcd and kube-apiserver (the
# binaries scripts/cluster builds into its cache) on free local ports, installs
# deploy/helm/stasis/crds/stasis.dev.yaml, and checks what the API server accepts, refuses
# (with which message), defaults, and prints. No kubelet, no cluster: seconds, not minutes.
#
# Exit 0: all checks pass. Exit 1: a check failed. Exit 77: skipped (binaries not built yet;
# `scripts/cluster up` builds them) — printed, never silent.
set -euo pipefail

# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need apiserver-crds
apiserver_start

kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl wait --for condition=established --timeout=30s \
    crd/checkpointpolicies.stasis.dev crd/podcheckpoints.stasis.dev crd/podrestores.stasis.dev >/dev/null
if kubectl get crd -o jsonpath='{.items[*].status.conditions[?(@.type=="NonStructuralSchema")].message}' | grep -q .; then
    fail "CRD schemas are structural"
else
    pass "CRDs installed, established, structural"
fi

policy() { # name interval [extra spec yaml]
    printf 'apiVersion: stasis.dev/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: %s}\nspec: {selector: {matchLabels: {app: counter}}, interval: "%s"%s}\n' "$1" "$2" "${3:-}"
}
accepts() { # what, yaml on stdin
    local out
    if out="$(kubectl apply -f - 2>&1)"; then pass "$1"; else fail "$1: $out"; fi
}
refuses() { # what, expected message fragment, yaml on stdin
    local out
    if out="$(kubectl apply -f - 2>&1)"; then
        fail "$1: accepted"
    elif grep -qF -- "$2" <<<"$out"; then
        pass "$1"
    else
        fail "$1: refused without \"$2\": $out"
    fi
}

policy counter 10s | accepts "CheckpointPolicy with a 10s interval"
defaults="$(kubectl get checkpointpolicy counter -o jsonpath='{.spec.onTermination} {.spec.restoreOnCrash} {.spec.retention.keepLast}')"
[[ "$defaults" == "true false 3" ]] && pass "defaults onTermination=true restoreOnCrash=false keepLast=3" \
    || fail "defaults: got '$defaults'"
policy long 1h30m ", safeVolumes: [db], retention: {keepLast: 5, maxAge: 24h}, triggers: {memoryPercent: 90, spotNotice: true}, maxFreezeFraction: 0.25" \
    | accepts "CheckpointPolicy with every field"
policy auto auto | accepts "interval auto is accepted"
policy short 500ms | refuses "interval below 1s is refused" "at least 1s"
policy words "10 seconds" | refuses "interval that is not a duration is refused" "should match"
policy keep 10s ", retention: {keepLast: 0}" | refuses "keepLast 0 is refused" "greater than or equal to 1"

accepts "PodCheckpoint request" <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: c1}
spec: {sourcePodName: counter-abc, sourcePodUID: 3f2a9c10, reason: Heartbeat, timeoutSeconds: 60}
EOF
refuses "PodCheckpoint reason outside the enum" "Unsupported value" <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: c2}
spec: {sourcePodName: counter-abc, reason: Whim}
EOF
refuses "PodCheckpoint timeoutSeconds above an hour" "less than or equal to 3600" <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: c3}
spec: {sourcePodName: counter-abc, timeoutSeconds: 3601}
EOF
if out="$(kubectl patch podcheckpoint c1 --type merge -p '{"spec":{"sourcePodName":"other"}}' 2>&1)"; then
    fail "PodCheckpoint spec is immutable: patch accepted"
else
    grep -q "immutable" <<<"$out" && pass "PodCheckpoint spec is immutable" || fail "immutability message: $out"
fi
kubectl patch podcheckpoint c1 --subresource status --type merge -p '{"status":{"phase":"Succeeded","node":"worker-1","sizeBytes":268435456,"checkpointRef":"default_deploy_counter.3f2a9c10/20261129T090000.000Z-0000abcd","lineage":"default_deploy_counter.3f2a9c10","generation":2,"freezeMillis":850,"conditions":[{"type":"Ready","status":"True","reason":"CheckpointCompleted","message":"","lastTransitionTime":"2026-11-29T09:00:00Z"}]}}' >/dev/null \
    && pass "PodCheckpoint status through the status subresource" || fail "PodCheckpoint status patch"
row="$(kubectl get podcheckpoints --no-headers --field-selector spec.sourcePodName=counter-abc)"
[[ "$(awk '{print $2, $3, $4, $5, $6, $7}' <<<"$row")" == "counter-abc Heartbeat Succeeded 268435456 850 worker-1" ]] \
    && pass "kubectl get podcheckpoints columns and field selector" || fail "podcheckpoints row: $row"
header="$(kubectl get podcheckpoints | sed -n 1p | tr -s ' ')"
[[ "$header" == "NAME POD REASON PHASE SIZE FREEZE (MS) NODE AGE" ]] \
    && pass "podcheckpoints columns: $header" || fail "podcheckpoints header: $header"

accepts "PodRestore" <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: PodRestore
metadata: {name: r1}
spec: {checkpointRef: "default_deploy_counter.3f2a9c10/20261129T090000.000Z-0000abcd", targetPodName: counter-xyz, sourcePodName: counter-abc, lineage: default_deploy_counter.3f2a9c10, generation: 3}
EOF
for phase in Pending Fetching Ready Restored Failed ColdStart; do
    kubectl patch podrestore r1 --subresource status --type merge -p "{\"status\":{\"phase\":\"$phase\"}}" >/dev/null 2>&1 \
        || fail "PodRestore phase $phase accepted"
done
pass "PodRestore phases Pending|Fetching|Ready|Restored|Failed|ColdStart accepted"
if kubectl patch podrestore r1 --subresource status --type merge -p '{"status":{"phase":"Maybe"}}' >/dev/null 2>&1; then
    fail "PodRestore phase outside the enum accepted"
else
    pass "PodRestore phase outside the enum refused"
fi
# The typed failure the restore-loop guard counts: one of the enum, nothing else.
kubectl patch podrestore r1 --subresource status --type merge -p '{"status":{"failure":"FetchFailed"}}' >/dev/null 2>&1 \
    && pass "PodRestore failure FetchFailed accepted" || fail "PodRestore failure FetchFailed refused"
if kubectl patch podrestore r1 --subresource status --type merge -p '{"status":{"failure":"Flaky"}}' >/dev/null 2>&1; then
    fail "PodRestore failure outside the enum accepted"
else
    pass "PodRestore failure outside the enum refused"
fi
kubectl get stasis >/dev/null && pass "category 'stasis' lists all three kinds" || fail "kubectl get stasis"
header="$(kubectl get podrestores | sed -n 1p | tr -s ' ')"
[[ "$header" == "NAME TARGET POD CHECKPOINT PHASE NODE AGE" ]] \
    && pass "podrestores columns: $header" || fail "podrestores header: $header"
row="$(kubectl get podrestore r1 --no-headers | awk '{print $2, $3, $4}')"
[[ "$row" == "counter-xyz default_deploy_counter.3f2a9c10/20261129T090000.000Z-0000abcd ColdStart" ]] \
    && pass "podrestores row: $row" || fail "podrestores row: $row"
header="$(kubectl get checkpointpolicies | sed -n 1p | tr -s ' ')"
[[ "$header" == "NAME INTERVAL KEEPLAST PODS READY AGE" ]] \
    && pass "checkpointpolicies columns: $header" || fail "checkpointpolicies header: $header"

if ((failures)); then
    echo "apiserver-crds: $failures check(s) failed" >&2
    exit 1
fi
echo "apiserver-crds: all checks passed against $(basename "$(dirname "$(dirname "$apiserver")")")"
