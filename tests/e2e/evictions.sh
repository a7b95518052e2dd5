#!/usr/bin/env bash
# End to end on the local cluster: every way Kubernetes ends a pod, taken by an opted-in counter
# (`runtimeClassName: stasis`, a CheckpointPolicy with 5 s heartbeats). One install, one
# namespace; each path: trigger, wait for the replacement to count, check, move on.
#
#   1. taint-based eviction: a NoExecute taint the pod does not tolerate, on its node
#   2. Karpenter-style disruption: karpenter.sh/disrupted:NoSchedule on the node, then an API
#      eviction of the pod (the eviction subresource, as Karpenter's terminator calls it)
#   3. priority preemption: a pod of a higher PriorityClass, pinned to the victim's node, needs
#      the CPU the victim's request holds
#   4. workload kinds: a StatefulSet (graceful delete; the replacement has the same name), a Job
#      with restartPolicy Never (drained: an API eviction), an indexed Job (graceful delete)
#  4d. a Job with restartPolicy OnFailure, drained (the Job replaces the evicted pod; the kubelet
#      would restart a failed container in place, but an evicted pod is gone)
#  4e. a bare pod (no owner) restored through a PodRestore: checkpointed, deleted; then, as a user
#      does it, `kubectl stasis restore bare-2 --from <its final checkpoint>` and a new pod bare-2
#      with the same spec on the other node (the webhook makes it wait for that PodRestore)
#   5. node-pressure eviction by the kubelet (hard threshold, no grace, no disruption budget):
#      the node's evictionHard memory.available raised above what the kubelet sees available
#      (its kubelet restarted with that); stasis's own pods on the node survive it
#   6. the EvictionRequest API (KEP-4563, alpha; scripts/cluster turns its gate on): an
#      EvictionRequest for the counter; stasis's agent answers as the pod's eviction responder
#      (heartbeats, then completion naming the published final checkpoint); then the imperative
#      evictor evicts the pod through the Eviction API, and its stop takes a new checkpoint,
#      which the replacement restores. Kubernetes 1.37 ships no controller that
#      drives the API: tests/lib/evictor.sh stands in for it (and says so in the output)
#   7. graceful node shutdown: the kubelet's shutdown manager ends the node's pods itself (no API
#      eviction; the pod objects stay, terminal). The old pod's node gets a system bus and elogind
#      for its kubelet only (scripts/cluster logind-up); logind's PrepareForShutdown(true) is sent
#      on that bus by hand in place of a poweroff, which never runs here; then the shutdown is
#      cancelled and the kubelet restarted without them (the DaemonSet's agent comes back)
#
# Each path checks: the replacement is restored (PodRestore phase Restored, a Restored Event),
# its first count > the count at the checkpoint it came from (and not a cold start's 1) and <= the
# last count of the old pod + 1, never state=CORRUPT. It prints, per path, the time from the
# trigger until the replacement is back at the old pod's last count, and the counts lost (the
# old pod's last count - the replacement's first + 1), and a table of them at the end.
#
# Needs root. Prints "N passed, M failed" (and the skipped), exits non-zero when a check failed.
# STASIS_E2E_ONLY="1 3": only these paths ("4" runs 4a-4e, "4d" only 4d; 5 runs on whatever pod
# the earlier left); STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up; STASIS_INSTALL_NO_BUILD=1
# reuses target/images/stasis.oci.tar. STASIS_E2E_STATE_MB (64) and STASIS_E2E_INTERVAL (5s): the
# counter's state and the heartbeat interval (bench/k8s.sh runs the paths at 256 MiB and 2 GiB);
# KUBECTL_STASIS: the plugin for 4e (default target/debug/kubectl-stasis).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
STATE=${STASIS_CLUSTER_STATE:-/var/lib/stasis-cluster}
WORK=$(mktemp -d /tmp/stasis-e2e-evictions.XXXXXX)
NS=e2e-evict
TAINT=e2e.stasis.dev/evict
FIGURES=$WORK/figures
PRESSURED=""   # a node whose kubelet runs with the raised threshold (restored by cleanup)
STATE_MB=${STASIS_E2E_STATE_MB:-64}
INTERVAL=${STASIS_E2E_INTERVAL:-5s}
KS=${KUBECTL_STASIS:-$REPO/target/debug/kubectl-stasis}

# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
# shellcheck source=tests/lib/evictor.sh
. "$REPO/tests/lib/evictor.sh"
e2e_begin evictions

