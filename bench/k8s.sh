#!/usr/bin/env bash
# Benchmark of stasis on Kubernetes (issue 4): the local cluster with the chart installed, the
# counter workload (10 ticks/s), and in the same run the baseline a user has without stasis.
#
#   recovery   a Deployment counts for PROGRESS_S seconds, then its node is drained: the time from
#              the drain until the replacement is back at the count it had before the drain,
#              with stasis (runtimeClassName: stasis, 10 s heartbeats, final checkpoint on the
#              drain) vs without (plain runc: a cold start counts again from 1), as a ratio;
#              for each STATE_MB in SIZES (BASELINE=0: without the cold-start runs);
#              CORDON_LEAD_S=<s>: the node is cordoned that long before the drain (what a node
#              upgrade or an autoscaler does), so the other worker's agent pre-stages the pod's
#              latest checkpoint (docs/design.md §12.10c); the time is still from the drain
#   overhead   ticks per second while a 10 s CheckpointPolicy checkpoints it vs no policy (the
#              baseline's replacement, counting up again)
#   node costs stasis-runc create+delete vs runc create+delete of a container that does not
#              restore (N runs each, median); stasisd RSS idle and its peak while it checkpoints;
#              stasis-controller RSS with PODS opted-in pods
#   paths      with PATHS (e.g. "1 2 3 4 5 6 7"): the eviction paths of tests/e2e/evictions.sh, run
#              at each STATE_MB in SIZES (the counter holds that much memory, heartbeats every
#              PATH_INTERVAL): per path the time from the trigger until the replacement is back
#              at the old pod's last count, the counts lost, the checkpoint restored and the
#              machine's load average; beside it the baseline, a cold start redoing the same
#              count (the cold run's time from the drain to its first count + count / its
#              ticks per second, both measured at that size), and the ratio
#
# Needs root. Environment: SIZES ("256 2048"), PROGRESS_S (120), PODS (100), CREATE_RUNS (20),
# RECOVERY_ONLY=1 (no node costs), BASELINE=0 (no cold-start runs), PATHS ("": none),
# PATHS_ONLY=1 (only the paths and their cold baselines), PATH_INTERVAL (10s), PATH_LOGS (a
# directory to keep evictions.sh's output in), STASIS_INSTALL_NO_BUILD=1 (reuse
# target/images/stasis.oci.tar), KEEP_CLUSTER=1 (leave it up).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER=$REPO/scripts/cluster
SIZES=${SIZES:-256 2048}
PROGRESS_S=${PROGRESS_S:-120}
PODS=${PODS:-100}
CREATE_RUNS=${CREATE_RUNS:-20}
PATHS=${PATHS:-}
PATH_INTERVAL=${PATH_INTERVAL:-10s}
WORK=$(mktemp -d /tmp/stasis-bench-k8s.XXXXXX)
RESULTS=$WORK/results
cleanup() {
  jobs -p | xargs -r kill 2>/dev/null
  if [ -z "${KEEP_CLUSTER:-}" ]; then
    "$CLUSTER" uninstall-stasis >/dev/null 2>&1
    "$CLUSTER" down >/dev/null 2>&1
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
say() { echo "bench: $*" >&2; }
die() { say "error: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

# RSS (MiB) of a node's stasisd and of the stasis-controller processes, from /proc (the nodes
# share this machine's PID namespace)
agent_pid() {
  local p
  for p in $(pgrep -x stasisd); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "NODE_NAME=$1" && { echo "$p"; return; }
  done
}
rss_mib() { awk '/^VmRSS/ {printf "%d", $2 / 1024}' "/proc/$1/status" 2>/dev/null; }
controller_pids() {
  local p
  for p in $(pgrep -f /usr/local/bin/stasis-controller); do
    grep -q wait-restore "/proc/$p/cmdline" 2>/dev/null || echo "$p"
  done
}
# samples a node's stasisd RSS every 100 ms into $WORK/rss-<node> until killed
sample_rss() {
  local pid; pid=$(agent_pid "$1")
  while [ -n "$pid" ] && [ -d "/proc/$pid" ]; do rss_mib "$pid" >>"$WORK/rss-$1"; echo >>"$WORK/rss-$1"; sleep 0.1; done
}
peak() { sort -n "$1" 2>/dev/null | tail -1; }
# the count a pod's current container has reached (its last status line)
count_now() { kubectl -n "$1" logs "$2" -c counter --tail=20 2>/dev/null | grep -o '^count=[0-9]*' | tail -1 | cut -d= -f2; }
# ticks per second in a followed log between two of its lines (the first and last N seconds)
rate() { # LOGFILE
  awk '$2 ~ /^count=/ { split($1, d, /[T:Z]/); t = d[2] * 3600 + d[3] * 60 + d[4]; c = substr($2, 7);
         if (n == 0) { t0 = t; c0 = c } n++; t1 = t; c1 = c }
       END { if (t1 > t0) printf "%.2f", (c1 - c0) / (t1 - t0); else print "n/a" }' "$1"
}

"$CLUSTER" up >/dev/null || die "scripts/cluster up failed"
eval "$("$CLUSTER" env)"
[ -f "$REPO/target/images/stasis-counter.oci.tar" ] || "$REPO/scripts/build-counter-image" >/dev/null
"$CLUSTER" load-image "$REPO/target/images/stasis-counter.oci.tar" >/dev/null
"$CLUSTER" install-stasis >/dev/null || die "install-stasis failed"
retry 60 bash -c "test \"\$(kubectl get nodes -l stasis.dev/ready=true -o name | wc -l)\" -ge 2" || die "nodes not ready for stasis"
sleep 5
for n in worker-1 worker-2; do echo "agent_idle_rss_mib $n $(rss_mib "$(agent_pid $n)")" >>"$RESULTS"; done

# ------------------------------------------------------------------ recovery after a drain
recover() { # MB MODE(stasis|cold) TARGET-COUNT(cold only)
  local mb=$1 mode=$2 target=${3:-} ns="bench-$2-$1" p1 p2 node t c_before back first
  new_ns "$ns"
  if [ "$mode" = stasis ]; then
    policy "$ns" every-10s app 10s
    counter "$ns" app 1 "$mb"
  else
    counter "$ns" app 1 "$mb" RollingUpdate v1 none
  fi
  appcounting() { local p; p=$(one_pod "$ns" app) && counting "$ns" "$p"; }
  retry 180 appcounting || die "$ns: the counter does not run"
  p1=$(one_pod "$ns" app); node=$(node_of "$ns" "$p1")
  follow "$ns" "$p1"
  if [ "$mode" = stasis ]; then
    : >"$WORK/rss-$node"; sample_rss "$node" & local sampler=$!
    say "$ns: counting on $node for $PROGRESS_S s (heartbeats every 10 s)"
    sleep "$PROGRESS_S"
  else
    sleep 10
  fi
  if [ "$mode" = stasis ] && [ "${CORDON_LEAD_S:-0}" -gt 0 ]; then
    say "$ns: cordoning $node $CORDON_LEAD_S s before the drain (pre-staging)"
    kubectl cordon "$node" >/dev/null
    sleep "$CORDON_LEAD_S"
  fi
  t=$(now)
  kubectl drain "$node" --ignore-daemonsets --delete-emptydir-data --pod-selector app=app --timeout=300s >/dev/null 2>&1
  [ "$mode" = stasis ] && kill "$sampler" 2>/dev/null
  c_before=$(last_count "$p1")
  [ "$mode" = stasis ] && target=$c_before
  p2=$(wait_replacement "$ns" app "$p1" 300) || die "$ns: no replacement"
  local counting_after; counting_after=$(since "$t")
  first=$(first_count "$ns" "$p2")
  follow "$ns" "$p2"
  until c=$(count_now "$ns" "$p2") && [ -n "$c" ] && [ "$c" -ge "$target" ]; do sleep 0.2; done
  back=$(since "$t")
  kubectl uncordon "$node" >/dev/null
  say "$ns: back at count $target $back s after the drain (first count of the replacement: $first)"
  if [ "$mode" = stasis ]; then
    local pr ref reason
    pr=$(kubectl -n "$ns" get prestore --field-selector "spec.targetPodName=$p2" -o json | jq -c '.items[0]')
    ref=$(jq -r .spec.checkpointRef <<<"$pr")
    reason=$(kubectl -n "$ns" get pckpt -o json | jq -r --arg r "$ref" '.items[] | select(.status.checkpointRef == $r) | .spec.reason')
    echo "recovery $mb stasis $back $target $first $(rate "$WORK/$p1.log") $(peak "$WORK/rss-$node") $(kubectl -n "$ns" get pckpt -o json | jq -r '[.items[] | select(.status.phase == "Succeeded" and .spec.reason == "Heartbeat") | .status.freezeMillis] | add / length | floor') ${reason:-?} $(jq -r '.status.fetchMillis // "?"' <<<"$pr") $(jq -r '.status.restoreMillis // "?"' <<<"$pr")" >>"$RESULTS"
  else
    echo "recovery $mb cold $back $target $first $(rate "$WORK/$p2.log") $counting_after" >>"$RESULTS"
  fi
  kubectl delete namespace "$ns" --wait=false >/dev/null
  echo "$target"
}
if [ -z "${PATHS_ONLY:-}" ]; then
for mb in $SIZES; do
  target=$(recover "$mb" stasis) || exit 1
  [ "${BASELINE:-1}" = 0 ] || recover "$mb" cold "$target" >/dev/null || exit 1
done
fi

# ------------------------------------------------------------------ eviction paths
# tests/e2e/evictions.sh at each size (its checks still count: a failed one is reported); its
# figure lines are "# <path> | <back s> | <lost> | <restored from> | <old count> | <load> | <MiB>"
if [ -n "$PATHS" ]; then
  for mb in $SIZES; do
    # the baseline: a cold start's time to its first count and its rate, at this size
    grep -q "^recovery $mb cold " "$RESULTS" || recover "$mb" cold 100 >/dev/null || exit 1
    say "eviction paths $PATHS at $mb MiB (tests/e2e/evictions.sh, heartbeats every $PATH_INTERVAL)"
    log=${PATH_LOGS:-$WORK}/evictions-$mb.log
    STASIS_E2E_ONLY="$PATHS" STASIS_E2E_STATE_MB=$mb STASIS_E2E_INTERVAL=$PATH_INTERVAL \
      STASIS_E2E_KEEP_CLUSTER=1 STASIS_INSTALL_NO_BUILD=1 "$REPO/tests/e2e/evictions.sh" >"$log" 2>&1
    echo "paths_run $mb $(tail -1 "$log" | tr ' ' _) $(uptime | sed 's/.*load average: //; s/ //g')" >>"$RESULTS"
    grep '^not ok' "$log" | sed "s/^/bench: $mb MiB: /" >&2
    sed -n 's/^# \([0-9][a-z]*\) | \(.*\)$/\1 | \2/p' "$log" |
      awk -F' [|] ' 'NF == 7 { print "path", $7, $1, $2, $3, $4, $5, $6 }' >>"$RESULTS"
  done
fi

# ------------------------------------------------------------------ create overhead on a node
if [ -z "${RECOVERY_ONLY:-}" ] && [ -z "${PATHS_ONLY:-}" ]; then
say "create overhead: $CREATE_RUNS x create+delete each, runc vs stasis-runc"
R1=$("$CLUSTER" node-root worker-1)
BUNDLE=$WORK/bundle
"$REPO/scripts/make-bundle" --force "$BUNDLE" STATE_MB=1 >/dev/null || die "make-bundle failed"
ROOT=$WORK/runc-root
create_ms() { # BINARY: median ms of create+delete
  local i t ms=()
  for i in $(seq "$CREATE_RUNS"); do
    t=$(date +%s%N)
    STASIS_RUN_DIR=$R1/run/stasis "$1" --root "$ROOT" create --bundle "$BUNDLE" "bench-$i" </dev/null >/dev/null 2>&1 || die "$1 create failed"
    "$1" --root "$ROOT" delete -f "bench-$i" >/dev/null 2>&1
    ms+=($(( ($(date +%s%N) - t) / 1000 )))
  done
  printf '%s\n' "${ms[@]}" | sort -n | awk '{a[NR] = $1} END {printf "%.1f", a[int((NR + 1) / 2)] / 1000}'
}
create_ms "$(command -v runc)" >/dev/null   # warm the caches
echo "create_ms runc $(create_ms "$(command -v runc)")" >>"$RESULTS"
echo "create_ms stasis-runc $(create_ms "$R1/opt/stasis/bin/stasis-runc")" >>"$RESULTS"

# ------------------------------------------------------------------ the controller with PODS pods
say "controller: $PODS opted-in pods"
ns=bench-many
new_ns "$ns"
policy "$ns" hourly many 1h
kubectl -n "$ns" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: many}
spec:
  replicas: $PODS
  selector: {matchLabels: {app: many}}
  template:
    metadata: {labels: {app: many}}
    spec:
      runtimeClassName: stasis
      terminationGracePeriodSeconds: 1
      containers:
      - {name: app, image: stasis.local/testapp:dev, imagePullPolicy: Never, command: [/testapp, sleep],
         resources: {requests: {cpu: 1m, memory: 8Mi}}}
