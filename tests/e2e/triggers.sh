#!/usr/bin/env bash
# End to end on the local cluster: the checkpoints a policy's triggers take before the end comes.
#
#   m. memory trigger: a counter whose working set passes 80 % of its memory limit
#      (STATE_MB=104 under a 128 MiB limit: ~83 % once its state is filled) under a policy with
#      `triggers.memoryPercent: 80` and a 4 min heartbeat (none falls due during the scenario)
#      -> a PodCheckpoint with reason MemoryPressure Succeeds, a MemoryPressure Event says why,
#      no second one within the rate limit while it stays above; then its memory grows until
#      the kernel's OOM killer acts (SIGRTMIN, as restore.sh scenario c) -> the restart in place
#      restores that checkpoint (PodRestore "-oom-", Restored) and counts on from it.
#   i. interval: auto: a counter under `interval: auto`; its cost is measured (one checkpoint
#      asked for by hand), the policy's status shows the interval chosen and its inputs; then
#      its pods are deleted four times in a row (interruptions of the node pool) -> the status
#      shows them and a shorter interval.
#
# Needs root. Prints "N passed, M failed"; STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up;
# STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar; STASIS_E2E_ONLY="m" or "i".
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
WORK=$(mktemp -d /tmp/stasis-e2e-triggers.XXXXXX)
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin triggers

up_and_install

# the pod's checkpoints with this reason: "<name> <phase> <startTime> <completionTime> <ref>"
ckpts_of() { # NS POD REASON
  kubectl -n "$1" get pckpt -o json | jq -r --arg p "$2" --arg r "$3" \
    '[.items[] | select(.spec.sourcePodName == $p and .spec.reason == $r)] | sort_by(.metadata.creationTimestamp) | .[] | "\(.metadata.name) \(.status.phase // "-") \(.status.startTime // "-") \(.status.completionTime // "-") \(.status.checkpointRef // "-")"'
}
n_with() { [ "$(ckpts_of "$1" "$2" "$3" | awk -v ph="$4" '$2 == ph' | wc -l)" -ge "$5" ]; }
epoch() { date -d "$1" +%s.%N; }