# ------------------------------------------------------------------ cleanup (run by finish)
kubelet_config() { echo "$STATE/nodes/$1/kubelet-config.yaml"; }
restart_kubelet() { "$STATE/bin/supervisor" ctl --dir "$STATE/supervisor" restart "$1-kubelet" >/dev/null; }
node_ready() { [ "$(kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]; }
no_memory_pressure() { [ "$(kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="MemoryPressure")].status}')" = False ]; }
unpressure() {
  [ -n "$PRESSURED" ] || return 0
  local n=$PRESSURED; PRESSURED=""
  mv "$(kubelet_config "$n").e2e-orig" "$(kubelet_config "$n")" && restart_kubelet "$n"
  retry 90 bash -c "[ \"\$(kubectl get node $n -o jsonpath='{.status.conditions[?(@.type==\"MemoryPressure\")].status}')\" = False ]" ||
    echo "# warning: $n still reports MemoryPressure"
}
untaint() { local n; for n in worker-1 worker-2; do kubectl taint node "$n" "$TAINT-" karpenter.sh/disrupted- 2>/dev/null; done; true; }
# Path 7: the node given a system bus, elogind and a shutdown grace (undone by cleanup): the
# shutdown cancelled, its kubelet back to its own config
SHUTDOWN_NODE=""
unshutdown() {
  [ -n "$SHUTDOWN_NODE" ] || return 0
  local n=$SHUTDOWN_NODE; SHUTDOWN_NODE=""
  "$CLUSTER" prepare-for-shutdown "$n" false >/dev/null 2>&1
  "$CLUSTER" logind-down "$n" 2>&1 | sed 's/^/# /'
  # the pods the kubelet ended or rejected while the node shut down
  kubectl -n stasis-system delete pods --field-selector "spec.nodeName=$n,status.phase=Failed" --wait=false >/dev/null 2>&1
  kubectl -n stasis-system delete pods --field-selector "spec.nodeName=$n,status.phase=Succeeded" --wait=false >/dev/null 2>&1
}
# every node Ready, every agent of the DaemonSet ready
agents_ready() {
  [ "$(kubectl get nodes -o json | jq '[.items[] | select(any(.status.conditions[]; .type == "Ready" and .status == "True"))] | length')" = 2 ] &&
    kubectl -n stasis-system get ds -l app.kubernetes.io/component=agent -o json |
      jq -e '.items | length == 1 and (.[0].status | .numberReady == .desiredNumberScheduled and .updatedNumberScheduled == .desiredNumberScheduled)' >/dev/null
}
# Host memory held during scenario 5 when the host's working set is small (see there).
BALLAST=/dev/shm/stasis-e2e-evictions-ballast
unballast() { rm -f "$BALLAST"; }
on_exit unpressure
on_exit unballast
on_exit untaint
on_exit unshutdown
on_exit "kubectl delete priorityclass e2e-evict-low e2e-evict-high --ignore-not-found"
figures() {
  [ -s "$FIGURES" ] || return 0
  echo "# path | trigger -> back at the old pod's last count (s) | counts lost (100 ms each) | restored from | the old pod's last count | load average (1 min) | state (MiB)"
  sed 's/^/# /' "$FIGURES"
}

# ------------------------------------------------------------------ the workloads
# the pod template of every workload here: the counter (STATE_MB, tick 100 ms), opted in, in the
# low PriorityClass, with a CPU request (preemption needs one to take) and memory request =
# limit (the kubelet ranks pods within their requests last under memory pressure)
template() { # APP RESTART-POLICY
  cat <<EOF
    metadata:
      labels: {app: $1}
$(pod_spec "$2")
EOF
}
pod_spec() { # RESTART-POLICY (indented for a pod template)
  cat <<EOF
    spec:
      runtimeClassName: stasis
      priorityClassName: e2e-evict-low
      restartPolicy: $1
      terminationGracePeriodSeconds: 30
      containers:
      - name: counter
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        env:
        - {name: STATE_MB, value: "$STATE_MB"}
        - {name: INTERVAL_MS, value: "100"}
        resources:
          requests: {cpu: 200m, memory: $((STATE_MB + 192))Mi}
          limits: {memory: $((STATE_MB + 192))Mi}
EOF
}
job() { # NAME RESTART-POLICY [SPEC-LINE]: a Job of one pod
  kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: batch/v1
kind: Job
metadata: {name: $1}
spec:
  completions: 1
  ${3:-parallelism: 1}
  backoffLimit: 3
  template:
$(template "$1" "$2")
EOF
}
deployment() {
  kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: counter}
spec:
  replicas: 1
  selector: {matchLabels: {app: counter}}
  template:
$(template counter Always)
EOF
}

# ------------------------------------------------------------------ per path
# follow_as POD KEY: the pod's counter log with timestamps into $WORK/KEY.log (KEY: name.uid, so
# that the two lives of a StatefulSet's pod do not share a file)
uid_of() { kubectl -n "$NS" get pod "$1" -o jsonpath='{.metadata.uid}'; }
follow_as() { kubectl -n "$NS" logs -f --timestamps "$1" -c counter >"$WORK/$2.log" 2>/dev/null & }
# heartbeats of one pod instance (by UID), "<startTime> <checkpointRef> <reason>", oldest first
ckpts_of() {
  kubectl -n "$NS" get pckpt -o json | jq -r --arg u "$1" \
    '[.items[] | select(.status.sourcePodUID == $u and .status.phase == "Succeeded")] | sort_by(.status.startTime) | .[] | "\(.status.startTime) \(.status.checkpointRef) \(.spec.reason)"'
}
has_ckpt() { [ -n "$(ckpts_of "$1")" ]; }
# arm LABEL POD: the pod counts and a heartbeat of it has Succeeded; sets OLD, OLD_UID, OLD_KEY,
# OLD_NODE, C_CKPT (the count at that heartbeat)
arm() {
  OLD=$2 OLD_UID=$(uid_of "$2")
  OLD_KEY=$OLD.$OLD_UID OLD_NODE=$(node_of "$NS" "$OLD")
  follow_as "$OLD" "$OLD_KEY"
  # (a pod's first heartbeat uploads its whole state: 60 s, and 1 s more per 20 MiB of it)
  if ! check "$1: a heartbeat of $OLD (on $OLD_NODE) Succeeded" retry $((60 + STATE_MB / 20)) has_ckpt "$OLD_UID"; then
    diagnose "$NS"; return 1
  fi
  # (the followed log must have reached the heartbeat's start, or its count before it reads 0:
  # a loaded machine writes it late)
  local last; last=$(ckpts_of "$OLD_UID" | tail -1)
  retry 15 logged_after "$OLD_KEY" "${last%% *}"
  C_CKPT=$(count_before "$OLD_KEY" "${last%% *}")
  # (a restored pod is checkpointed as soon as it runs, before its first line: that heartbeat's
  # count is at least the first count the pod printed, less one)
  if [ "$C_CKPT" = 0 ]; then
    C_CKPT=$(awk '$2 ~ /^count=[0-9]+$/ { print substr($2, 7) - 1; exit }' "$WORK/$OLD_KEY.log")
    C_CKPT=${C_CKPT:-0}; [ "$C_CKPT" -ge 0 ] || C_CKPT=0
  fi
  echo "# $1: count at the last heartbeat >= $C_CKPT ($last)"
}
# the newest pod matching SELECTOR whose UID is not OLD_UID, running and counting
new_pod() {
  local p
  p=$(kubectl -n "$NS" get pods -l "$1" -o json | jq -r --arg u "$OLD_UID" \
    '[.items[] | select(.metadata.uid != $u and .metadata.deletionTimestamp == null and .status.phase == "Running")] | sort_by(.metadata.creationTimestamp) | last | .metadata.name // empty')
  [ -n "$p" ] && counting "$NS" "$p" && echo "$p"
}
wait_new() { # SELECTOR TIMEOUT
  local end=$(( $(date +%s) + $2 )) p
  while [ "$(date +%s)" -lt "$end" ]; do p=$(new_pod "$1") && { echo "$p"; return 0; }; sleep 0.5; done
  return 1
}
newest_restore() { # POD: "<phase> <checkpointRef>" of the newest PodRestore targeting it
  kubectl -n "$NS" get prestore -o json | jq -r --arg p "$1" \
    '[.items[] | select(.spec.targetPodName == $p)] | sort_by(.metadata.creationTimestamp) | last | "\(.status.phase // "-") \(.spec.checkpointRef // "-")"'
}
restored() { [ "$(newest_restore "$1" | cut -d' ' -f1)" = Restored ]; }
# a Restored Event on POD UID (one naming the pod without its UID counts: the StatefulSet's first
# life started cold, so it has none)
restored_event() {
  kubectl -n "$NS" get events --field-selector "involvedObject.name=$1,reason=Restored" -o json |
    jq -e --arg u "$2" '[.items[] | select((.involvedObject.uid // "") == $u or (.involvedObject.uid // "") == "")] | length >= 1' >/dev/null
}
epoch() { date -d "$1" +%s.%N; }
# cold_start_why LABEL POD T_TRIGGER: what the webhook decided for a pod that was not restored,
# and whether the API server admitted it without asking stasis (a webhook call that failed open)
cold_start_why() {
  local since; since=$(date -u -d "@${3%.*}" +%H:%M:%S)
  echo "# $1: $2 was not restored; webhook decision: $(ann "$NS" "$2" decision) $(ann "$NS" "$2" decision-reason)"
  echo "# $1: kube-apiserver, since $since:"
  awk -v t="$since" '$2 >= t && /failing open pods.stasis.dev/' "$STATE/logs/kube-apiserver.log" 2>/dev/null | cut -c1-300 | sed 's/^/#   /'
}
# settle LABEL SELECTOR T_TRIGGER: the replacement of OLD counts and is checked; the figures are
# written; sets NEW (empty when none came)
settle() {
  local label=$1 sel=$2 t=$3 new_uid key c_first c_stop reached back ref
  NEW=$(wait_new "$sel" 150) || { NEW=""; fail "$label: a replacement of $OLD counts (within 150 s)"; diagnose "$NS"; return 1; }
  new_uid=$(uid_of "$NEW") key=$NEW.$new_uid
  echo "# $label: replacement $NEW on $(node_of "$NS" "$NEW") counting $(secs "$t") s after the trigger"
  follow_as "$NEW" "$key"
  sleep 1
  c_first=$(first_count "$NS" "$NEW"); c_stop=$(last_count "$OLD_KEY")
  echo "# $label: count at the heartbeat >= $C_CKPT, last count of $OLD: $c_stop, first count of $NEW: $c_first"
  if ! check "$label: PodRestore of $NEW Restored ($(newest_restore "$NEW"))" retry 30 restored "$NEW"; then
    cold_start_why "$label" "$NEW" "$t"
  fi
  check "$label: a Restored Event on $NEW" retry 30 restored_event "$NEW" "$new_uid"
  check "$label: it resumed from a checkpoint: first count ($c_first) > the count at the last heartbeat ($C_CKPT), and not a cold start's 1" \
    resumed "$c_first" "$C_CKPT"
  check "$label: ... and not beyond where $OLD stopped ($c_first <= $c_stop + 1)" ge "$((${c_stop:-0} + 1))" "$c_first"
  check "$label: never state=CORRUPT" not_corrupt "$NS" "$NEW"
  [ -n "$c_first" ] && [ -n "$c_stop" ] || return 0
  # back at the old pod's last count: the first line of the replacement that reaches it
  retry 60 bash -c "awk '\$2 ~ /^count=/ && substr(\$2, 7) + 0 >= $c_stop {f=1} END {exit !f}' '$WORK/$key.log'"
  reached=$(awk -v c="$c_stop" '$2 ~ /^count=[0-9]+$/ && substr($2, 7) + 0 >= c { print $1; exit }' "$WORK/$key.log")
  back=-; [ -n "$reached" ] && back=$(awk -v a="$t" -v b="$(epoch "$reached")" 'BEGIN{printf "%.1f", b-a}')
  ref=$(newest_restore "$NEW" | cut -d' ' -f2)
  echo "# $label: back at count $c_stop $back s after the trigger; counts lost: $((c_stop - c_first + 1))"
  echo "$label | $back | $((c_stop - c_first + 1)) | $(kubectl -n "$NS" get pckpt -o json | jq -r --arg r "$ref" '[.items[] | select(.status.checkpointRef == $r) | .spec.reason] | first // "?"') | $c_stop | $(cut -d' ' -f1 /proc/loadavg) | $STATE_MB" >>"$FIGURES"
}
current() { wait_one_counting "$NS" counter 120; }
# counter_pod LABEL: P = the counter Deployment's pod, counting; else a failed check that says
# what its pods are (a path never ends without a word)
counter_pod() {
  P=$(current) && return 0
  fail "$1: the counter Deployment has a pod counting (waited 120 s)" \
    "$(kubectl -n "$NS" get pods -l app=counter -o wide --no-headers 2>&1 | tr -s ' ' | paste -sd ';')"
  diagnose "$NS"
  return 1
}
# job_replaced LABEL JOB: the Job makes a replacement of OLD rather than counting OLD as its
# completion (the counter exits 0 on SIGTERM, like any program that handles it and ends cleanly:
# a Job pod of restartPolicy Never that does so after its final checkpoint is Succeeded)
job_replaced() {
  local end=$(( $(date +%s) + 60 )) done_
  while [ "$(date +%s)" -lt "$end" ]; do
    new_pod "job-name=$2" >/dev/null && return 0
    done_=$(kubectl -n "$NS" get job "$2" -o jsonpath='{.status.succeeded}')
    if [ "${done_:-0}" -ge 1 ]; then
      fail "$1: Job $2 replaces its evicted pod $OLD" "the Job completed instead: $OLD exited 0 on the SIGTERM that followed its final checkpoint, so the Job counted the evicted pod as its completion and its work is lost"
      return 1
    fi
    sleep 0.5
  done
  return 0
}

# job_path LABEL JOB RESTART-POLICY drain|delete [SPEC-LINE]: a Job of one pod, whose pod is
# drained (an API eviction) or deleted (grace 30 s); the Job replaces it and the replacement
# restores. The old pod ends by SIGKILL after its final checkpoint: an exit 0 on the SIGTERM would
# have been the Job's completion (with OnFailure as with Never).
job_path() {
  local label=$1 name=$2 how=$4 out rc
  echo "# --- $label. Job $name (restartPolicy $3${5:+, $5}): $how"
  job "$name" "$3" "${5:-}"
  NEW=""
  if P=$(wait_one_counting "$NS" "$name" 120) && arm "$label" "$P"; then
    t=$(date +%s.%N)
    if [ "$how" = drain ]; then
      out=$(drain "$OLD_NODE" --ignore-daemonsets --delete-emptydir-data --pod-selector "app=$name" --timeout=120s 2>&1); rc=$?
      check "$label: kubectl drain $OLD_NODE --pod-selector app=$name" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
    else
      kubectl -n "$NS" delete pod "$OLD" --grace-period=30 --wait=false >/dev/null
    fi
    job_replaced "$label" "$name" && settle "$label" "job-name=$name" "$t"
    [ -z "$NEW" ] || check "$label: Job $name has not completed (status.succeeded: $(kubectl -n "$NS" get job "$name" -o jsonpath='{.status.succeeded}'))" \
      test -z "$(kubectl -n "$NS" get job "$name" -o jsonpath='{.status.succeeded}')"
    [ "$how" != drain ] || kubectl uncordon "$OLD_NODE" >/dev/null
  else
    fail "$label: the pod of Job $name counts"; diagnose "$NS"
  fi
  kubectl -n "$NS" delete job "$name" --wait=false >/dev/null
}

# ------------------------------------------------------------------ up, install, workload
up_and_install
new_ns "$NS"
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: e2e-evict-low}
value: -10
description: "e2e: the evicted workloads (below every pod of priority 0, stasis's controller included)"
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: e2e-evict-high}
value: 1000
description: "e2e: the preemptor"
EOF
for a in counter sts job ijob ojob bare; do policy "$NS" "every-$INTERVAL-$a" "$a" "$INTERVAL"; done
deployment
P=$(current) || { fail "the counter Deployment's pod counts"; diagnose "$NS"; finish; }
echo "# stasis's pods: $(kubectl -n stasis-system get pods -o wide --no-headers | awk '{print $1 "@" $7}' | tr '\n' ' ')"

