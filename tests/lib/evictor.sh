# shellcheck shell=bash
# shellcheck disable=SC2016,SC2034 # jq programs in single quotes on purpose; EVICTOR_* are for the caller
# A STAND-IN for the one part of the EvictionRequest API (KEP-4563, lifecycle.k8s.io/v1alpha1)
# that Kubernetes v1.37.2 does not ship: the evictionrequest controller. The API server serves
# EvictionRequest and Eviction (feature gate EvictionRequestAPI) and validates every status
# update, but nothing turns an EvictionRequest into an Eviction, makes a responder Active or runs
# the imperative evictor. This file does exactly that, by the rules of
# staging/src/k8s.io/api/lifecycle/v1alpha1/types.go and pkg/apis/lifecycle/validation (v1.37.2):
#
#   - as a requester: an EvictionRequest {target.pod: name+uid, requester, intent: Eviction};
#   - as the controller: an Eviction for the pod, labelled with each participant's name
#     (responder / requester), status.targetResponders from the pod's spec.evictionResponders
#     plus imperative-eviction.k8s.io/evictor at priority 100, sorted by priority (then domain);
#     the first Active with its startTime; when the Active responder reports completionTime it
#     becomes Completed and the next one Active (Interrupted after 20 minutes without a report);
#   - as the imperative evictor (the last responder): POST pods/<name>/eviction (retried with a
#     backoff while a disruption budget refuses it), its completionTime, then the TargetEvicted
#     condition once the pod is gone; the EvictionRequest and Eviction are deleted at the end (the
#     controller's garbage collection).
#
# Everything it writes goes through the real API server, which refuses what the API's rules do
# not allow. Needs kubectl and jq.
#
#   evictor_run NS POD TIMEOUT  -> 0 once the pod is evicted; sets EVICTOR_RESPONDED (the message
#                                  of the responder before the evictor), EVICTOR_RESPONDED_S
#                                  (seconds from the request to its completion), EVICTOR_ENTRY
#                                  (its status.responders[] entry then, JSON) and
#                                  EVICTOR_HEARTBEATS (its heartbeats seen before the completion)

EVICTOR_REQUESTER=${EVICTOR_REQUESTER:-e2e.stasis.dev/evictor}
EVICTOR_IMPERATIVE=imperative-eviction.k8s.io/evictor

# (the first line of a run says what the stand-in is for; the others, that they are its)
evictor_say() {
  if [ -z "${EVICTOR_SAID:-}" ]; then
    EVICTOR_SAID=1
    echo "# evictor: a STAND-IN for the evictionrequest controller that Kubernetes $(kubectl version -o json 2>/dev/null | jq -r '.serverVersion.gitVersion // "?"') does not ship (tests/lib/evictor.sh)"
  fi
  echo "# evictor (stand-in): $*"
}
evictor_now() { date -u +%Y-%m-%dT%H:%M:%SZ; }

# evictor_status NS NAME JQ-PROGRAM [MSG]: a merge patch of the Eviction's status computed from it
# (with its resourceVersion: a concurrent report makes it fail, and the caller looks again)
evictor_status() {
  local ns=$1 name=$2 prog=$3 cur patch
  cur=$(kubectl -n "$ns" get evictions.lifecycle.k8s.io "$name" -o json) || return 1
  patch=$(jq -c --arg now "$(evictor_now)" --arg imp "$EVICTOR_IMPERATIVE" --arg msg "${4:-}" \
    "{metadata: {resourceVersion: .metadata.resourceVersion}, status: ($prog)}" <<<"$cur") || return 1
  kubectl -n "$ns" patch evictions.lifecycle.k8s.io "$name" --subresource=status --type=merge -p "$patch" >/dev/null
}