EOF
t=$(now)
all_running() { [ "$(kubectl -n "$ns" get pods --field-selector status.phase=Running -o name | wc -l)" -ge "$PODS" ]; }
retry 600 all_running || say "warning: not all $PODS pods Running after 600 s"
echo "many_pods_running_s $(since "$t") $(kubectl -n "$ns" get pods --field-selector status.phase=Running -o name | wc -l)" >>"$RESULTS"
sleep 20
for p in $(controller_pids); do echo "controller_rss_mib $p $(rss_mib "$p")" >>"$RESULTS"; done
kubectl delete namespace "$ns" --wait=false >/dev/null
fi

# ------------------------------------------------------------------ report
echo
echo "stasis on Kubernetes: local cluster (2 workers), counter at 10 ticks/s, $PROGRESS_S s of progress before the drain"
echo
printf '%-9s %-8s %12s %13s %12s %13s %14s\n' "state" "mode" "back (s)" "count before" "first count" "ticks/s" "note"
awk '$1 == "recovery" {
  note = ($3 == "stasis") ? sprintf("freeze %d ms, agent peak %s MiB; restored the %s checkpoint: fetch %s ms, restore %s ms", $9, $8, $10, $11, $12) : "cold start"
  printf "%-9s %-8s %12s %13s %12s %13s   %s\n", $2 " MiB", $3, $4, $5, $6, $7, note }' "$RESULTS"
