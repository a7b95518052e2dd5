#!/usr/bin/env bash
# End to end on the local cluster: a spot reclaim announced by the cloud.
#
# The agents are pointed at tests/cloud/metadata-standin.py, a STAND-IN for AWS's instance
# metadata service (IMDSv2; no cloud is reachable here), one machine per node
# (http://<host>:<port>/$(NODE_NAME)). A counter with a one-hour heartbeat (so the notice's is
# the only checkpoint) runs on a node; the stand-in announces the node's spot interruption two
# minutes ahead; then the node is killed, as the cloud would.
#   - a PodCheckpoint with reason SpotNotice Succeeds for the pod, a CloudNotice Event says why;
#   - the node is labelled stasis.dev/notice=Reclaim and loses stasis.dev/ready (opted-in pods
#     are then scheduled elsewhere);
#   - the replacement, on the other node, is restored from that checkpoint (PodRestore
#     Restored), counts on from it, never state=CORRUPT;
#   - pre-staging: the other node's agent, a likely receiver of the noticed node's pods, fetched
#     that checkpoint into its chunk cache before the reclaim (its log line), and the
#     replacement's restore read every chunk from that cache (the agent's chunk cache metrics);
#     the replacement prefers that node (the webhook's preferred node affinity).
#
# Needs root. Prints "N passed, M failed"; STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up;
# STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
WORK=$(mktemp -d /tmp/stasis-e2e-notice.XXXXXX)
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin notice

# ------------------------------------------------------------------ the stand-in, up, install
if ! "$CLUSTER" up >/dev/null; then fail "scripts/cluster up"; finish; fi
eval "$("$CLUSTER" env)"
python3 "$REPO/tests/cloud/metadata-standin.py" --host "$STASIS_CLUSTER_HOST_IP" >"$WORK/standin.out" 2>"$WORK/standin.err" &
on_exit "kill $! 2>/dev/null"
retry 10 grep -q '^listening' "$WORK/standin.out" || { fail "the metadata stand-in starts" "$(cat "$WORK/standin.err")"; finish; }
MD="http://$STASIS_CLUSTER_HOST_IP:$(awk '/^listening/ {print $2}' "$WORK/standin.out")"
echo "# STAND-IN cloud metadata service (AWS IMDSv2) at $MD/<node> (no cloud is reachable here)"
# $(NODE_NAME) is expanded by the kubelet from the agent's environment: one machine per node.
# Pre-staging needs the namespace's data key on the receiving node, which the key broker gives
# only to nodes running a pod of that namespace: the broker is off here (docs/design.md §12.10c).
export STASIS_HELM_ARGS="--set-json agent.extraArgs=[\"--cloud-provider=aws\",\"--cloud-metadata-url=$MD/\$(NODE_NAME)\"] --set keys.broker.enabled=false"
up_and_install
check "each agent watches its node's notices" retry 60 bash -c \
  "[ \"\$(kubectl -n stasis-system logs -l app.kubernetes.io/component=agent --tail=-1 | grep -c 'watching the cloud')\" -ge 2 ]"

NS=e2e-notice
new_ns "$NS"
# holdUntilEvicted: from the notice's capture the pod stays frozen until the instance stops, so
# its replacement does nothing again
policy "$NS" hourly spot 1h $'retention: {keepLast: 3}\n  holdUntilEvicted: true'
counter "$NS" spot 1 64
P1=$(wait_one_counting "$NS" spot 120) || { fail "the counter counts"; diagnose "$NS"; finish; }
N1=$(node_of "$NS" "$P1")
follow "$NS" "$P1"
wait_for 10 "the log of $P1 followed" followed "$P1"
# A pod is checkpointed once the controller has registered it as its lineage's holder (its
# first second or so; longer while a controller replica that has just started takes the lead):
# the notice waits for that, as a real one would find it long done.
registered() {
  local uid; uid=$(kubectl -n "$NS" get pod "$P1" -o jsonpath='{.metadata.uid}')
  kubectl -n stasis-system get cm -l stasis.dev/lineage-record=true -o json |
    jq -e --arg u "$uid" '[.items[].data["holder.json"] // "{}" | fromjson | .uid] | index($u) != null' >/dev/null
}
check "the controller registered $P1 as its lineage's holder" retry 90 registered
echo "# $P1 counts on $N1; the stand-in announces its spot interruption in 120 s"
curl -fsS "$MD/$N1/_standin/arm?kind=aws-spot&seconds=120" >/dev/null
T_NOTICE=$(date +%s.%N)

notice_ckpt() { kubectl -n "$NS" get pckpt -o json | jq -r --arg p "$P1" '.items[] | select(.spec.sourcePodName == $p and .spec.reason == "SpotNotice") | "\(.metadata.name) \(.status.phase // "-")"'; }
check "a SpotNotice checkpoint of $P1 is created" retry 30 bash -c "[ -n \"\$(kubectl -n $NS get pckpt -o json | jq -r '.items[] | select(.spec.reason == \"SpotNotice\") | .metadata.name')\" ]"
check "... and Succeeds" retry 90 bash -c "kubectl -n $NS get pckpt -o json | jq -e '[.items[] | select(.spec.reason == \"SpotNotice\" and .status.phase == \"Succeeded\")] | length == 1' >/dev/null"
echo "# notice checkpoint: $(notice_ckpt) $(secs "$T_NOTICE") s after the notice"
CK=$(notice_ckpt | awk '{print $1}')
C_HELD=$(last_count "$P1"); sleep 2
check "$P1 is held frozen after the notice's checkpoint (holdUntilEvicted: count $C_HELD, 2 s later $(last_count "$P1"))" \
  test "$(last_count "$P1")" = "$C_HELD"