# jq: the status with the Active responder made STATE and the next one in order made Active
EVICTOR_NEXT='(.status.targetResponders | map(.state) | index("Active")) as $i
  | .status.targetResponders[$i].name as $done
  | (.status.targetResponders[$i + 1].name // "") as $next
  | .status
  | .targetResponders[$i].state = $state
  | (if $next != "" then .targetResponders[$i + 1].state = "Active" else . end)
  | .responders |= map(if .name == $next then .startTime = $now else . end)'

evictor_run() {
  local ns=$1 pod=$2 timeout=$3 uid pod_json name t0 end ev active st hb beat last_beat="" rc out
  EVICTOR_RESPONDED="" EVICTOR_RESPONDED_S="" EVICTOR_HEARTBEATS=0 EVICTOR_ENTRY="" EVICTOR_SAID=""
  pod_json=$(kubectl -n "$ns" get pod "$pod" -o json) || return 1
  uid=$(jq -r .metadata.uid <<<"$pod_json")
  name=$pod-$(cut -c1-8 <<<"$uid")
  t0=$(date +%s.%N) end=$(( $(date +%s) + timeout ))
  kubectl -n "$ns" apply -f - >/dev/null <<EOF || return 1
apiVersion: lifecycle.k8s.io/v1alpha1
kind: EvictionRequest
metadata: {name: $name, namespace: $ns}
spec:
  target: {pod: {name: $pod, uid: $uid}}
  requester: $EVICTOR_REQUESTER
  intent: Eviction
EOF
  evictor_say "EvictionRequest $ns/$name by $EVICTOR_REQUESTER for pod $pod ($uid)"
  # the Eviction, its labels, and its first status: responders from the pod, the first Active
  jq -c --arg ns "$ns" --arg name "$name" --arg req "$EVICTOR_REQUESTER" --arg imp "$EVICTOR_IMPERATIVE" '
    ([(.spec.evictionResponders // [])[], {name: $imp, priority: 100}]
      | sort_by([-.priority, (.name | split("/")[0] | split(".") | reverse), (.name | split("/")[1] // "")])) as $r
    | {apiVersion: "lifecycle.k8s.io/v1alpha1", kind: "Eviction",
       metadata: {name: $name, namespace: $ns,
                  labels: ([$r[] | {key: .name, value: "responder"}] + [{key: $req, value: "requester"}] | from_entries)},
       spec: {target: {pod: {name: .metadata.name, uid: .metadata.uid}}}}' <<<"$pod_json" |
    kubectl create -f - >/dev/null || return 1
  until jq -c --arg imp "$EVICTOR_IMPERATIVE" --arg req "$EVICTOR_REQUESTER" --arg now "$(evictor_now)" '
      ([(.spec.evictionResponders // [])[], {name: $imp, priority: 100}]
        | sort_by([-.priority, (.name | split("/")[0] | split(".") | reverse), (.name | split("/")[1] // "")])) as $r
      | {status: {requesters: [{name: $req, intent: "Eviction"}],
                  targetResponders: [$r | to_entries[] | {name: .value.name, priority: .value.priority, state: (if .key == 0 then "Active" else "Inactive" end)}],
                  responders: [$r | to_entries[] | {name: .value.name} + (if .key == 0 then {startTime: $now} else {} end)]}}' <<<"$pod_json" |
      kubectl -n "$ns" patch evictions.lifecycle.k8s.io "$name" --subresource=status --type=merge --patch-file /dev/stdin >/dev/null; do
    [ "$(date +%s)" -lt "$end" ] || { evictor_say "cannot initialise the Eviction's status"; return 1; }
    sleep 0.5
  done
  evictor_say "Eviction $ns/$name: $(kubectl -n "$ns" get evictions.lifecycle.k8s.io "$name" -o json | jq -r '[.status.targetResponders[] | "\(.name) (\(.priority)) \(.state)"] | join(", ")')"
  while [ "$(date +%s)" -lt "$end" ]; do
    ev=$(kubectl -n "$ns" get evictions.lifecycle.k8s.io "$name" -o json 2>/dev/null) || { sleep 0.5; continue; }
    active=$(jq -r '.status.targetResponders[] | select(.state == "Active") | .name' <<<"$ev")
    [ -n "$active" ] || break
    st=$(jq -c --arg a "$active" '.status.responders[] | select(.name == $a)' <<<"$ev")
    if [ "$active" = "$EVICTOR_IMPERATIVE" ]; then
      out=$(kubectl create --raw "/api/v1/namespaces/$ns/pods/$pod/eviction" -f - 2>&1 <<<"{\"apiVersion\":\"policy/v1\",\"kind\":\"Eviction\",\"metadata\":{\"name\":\"$pod\",\"namespace\":\"$ns\"}}"); rc=$?
      if [ $rc = 0 ]; then
        evictor_say "$EVICTOR_IMPERATIVE: POST pods/$pod/eviction accepted"
        evictor_status "$ns" "$name" '.status | .responders |= map(if .name == $imp then .heartbeatTime = $now | .completionTime = $now | .message = "evicted through the pods/eviction subresource" else . end)' &&
          until evictor_status "$ns" "$name" '"Completed" as $state | '"$EVICTOR_NEXT" 2>/dev/null; do sleep 0.3; done
        break
      fi
      evictor_say "$EVICTOR_IMPERATIVE: eviction refused, retrying in 5 s: $out"
      evictor_status "$ns" "$name" '.status | .responders |= map(if .name == $imp then .heartbeatTime = $now | .message = ($msg | .[:4000]) else . end)' "$out" 2>/dev/null
      sleep 5; continue
    fi
    hb=$(jq -r '.heartbeatTime // .startTime // empty' <<<"$st")
    if [ -n "$hb" ] && [ "$hb" != "$last_beat" ] && jq -e '.heartbeatTime and (.completionTime | not)' <<<"$st" >/dev/null; then
      EVICTOR_HEARTBEATS=$((EVICTOR_HEARTBEATS + 1)); last_beat=$hb
      evictor_say "$active: heartbeat $hb$(jq -r 'if .expectedCompletionTime then ", expected completion \(.expectedCompletionTime)" else "" end' <<<"$st"): $(jq -r '.message // ""' <<<"$st")"
    fi
    if jq -e '.completionTime' <<<"$st" >/dev/null; then
      if [ -z "$EVICTOR_RESPONDED" ]; then
        EVICTOR_RESPONDED=$(jq -r '.message // ""' <<<"$st") EVICTOR_ENTRY=$st
        EVICTOR_RESPONDED_S=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
        evictor_say "$active: completed after $EVICTOR_RESPONDED_S s: $EVICTOR_RESPONDED"
      fi
      evictor_status "$ns" "$name" '"Completed" as $state | '"$EVICTOR_NEXT" 2>/dev/null || { sleep 0.2; continue; }
      continue
    fi
    beat=$(date -d "$hb" +%s 2>/dev/null || date +%s)
    if [ $(( $(date +%s) - beat )) -ge 1200 ]; then
      evictor_say "$active: no report for 20 minutes: Interrupted"
      evictor_status "$ns" "$name" '"Interrupted" as $state | '"$EVICTOR_NEXT" 2>/dev/null
      continue
    fi
    sleep 0.5
  done
  local gone=1
  while [ "$(date +%s)" -lt "$end" ]; do
    [ "$(kubectl -n "$ns" get pod "$pod" -o jsonpath='{.metadata.uid}' 2>/dev/null)" = "$uid" ] || { gone=0; break; }
    sleep 0.5
  done
  if [ $gone = 0 ]; then
    evictor_status "$ns" "$name" '.status | .conditions = [{type: "TargetEvicted", status: "True", reason: "PodDeleted", message: "the pod was deleted", lastTransitionTime: $now}]' 2>/dev/null ||
      evictor_say "cannot set the Eviction's TargetEvicted condition"
    evictor_say "pod $pod ($uid) evicted $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after the request"
  else
    evictor_say "pod $pod ($uid) not evicted within $timeout s: $(kubectl -n "$ns" get evictions.lifecycle.k8s.io "$name" -o json 2>/dev/null | jq -c .status)"
  fi
  kubectl -n "$ns" delete evictionrequests.lifecycle.k8s.io "$name" --wait=false >/dev/null 2>&1
  kubectl -n "$ns" delete evictions.lifecycle.k8s.io "$name" --wait=false >/dev/null 2>&1
  return $gone
}