echo
awk '$1 == "recovery" { back[$2 "/" $3] = $4; rate[$2 "/" $3] = $7; sizes[$2] = 1 }
  END { for (s in sizes) if ((s "/cold") in back && (s "/stasis") in back) {
    printf "%s MiB: back at the pre-drain count %.1fx faster with stasis (%.1f s vs %.1f s); ticks/s with a 10 s policy / without: %.3f\n",
      s, back[s "/cold"] / back[s "/stasis"], back[s "/stasis"], back[s "/cold"], rate[s "/stasis"] / rate[s "/cold"] } }' "$RESULTS"
if grep -q '^path ' "$RESULTS"; then
  echo
  echo "eviction paths (tests/e2e/evictions.sh, heartbeats every $PATH_INTERVAL): trigger -> back at the old pod's last count"
  printf '%-9s %-34s %9s %6s %-14s %10s %15s %7s %8s\n' "state" "path" "back (s)" "lost" "restored from" "old count" "cold start (s)" "ratio" "load 1m"
  awk 'BEGIN { n["1"] = "taint NoExecute"; n["2"] = "Karpenter (taint, eviction)"; n["3"] = "priority preemption";
         n["4a"] = "StatefulSet, delete"; n["4b"] = "Job Never, drain"; n["4c"] = "indexed Job, delete";
         n["4d"] = "Job OnFailure, drain"; n["4e"] = "bare pod, PodRestore"; n["5"] = "kubelet node pressure";
         n["6"] = "EvictionRequest, responder"; n["7"] = "graceful node shutdown" }
    $1 == "recovery" && $3 == "cold" && NF >= 8 { first[$2] = $8; rate[$2] = $7 }
    $1 == "path" {
      base = ($2 in rate && rate[$2] > 0) ? first[$2] + $7 / rate[$2] : 0
      ratio = (base > 0 && $4 > 0) ? sprintf("%.1fx", base / $4) : "-"
      cold = (base > 0) ? sprintf("%.1f", base) : "-"
      printf "%-9s %-34s %9s %6s %-14s %10s %15s %7s %8s\n", $2 " MiB", $3 " " n[$3], $4, $5, $6, $7, cold, ratio, $8 }' "$RESULTS"
  awk '$1 == "recovery" && $3 == "cold" && NF >= 8 { printf "(cold start at %s MiB: counting %s s after the drain, then %s ticks/s)\n", $2, $8, $7 }
       $1 == "paths_run" { gsub(/_/, " ", $3); printf "(evictions.sh at %s MiB: %s; load average at its end %s)\n", $2, $3, $4 }' "$RESULTS"
fi
awk '$1 == "create_ms" { ms[$2] = $3 } END { if ("runc" in ms)
  printf "create+delete (no restore), median of '"$CREATE_RUNS"': runc %.1f ms, stasis-runc %.1f ms: +%.1f ms\n", ms["runc"], ms["stasis-runc"], ms["stasis-runc"] - ms["runc"] }' "$RESULTS"
awk '$1 == "agent_idle_rss_mib" { printf "stasisd idle RSS on %s: %s MiB\n", $2, $3 }' "$RESULTS"
awk '$1 == "controller_rss_mib" { printf "stasis-controller RSS with '"$PODS"' opted-in pods: %s MiB (pid %s)\n", $3, $2 }' "$RESULTS"
awk '$1 == "many_pods_running_s" { printf "(%s pods Running %s s after the Deployment was created)\n", $3, $2 }' "$RESULTS"