# ------------------------------------------------------------------ 1. taint-based eviction
if want 1; then
echo "# --- 1. taint-based eviction: $TAINT=now:NoExecute"
if counter_pod 1 && arm 1 "$P"; then
  ctl=$(kubectl -n stasis-system get pods -l app.kubernetes.io/component=controller --field-selector "spec.nodeName=$OLD_NODE" -o name)
  [ -z "$ctl" ] || echo "# 1: ${ctl#pod/} runs on $OLD_NODE and does not tolerate the taint either: it is evicted with the workload, and a webhook call it was answering fails open"
  t=$(date +%s.%N)
  check "1: kubectl taint node $OLD_NODE $TAINT=now:NoExecute" kubectl taint node "$OLD_NODE" "$TAINT=now:NoExecute"
  settle 1 app=counter "$t"
  kubectl taint node "$OLD_NODE" "$TAINT-" >/dev/null
fi
fi

# ------------------------------------------------------------------ 2. Karpenter-style disruption
if want 2; then
echo "# --- 2. Karpenter-style disruption: karpenter.sh/disrupted:NoSchedule, then an API eviction"
if counter_pod 2 && arm 2 "$P"; then
  t=$(date +%s.%N)
  check "2: kubectl taint node $OLD_NODE karpenter.sh/disrupted:NoSchedule" kubectl taint node "$OLD_NODE" karpenter.sh/disrupted:NoSchedule
  ev=$(printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"%s","namespace":"%s"}}' "$OLD" "$NS")
  out=$(kubectl create --raw "/api/v1/namespaces/$NS/pods/$OLD/eviction" -f - <<<"$ev" 2>&1); rc=$?
  check "2: POST pods/$OLD/eviction accepted" test $rc -eq 0 || echo "# $out"
  settle 2 app=counter "$t"
  kubectl taint node "$OLD_NODE" karpenter.sh/disrupted- >/dev/null
