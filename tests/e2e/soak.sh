#!/usr/bin/env bash
# Soak under faults on the local cluster: an opted-in counter (`runtimeClassName: stasis`, 5 s
# heartbeats) is checkpointed and drained from node to node, and in every iteration one fault
# strikes at a random phase: while idle, while a heartbeat checkpoint runs, or while the pod is
# drained (its final checkpoint and the replacement's restore). The faults, in turn:
#
#   agent       SIGKILL of stasisd in the agent pod of a node (the kubelet restarts the container)
#   controller  SIGKILL of the leading stasis-controller replica (the Lease holder; the other
#               replica serves the webhook and takes the lead)
#   containerd  SIGKILL of a node's containerd (scripts/cluster's supervisor starts it again, as
#               systemd would)
#   kubelet     SIGKILL of a node's kubelet (likewise)
#   s3          SIGKILL of the S3 server (s3s-fs; likewise)
#   node        scripts/cluster kill-node: every process of a node at once; the node boots again
#               once the workload counts elsewhere
#   disk        the node's stasis disk full: a file takes every free block of the filesystem at
#               the node's /var/lib/stasis for SOAK_HOLD_S seconds (that directory is not a
#               filesystem of its own in the local cluster: the soak mounts a small ext4 image,
#               SOAK_DISK_MB, there in each node's mount namespace and restarts the agents onto it,
#               and unmounts it at the end; the test cluster only)
#   s3-cut      the node cut off the S3 server for SOAK_HOLD_S seconds: iptables DROP rules for the
#               S3 port in the node's network namespace (OUTPUT, and FORWARD for its pods)
#
# After each fault, within bounds: the workload counts again (state=ok) and a checkpoint started
# after the fault (after its end, for disk and s3-cut) succeeds: the time to that is the fault's
# recovery time. Then the invariants, each a check:
#   - no workload left frozen: the counter's freezer cgroup is THAWED, its process neither stopped
#     nor traced, and its count advances
#   - no checkpoint published corrupt: the checkpoints published around the fault and the newest
#     one open in full with `kubectl stasis export` (manifest and every chunk authenticated); a
#     restored counter never prints state=CORRUPT
#   - no restore of a wrong or older checkpoint: each replacement's PodRestore is Restored, from a
#     checkpoint of its lineage no older than the newest one that had succeeded before the restore
#     began, and its first count is past that checkpoint's count (from the old pod's followed log)
#   - no lost pod: the Deployment's pod is back Running and counting
# A line per iteration goes to $SOAK_RESULTS (tab-separated) and a summary per fault (recovery
# min/median/max) is printed at the end.
#
#   SOAK_ITERATIONS                iterations (default 8: each fault once, as `make test` runs it;
#                                  `make soak` runs ITERATIONS=200)
#   SOAK_SEED                      the random phases' seed (printed; set it to replay a run)
#   SOAK_HOLD_S (12)               how long disk and s3-cut last
#   SOAK_STATE_MB (32)             the counter's state
#   SOAK_DISK_MB (2048)            the size of each node's stasis filesystem (the agents' chunk
#                                  cache is installed with 512 MiB: STASIS_CLUSTER_CHUNK_CACHE_BYTES)
#   SOAK_MAX_S                     start no iteration after this many seconds (0: no limit)
#   SOAK_RESULTS                   the per-iteration lines, appended (default: a file in the scratch dir)
#   SOAK_FAULTS, SOAK_PHASES       the faults taken in turn and the phases drawn from (default:
#                                  all of them), e.g. SOAK_FAULTS=kubelet SOAK_PHASES=restore
#   SOAK_TARGET (random)           in the restore phase, the node struck: source, destination or
#                                  random
#   KUBECTL_STASIS                 the plugin that opens checkpoints (target/debug/kubectl-stasis)
#
# Needs root. Prints "N passed, M failed", exits non-zero when a check failed.
# STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up; STASIS_INSTALL_NO_BUILD=1 reuses
# target/images/stasis.oci.tar.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
STATE=${STASIS_CLUSTER_STATE:-/var/lib/stasis-cluster}
WORK=$(mktemp -d /tmp/stasis-e2e-soak.XXXXXX)
NS=e2e-soak APP=soak SNS=stasis-system
ITERATIONS=${SOAK_ITERATIONS:-8}
SEED=${SOAK_SEED:-$(( $(date +%s) % 32768 ))}
HOLD=${SOAK_HOLD_S:-12}
STATE_MB=${SOAK_STATE_MB:-32}
DISK_MB=${SOAK_DISK_MB:-2048}
MAX_S=${SOAK_MAX_S:-0}
# (the agents' chunk cache, 2 GiB by default in the local cluster, must fit the small filesystem)
export STASIS_CLUSTER_CHUNK_CACHE_BYTES=${STASIS_CLUSTER_CHUNK_CACHE_BYTES:-536870912}
S3_PORT=${STASIS_CLUSTER_S3_PORT:-9000}
KS=${KUBECTL_STASIS:-$REPO/target/debug/kubectl-stasis}
read -r -a FAULTS <<<"${SOAK_FAULTS:-agent controller containerd kubelet s3 node disk s3-cut}"
read -r -a PHASES <<<"${SOAK_PHASES:-idle checkpoint restore}"
TARGET=${SOAK_TARGET:-random}
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
RESULTS=${SOAK_RESULTS:-$WORK/results.tsv}
e2e_begin soak
RANDOM=$SEED
# (the rest is one group, read in full before it runs: an edit of this file during a long soak
# cannot change the run)
{

now() { date +%s.%N; }
replacement_made() { kubectl -n "$NS" get pods -l "app=$APP" -o name | grep -v "^pod/$1\$" | grep -q .; }
utc() { date -u +%Y-%m-%dT%H:%M:%SZ; }
sup() { "$STATE/bin/supervisor" ctl --dir "$STATE/supervisor" "$@"; }
# the pid of a supervised service (0 while it is not running)
svc_pid() { sup status | awk -v n="$1" '$1 == n { sub("pid=", "", $3); print $3 + 0 }'; }
svc_running() { [ "$(svc_pid "$1")" -gt 0 ]; }
in_node() { local n=$1; shift; nsenter --mount="$STATE/ns/$n.mnt" --net="$STATE/ns/$n.net" -- "$@"; }
# the host pid of a container's first process: NS POD CONTAINER
ctr_pid() {
  local cid node
  cid=$(kubectl -n "$1" get pod "$2" -o json | jq -r --arg c "$3" '.status.containerStatuses[]? | select(.name == $c) | .containerID // empty')
  cid=${cid#containerd://}; node=$(node_of "$1" "$2")
  [ -n "$cid" ] && [ -n "$node" ] && jq -r .init_process_pid "$("$CLUSTER" node-root "$node")/run/containerd/runc/k8s.io/$cid/state.json" 2>/dev/null
}
agent_pod() { kubectl -n "$SNS" get pods -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$1" -o jsonpath='{.items[0].metadata.name}'; }
agents_ready() { [ "$(kubectl -n "$SNS" get ds stasis-agent -o jsonpath='{.status.numberReady}')" = 2 ]; }
controllers_ready() { [ "$(kubectl -n "$SNS" get deploy stasis-controller -o jsonpath='{.status.readyReplicas}')" = 2 ]; }
controller_ready() { [ "$(kubectl -n "$SNS" get deploy stasis-controller -o jsonpath='{.status.readyReplicas}')" -ge 1 ]; }
# the nodes the controller replicas run on (how many)
controller_nodes() {
  kubectl -n "$SNS" get pods -l app.kubernetes.io/component=controller --field-selector=status.phase=Running \
    -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort -u | grep -c .
}
controllers_spread() { controllers_ready && [ "$(controller_nodes)" -ge 2 ]; }
# Both replicas on one node make a node fault two faults at once (the webhook fails open, by
# design): an earlier script's drains can leave them so, and nothing moves a running replica
# back. Then one is deleted, and the topology spread puts its successor on the other node.
spread_controllers() {
  controllers_ready || return 0
  [ "$(controller_nodes)" -ge 2 ] && return 0
  local p
  p=$(kubectl -n "$SNS" get pods -l app.kubernetes.io/component=controller -o jsonpath='{.items[0].metadata.name}')
  echo "# $1: both controller replicas run on one node: $p deleted, so that the scheduler spreads them"
  kubectl -n "$SNS" delete pod "$p" --wait=false >/dev/null
  retry 180 controllers_spread || echo "# $1: the controller replicas are not on two nodes after 180 s"
}
nodes_ready() { [ "$(kubectl get nodes -o json | jq '[.items[] | select(any(.status.conditions[]; .type == "Ready" and .status == "True"))] | length')" = 2 ]; }
# every component back: nodes Ready, both agents and a controller ready (a replica killed again
# within 10 minutes waits out the kubelet's crash-loop back-off, up to 5 min: the other one
# serves meanwhile), containerd, kubelets and the S3 server running
all_back() {
  nodes_ready && agents_ready && controller_ready && svc_running s3 &&
    svc_running worker-1-containerd && svc_running worker-2-containerd &&
    svc_running worker-1-kubelet && svc_running worker-2-kubelet
}
# The PodCheckpoints of the namespace, oldest first: "<id> <phase> <sourcePod> <name>
# <checkpointRef> <completionTime> <creationTimestamp>". <id> is the checkpoint's id (the part of
# the reference after the lineage: the agent's clock in ms when the dump was done, which orders a
# lineage's checkpoints), "-" until published. The object is made before the dump starts (by the
# controller for a heartbeat, by the agent for a final checkpoint), and its creationTimestamp is
# in whole seconds, rounded down: a count logged before it is at most the checkpoint's.
# Retention deletes the PodCheckpoints of dropped checkpoints while an iteration runs: a ledger
# ($WORK/ledger, refreshed every 2 s in the background) keeps the last state seen of each.
ckpt_live() {
  kubectl -n "$NS" get pckpt -o json | jq -r '.items[] | "\((.status.checkpointRef // "-") | split("/") | last) \(.status.phase // "-") \(.spec.sourcePodName) \(.metadata.name) \(.status.checkpointRef // "-") \(.status.completionTime // "-") \(.metadata.creationTimestamp)"' | sort
}
ckpt_lines() {
  { cat "$WORK/ledger" 2>/dev/null; ckpt_live; } | awk 'NF == 7 { last[$4] = $0 } END { for (n in last) print last[n] }' | sort
}
keep_ledger() { while :; do ckpt_lines >"$WORK/ledger.tmp" && mv "$WORK/ledger.tmp" "$WORK/ledger"; sleep 2; done; }
# a checkpoint of pod $1 made after the second $2 (RFC 3339) Succeeded
ckpt_after() { ckpt_lines | awk -v p="$1" -v t="$2" '$3 == p && $2 == "Succeeded" && $7 > t' | grep -q .; }
ckpt_running() { ckpt_lines | awk -v p="$1" '$3 == p && ($2 == "Running" || $2 == "Pending")' | grep -q .; }
median() { sort -n | awk '{ a[NR] = $1 } END { if (NR) printf "%.1f", (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2); else printf "-" }'; }

# ------------------------------------------------------------------ the faults
FAULT_DESC=""
inject() { # FAULT NODE
  local f=$1 n=$2 pid p
  case $f in
    agent)
      p=$(agent_pod "$n"); pid=$(ctr_pid "$SNS" "$p" agent)
      FAULT_DESC="kill -9 stasisd (pid $pid, $p)"; kill -9 "$pid" ;;
    controller)
      p=$(kubectl -n "$SNS" get lease -o json | jq -r '[.items[].spec.holderIdentity // empty | select(startswith("stasis-controller"))][0] // empty')
      pid=$(ctr_pid "$SNS" "$p" controller)
      FAULT_DESC="kill -9 the leading stasis-controller (pid $pid, $p)"; kill -9 "$pid" ;;
    containerd | kubelet)
      pid=$(svc_pid "$n-$f"); FAULT_DESC="kill -9 $n's $f (pid $pid)"; kill -9 "$pid" ;;
    s3)
      pid=$(svc_pid s3); FAULT_DESC="kill -9 s3s-fs (pid $pid)"; kill -9 "$pid" ;;
    node)
      FAULT_DESC="scripts/cluster kill-node $n"; "$CLUSTER" kill-node "$n" 2>/dev/null ;;
    disk)
      # (never anything but the soak's own small filesystem: not the machine's disk)
      ours "$n" || { FAULT_DESC="not filled: $n's /var/lib/stasis is not the soak's filesystem"; fail "$IT: $FAULT_DESC"; return; }
      local avail; avail=$(in_node "$n" df -B1 --output=avail /var/lib/stasis | tail -1)
      in_node "$n" fallocate -l "$avail" /var/lib/stasis/soak-fill 2>/dev/null ||
        in_node "$n" fallocate -l "$((avail - 1048576))" /var/lib/stasis/soak-fill
      FAULT_DESC="fallocate $avail B on $n's /var/lib/stasis ($(in_node "$n" df -h --output=avail /var/lib/stasis | tail -1 | tr -d ' ') left)" ;;
    s3-cut)
      in_node "$n" iptables -w -I OUTPUT 1 -d "$STASIS_CLUSTER_HOST_IP" -p tcp --dport "$S3_PORT" -j DROP
      in_node "$n" iptables -w -I FORWARD 1 -d "$STASIS_CLUSTER_HOST_IP" -p tcp --dport "$S3_PORT" -j DROP
      FAULT_DESC="iptables DROP to $STASIS_CLUSTER_HOST_IP:$S3_PORT in $n's network namespace" ;;
  esac
}
clear_fault() { # FAULT NODE: end a fault that lasts (the killed come back by themselves, but a node)
  case $1 in
    node) [ ! -e "$STATE/killed-$2" ] || "$CLUSTER" start-node "$2" >/dev/null 2>&1 ;;
    disk) in_node "$2" rm -f /var/lib/stasis/soak-fill ;;
    s3-cut)
      while in_node "$2" iptables -w -D OUTPUT -d "$STASIS_CLUSTER_HOST_IP" -p tcp --dport "$S3_PORT" -j DROP 2>/dev/null; do :; done
      while in_node "$2" iptables -w -D FORWARD -d "$STASIS_CLUSTER_HOST_IP" -p tcp --dport "$S3_PORT" -j DROP 2>/dev/null; do :; done ;;
  esac
  return 0
}
clear_all() { local n; for n in worker-1 worker-2; do clear_fault node "$n"; clear_fault disk "$n"; clear_fault s3-cut "$n"; done; }
on_exit clear_all