T_CK=$(kubectl -n "$NS" get pckpt "$CK" -o jsonpath='{.status.startTime}')
REF=$(kubectl -n "$NS" get pckpt "$CK" -o jsonpath='{.status.checkpointRef}')
C_CKPT=$(count_before "$P1" "$T_CK")
check "$N1 is labelled stasis.dev/notice=Reclaim and is no longer stasis.dev/ready" bash -c \
  "kubectl get node $N1 -o json | jq -e '.metadata.labels[\"stasis.dev/notice\"] == \"Reclaim\" and (.metadata.labels[\"stasis.dev/ready\"] == null)' >/dev/null"
check "a CloudNotice Event on $P1 says why: $(event "$NS" "$P1" CloudNotice | head -1 | cut -c1-120)" bash -c "[ -n \"\$(kubectl -n $NS get events --field-selector involvedObject.name=$P1,reason=CloudNotice -o name)\" ]"

N2=$(other_node "$N1")
agent_on() { kubectl -n stasis-system get pods -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$1" -o jsonpath='{.items[0].metadata.name}'; }
A2=$(agent_on "$N2")
prestaged() { kubectl -n stasis-system logs "$A2" --tail=-1 | grep 'checkpoint pre-staged' | grep -F "$REF"; }
check "$N2's agent pre-staged $REF before the reclaim" retry 30 prestaged
echo "# pre-staged on $N2: $(prestaged | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'chunks=.*' | head -1)"
cache_metric() { kubectl get --raw "/api/v1/namespaces/stasis-system/pods/$A2:9464/proxy/metrics" | awk -v n="stasis_agent_chunk_cache_$1_total" '$1 == n {print $2}'; }
MISSES=$(cache_metric misses)
from_cache() { ge "$(cache_metric hits)" 1 && [ "$(cache_metric misses)" = "$MISSES" ]; }
echo "# the cloud reclaims $N1"
on_exit "kubectl label node $N1 stasis.dev/notice-"
check "kill-node $N1" kill_node "$N1"
C_DEAD=$(last_count "$P1")
P2=$(wait_replacement "$NS" spot "$P1" 180) || { fail "a replacement counts after the reclaim"; diagnose "$NS"; }
if [ -n "$P2" ]; then
  echo "# replacement $P2 on $(node_of "$NS" "$P2"), counting $(secs "$T_NOTICE") s after the notice"
  C_FIRST=$(first_count "$NS" "$P2")
  check "$P2 is restored (PodRestore Restored)" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore --field-selector spec.targetPodName=$P2 -o jsonpath='{.items[*].status.phase}')\" = Restored ]"
  check "... from the notice's checkpoint ${REF:-(none)} ($(restore_ref "$NS" "$P2"))" test -n "$REF" -a "$(restore_ref "$NS" "$P2")" = "$REF"
  echo "# count at the notice's checkpoint >= $C_CKPT, last count of the reclaimed pod: $C_DEAD, first count of $P2: $C_FIRST"
  check "first count ($C_FIRST) > the count at the notice's checkpoint ($C_CKPT), and not a cold start's 1" resumed "$C_FIRST" "$C_CKPT"
  check "... and <= the last count before the reclaim + 1 ($C_DEAD)" ge "$((C_DEAD + 1))" "$C_FIRST"
  check "held until the reclaim: counts lost ($((C_DEAD - C_FIRST + 1))) <= 3" ge 3 "$((C_DEAD - C_FIRST + 1))"
  check "never state=CORRUPT" not_corrupt "$NS" "$P2"
  # the webhook steers the replacement to the nodes that pre-staged its checkpoint, by the
  # agents' own rule: a preferred node affinity (weight 100) naming them
  prefers() {
    kubectl -n "$NS" get pod "$P2" -o json | jq -e --arg n "$N2" '[.spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[]?
      | select(.weight == 100) | .preference.matchFields[]? | select(.key == "metadata.name") | .values[]] | index($n) != null' >/dev/null
  }
  check "$P2 prefers $N2, which pre-staged its checkpoint ($(kubectl -n "$NS" get pod "$P2" -o json | jq -c '.spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution')" prefers
  if [ "$(node_of "$NS" "$P2")" = "$N2" ]; then
    # (the agent's cache counters reach /metrics within 5 s)
    check "$P2's restore read its chunks from $N2's cache (misses before: ${MISSES:-?})" retry 10 from_cache
    echo "# $N2's chunk cache: hits $(cache_metric hits), misses $(cache_metric misses)"
  fi
fi
check "$N1 boots again" "$CLUSTER" start-node "$N1"
kubectl label node "$N1" stasis.dev/notice- >/dev/null 2>&1
kubectl delete namespace "$NS" --wait=false >/dev/null
finish