fi
fi

# ------------------------------------------------------------------ 3. priority preemption
if want 3; then
echo "# --- 3. priority preemption"
if counter_pod 3 && arm 3 "$P"; then
  # the preemptor asks 100m more than the node has free: it fits once the victim's 200m are gone
  alloc=$(kubectl get node "$OLD_NODE" -o jsonpath='{.status.allocatable.cpu}')
  [[ $alloc == *m ]] && alloc=${alloc%m} || alloc=$((alloc * 1000))
  used=$(kubectl describe node "$OLD_NODE" | awk '/^Allocated resources/ {a=1} a && $1 == "cpu" {print $2; exit}')
  [[ $used == *m ]] && used=${used%m} || used=$((used * 1000))
  want_m=$((alloc - used + 100))
  echo "# 3: $OLD_NODE allocatable ${alloc}m, requested ${used}m: the preemptor requests ${want_m}m"
  t=$(date +%s.%N)
  kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: preemptor}
spec:
  priorityClassName: e2e-evict-high
  nodeSelector: {kubernetes.io/hostname: $OLD_NODE}
  terminationGracePeriodSeconds: 0
  containers:
  - {name: pause, image: registry.k8s.io/pause:3.10.2, imagePullPolicy: Never, resources: {requests: {cpu: ${want_m}m}}}