# ------------------------------------------------------------------ the nodes' stasis disks
# A small ext4 image at each node's /var/lib/stasis (mounted in the node's mount namespace, what
# was there copied in but the chunk cache), so that filling it fills no one else's disk
# ours NODE: the node's /var/lib/stasis is the soak's small filesystem (a loop device's ext4)
ours() {
  local src size
  # (the last line: the mount on top, where the node root's bind mount lies below it)
  read -r src size < <(in_node "$1" findmnt -n -b -o SOURCE,SIZE --target /var/lib/stasis | tail -n 1)
  [[ $src == /dev/loop* ]] && [ "$size" -le $(( DISK_MB * 1024 * 1024 )) ]
}
disk_up() {
  local n img mnt
  for n in worker-1 worker-2; do
    img=$STATE/nodes/$n/soak-stasis-disk.img mnt=$WORK/mnt-$n
    ours "$n" && continue
    truncate -s "${DISK_MB}M" "$img" && mkfs.ext4 -q -F -m 0 "$img" || return 1
    mkdir -p "$mnt" && mount -o loop "$img" "$mnt" || return 1
    tar -C "$("$CLUSTER" node-root "$n")/var/lib/stasis" --exclude ./chunk-cache -cf - . | tar -C "$mnt" -xf -
    umount "$mnt"
    in_node "$n" mount -o loop "$img" /var/lib/stasis || return 1
  done
}
# restart_agents: new agent pods, ready (their node installers restart containerd first: until
# then an image import or a container start on the node may fail)
restart_agents() {
  local old; old=$(kubectl -n "$SNS" get pods -l app.kubernetes.io/component=agent -o name)
  # shellcheck disable=SC2086 # (pod names)
  kubectl -n "$SNS" delete $old --wait=false >/dev/null 2>&1
  new_agents() { ! kubectl -n "$SNS" get pods -l app.kubernetes.io/component=agent -o name | grep -qxF "$old" && agents_ready; }
  retry 180 new_agents
}
disk_down() {
  local n
  for n in worker-1 worker-2; do
    in_node "$n" rm -f /var/lib/stasis/soak-fill 2>/dev/null
    ours "$n" && in_node "$n" umount -l /var/lib/stasis
    rm -f "$STATE/nodes/$n/soak-stasis-disk.img"
  done
  # the agents back onto the node's own directory
  restart_agents
}