# ------------------------------------------------------------------ m. memory trigger
if want m; then
echo "# --- m. memory trigger: working set past 80 % of the limit, then an OOM kill"
NS=e2e-memory
new_ns "$NS"
policy "$NS" memory hungry 4m "triggers: {memoryPercent: 80}"
COUNTER_LIMIT_MIB=128 counter "$NS" hungry 1 104
if P1=$(wait_one_counting "$NS" hungry 120); then
  NO=$(node_of "$NS" "$P1")
  follow "$NS" "$P1"
  T0=$(date +%s.%N)
  check "m: a MemoryPressure checkpoint of $P1 Succeeds" retry 90 n_with "$NS" "$P1" MemoryPressure Succeeded 1
  read -r CK _ T_CK_START T_CK_END REF <<<"$(ckpts_of "$NS" "$P1" MemoryPressure | awk '$2 == "Succeeded"' | head -1)"
  echo "# $CK on $NO: started $T_CK_START, completed $T_CK_END ($(secs "$T0") s after the pod counted)"
  kubectl -n "$NS" get pckpt "$CK" -o custom-columns=SIZE:.status.sizeBytes,FREEZE_MS:.status.freezeMillis,TOTAL_MS:.status.totalMillis | sed 's/^/#   /'
  check "m: a MemoryPressure Event on $P1 says why: $(event "$NS" "$P1" MemoryPressure | head -1 | cut -c1-160)" \
    bash -c "[ -n \"\$(kubectl -n $NS get events --field-selector involvedObject.name=$P1,reason=MemoryPressure -o name)\" ]"
  AIP=$(kubectl -n stasis-system get pod -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$NO" -o jsonpath='{.items[0].status.podIP}')
  check "m: the agent of $NO counts it (stasis_agent_memory_triggers_total{kind=\"ContainerLimit\"} at $AIP)" bash -c \
    "curl -fsS --max-time 5 http://$AIP:9464/metrics | grep -q '^stasis_agent_memory_triggers_total{kind=\"ContainerLimit\"} [1-9]'"
  sleep 20
  # (one made before the pod's lineage was registered fails and is retried after the shortest
  # gap: it comes before the one that succeeded, and is not what the rate limit is about)
  ckpts_of "$NS" "$P1" MemoryPressure | awk '$2 == "Failed" {print "# m: failed before it: " $0}'
  after_ck() { ckpts_of "$NS" "$P1" MemoryPressure | awk -v ck="$CK" 'seen {n++} $1 == ck {seen = 1} END {print n + 0}'; }
  check "m: rate-limited: no MemoryPressure checkpoint after $CK 20 s later, above 80 % all along ($(after_ck))" \
    test "$(after_ck)" = 0
  check "m: no heartbeat checkpoint meanwhile (the restore below can only be the memory checkpoint's)" \
    test -z "$(ckpts_of "$NS" "$P1" Heartbeat)"
  C_CKPT=$(count_before "$P1" "$T_CK_START")
  PID=$(counter_pid "$NS" "$P1" "$NO")
  # What the node keeps for the restart in place (security review M6)
  check_kept_reference m "$(pod_images "$NS" "$P1" "$NO")" "the memory checkpoint"
  # SIGRTMIN: the counter grows its memory, 16 MiB at a time, until the OOM killer acts
  T_KILL=$(date +%s.%N)
  check "m: SIGRTMIN to the counter (pid $PID on $NO): its memory grows until the OOM kill" kill -s RTMIN "$PID"
  echo "# the checkpoint completed $(awk -v a="$(epoch "$T_CK_END")" -v b="$T_KILL" 'BEGIN{printf "%.1f", b-a}') s before the memory growth that ended in the OOM kill began"
  if check "m: the container is restarted in place and counts again" retry 60 restarted "$NS" "$P1"; then
    echo "# counting again $(secs "$T_KILL") s after the signal"
    check "m: a PodRestore of the restart in place, Restored" retry 30 restored_in_place "$NS" "$P1"
    check "m: ... from the MemoryPressure checkpoint ($REF = $(oom_restores "$NS" "$P1"))" test "$(oom_restores "$NS" "$P1")" = "$REF"
    check_resumed_after_oom m "$NS" "$P1" "$C_CKPT" "the MemoryPressure checkpoint"
  else
    diagnose "$NS"
  fi
else
  fail "m: the counter pod counts"; diagnose "$NS"
fi
kubectl delete namespace "$NS" --wait=false >/dev/null
fi

# ------------------------------------------------------------------ i. interval: auto
if want i; then
echo "# --- i. interval: auto shortens when the node pool's pods are interrupted often"
NS=e2e-auto
new_ns "$NS"
policy "$NS" auto auto auto ""
check "i: the policy with interval: auto is accepted and Ready" retry 60 bash -c \
  "[ \"\$(kubectl -n $NS get ckptpolicy auto -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}')\" = True ]"
counter "$NS" auto 1 64
T_I=$(date +%s.%N)
P=$(wait_one_counting "$NS" auto 120) || { fail "i: the counter counts"; diagnose "$NS"; finish; }
follow "$NS" "$P"
# the cost: one checkpoint asked for by hand (the first heartbeat is minutes away)
kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodCheckpoint
metadata: {name: auto-cost}
spec: {sourcePodName: $P, reason: Manual}
EOF
check "i: a checkpoint of $P measures its cost" retry 60 bash -c "[ \"\$(kubectl -n $NS get pckpt auto-cost -o jsonpath='{.status.phase}')\" = Succeeded ]"
entry() { kubectl -n "$NS" get ckptpolicy auto -o json | jq -c --arg p "$1" '.status.autoIntervals // [] | .[] | select(.pod == $p)'; }
# (sets E1: read once, used below; the status is rewritten every 15 s)
measured() { E1=$(entry "$1"); [ -n "$E1" ] && jq -e '.costMeasured' <<<"$E1" >/dev/null; }
check "i: the policy's status shows $P's interval, chosen from its measured cost" retry 60 measured "$P"
echo "# before: $E1"
I1=$(jq -r .intervalMillis <<<"$E1"); N1=$(jq -r .interruptions <<<"$E1")
for k in 1 2 3 4; do
  OLD=$P
  kubectl -n "$NS" delete pod "$OLD" --wait=false >/dev/null
  P=$(wait_replacement "$NS" auto "$OLD" 90) || { fail "i: a replacement after deletion $k"; diagnose "$NS"; break; }
  echo "# deletion $k: $OLD -> $P ($(secs "$T_I") s into the scenario)"
done
# the status's entry of the current pod, once it counts the deletions
shorter() { E2=$(entry "$P"); [ -n "$E2" ] && [ "$(jq -r .interruptions <<<"$E2")" -ge $((N1 + 4)) ]; }
check "i: the status counts four more interruptions of the node pool for $P" retry 90 shorter
E2=$(entry "$P"); echo "# after: $E2"
I2=$(jq -r '.intervalMillis // empty' <<<"$E2")
check "i: the interval shortened: $I1 ms -> ${I2:-?} ms" test -n "$I2" -a "${I2:-0}" -lt "$I1"
check "i: ... by Young/Daly's sqrt(M) rule: ratio within 20 % of sqrt(MTBF before / MTBF after)" python3 -c "
import json,math,sys
a,b=json.loads('''$E1'''),json.loads('''$E2''')
# only the MTBF moved unless the cost did: compare optimum ratios with sqrt(M ratio * cost ratio)
exp=math.sqrt(a['mtbfSeconds']*a['costMillis']/(b['mtbfSeconds']*b['costMillis']))
got=a['optimumMillis']/b['optimumMillis']
sys.exit(0 if abs(got/exp-1)<0.2 else 1)"
echo "# scenario i: $(secs "$T_I") s"
kubectl delete namespace "$NS" --wait=false >/dev/null
fi

finish