EOF
  settle 3 app=counter "$t"
  preempted() { kubectl -n "$NS" get events --field-selector "involvedObject.uid=$OLD_UID,reason=Preempted" -o name | grep -q .; }
  check "3: $OLD was preempted (a Preempted Event), not deleted otherwise" retry 10 preempted
  check "3: the preemptor runs on $OLD_NODE" retry 60 bash -c "[ \"\$(kubectl -n $NS get pod preemptor -o jsonpath='{.status.phase}')\" = Running ]"
  kubectl -n "$NS" delete pod preemptor --grace-period=0 --wait=false >/dev/null
fi
fi

# ------------------------------------------------------------------ 4. workload kinds
if want 4; then
echo "# --- 4a. StatefulSet: graceful delete, the replacement has the same name"
kubectl -n "$NS" scale deployment counter --replicas=0 >/dev/null
kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata: {name: sts}
spec: {clusterIP: None, selector: {app: sts}, ports: [{port: 7070}]}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: sts}
spec:
  replicas: 1
  serviceName: sts
  selector: {matchLabels: {app: sts}}
  template:
$(template sts Always)
EOF
if P=$(wait_one_counting "$NS" sts 120) && arm 4a "$P"; then
  t=$(date +%s.%N)
  kubectl -n "$NS" delete pod "$OLD" --grace-period=30 --wait=false >/dev/null
  settle 4a app=sts "$t"
  [ -n "$NEW" ] && check "4a: the replacement has the same name ($NEW)" test "$NEW" = "$OLD"
else
  fail "4a: the StatefulSet's pod counts"; diagnose "$NS"
fi
kubectl -n "$NS" delete statefulset sts --wait=false >/dev/null

job_path 4b job Never drain
job_path 4c ijob Never delete "completionMode: Indexed"
fi

# ------------------------------------------------------------------ 4d. Job, restartPolicy OnFailure
if want 4 || want 4d; then
kubectl -n "$NS" scale deployment counter --replicas=0 >/dev/null
job_path 4d ojob OnFailure drain
fi

# ------------------------------------------------------------------ 4e. bare pod, PodRestore
if want 4 || want 4e; then
kubectl -n "$NS" scale deployment counter --replicas=0 >/dev/null
echo "# --- 4e. bare pod restored through a PodRestore (kubectl stasis restore, then the new pod)"
bare() { # NAME [NODE]
  { printf 'apiVersion: v1\nkind: Pod\nmetadata:\n  name: %s\n  labels: {app: bare}\n' "$1"
    pod_spec Always | sed 's/^    //'
    [ -z "${2:-}" ] || printf '  nodeSelector: {kubernetes.io/hostname: %s}\n' "$2"
  } | kubectl -n "$NS" apply -f - >/dev/null
}
NEW=""
if [ ! -x "$KS" ]; then
  fail "4e: the kubectl plugin at $KS" "not built: cargo build -p stasis-kubectl (or set KUBECTL_STASIS)"
elif bare bare && P=$(wait_one_counting "$NS" bare 120) && arm 4e "$P"; then
  t=$(date +%s.%N)
  kubectl -n "$NS" delete pod "$OLD" --grace-period=30 --wait=false >/dev/null
  final_of() { ckpts_of "$OLD_UID" | awk '$3 == "Termination"' | grep -q .; }
  check "4e: the final checkpoint of $OLD Succeeded" retry 60 final_of
  ck=$(kubectl -n "$NS" get pckpt -o json | jq -r --arg u "$OLD_UID" \
    '[.items[] | select(.status.sourcePodUID == $u and .status.phase == "Succeeded")] | sort_by(.status.startTime) | last | .metadata.name')
  # bare-2 goes to the other node, so its checkpoint comes from the store, not the node's chunk
  # cache: the fetch then takes longer than the sandbox's creation, and a pod that did not wait
  # for its PodRestore started cold
  to=$(other_node "$OLD_NODE")
  out=$("$KS" -n "$NS" restore bare-2 --from "$ck" 2>&1); rc=$?
  echo "# 4e: \$ kubectl stasis restore bare-2 --from $ck: $out"
  check "4e: kubectl stasis restore bare-2 --from $ck" test $rc -eq 0
  bare bare-2 "$to"
  check "4e: the webhook made bare-2 wait for its PodRestore ($(ann "$NS" bare-2 decision-reason))" bash -c \
    "kubectl -n $NS get pod bare-2 -o jsonpath='{.spec.initContainers[*].name}' | grep -qw stasis-restore-wait"
  settle 4e app=bare "$t"
  [ -n "$NEW" ] && check "4e: the restored pod is bare-2 on $to" test "$NEW $(node_of "$NS" "$NEW")" = "bare-2 $to"
