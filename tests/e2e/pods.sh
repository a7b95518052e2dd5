#!/usr/bin/env bash
# End to end on the local cluster: a pod with several containers. A Deployment whose pod has two
# app containers (counter, worker), a native sidecar (side: an init container with
# restartPolicy Always) and a regular init container (setup: appends a line to a file of the
# pod's state, and prints it, each time it runs), opted in with 5 s heartbeats. Its node is
# drained; the replacement on the other node must:
#   - resume every container from the checkpoint (each counter's first count past its count at
#     the last heartbeat, and not a cold start's 1, and not past where it stopped + 1);
#   - not run setup again (its log in the replacement is empty, it ended with exit code 0);
#   - be restored (PodRestore Restored, a Restored Event), never state=CORRUPT.
#
# Needs root. Prints "N passed, M failed", exits non-zero when a check failed.
# STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up; STASIS_INSTALL_NO_BUILD=1 reuses
# target/images/stasis.oci.tar. setup runs in the stasis image (its static busybox): the counter
# image has no shell.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
WORK=$(mktemp -d /tmp/stasis-e2e-pods.XXXXXX)
NS=e2e-pods
APP=pods
CONTAINERS="counter worker side"
SHELL_IMAGE=${STASIS_IMAGE:-docker.io/stasis/stasis:dev}

# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin pods

deployment() {
  kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: $APP}
spec:
  replicas: 1
  selector: {matchLabels: {app: $APP}}
  template:
    metadata:
      labels: {app: $APP}
    spec:
      runtimeClassName: stasis
      terminationGracePeriodSeconds: 30
      volumes: [{name: state, emptyDir: {}}]
      initContainers:
      - name: setup
        image: $SHELL_IMAGE
        imagePullPolicy: Never
        command: ["/bin/busybox", "sh", "-c", "echo \"setup ran \$(date +%s%N)\" | tee -a /state/setup-runs"]
        volumeMounts: [{name: state, mountPath: /state}]
      - name: side
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        restartPolicy: Always
        env: [{name: STATE_MB, value: "8"}, {name: INTERVAL_MS, value: "100"}]
        resources: {limits: {memory: 136Mi}}
      containers:
      - name: counter
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        env: [{name: STATE_MB, value: "32"}, {name: INTERVAL_MS, value: "100"}]
        volumeMounts: [{name: state, mountPath: /state}]
        resources: {limits: {memory: 224Mi}}
      - name: worker
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        env: [{name: STATE_MB, value: "16"}, {name: INTERVAL_MS, value: "100"}]
        resources: {limits: {memory: 144Mi}}
EOF
}

uid_of() { kubectl -n "$NS" get pod "$1" -o jsonpath='{.metadata.uid}'; }
# follow POD: each container's log with timestamps into $WORK/<pod>.<container>.log
follow_all() {
  local c
  for c in $CONTAINERS; do kubectl -n "$NS" logs -f --timestamps "$1" -c "$c" >"$WORK/$1.$c.log" 2>/dev/null & done
}
counts_in() { kubectl -n "$NS" logs "$1" -c "$2" 2>/dev/null | grep -q '^count='; }
all_count() { local c; for c in $CONTAINERS; do counts_in "$1" "$c" || return 1; done; }
first_of() { kubectl -n "$NS" logs "$1" -c "$2" 2>/dev/null | grep -m1 -o '^count=[0-9]*' | cut -d= -f2; }
corrupt_free() { ! kubectl -n "$NS" logs "$1" -c "$2" 2>/dev/null | grep -q CORRUPT; }
heartbeats() { # UID: "<startTime> <checkpointRef>" of its Succeeded heartbeats, oldest first
  kubectl -n "$NS" get pckpt -o json | jq -r --arg u "$1" \
    '[.items[] | select(.status.sourcePodUID == $u and .status.phase == "Succeeded")] | sort_by(.status.startTime) | .[] | "\(.status.startTime) \(.status.checkpointRef)"'
}
has_heartbeat() { [ -n "$(heartbeats "$1")" ]; }
restore_of() { # POD: "<phase> <checkpointRef>" of the newest PodRestore targeting it
  kubectl -n "$NS" get prestore -o json | jq -r --arg p "$1" \
    '[.items[] | select(.spec.targetPodName == $p)] | sort_by(.metadata.creationTimestamp) | last | "\(.status.phase // "-") \(.spec.checkpointRef // "-")"'
}
restored() { [ "$(restore_of "$1" | cut -d' ' -f1)" = Restored ]; }
restored_event() { [ -n "$(event "$NS" "$1" Restored)" ]; }
setup_exit() { kubectl -n "$NS" get pod "$1" -o jsonpath='{.status.initContainerStatuses[?(@.name=="setup")].state.terminated.exitCode}'; }
# a replacement of OLD: running, every container counting
new_counting() {
  local p
  p=$(kubectl -n "$NS" get pods -l "app=$APP" -o json | jq -r --arg u "$1" \
    '[.items[] | select(.metadata.uid != $u and .metadata.deletionTimestamp == null and .status.phase == "Running")] | last | .metadata.name // empty')
  [ -n "$p" ] && all_count "$p" && echo "$p"
}

