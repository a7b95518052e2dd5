#!/usr/bin/env bash
# kubectl-stasis on the local cluster (scripts/cluster) with stasis installed and running: the
# real agent checkpoints, the real webhook decides, the real controller writes Events. A counter
# Deployment under a 10 s policy; the plugin shows its status, checkpoints it, explains its
# replacement's restore and refuses a restore to a user without stasis-restorer.
#
#   flock -o /tmp/stasis-cluster.lock crates/kubectl/tests/cluster-kubectl.sh [kubectl-stasis]
#
# Needs root (the cluster). STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar;
# STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up. Prints "N passed, M failed".
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
CLUSTER=$REPO/scripts/cluster
plugin=$(readlink -f "${1:-$REPO/target/debug/kubectl-stasis}")
NS=e2e-kubectl
PASSED=0 FAILED=0
pass() { PASSED=$((PASSED + 1)); echo "ok - $1"; }
fail() { FAILED=$((FAILED + 1)); echo "not ok - $1"; }
finish() {
  [ -n "${STASIS_E2E_KEEP_CLUSTER:-}" ] || "$CLUSTER" down >/dev/null 2>&1 || echo "# warning: scripts/cluster down failed"
  rm -rf "$W"
  echo "$PASSED passed, $FAILED failed"
  [ "$FAILED" -eq 0 ]; exit $?
}
retry() { local end=$(( $(date +%s) + $1 )); shift; until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 1; done; }
W=$(mktemp -d /tmp/stasis-e2e-kubectl.XXXXXX); OUT=$W/out ERR=$W/err
# ks ARGS...: the plugin; its stdout in $OUT, stderr in $ERR (files), status in rc, all shown
ks() {
  rc=0; "$plugin" -n "$NS" "$@" >"$OUT" 2>"$ERR" || rc=$?
  { echo "\$ kubectl stasis $* (exit $rc)"; cat "$OUT" "$ERR"; } | sed 's/^/#   /'
}
ok_if() { local what=$1; shift; if "$@" >/dev/null 2>&1; then pass "$what"; else fail "$what"; fi; }
[ -x "$plugin" ] || { echo "no plugin binary at $plugin (cargo build -p stasis-kubectl)"; exit 1; }

"$CLUSTER" up >/dev/null || { fail "scripts/cluster up"; finish; }
eval "$("$CLUSTER" env)"
[ -f "$REPO/target/images/stasis-counter.oci.tar" ] || "$REPO/scripts/build-counter-image" >/dev/null
"$CLUSTER" load-image "$REPO/target/images/stasis-counter.oci.tar" >/dev/null
out=$("$CLUSTER" install-stasis 2>&1) || { echo "$out" | sed 's/^/# /'; fail "scripts/cluster install-stasis"; finish; }
pass "stasis installed ($(helm get values stasis -n stasis-system -a -o json | jq -c '{broker: .keys.broker.enabled, agentOwnNodeOnly: .admissionPolicy.agentOwnNodeOnly}'))"
retry 60 bash -c "test \"\$(kubectl get nodes -l stasis.dev/ready=true -o name | wc -l)\" -ge 2"