else
  fail "4e: the bare pod counts"; diagnose "$NS"
fi
kubectl -n "$NS" delete pod bare bare-2 --ignore-not-found --wait=false >/dev/null
fi
if want 4 || want 4d || want 4e; then kubectl -n "$NS" scale deployment counter --replicas=1 >/dev/null; fi

# ------------------------------------------------------------------ 5. node-pressure eviction
if want 5; then
echo "# --- 5. node-pressure eviction by the kubelet (hard threshold: no grace, no disruption budget)"
if counter_pod 5 && arm 5 "$P"; then
  cfg=$(kubelet_config "$OLD_NODE")
  # What the kubelet sees available (the machine's memory less its working set: the nodes share
  # the host's) + 1 GiB is the new hard threshold, so the node is under MemoryPressure at once.
  # The threshold also lowers the node's allocatable memory, which must still hold the requests
  # of the pods on it (else the restarted kubelet rejects them at admission: OutOfmemory, which
  # is not the path under test).
  summary=$(kubectl get --raw "/api/v1/nodes/$OLD_NODE/proxy/stats/summary")
  avail_mi=$(( $(jq -r .node.memory.availableBytes <<<"$summary") >> 20 ))
  cap=$(kubectl get node "$OLD_NODE" -o jsonpath='{.status.capacity.memory}')
  cap_mi=$(( ${cap%Ki} >> 10 ))
  req=$(kubectl describe node "$OLD_NODE" | awk '/^Allocated resources/ {a=1} a && $1 == "memory" {print $2; exit}')
  case $req in *Mi) req_mi=${req%Mi} ;; *Gi) req_mi=$(( ${req%Gi} << 10 )) ;; *Ki) req_mi=$(( ${req%Ki} >> 10 )) ;; *) req_mi=$(( req >> 20 )) ;; esac
  # The nodes share the host's memory, and the threshold must leave the pods' requests
  # allocatable: that needs a host working set of at least the requests + 1.25 GiB. A quiet host
  # has less; then it holds ballast for the scenario (a tmpfs file: shared memory, counted as
  # used), else the test would depend on what else the machine happens to run.
  need_mi=$((req_mi + 1280 + 256 - (cap_mi - avail_mi)))
  if [ "$need_mi" -gt 0 ] && fallocate -l "${need_mi}MiB" "$BALLAST" 2>/dev/null; then
    echo "# 5: the host's working set is $((cap_mi - avail_mi))Mi: ${need_mi}Mi of ballast in $BALLAST for the scenario"
    avail_mi=$((avail_mi - need_mi))
  fi
  thr_mi=$((avail_mi + 1024))
  echo "# 5: $OLD_NODE: capacity ${cap_mi}Mi, available to the kubelet ${avail_mi}Mi, requested ${req_mi}Mi: memory.available threshold ${thr_mi}Mi"
  if [ $((cap_mi - thr_mi)) -lt $((req_mi + 256)) ]; then
    fail "5: the threshold leaves allocatable memory for the pods on $OLD_NODE" \
      "the host's working set ($((cap_mi - avail_mi))Mi) is below the node's requests + 1.25 GiB: a raised threshold would make the kubelet reject its pods at admission instead of evicting"
  else
    agent=$(kubectl -n stasis-system get pods -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$OLD_NODE" -o jsonpath='{.items[*].metadata.uid}')
    cp "$cfg" "$cfg.e2e-orig" && PRESSURED=$OLD_NODE
    sed -i "s/memory.available: [^,}]*/memory.available: ${thr_mi}Mi/" "$cfg"
    t=$(date +%s.%N)
    restart_kubelet "$OLD_NODE"
    # the restart ended `kubectl logs -f` (it streams through the kubelet): follow again, before
    # the eviction removes the container and its log
    retry 30 kubectl -n "$NS" logs "$OLD" -c counter --tail=1
    OLD_KEY=$OLD_KEY.2; follow_as "$OLD" "$OLD_KEY"
    settle 5 app=counter "$t"
    # (the eviction manager's Event; the pod's phase is Failed/Evicted or, when its containers
    # exited 0 on the SIGTERM first, Succeeded)
    evicted=$(kubectl -n "$NS" get events --field-selector "involvedObject.uid=$OLD_UID,reason=Evicted" -o jsonpath='{.items[*].message}')
    check "5: $OLD was evicted by the kubelet's eviction manager: ${evicted:-no Evicted Event}" test -n "$evicted"
    # stasis's own pods on the node: none evicted while the pressure lasts (15 s more: the
    # kubelet evicts one pod per pass until the threshold is met, and here it never is). The agent
    # is system-node-critical, which the kubelet never evicts; the controller is what the chart
    # makes it.
    echo "# 5: stasis's pods on $OLD_NODE under pressure: $(kubectl -n stasis-system get pods --field-selector "spec.nodeName=$OLD_NODE" -o name | tr '\n' ' ')"
    sleep 15
    gone=$(kubectl -n stasis-system get pods -o json | jq -r --arg n "$OLD_NODE" \
      '.items[] | select(.spec.nodeName == $n and .status.reason == "Evicted") | "\(.metadata.name) (priority \(.spec.priority // 0), \(.status.message))"')
    check "5: no pod of stasis on $OLD_NODE was evicted${gone:+ -- evicted: $gone}" test -z "$gone"
    agent_kept() {
      kubectl -n stasis-system get pods -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$OLD_NODE" -o json |
        jq -e --arg u "$agent" '[.items[] | select(.metadata.uid == $u and .status.phase == "Running" and all(.status.containerStatuses[]; .ready))] | length == 1' >/dev/null
    }
    check "5: the agent on $OLD_NODE is the same pod, running and ready (system-node-critical: never evicted)" agent_kept
    unpressure
    unballast
    kubectl -n stasis-system delete pods --field-selector status.phase=Failed --wait=false >/dev/null 2>&1
  fi
  kubectl -n "$NS" delete pod "$OLD" --wait=false >/dev/null 2>&1
fi
fi

# ------------------------------------------------------------------ 6. EvictionRequest API
# pckpt_of REF: "<reason> <phase> <totalMillis>" of the PodCheckpoint that published REF
pckpt_of() {
  kubectl -n "$NS" get pckpt -o json | jq -r --arg r "$1" \
    '[.items[] | select(.status.checkpointRef == $r)] | first // {} | "\(.spec.reason // "-") \(.status.phase // "-") \(.status.totalMillis // "-")"'
}
if want 6; then
echo "# --- 6. the EvictionRequest API (KEP-4563): stasis answers as the pod's eviction responder"
if ! kubectl api-resources --api-group=lifecycle.k8s.io -o name 2>/dev/null | grep -q '^evictions'; then
  skip "EvictionRequest" "lifecycle.k8s.io/v1alpha1 is not served: this cluster was started without feature gate EvictionRequestAPI and --runtime-config lifecycle.k8s.io/v1alpha1=true (scripts/cluster's defaults, unless STASIS_CLUSTER_FEATURE_GATES / STASIS_CLUSTER_RUNTIME_CONFIG said otherwise); restart it with scripts/cluster down && scripts/cluster up"
elif counter_pod 6 && arm 6 "$P"; then
  check "6: the webhook named stasis.dev/checkpoint (priority 1000) among $OLD's eviction responders" \
    jq -e '.spec.evictionResponders // [] | any(.name == "stasis.dev/checkpoint" and .priority == 1000)' <<<"$(kubectl -n "$NS" get pod "$OLD" -o json)"
  t=$(date +%s.%N)
  evictor_run "$NS" "$OLD" 180; rc=$?
  check "6: the EvictionRequest ended in the eviction of $OLD" test $rc -eq 0
  check "6: stasis reported a heartbeat while its final checkpoint ran ($EVICTOR_HEARTBEATS seen)" test "$EVICTOR_HEARTBEATS" -ge 1
  ref=$(grep -o 'final checkpoint [^ ]*:' <<<"$EVICTOR_RESPONDED" | cut -d' ' -f3 | tr -d :)
  check "6: stasis completed, naming the published final checkpoint (after ${EVICTOR_RESPONDED_S:-?} s: $EVICTOR_RESPONDED)" test -n "$ref"
  read -r reason phase total_ms <<<"$(pckpt_of "${ref:-none}")"
  check "6: $ref is a Succeeded PodCheckpoint of $OLD, reason Termination ($reason $phase, ${total_ms} ms)" \
    test "$reason $phase" = "Termination Succeeded"
  # The pod ran on after the responder's capture (the policy does not hold it), through the
  # upload and the eviction's own path: its stop takes a new checkpoint, which fits the 30 s
  # grace period by the pod's measured cost, and the replacement restores that one.
  # (ckpts_of lists the Succeeded ones; read now, before the replacement's heartbeats push it out)
  at_stop() { ckpts_of "$OLD_UID" | awk -v r="$ref" '$3 == "Termination" && $2 != r {print $2}' | tail -1; }
  has_at_stop() { [ -n "$(at_stop)" ]; }
  check "6: the stop took a new final checkpoint of $OLD after the responder's" retry 60 has_at_stop
  stop_ref=$(at_stop)
  settle 6 app=counter "$t"
  if [ -n "$NEW" ]; then
    check "6: $NEW restored the stop's checkpoint ($(newest_restore "$NEW"); the stop's: ${stop_ref:-none}, the responder's: $ref)" \
      test "$(newest_restore "$NEW" | cut -d' ' -f2)" = "${stop_ref:-none}"
    # Without it the pod would have lost what it counted (10 a second) from the responder's
    # capture to the stop: the upload and the eviction's path after stasis's completion
    # (41 counts for a 34-count checkpoint, docs/benchmarks.md); with it, the count or two
    # between the stop's capture and the SIGTERM that follows its answer.
    c_first=$(first_count "$NS" "$NEW"); c_stop=$(last_count "$OLD_KEY")
    last_ts=$(awk '$2 ~ /^count=[0-9]+$/ { t = $1 } END { print t }' "$WORK/$OLD_KEY.log")
    if [ -n "$c_first" ] && [ -n "$c_stop" ] && [ -n "$last_ts" ] && [[ $total_ms =~ ^[0-9]+$ ]]; then
      lost=$((c_stop - c_first + 1))
      path_ds=$(awk -v a="$t" -v r="${EVICTOR_RESPONDED_S:-0}" -v b="$(epoch "$last_ts")" 'BEGIN { d = (b - a - r) * 10; printf "%d", (d > 0 ? d : 0) + 0.5 }')
      echo "# 6: counts lost $lost: the responder's checkpoint took $total_ms ms ($((total_ms / 100)) counts) and the eviction's path after its completion $path_ds counts, which restoring it would have lost"
      check "6: counts lost ($lost) <= 5, less than the responder's checkpoint's own duration ($((total_ms / 100)) counts)" test "$lost" -le 5
    fi
  fi
fi
fi
# ------------------------------------------------------------------ 7. graceful node shutdown
if want 7; then
echo "# --- 7. graceful node shutdown: the kubelet's shutdown manager, on logind's PrepareForShutdown"
echo "# 7: the old pod's node gets a system bus and elogind (scripts/cluster logind-up) for its kubelet only; PrepareForShutdown(true) is sent on that bus by hand, standing in for a poweroff's start: no poweroff runs, and that bus refuses every logind method but Inhibit and ListInhibitors"
if counter_pod 7; then
  n=$(node_of "$NS" "$P")
  out=$("$CLUSTER" logind-up "$n" 2>&1); rc=$?
  SHUTDOWN_NODE=$n
  echo "$out" | sed 's/^/# /'
  if check "7: scripts/cluster logind-up $n (its kubelet holds a delay inhibitor lock)" test $rc -eq 0 && arm 7 "$P"; then
    agent=$(kubectl -n stasis-system get pods -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$n" -o jsonpath='{.items[*].metadata.name}')
    # (its log, followed: the DaemonSet deletes the pod once the kubelet ended it)
    kubectl -n stasis-system logs -f "$agent" -c agent >"$WORK/agent-$n.log" 2>&1 &
    t=$(date +%s.%N)
    check "7: PrepareForShutdown(true) on $n's bus" "$CLUSTER" prepare-for-shutdown "$n" true
    # the kubelet ends the pod itself, without an API eviction: the pod object stays, terminal,
    # with its DisruptionTarget condition (Failed, or Succeeded when the process exited 0 on the
    # SIGTERM that followed its final checkpoint)
    ended_by_shutdown() {
      kubectl -n "$NS" get pod "$OLD" -o json | jq -e '(.status.phase == "Failed" or .status.phase == "Succeeded")
        and any(.status.conditions[]?; .type == "DisruptionTarget" and .reason == "TerminationByKubelet" and (.message | test("node shutdown")))' >/dev/null
    }
    if check "7: the kubelet ended $OLD for the node's shutdown (DisruptionTarget TerminationByKubelet)" retry 60 ended_by_shutdown; then
      echo "# 7: $OLD: $(kubectl -n "$NS" get pod "$OLD" -o json | jq -c '{phase: .status.phase, reason: .status.reason, message: .status.message, deleted: (.metadata.deletionTimestamp != null), exit: .status.containerStatuses[0].state.terminated.exitCode}')"
    fi
    check "7: $n reports the shutdown (Ready False: $(kubectl get node "$n" -o jsonpath='{.status.conditions[?(@.type=="Ready")].message}'))" \
      test "$(kubectl get node "$n" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = False
    # (ckpts_of lists the Succeeded ones; read now: the replacement's heartbeats soon push it out
    # of the lineage's keepLast, and its record with it)
    final_ref() { ckpts_of "$OLD_UID" | awk '$3 == "Termination" {print $2}' | tail -1; }
    has_final() { [ -n "$(final_ref)" ]; }
    check "7: the final checkpoint of $OLD (reason Termination) Succeeded" retry 30 has_final
    ref=$(final_ref)
    # then the critical pods: the agent (system-node-critical) ends after the workloads, once
    # the final checkpoints' uploads are done (the DaemonSet then deletes its pod)
    agent_ended() {
      kubectl -n stasis-system get pod "$agent" -o json 2>/dev/null | jq -e '.status.phase == "Failed" or .status.phase == "Succeeded"' >/dev/null ||
        ! kubectl -n stasis-system get pod "$agent" >/dev/null 2>&1
    }
    check "7: the kubelet ended the agent $agent after the workloads" retry 60 agent_ended
    grep -E 'final checkpoint|checkpoints in progress|stopping' "$WORK/agent-$n.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-700 | sed 's/^/# 7: agent: /'
    # The shutdown is over for the node (a real one would power off now): cancel it at once.
    "$CLUSTER" prepare-for-shutdown "$n" false 2>&1 | sed 's/^/# /'
    settle 7 app=counter "$t"
    [ -z "$NEW" ] || check "7: $NEW restored the final checkpoint ($(newest_restore "$NEW"); final: ${ref:-none})" \
      test "$(newest_restore "$NEW" | cut -d' ' -f2)" = "${ref:-none}"
    # (where: the other node, or this one once the shutdown was cancelled, which a real node,
    # powered off by then, is not)
    [ -z "$NEW" ] || echo "# 7: $NEW runs on $(node_of "$NS" "$NEW")"
    # The chart's agent does not tolerate the not-ready NoSchedule taint of a node shutting
    # down, so the DaemonSet controller does not recreate the agent pod there for the kubelet to
    # reject (with `operator: Exists` for every taint: 313 rejected pods in 60 s)
    rejected=$(kubectl -n stasis-system get pods --field-selector "spec.nodeName=$n,status.phase=Failed" -o json | jq '[.items[] | select(.status.reason == "NodeShutdown")] | length')
    check "7: no flood of agent pods the kubelet of $n rejected while it shut down ($rejected; at most 2)" test "${rejected:-0}" -le 2
  fi
  unshutdown
  check "7: $n Ready again, its agent ready (the DaemonSet's new pod)" retry 180 agents_ready
  kubectl -n "$NS" delete pod "$OLD" --wait=false >/dev/null 2>&1
fi
fi

figures
finish
