# Helpers of the end-to-end tests and the Kubernetes benchmark on the local cluster (sourced by
# tests/e2e/*.sh and bench/k8s.sh; kubectl and jq on PATH, the cluster's KUBECONFIG set).
# The workload is stasis-counter (image docker.io/stasis/counter:dev): one "count=<n> state=ok"
# line per tick on stdout.
#
# A test script sets REPO, CLUSTER and WORK (a scratch directory), sources this file and calls
# `e2e_begin NAME`: its checks (check, pass, fail, skip) are counted, and on exit, on an error
# that ends it early, or on Ctrl-C/TERM, `finish` cleans up (the commands given to on_exit, the
# namespaces given to e2e_ns, the background jobs, $WORK; stasis and the cluster unless
# STASIS_E2E_KEEP_CLUSTER=1) and prints "N passed, M failed" (exit status non-zero when a check
# failed or the test was interrupted).
# shellcheck shell=bash
COUNTER_IMAGE=${COUNTER_IMAGE:-docker.io/stasis/counter:dev}
WORK=${WORK:?WORK: a scratch directory for followed logs}

# ------------------------------------------------------------------ checks, cleanup, summary
PASSED=${PASSED:-0} FAILED=${FAILED:-0} SKIPPED=${SKIPPED:-0}
[ -n "${FAILED_NAMES+x}" ] || FAILED_NAMES=()
T_START=${T_START:-$(date +%s)}
E2E_NAME=${E2E_NAME:-test}
E2E_NAMESPACES=() E2E_CLEANUP=()