# ------------------------------------------------------------------ up, install, workload
up_and_install
export AWS_ALLOW_HTTP=true
echo "# soak: $ITERATIONS iterations, seed $SEED, faults ${FAULTS[*]}, phases ${PHASES[*]}, hold $HOLD s"
kubectl delete namespace "$NS" --ignore-not-found --wait=true >/dev/null 2>&1
on_exit "kubectl uncordon worker-1; kubectl uncordon worker-2"
on_exit "kubectl delete namespace $NS --ignore-not-found --wait=true --timeout=120s"
on_exit disk_down
both_ours() { ours worker-1 && ours worker-2; }
disk_up
check "a ${DISK_MB} MiB ext4 filesystem at each node's /var/lib/stasis (the test cluster's)" both_ours || finish
check "the agents restarted onto it" restart_agents || finish
both_ready() { [ "$(kubectl get nodes -l stasis.dev/ready=true -o name | wc -l)" -ge 2 ]; }
check "... and call their nodes ready" retry 60 both_ready
new_ns "$NS"
policy "$NS" every-5s "$APP" 5s "retention: {keepLast: 6}"
keep_ledger &
counter "$NS" "$APP" 1 "$STATE_MB"
counts() { local p; p=$(one_pod "$NS" "$APP") && counting "$NS" "$p"; }
check "the counter counts" retry 120 counts || { diagnose "$NS"; finish; }
[ -s "$RESULTS" ] || printf 'iteration\tfault\tphase\tnode\trecovery_s\tpods\trestored_from\tfailed_checkpoints\tfindings\ttarget\n' >"$RESULTS"
RESULTS_FROM=$(wc -l <"$RESULTS")