kubectl delete namespace "$NS" --ignore-not-found --wait=true >/dev/null 2>&1
kubectl create namespace "$NS" >/dev/null
retry 30 kubectl -n "$NS" get serviceaccount default
kubectl -n "$NS" create rolebinding dev-edit --clusterrole=edit --user=dev >/dev/null
kubectl -n "$NS" create rolebinding ops-edit --clusterrole=edit --user=ops >/dev/null
kubectl -n "$NS" create rolebinding ops-restore --clusterrole=stasis-restorer --user=ops >/dev/null
kubectl -n "$NS" apply -f - >/dev/null <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: every-10s}
spec: {selector: {matchLabels: {app: web}}, interval: 10s, retention: {keepLast: 5}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      runtimeClassName: stasis
      terminationGracePeriodSeconds: 30
      containers:
      - name: counter
        image: docker.io/stasis/counter:dev
        imagePullPolicy: Never
        env: [{name: STATE_MB, value: "32"}, {name: INTERVAL_MS, value: "100"}]
EOF
running() { kubectl -n "$NS" get pods -l app=web -o json | jq -r '.items[] | select(.metadata.deletionTimestamp == null and .status.phase == "Running") | .metadata.name'; }
counting() { kubectl -n "$NS" logs "$1" -c counter 2>/dev/null | grep -q '^count='; }
retry 120 bash -c "p=\$(kubectl -n $NS get pods -l app=web -o name | head -1) && kubectl -n $NS logs \$p -c counter | grep -q '^count='"
P1=$(running | head -1)
[ -n "$P1" ] || { fail "the counter pod runs"; finish; }
pass "counter pod $P1 runs"
heartbeat() { kubectl -n "$NS" get pckpt -o json | jq -e '[.items[] | select(.spec.reason == "Heartbeat" and .status.phase == "Succeeded")] | length >= 1'; }
ok_if "a heartbeat checkpoint succeeded (the real agent)" retry 60 heartbeat

ks status
ok_if "status: $P1 with its lineage, a checkpoint seconds old, its size and freeze, the next heartbeat, ColdStart and why" \
  bash -c "grep -Eq '^$P1 +${NS}[^ ]* +[1-9][0-9]* +[0-9]+s ago +[0-9.]+[KMG]i +[0-9]+ms +(in [0-9]+s|now) +ColdStart +.+' '$OUT'"
ks checkpoint "$P1"
ok_if "checkpoint $P1: followed to Succeeded by the node's agent, with a progress line" \
  bash -c "[ $rc = 0 ] && grep -Eq ': Succeeded on worker-[12] \\(' '$ERR'"
ks list
ok_if "list: the Manual checkpoint first (newest), then heartbeats" bash -c "awk 'NR==2 {print \$3}' '$OUT' | grep -qx Manual"
REF=$(kubectl -n "$NS" get pckpt -o json | jq -r '[.items[] | select(.status.phase == "Succeeded")] | sort_by(.status.startTime) | last | .metadata.name')

kubectl -n "$NS" delete pod "$P1" --wait=false >/dev/null
retry 120 bash -c "p=\$(kubectl -n $NS get pods -l app=web -o json | jq -r '.items[] | select(.metadata.deletionTimestamp == null and .status.phase == \"Running\") | .metadata.name' | grep -vx $P1 | head -1) && [ -n \"\$p\" ] && kubectl -n $NS logs \$p -c counter | grep -q '^count='"
P2=$(running | grep -vx "$P1" | head -1)
[ -n "$P2" ] || { fail "a replacement runs"; finish; }
retry 30 bash -c "kubectl -n $NS get events --field-selector involvedObject.name=$P2,reason=Restored -o name | grep -q ."
ks why "$P2"
ok_if "why $P2: Decision Restore, the checkpoint, its PodRestore Restored and stasis's Restored Event" \
  bash -c "grep -q '^Decision: *Restore\$' '$OUT' && grep -q '^Restore from: ' '$OUT' && grep -Eq ' Restored +worker-[12]' '$OUT' && grep -Eq 'Normal +Restored +[0-9]+s +stasis' '$OUT'"
ks status deployment/web
ok_if "status deployment/web: $P2 restored, from the checkpoint it names" bash -c "grep -Eq '^$P2 .* Restore +from ' '$OUT'"
ks advise
ok_if "advise: deployment/web, its interval from the policy, its checkpoint's cost as the real agent measured it, exit 0" \
  bash -c "[ $rc = 0 ] && grep -Eq '^deployment/web +1 +' '$OUT' && grep -q '^  interval          10s       policy: policy every-10s\$' '$OUT' &&
           grep -Eq '^  checkpoint +[0-9.]+m?s +measured: ' '$OUT'"
ks advise -o json
ok_if "advise -o json: the replacement's restore measured (its PodRestore), the local nodes' pool on demand, only NoDisruptionBudget found" \
  jq -e '.workloads | length == 1 and (.[0] | .workload == "deployment/web" and .restoreSeconds.source == "measured" and .restoreSeconds.value > 0
         and .spot == false and .checkpointSeconds.source == "measured" and ([.findings[].code] == ["NoDisruptionBudget"]) and .goodput.withStasis > 0)' "$OUT"
ks restore "$P2" --from "$REF" --as dev
ok_if "restore --as dev (edit, not stasis-restorer): refused with the reason" \
  bash -c "[ $rc = 1 ] && grep -qF 'you may not restore in namespace $NS' '$ERR'"
ks restore "$P2" --from "$REF" --as ops --dry-run
ok_if "restore --as ops (stasis-restorer) --dry-run: the API server accepts" bash -c "[ $rc = 0 ] && grep -q 'server dry run' '$OUT'"
kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1
finish