pass() { PASSED=$((PASSED + 1)); echo "ok - $1"; }
fail() { FAILED=$((FAILED + 1)); FAILED_NAMES+=("$1"); echo "not ok - $1${2:+: $2}"; }
skip() { SKIPPED=$((SKIPPED + 1)); echo "skip - $1: $2"; }
# check NAME COMMAND...: pass when the command succeeds (its output is not shown), else fail
check() { local name=$1; shift; if "$@" >/dev/null 2>&1; then pass "$name"; else fail "$name"; return 1; fi; }
secs() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
retry() { # timeout-seconds command...: until the command succeeds (quietly), once a second
  local end=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 1; done
}
# wait_for TIMEOUT WHAT COMMAND...: polls the command (every 0.5 s) until it succeeds; after
# TIMEOUT seconds prints "# timed out after N s waiting for WHAT" and fails
wait_for() {
  local timeout=$1 what=$2 end; shift 2
  end=$(( $(date +%s) + timeout ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$end" ]; then echo "# timed out after $timeout s waiting for $what"; return 1; fi
    sleep 0.5
  done
}
# on_exit COMMAND: a shell command finish runs (in the order given), e.g. to uncordon a node
on_exit() { E2E_CLEANUP+=("$1"); }
# e2e_ns NS...: namespaces of this test, deleted by finish (without waiting)
e2e_ns() { E2E_NAMESPACES+=("$@"); }
# kill_node NODE: scripts/cluster kill-node NODE; finish starts it again if the test did not
kill_node() {
  on_exit "[ ! -e '${STASIS_CLUSTER_STATE:-/var/lib/stasis-cluster}/killed-$1' ] || '$CLUSTER' start-node $1"
  "$CLUSTER" kill-node "$1"
}
# drain NODE ARGS...: kubectl drain; finish uncordons the node
drain() { on_exit "kubectl uncordon $1"; kubectl drain "$@"; }
# want SCENARIO: it is one of $STASIS_E2E_ONLY, or that is empty (all scenarios run)
want() { [ -z "${STASIS_E2E_ONLY:-}" ] || grep -qw "$1" <<<"$STASIS_E2E_ONLY"; }
# e2e_begin NAME: name the test (for its summary) and have finish run on exit and interrupt
e2e_begin() {
  E2E_NAME=$1
  trap 'e2e_early $?' EXIT
  trap 'echo "# interrupted"; FAILED=$((FAILED + 1)); FAILED_NAMES+=("interrupted"); finish' INT TERM
}
# (an exit before finish, e.g. an unset variable under set -u, is a failure when its status is)
e2e_early() {
  if [ "$1" -ne 0 ]; then
    echo "# ended early (exit status $1)"; FAILED=$((FAILED + 1)); FAILED_NAMES+=("ended early (exit status $1)")
  fi
  finish
}
finish() {
  local c
  trap - EXIT INT TERM
  for c in "${E2E_CLEANUP[@]}"; do eval "$c" >/dev/null 2>&1 || echo "# warning: cleanup failed: $c"; done
  jobs -p | xargs -r kill 2>/dev/null
  if [ ${#E2E_NAMESPACES[@]} -gt 0 ] && command -v kubectl >/dev/null; then
    kubectl delete namespace "${E2E_NAMESPACES[@]}" --ignore-not-found --wait=false >/dev/null 2>&1
  fi
  if [ -z "${STASIS_E2E_KEEP_CLUSTER:-}" ]; then
    "$CLUSTER" uninstall-stasis >/dev/null 2>&1 || true
    "$CLUSTER" down >/dev/null 2>&1 || echo "# warning: scripts/cluster down failed"
  fi
  rm -rf "$WORK"
  echo "e2e $E2E_NAME: $(( $(date +%s) - T_START )) s"
  [ "$SKIPPED" -eq 0 ] || echo "$SKIPPED skipped (reasons above)"
  [ "$FAILED" -eq 0 ] || printf '# failed: %s\n' "${FAILED_NAMES[@]}"
  echo "$PASSED passed, $FAILED failed"
  [ "$FAILED" -eq 0 ]
  exit $?
}

# ------------------------------------------------------------------ helpers
# new_ns NS: a fresh namespace (deleted by finish), once its "default" ServiceAccount exists
# (pods are refused until the controller-manager made it)
new_ns() {
  kubectl delete namespace "$1" --ignore-not-found --wait=true >/dev/null 2>&1
  kubectl create namespace "$1" >/dev/null
  e2e_ns "$1"
  wait_for 30 "the default ServiceAccount of namespace $1" kubectl -n "$1" get serviceaccount default
}
# policy NS NAME SELECTOR-APP INTERVAL [SPEC]: a CheckpointPolicy; SPEC is the rest of its spec
# as one YAML line ("retention: {keepLast: 3}" when not given, nothing when empty)
policy() {
  local spec="retention: {keepLast: 3}"
  [ $# -ge 5 ] && spec=$5
  kubectl -n "$1" apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: $2}
spec:
  selector: {matchLabels: {app: $3}}
  interval: $4
  $spec
EOF
}
# counter NS NAME REPLICAS STATE_MB [STRATEGY] [ENGINE-VERSION] [RUNTIME-CLASS|none]: a Deployment
# of stasis-counter (tick 100 ms, port 7070), tolerating an unreachable node for 5 s (node loss is
# noticed fast); its memory limit is STATE_MB + 192 MiB, or $COUNTER_LIMIT_MIB
counter() {
  local ns=$1 name=$2 replicas=$3 mb=$4 strategy=${5:-RollingUpdate} engine=${6:-v1} rc=${7:-stasis}
  local limit=${COUNTER_LIMIT_MIB:-$(($4 + 192))}
  local rcl="runtimeClassName: $rc"; [ "$rc" = none ] && rcl="# no runtimeClassName (plain runc)"
  kubectl -n "$ns" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: $name}
spec:
  replicas: $replicas
  strategy: {type: $strategy}
  selector: {matchLabels: {app: $name}}
  template:
    metadata:
      labels: {app: $name, declare.stasis.dev/engine: "$engine"}
    spec:
      $rcl
      terminationGracePeriodSeconds: 30
      tolerations:
      - {key: node.kubernetes.io/not-ready, operator: Exists, effect: NoExecute, tolerationSeconds: 5}
      - {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 5}
      containers:
      - name: counter
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        env:
        - {name: STATE_MB, value: "$mb"}
        - {name: INTERVAL_MS, value: "100"}
        - {name: LISTEN_PORT, value: "7070"}
        ports: [{containerPort: 7070}]
        resources:
          limits: {memory: "${limit}Mi"}
EOF
}
# scenario NS APP INTERVAL COUNTER-ARGS...: a fresh namespace, a CheckpointPolicy "every-<interval>"
# selecting app APP, and the counter Deployment APP (`counter NS APP COUNTER-ARGS...`)
scenario() {
  local ns=$1 app=$2 interval=$3; shift 3
  new_ns "$ns"
  policy "$ns" "every-$interval" "$app" "$interval"
  counter "$ns" "$app" "$@"
}
# first_pod VAR LETTER NS APP: sets VAR to the scenario's one counting pod; else a failed check
# (the test's fail) and the namespace's state
first_pod() {
  local p
  p=$(wait_one_counting "$3" "$4" 90) && { printf -v "$1" %s "$p"; return 0; }
  fail "$2: the counter pod runs"
  diagnose "$3"
  return 1
}
# the running (not deleting) pods of app $2, one name per line
pods_of() {
  kubectl -n "$1" get pods -l "app=$2" -o json |
    jq -r '.items[] | select(.metadata.deletionTimestamp == null and .status.phase == "Running") | .metadata.name'
}
one_pod() { local p; p=$(pods_of "$1" "$2"); [ "$(wc -w <<<"$p")" = 1 ] && echo "$p"; }
# the one running pod of app $2 once it counts (within $3 seconds), printed
wait_one_counting() {
  local end=$(( $(date +%s) + $3 )) p
  while [ "$(date +%s)" -lt "$end" ]; do
    p=$(one_pod "$1" "$2") && counting "$1" "$p" && { echo "$p"; return 0; }
    sleep 1
  done
  return 1
}
node_of() { kubectl -n "$1" get pod "$2" -o jsonpath='{.spec.nodeName}'; }
other_node() { [ "$1" = worker-1 ] && echo worker-2 || echo worker-1; }
# the app container is running and printing (after the injected wait container, on a restore)
counting() { kubectl -n "$1" logs "$2" -c counter 2>/dev/null | grep -q '^count='; }
# follow a pod's log (with timestamps) into $WORK/<pod>.log until the container ends
follow() { kubectl -n "$1" logs -f --timestamps "$2" -c counter >"$WORK/$2.log" 2>/dev/null & }
# followed POD: its followed log has a count (the follower runs)
followed() { grep -q ' count=' "$WORK/$1.log" 2>/dev/null; }
# logged_after POD TIME: its followed log reached an RFC 3339 time (second precision), so
# count_before POD TIME is final
logged_after() { awk -v t="${2%Z}" 'substr($1, 1, 19) >= t { f = 1; exit } END { exit !f }' "$WORK/$1.log" 2>/dev/null; }
# succeeded checkpoints of a pod: "<startTime> <node> <checkpointRef>" lines, oldest first
ckpts() {
  kubectl -n "$1" get pckpt --field-selector "spec.sourcePodName=$2" -o json |
    jq -r '[.items[] | select(.status.phase == "Succeeded")] | sort_by(.status.startTime) | .[] | "\(.status.startTime) \(.status.node) \(.status.checkpointRef) \(.spec.reason)"'
}
n_ckpts() { [ "$(ckpts "$1" "$2" | wc -l)" -ge "$3" ]; }
# the last count a followed pod logged before an RFC 3339 time (second precision)
count_before() {
  local t=${2%Z}
  awk -v t="$t" 'substr($1, 1, 19) < t && $2 ~ /^count=[0-9]+$/ { c = substr($2, 7) } END { print c + 0 }' "$WORK/$1.log"
}
# (the counter's status lines start with "count="; its stderr lines, such as "full-check count=0",
# do not)
last_count() { awk '$2 ~ /^count=[0-9]+$/ { c = substr($2, 7) } END { print c }' "$WORK/$1.log"; }
first_count() { kubectl -n "$1" logs "$2" -c counter 2>/dev/null | grep -m1 -o '^count=[0-9]*' | cut -d= -f2; }
not_corrupt() { ! kubectl -n "$1" logs "$2" -c counter 2>/dev/null | grep -q CORRUPT; }
restore_phase() { kubectl -n "$1" get prestore --field-selector "spec.targetPodName=$2" -o jsonpath='{.items[*].status.phase}'; }
restore_ref() { kubectl -n "$1" get prestore --field-selector "spec.targetPodName=$2" -o jsonpath='{.items[*].spec.checkpointRef}'; }
event() { # NS POD REASON: the messages of the pod's Events with that reason
  kubectl -n "$1" get events --field-selector "involvedObject.name=$2,reason=$3" -o jsonpath='{range .items[*]}{.message}{"\n"}{end}'
}
ann() { kubectl -n "$1" get pod "$2" -o jsonpath="{.metadata.annotations.stasis\.dev/$3}"; }
ge() { [ -n "$1" ] && [ -n "$2" ] && [ "$1" -ge "$2" ]; }
# resumed FIRST CKPT: a counter's first count after a restore is past CKPT, the last count it logged
# before the checkpoint began; a cold start's first count is 1, so FIRST must also be 2 or more.
# (CKPT may be 0 when the checkpoint came within a second of the first count.)
resumed() { [ -n "$1" ] && [ -n "$2" ] && [ "$1" -gt "$2" ] && [ "$1" -ge 2 ]; }
# a replacement of app $2 other than $3, running and counting
replacement() {
  local p; p=$(pods_of "$1" "$2" | grep -vx "$3" | head -1)
  [ -n "$p" ] && counting "$1" "$p" && echo "$p"
}
wait_replacement() { # NS APP OLD-POD TIMEOUT -> prints the new pod
  local end=$(( $(date +%s) + $4 )) p
  while [ "$(date +%s)" -lt "$end" ]; do
    p=$(replacement "$1" "$2" "$3") && { echo "$p"; return 0; }
    sleep 0.5
  done
  return 1
}
diagnose() { # NS: what the test saw, for a failed scenario
  echo "# --- $1: pods, checkpoints, restores, events"
  kubectl -n "$1" get pods -o wide 2>&1 | sed 's/^/#   /'
  kubectl -n "$1" get pckpt,prestore 2>&1 | sed 's/^/#   /'
  kubectl -n "$1" get events --sort-by=.lastTimestamp 2>&1 | tail -25 | sed 's/^/#   /'
}

# ------------------------------------------------------------------ restart in place (OOM kill)
# counter_pid NS POD NODE: the host pid of the pod's counter, from runc's state on its node
counter_pid() {
  local cid
  cid=$(kubectl -n "$1" get pod "$2" -o jsonpath='{.status.containerStatuses[0].containerID}')
  cid=${cid#containerd://}
  jq -r .init_process_pid "$("$CLUSTER" node-root "$3")/run/containerd/runc/k8s.io/$cid/state.json" 2>/dev/null
}
# pod_images NS POD NODE: the node's directory of the pod's images (images/<pod-uid>)
pod_images() {
  echo "$("$CLUSTER" node-root "$3")/var/lib/stasis/images/$(kubectl -n "$1" get pod "$2" -o jsonpath='{.metadata.uid}')"
}
# check_kept_reference LETTER IMAGES WHAT: for a restart in place the node keeps a reference to
# the checkpoint WHAT (its chunks are in the encrypted chunk cache) and no memory image under
# IMAGES (a pod_images directory)
check_kept_reference() {
  check "$1: the node keeps a reference to $3 for a restart in place ($(ls "$2"/.latest-*/.stasis-latest.json 2>/dev/null | sed "s|.*/images/|images/|"))" \
    bash -c "ls '$2'/.latest-*/.stasis-latest.json"
  check "$1: ... and no memory image under the node's images/<pod-uid>/ ($(find "$2" -name 'pages-*.img' 2>/dev/null | wc -l) pages-*.img)" \
    test -z "$(find "$2" -name 'pages-*.img' 2>/dev/null)"
}
# restarted NS POD: the pod's container was restarted (restartCount >= 1) and counts again
restarted() {
  [ "$(kubectl -n "$1" get pod "$2" -o jsonpath='{.status.containerStatuses[0].restartCount}')" -ge 1 ] && counting "$1" "$2"
}
# oom_restores NS POD: the checkpointRef of each Restored PodRestore of the pod's restarts in place
oom_restores() {
  kubectl -n "$1" get prestore -o json | jq -r --arg p "$2" \
    '.items[] | select(.spec.targetPodName == $p and (.metadata.name | contains("-oom-")) and .status.phase == "Restored") | .spec.checkpointRef'
}
restored_in_place() { [ "$(oom_restores "$1" "$2" | grep -c .)" = 1 ]; }
# check_resumed_after_oom LETTER NS POD C_CKPT WHAT: after a restart in place (the pod followed),
# the kubelet saw an OOM kill and the counter resumed from the checkpoint WHAT (C_CKPT: the last
# count before it began): its first count is past C_CKPT and at most one past the last count
# before the kill, and it never says state=CORRUPT
check_resumed_after_oom() {
  local l=$1 ns=$2 pod=$3 c_ckpt=$4 what=$5 c_kill c_first
  c_kill=$(last_count "$pod"); c_first=$(first_count "$ns" "$pod")
  echo "# count at $what >= $c_ckpt, last count before the OOM kill: $c_kill, first count after the restart: $c_first"
  check "$l: the kubelet saw an OOM kill (lastState.terminated.reason)" test \
    "$(kubectl -n "$ns" get pod "$pod" -o jsonpath='{.status.containerStatuses[0].lastState.terminated.reason}')" = OOMKilled
  check "$l: it resumed from $what: first count ($c_first) > $c_ckpt, and not a cold start's 1" resumed "$c_first" "$c_ckpt"
  check "$l: ... and <= the last count before the kill + 1 ($c_kill)" ge "$((c_kill + 1))" "$c_first"
  check "$l: never state=CORRUPT" not_corrupt "$ns" "$pod"
}

# up_and_install: start the cluster, load the counter image, install the chart (a failed check and
# the test's finish when that fails; STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar)
# and wait for both agents to call their nodes ready. Needs REPO, CLUSTER, check, fail, finish.
up_and_install() {
  local t out rc values
  t=$(date +%s.%N)
  if ! "$CLUSTER" up; then fail "scripts/cluster up"; finish; fi
  echo "# cluster up: $(secs "$t") s"
  eval "$("$CLUSTER" env)"
  t=$(date +%s.%N)
  [ -f "$REPO/target/images/stasis-counter.oci.tar" ] || "$REPO/scripts/build-counter-image" >/dev/null
  "$CLUSTER" load-image "$REPO/target/images/stasis-counter.oci.tar" >/dev/null
  out=$("$CLUSTER" install-stasis 2>&1); rc=$?
  echo "$out" | sed 's/^/# /'
  check "scripts/cluster install-stasis" test $rc -eq 0
  [ $rc -eq 0 ] || finish
  echo "# images and install: $(secs "$t") s"
  values=$(helm get values stasis -n stasis-system -a -o json)
  if [ "$(jq -r .agent.standIn <<<"$values")" = true ] || [ "$(jq -r .controller.standIn <<<"$values")" = true ]; then
    fail "stasisd and stasis-controller installed (not stand-ins)"; finish
  fi
  check "both nodes labelled stasis.dev/ready=true by their agents" retry 60 bash -c \
    "test \"\$(kubectl get nodes -l stasis.dev/ready=true -o name | wc -l)\" -ge 2"
}