# ------------------------------------------------------------------ invariants
# no_frozen POD: its freezer cgroup THAWED, its process neither stopped (T) nor traced (t), and
# its count advancing (a heartbeat's freeze lasts milliseconds: each waits up to 15 s)
thawed() {
  local pid cg
  pid=$(ctr_pid "$NS" "$1" counter) && [ -n "$pid" ] || return 1
  cg=$(awk -F: '$2 == "freezer" { print $3 }' "/proc/$pid/cgroup")
  [ "$(cat "/sys/fs/cgroup/freezer$cg/freezer.state")" = THAWED ] &&
    ! grep -Eq '^State:\s+[Tt]' "/proc/$pid/status"
}
count_now() { kubectl -n "$NS" logs "$1" -c counter --tail=1 2>/dev/null | grep -o '^count=[0-9]*' | cut -d= -f2; }
advances() { local a=$2 b; b=$(count_now "$1"); [ -n "$b" ] && [ -n "$a" ] && [ "$b" -gt "$a" ]; }
check_not_frozen() {
  local p=$1 c
  check "$IT: $p not frozen (freezer THAWED, process not stopped)" retry 15 thawed "$p" || { FINDINGS+="frozen:$p "; N_FROZEN=$((N_FROZEN + 1)); return; }
  c=$(count_now "$p")
  check "$IT: $p counts on (from $c)" retry 15 advances "$p" "$c" || { FINDINGS+="stalled:$p "; N_FROZEN=$((N_FROZEN + 1)); }
}
# opens NAME: the published checkpoint opens in full (kubectl stasis export)
opens() { local f=$WORK/export.tar; rm -f "$f"; "$KS" -n "$NS" export "$1" -f "$f" --store "s3://$STASIS_S3_BUCKET/" --work-dir "$WORK" >"$WORK/export.out" 2>&1; local rc=$?; rm -f "$f"; return $rc; }
check_opens() {
  local name
  if [ ! -x "$KS" ]; then skip "$IT: published checkpoints open" "no $KS (cargo build -p stasis-kubectl)"; return; fi
  for name in "$@"; do
    check "$IT: published checkpoint $name opens in full (kubectl stasis export)" opens "$name" ||
      { sed 's/^/#   /' "$WORK/export.out"; FINDINGS+="corrupt:$name "; N_CORRUPT=$((N_CORRUPT + 1)); }
  done
}
# check_restore OLD NEW: NEW (a replacement of OLD's lineage) was restored from a checkpoint no
# older than the newest that had succeeded before its PodRestore was made, and continues past it
check_restore() {
  local old=$1 new=$2 pr phase ref created newest nid ncreated rid c_ckpt first src
  # A restore made while no agent ran (the agent killed on the destination) is reported by the
  # next agent from the wrapper's report file, once it is 10 s old (at-least-once delivery,
  # docs/design.md §12.5): a PodRestore still `Ready` is given that long to turn.
  restore_reported() {
    kubectl -n "$NS" get prestore --field-selector "spec.targetPodName=$new" -o json |
      jq -e '.items[0].status.phase // "" | . != "Ready" and . != "Fetching" and . != "Pending" and . != ""' >/dev/null
  }
  retry 30 restore_reported || true
  pr=$(kubectl -n "$NS" get prestore --field-selector "spec.targetPodName=$new" -o json | jq -c '.items[0] // empty')
  phase=$(jq -r '.status.phase // "-"' <<<"$pr"); ref=$(jq -r '.spec.checkpointRef // "-"' <<<"$pr")
  created=$(jq -r '.metadata.creationTimestamp // "-"' <<<"$pr")
  RESTORED_FROM=$ref
  if [ -z "$pr" ] || [ "$phase" != Restored ]; then
    fail "$IT: $new, the replacement of $old, restored (PodRestore ${phase:-none}: $(jq -r '.status.message // ""' <<<"$pr"); $(event "$NS" "$new" ColdStart | tail -1); restarts $(kubectl -n "$NS" get pod "$new" -o jsonpath='{.status.containerStatuses[0].restartCount}'), first count $(first_count "$NS" "$new"), $old's last $(last_count "$old"))"
    FINDINGS+="not-restored:$new "; N_OLDER=$((N_OLDER + 1)); diagnose "$NS"; return
  fi
  # the newest checkpoint of the pods it replaces that completed before the PodRestore was made
  newest=$(ckpt_lines | awk -v c="$created" -v n="$new" '$3 != n && $2 == "Succeeded" && $6 < c' | tail -1)
  read -r nid _ src _ _ _ ncreated <<<"$newest"
  # (a reference's id is its lineage's order; the restored checkpoint need not have a PodCheckpoint left)
  rid=${ref##*/}
  not_older() { [ -n "$nid" ] && [[ ! "$rid" < "$nid" ]]; }
  check "$IT: $new restored from $ref, not older than the newest complete checkpoint before its PodRestore (${newest:+$(awk '{print $5}' <<<"$newest")})" \
    not_older || { FINDINGS+="older:$new "; N_OLDER=$((N_OLDER + 1)); }
  first=$(first_count "$NS" "$new")
  if [ -f "$WORK/$src.log" ]; then
    c_ckpt=$(count_before "$src" "$ncreated")
    check "$IT: $new's first count ($first) is past that checkpoint's ($c_ckpt, $src's log)" resumed "$first" "$c_ckpt" ||
      { FINDINGS+="count:$new "; N_OLDER=$((N_OLDER + 1)); }
  fi
  check "$IT: $new never state=CORRUPT" not_corrupt "$NS" "$new" || { FINDINGS+="CORRUPT:$new "; N_CORRUPT=$((N_CORRUPT + 1)); }
}

# ------------------------------------------------------------------ iterations
N_FROZEN=0 N_CORRUPT=0 N_OLDER=0 N_LOST=0
P=$(wait_one_counting "$NS" "$APP" 60)
follow "$NS" "$P"
DRAIN_PID=""
T_SOAK=$(date +%s)
for IT in $(seq 1 "$ITERATIONS"); do
  if [ "$MAX_S" -gt 0 ] && [ $(( $(date +%s) - T_SOAK )) -ge "$MAX_S" ]; then
    echo "# SOAK_MAX_S=$MAX_S reached: no iteration after $((IT - 1))"; break
  fi
  F=${FAULTS[$(( (IT - 1) % ${#FAULTS[@]} ))]}
  PH=${PHASES[$(( RANDOM % ${#PHASES[@]} ))]}
  FINDINGS="" RESTORED_FROM="-"
  P=$(wait_one_counting "$NS" "$APP" 120) || { fail "$IT: the counter runs before the fault"; diagnose "$NS"; N_LOST=$((N_LOST + 1)); break; }
  followed "$P" || { follow "$NS" "$P"; wait_for 10 "the log of $P followed" followed "$P"; }
  N=$(node_of "$NS" "$P") D=$(other_node "$(node_of "$NS" "$P")")
  # a complete checkpoint to come back to
  T_PRE=$(utc)
  retry 60 ckpt_after "$P" "$T_PRE" || retry 1 n_ckpts "$NS" "$P" 1 || echo "# $IT: no checkpoint of $P succeeded in 60 s before the fault"
  T=$N
  if [ "$PH" = restore ]; then
    case $TARGET in destination) T=$D ;; source) ;; *) [ $((RANDOM % 2)) = 1 ] && T=$D ;; esac
  fi
  # (the controller and the S3 server are the cluster's, not a node's)
  case $F in controller | s3) T=- ;; esac
  # (one fault at a time: no iteration starts while a controller replica waits out the kubelet's
  # back-off from an earlier kill; with both replicas down the webhook fails open, by design)
  if ! controllers_ready; then
    t=$(now); retry 330 controllers_ready || echo "# $IT: the controller replicas are not both ready after 330 s"
    echo "# $IT: waited $(secs "$t") s for both controller replicas (the kubelet's back-off after the earlier kill)"
  fi
  spread_controllers "$IT"
  case $PH in
    idle) sleep "$((RANDOM % 5)).$((RANDOM % 10))" ;;
    checkpoint) retry 20 ckpt_running "$P" || PH="idle(no checkpoint seen running in 20 s)" ;;
    restore)
      # (uncordoned as soon as the drain ends: a replacement lost with the other node needs it)
      { kubectl drain "$N" --ignore-daemonsets --delete-emptydir-data --pod-selector "app=$APP" --timeout=150s; kubectl uncordon "$N"; } >"$WORK/drain.out" 2>&1 &
      DRAIN_PID=$!
      # the replacement made (its PodRestore is being prepared), then a random moment of it
      retry 30 replacement_made "$P"
      sleep "0.$((RANDOM % 10))$((RANDOM % 10))" ;;
  esac
  T_FAULT=$(now) U_FAULT=$(utc)
  FAILED_BEFORE=$(ckpt_lines | awk '$2 == "Failed"' | wc -l)
  inject "$F" "$T"
  echo "# --- $IT/$ITERATIONS: $F during $PH on ${T} (pod $P on $N): $FAULT_DESC"
  # a lasting fault ends after SOAK_HOLD_S; a kill is over at once (what was killed restarts by
  # itself; a killed node boots again once the workload is back)
  T_REF=$T_FAULT U_REF=$U_FAULT
  case $F in disk | s3-cut) sleep "$HOLD"; clear_fault "$F" "$T"; T_REF=$(now) U_REF=$(utc) ;; esac
  # recovery: the workload counts (off a killed node) and a checkpoint of it that started after
  # the fault succeeded
  recovered() {
    local p; p=$(one_pod "$NS" "$APP") && counting "$NS" "$p" && ckpt_after "$p" "$U_REF" &&
      { [ "$F" != node ] || [ "$(node_of "$NS" "$p")" != "$T" ]; }
  }
  if retry 240 recovered; then
    REC=$(secs "$T_REF")
    pass "$IT: recovered from $F during $PH in $REC s (counting, a checkpoint started after it succeeded)"
  else
    REC=-; fail "$IT: recovered from $F during $PH (counting, a checkpoint started after $U_REF succeeded) within 240 s"
    FINDINGS+="no-recovery "; diagnose "$NS"
  fi
  [ "$F" != node ] || clear_fault node "$T"
  # the drain of this iteration (restore phase), or now one to move the pod back
  if [ -n "$DRAIN_PID" ]; then
    retry 200 bash -c "! kill -0 $DRAIN_PID" || kill "$DRAIN_PID" 2>/dev/null
    wait "$DRAIN_PID" 2>/dev/null; DRAIN_PID=""
  elif Q=$(one_pod "$NS" "$APP") && [ "$Q" = "$P" ]; then
    followed "$P" || follow "$NS" "$P"
    kubectl drain "$N" --ignore-daemonsets --delete-emptydir-data --pod-selector "app=$APP" --timeout=150s >"$WORK/drain.out" 2>&1 ||
      { echo "# $IT: drain of $N:"; sed 's/^/#   /' "$WORK/drain.out"; }
  fi
  kubectl uncordon "$N" >/dev/null 2>&1
  check "$IT: every component back (nodes, agents, controllers, containerd, kubelets, S3)" retry 180 all_back || FINDINGS+="not-back "
  # no lost pod: one pod of the Deployment runs and counts
  if Q=$(wait_one_counting "$NS" "$APP" 180); then pass "$IT: the Deployment's pod $Q runs and counts"
  else fail "$IT: the Deployment's pod runs and counts (lost)"; FINDINGS+="lost "; N_LOST=$((N_LOST + 1)); diagnose "$NS"; continue; fi
  followed "$Q" || { follow "$NS" "$Q"; wait_for 10 "the log of $Q followed" followed "$Q"; }
  check_not_frozen "$Q"
  PODS=$P
  [ "$Q" = "$P" ] || { PODS="$P>$Q"; check_restore "$P" "$Q"; }
  # the checkpoints published from just before the fault on, and the newest
  PUB=$(ckpt_lines | awk -v t="$(date -u -d "@$(( ${T_FAULT%.*} - 10 ))" +%Y-%m-%dT%H:%M:%SZ)" -v c="$(utc)" '$2 == "Succeeded" && $7 >= t && $7 <= c { print $4 }' | tail -3)
  NEWEST=$(ckpt_lines | awk '$2 == "Succeeded" { n = $4 } END { print n }')
  mapfile -t OPEN < <(printf '%s\n' $PUB "$NEWEST" | grep . | sort -u)
  check_opens "${OPEN[@]}"
  FAILED_CK=$(( $(ckpt_lines | awk '$2 == "Failed"' | wc -l) - FAILED_BEFORE ))
  case $T in -) ROLE=cluster ;; "$N") ROLE=source ;; *) ROLE=destination ;; esac
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$IT" "$F" "$PH" "$T" "$REC" "$PODS" "$RESTORED_FROM" "$FAILED_CK" "${FINDINGS:-none}" "$ROLE" >>"$RESULTS"
  P=$Q
done

# ------------------------------------------------------------------ summary
echo "# soak: $(( $(wc -l <"$RESULTS") - RESULTS_FROM )) of $ITERATIONS iterations ran (seed $SEED)"
echo "# frozen workloads: $N_FROZEN, corrupt checkpoints: $N_CORRUPT, restores not of the newest complete checkpoint: $N_OLDER, lost pods: $N_LOST"
echo "# recovery (s) by fault: count, min, median, max"
for f in "${FAULTS[@]}"; do
  r=$(awk -F'\t' -v f="$f" -v from="$RESULTS_FROM" 'NR > from && $2 == f && $5 != "-" { print $5 }' "$RESULTS")
  [ -n "$r" ] || continue
  echo "#   $f: $(wc -l <<<"$r"), $(sort -n <<<"$r" | head -1), $(median <<<"$r"), $(sort -n <<<"$r" | tail -1)"
done
sed -n "1p;$((RESULTS_FROM + 1)),\$p" "$RESULTS" | sed 's/^/#   /'
[ -z "${SOAK_RESULTS:-}" ] || echo "# per iteration: $RESULTS"
finish
}