up_and_install
new_ns "$NS"
policy "$NS" every-5s "$APP" 5s
deployment

echo "# --- a pod with two app containers, a native sidecar and an init container"
OLD=$(wait_one_counting "$NS" "$APP" 120) || { fail "the pod counts (within 120 s)"; diagnose "$NS"; finish; }
check "every container of $OLD counts ($CONTAINERS)" retry 60 all_count "$OLD"
OLD_UID=$(uid_of "$OLD") OLD_NODE=$(node_of "$NS" "$OLD")
check "setup ran once in $OLD" bash -c "[ \"\$(kubectl -n $NS logs $OLD -c setup | grep -c 'setup ran')\" = 1 ]"
follow_all "$OLD"
if ! check "a heartbeat of the whole pod $OLD (on $OLD_NODE) Succeeded" retry 90 has_heartbeat "$OLD_UID"; then
  kubectl -n "$NS" get pckpt -o json | jq -r '.items[] | "# \(.metadata.name) \(.status.phase) \(.status.message // "")"'
  kubectl -n "$NS" get events --field-selector reason=CheckpointFailed -o json | jq -r '.items[] | "# \(.message)"'
  diagnose "$NS"; finish
fi
sleep 1
HB=$(heartbeats "$OLD_UID" | tail -1)
declare -A C_HB
for c in $CONTAINERS; do
  C_HB[$c]=$(count_before "$OLD.$c" "${HB%% *}")
  echo "# $c: count at the last heartbeat ($HB) >= ${C_HB[$c]}"
done

echo "# --- drain $OLD_NODE"
T=$(date +%s.%N)
out=$(drain "$OLD_NODE" --ignore-daemonsets --delete-emptydir-data --pod-selector "app=$APP" --timeout=120s 2>&1); rc=$?
check "kubectl drain $OLD_NODE --pod-selector app=$APP" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
NEW=""
end=$(( $(date +%s) + 150 ))
while [ "$(date +%s)" -lt "$end" ]; do NEW=$(new_counting "$OLD_UID") && break; NEW=""; sleep 0.5; done
kubectl uncordon "$OLD_NODE" >/dev/null
if [ -z "$NEW" ]; then
  fail "a replacement of $OLD counts in every container (within 150 s)"; diagnose "$NS"; finish
fi
echo "# replacement $NEW on $(node_of "$NS" "$NEW"), every container counting $(secs "$T") s after the drain"
sleep 1
check "PodRestore of $NEW Restored ($(restore_of "$NEW"))" retry 30 restored "$NEW"
check "a Restored Event on $NEW" retry 30 restored_event "$NEW"
for c in $CONTAINERS; do
  first=$(first_of "$NEW" "$c"); stop=$(last_count "$OLD.$c")
  echo "# $c: count at the heartbeat >= ${C_HB[$c]}, last count of $OLD: $stop, first count of $NEW: $first"
  check "$c resumed from the checkpoint: first count ($first) > the count at the last heartbeat (${C_HB[$c]}), and not a cold start's 1" \
    resumed "$first" "${C_HB[$c]}"
  check "$c: ... and not beyond where $OLD stopped ($first <= $stop + 1)" ge "$((${stop:-0} + 1))" "$first"
  check "$c: never state=CORRUPT" corrupt_free "$NEW" "$c"
done
check "setup did not run again in $NEW (its log is empty)" bash -c "[ -z \"\$(kubectl -n $NS logs $NEW -c setup 2>&1)\" ]"
check "setup of $NEW ended with exit code 0" test "$(setup_exit "$NEW")" = 0
event "$NS" "$NEW" Restored | sed 's/^/# Restored: /'
finish
