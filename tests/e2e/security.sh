#!/usr/bin/env bash
# The security review's attacks, run as written against stasis on the local cluster with the Helm
# chart installed. The attacker is user `dev` (the `edit` role, no `stasis-restorer`) in the
# victim's namespace and in a namespace of their own, or a pod on the cluster network without
# credentials. The victim is the Deployment `web` (stasis-counter) whose pod was restored once.
#
#   M4  the controller's status endpoint, asked from another namespace, reveals no ids
#   H1  a pod carrying a restored pod's claim token and `decision: Restore` (a. with the
#       `stasis.dev/system` label that skips the webhook, b. without it, c. added afterwards with
#       `kubectl label/annotate`) gets no PodRestore
#   M1  a ReplicaSet `web-zz9` mimicking the Deployment does not get its orphaned lineage
#   H2  forged AdmissionReviews posted to the webhook Service from a pod: no lineage records
#       created, no ids answered, the orphaned lineage not claimed; and again with the chart
#       upgraded without webhook.clientCA (the webhook answers anyone): for web's real ReplicaSet,
#       still no record created or changed, and web's replacement still restores
#   H3  a bare pod with the victim's lineage/generation annotations and a PodCheckpoint of it
#       (a. same namespace: the victim's replacement does not restore it; b. another namespace:
#       the victim's lineage and checkpoints are not deleted)
#   H4  an admin's PodRestore made for a pod not created yet (no target UID); dev, who may create
#       pods but not PodRestores, creates a pod of that name: it is not marked, not prepared
#   M2  a restore target that differs by an exec probe starts cold, with the reason
#   and last: the legitimate workload still resumes from its checkpoint (a Restored Event).
#
# Each attack checks: the victim's pod, lineage record and checkpoints are untouched; no
# PodRestore for the attacker; the refusal is visible (an admission denial, an error naming the
# cause, an Event or the decision's reason).
#
# Needs root. Prints "ok - ..." / "not ok - ..." per check and "N passed, M failed"; exits
# non-zero when a check failed. STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up (and stasis
# installed); STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck disable=SC2034 # (lib.sh uses it)
CLUSTER=$REPO/scripts/cluster
WORK=$(mktemp -d /tmp/stasis-e2e-security.XXXXXX)
NS=e2e-sec           # the victim's namespace (dev has edit here)
NSA=e2e-sec-dev      # dev's own namespace
SYS=stasis-system
STATUS_URL=http://stasis-controller.$SYS.svc:9464
WEBHOOK_URL=https://stasis-controller.$SYS.svc/mutate
H3DENIED=""

# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin security

# ------------------------------------------------------------------ helpers of this test
dev() { kubectl --as=dev --as-group=system:authenticated "$@"; }
# the lineage record of lineage $1 as one JSON object (generation, holder token and pod UID,
# orphaned, checkpoint ids, bad ids, failures), "{}" when there is none
record() {
  kubectl -n "$SYS" get cm -l stasis.dev/lineage-record=true -o json | jq -c --arg l "$1" '
    [.items[] | select(.metadata.annotations["stasis.dev/lineage"] == $l)] | first // {} |
    (.data["lineage.json"] // "{}" | fromjson) as $r | (.data["holder.json"] // "{}" | fromjson) as $h |
    if . == {} then {} else
    {generation: $r.generation, holder: $r.holder, orphaned: $r.orphaned, holder_uid: $h.uid,
     checkpoints: ([$r.checkpoints[]?.id] | sort), bad: ($r.bad // []), failures: ($r.failures // [] | length)} end'
}
n_records() { kubectl -n "$SYS" get cm -l stasis.dev/lineage-record=true -o name | wc -l; }
# the Succeeded PodCheckpoints of the victim's namespace: "<name> <checkpointRef>", sorted
victim_ckpts() {
  kubectl -n "$NS" get pckpt -o json | jq -r '.items[] | select(.status.phase == "Succeeded") | "\(.metadata.name) \(.status.checkpointRef)"' | sort
}
# snapshot TAG POD LINEAGE: what an attack must leave as it is
snapshot() {
  { echo "pod $3 $(kubectl -n "$NS" get pod "$2" -o jsonpath='{.metadata.uid} {.status.phase} {.status.containerStatuses[0].restartCount}' 2>&1)"
    [ -n "$2" ] || echo "pod (none)"
    echo "record $(record "$3")"
  } >"$WORK/snap-$1"
  victim_ckpts >"$WORK/ckpts-$1"
}
# untouched TAG POD LINEAGE: the check that the victim's pod (when given), lineage record and
# checkpoints are as the snapshot had them (what changed is printed)
untouched() {
  local tag=$1 before after gone
  before=$WORK/snap-$tag after=$WORK/snap-$tag.after
  { echo "pod $3 $(kubectl -n "$NS" get pod "$2" -o jsonpath='{.metadata.uid} {.status.phase} {.status.containerStatuses[0].restartCount}' 2>&1)"
    [ -n "$2" ] || echo "pod (none)"
    echo "record $(record "$3")"
  } >"$after"
  gone=$(victim_ckpts | comm -23 "$WORK/ckpts-$tag" -)
  if cmp -s "$before" "$after" && [ -z "$gone" ] && [ "$(record "$3")" != "{}" ]; then
    pass "$tag: the victim's pod, lineage record and checkpoints are untouched"
  else
    fail "$tag: the victim's pod, lineage record and checkpoints are untouched"
    diff "$before" "$after" | sed 's/^/#   /'
    [ -z "$gone" ] || echo "$gone" | sed 's/^/#   PodCheckpoint gone: /'
  fi
}
no_restore_for() { # TAG NS POD
  local r; r=$(kubectl -n "$2" get prestore -o json | jq -r --arg p "$3" '.items[] | select(.metadata.name == $p or .spec.targetPodName == $p) | "\(.metadata.name) -> \(.spec.checkpointRef) (\(.status.phase // "no phase"))"')
  if [ -z "$r" ]; then pass "$1: no PodRestore for the attacker's pod $3"; else fail "$1: no PodRestore for the attacker's pod $3" "$r"; fi
}
# the messages of every Event about a pod, one a line ("<reason>: <message>")
pod_events() {
  kubectl -n "$1" get events --field-selector "involvedObject.name=$2" -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null
}
# visible TAG NS POD [CREATE-OUTPUT]: the refusal is visible: the create was denied with a
# message, or the pod's decision is ColdStart with a reason, or a stasis Event on it says why
visible() {
  local tag=$1 ns=$2 pod=$3 out=${4:-} d why ev
  if [ -n "$out" ]; then pass "$tag: refused visibly: $(cut -c1-160 <<<"$out")"; return; fi
  d=$(kubectl -n "$ns" get pod "$pod" -o jsonpath='{.metadata.annotations.stasis\.dev/decision}' 2>/dev/null)
  why=$(kubectl -n "$ns" get pod "$pod" -o jsonpath='{.metadata.annotations.stasis\.dev/decision-reason}' 2>/dev/null)
  ev=$(pod_events "$ns" "$pod" | grep -Ev '^(Scheduled|Pulled|Created|Started|Killing|SandboxChanged|BackOff|Unhealthy):' | sort -u | tr '\n' ';')
  if grep -Eq '(^|;)(RestoreDecided|Restored):' <<<"$ev"; then
    fail "$tag: refused visibly (an admission denial, a ColdStart decision with its reason, or an Event)" "a restore was decided: $(cut -c1-200 <<<"$ev")"
  elif [ "$d" = ColdStart ] && [ -n "$why" ]; then pass "$tag: refused visibly: decision ColdStart, $(cut -c1-140 <<<"$why")"
  elif [ -n "$ev" ]; then pass "$tag: refused visibly: Event $(cut -c1-160 <<<"$ev")"
  else fail "$tag: refused visibly (an admission denial, a ColdStart decision with its reason, or an Event)" "decision '${d:-none}', Events: none"
  fi
}
# a pod spec like the victim's, as an attacker would write it (no node, no injected parts)
attacker_spec() {
  kubectl -n "$NS" get pod "$1" -o json | jq '.spec | del(.nodeName, .priority, .initContainers, .affinity, .volumes, .schedulerName, .enableServiceLinks, .preemptionPolicy) | .containers |= map(del(.volumeMounts))'
}
# attacker_pod NAME LABELS-JSON ANNOTATIONS-JSON SPEC-JSON -> the pod as JSON
attacker_pod() {
  jq -n --arg n "$1" --argjson l "$2" --argjson a "$3" --argjson s "$4" \
    '{apiVersion: "v1", kind: "Pod", metadata: {name: $n, labels: $l, annotations: $a}, spec: $s}'
}
restored_from() { kubectl -n "$NS" get prestore "$1" -o jsonpath='{.spec.checkpointRef} {.status.phase} {.status.message}' 2>/dev/null; }
# wait until the pod's decision has been handled by the controller (reported) or N seconds pass
settle() { retry "$3" bash -c "[ -n \"\$(kubectl -n $1 get pod $2 -o jsonpath='{.metadata.annotations.stasis\\.dev/decision-reported}')\" ]" || true; sleep 3; }
ask() { # ask TOKEN? [UID]: the attacker pod GETs the victim's restore status (with UID: the
  # path the wait container asks, /v1/restores/<ns>/<pod>/<uid>); prints "status N" and the body
  local b=(); [ "$1" = token ] && b=(--bearer /var/run/stasis/token)
  kubectl -n "$NSA" exec client -- /testapp request "${b[@]}" GET "$STATUS_URL/v1/restores/$NS/$V${2:+/$2}" 2>&1
}

# (for the checks that run them under bash -c)
export NS NSA SYS
export -f ann record restored_from

# ------------------------------------------------------------------ up, install
up_and_install
T_SCEN=$(date +%s)

# ------------------------------------------------------------------ the victim, the attacker
echo "# --- the victim: Deployment web, restored once from its final checkpoint"
new_ns "$NS"; new_ns "$NSA"
# no heartbeats during the test (interval 1h): the victim's checkpoints change only when the test
# deletes its pod gracefully, so "untouched" can mean "equal"
policy "$NS" hourly web 1h
counter "$NS" web 1 64 Recreate
for n in "$NS" "$NSA"; do kubectl -n "$n" create rolebinding dev-edit --clusterrole=edit --user=dev >/dev/null; done
# the pod on the cluster network: dev's, in dev's namespace, with a projected token for audience
# "stasis" (what a status endpoint that authenticates callers would take)
kubectl -n "$NSA" apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: client
    image: stasis.local/testapp:dev
    imagePullPolicy: Never
    command: [/testapp, sleep]
    volumeMounts: [{name: token, mountPath: /var/run/stasis}]
  volumes:
  - name: token
    projected: {sources: [{serviceAccountToken: {audience: stasis, path: token, expirationSeconds: 3600}}]}
EOF
retry 30 bash -c "[ \"\$(kubectl -n $NS auth can-i create pods --as=dev)\" = yes ] && [ \"\$(kubectl -n $NSA auth can-i create pods --as=dev)\" = yes ]"
check "dev (edit) may not create PodRestores" bash -c "[ \"\$(kubectl -n $NS auth can-i create podrestores --as=dev)\" = no ]"
V=""
if first_pod P1 setup "$NS" web; then
  kubectl -n "$NS" delete pod "$P1" --grace-period=30 --wait=false >/dev/null
  V=$(wait_replacement "$NS" web "$P1" 120) || { fail "setup: the replacement of $P1 counts"; diagnose "$NS"; }
fi
[ -n "$V" ] || finish
check "setup: $V restored from the final checkpoint of $P1" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore $V -o jsonpath='{.status.phase}')\" = Restored ]"
L=$(ann "$NS" "$V" lineage); G=$(ann "$NS" "$V" generation)
T=$(kubectl -n "$NS" get pod "$V" -o jsonpath='{.metadata.labels.stasis\.dev/claim-token}')
REF=$(kubectl -n "$NS" get prestore "$V" -o jsonpath='{.spec.checkpointRef}')
CKPT_ID=${REF##*/}
echo "# victim $V: lineage $L generation $G, claim token $T, restored from $REF"
echo "#   record: $(record "$L")"
check "setup: the victim's lineage record holds $V" bash -c "[ \"\$(record '$L' | jq -r .holder_uid)\" = \"\$(kubectl -n $NS get pod $V -o jsonpath='{.metadata.uid}')\" ]"
check "setup: dev's client pod runs" retry 60 bash -c "[ \"\$(kubectl -n $NSA get pod client -o jsonpath='{.status.phase}')\" = Running ]"
SPEC=$(attacker_spec "$V")
# what the attacker copies of the victim's labels: the declared versions a restore must match
DECL=$(kubectl -n "$NS" get pod "$V" -o json | jq -c '.metadata.labels | with_entries(select(.key | startswith("declare.stasis.dev/")))')
with_decl() { jq -c --argjson d "$DECL" '. + $d' <<<"$1"; }
# ids an answer to an attacker must not contain
leaks() { grep -oE "$(printf '%s|' "$L" "$CKPT_ID" restore-from | sed 's/|$//')" <<<"$1" | sort -u | tr '\n' ' '; }

# ------------------------------------------------------------------ M4
echo "# --- M4: the status endpoint, asked from another namespace"
for how in no-credentials token; do
  out=$(ask "$how"); lk=$(leaks "$out")
  echo "# GET $STATUS_URL/v1/restores/$NS/$V ($how): $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
  if [ -z "$lk" ]; then pass "M4: asked from $NSA ($how), the status endpoint reveals no lineage or checkpoint id"
  else fail "M4: asked from $NSA ($how), the status endpoint reveals no lineage or checkpoint id" "it answered $lk"; fi
done
# with a guessed UID, and about a pod that does not exist: the same answer (no oracle)
# (testapp's "status N" line and the body may come in either order: each is compared on its own)
answer() { local a; a=$(tr '\n' ' ' | tr -s ' '); echo "$(grep -oE 'status [0-9]{3}' <<<"$a" | head -1) body $(sed -E 's/ ?status [0-9]{3} ?/ /g; s/^ +| +$//g' <<<"$a")"; }
GUESS=$(ask none "$(cat /proc/sys/kernel/random/uuid)" | answer)
NOPOD=$(V=no-such-pod ask none "$(cat /proc/sys/kernel/random/uuid)" | answer)
echo "# GET .../$NS/$V/<guessed UID>: $GUESS; .../$NS/no-such-pod/<UID>: $NOPOD"
if [ "$GUESS" = "$NOPOD" ] && grep -q '^status 404 ' <<<"$GUESS"; then
  pass "M4: a guessed UID gets the answer of a pod that does not exist (404)"
else fail "M4: a guessed UID gets the answer of a pod that does not exist (404)" "$GUESS / $NOPOD"; fi

# ------------------------------------------------------------------ H1
echo "# --- H1: the claim token and decision of a restored pod on dev's own pod"
h1() { # TAG NAME LABELS ANNOTATIONS
  local tag=$1 name=$2 out
  snapshot "$tag" "$V" "$L"
  out=$(attacker_pod "$name" "$(with_decl "$3")" "$4" "$SPEC" | dev -n "$NS" create -f - 2>&1) && out=""
  echo "# dev creates pod $name: ${out:-created}"
  [ -z "$out" ] && settle "$NS" "$name" 15
  no_restore_for "$tag" "$NS" "$name"
  untouched "$tag" "$V" "$L"
  visible "$tag" "$NS" "$name" "$out"
}
h1 H1a h1-system "{\"stasis.dev/system\": \"true\", \"stasis.dev/claim-token\": \"$T\"}" '{"stasis.dev/decision": "Restore"}'
h1 H1b h1-token "{\"stasis.dev/claim-token\": \"$T\"}" '{"stasis.dev/decision": "Restore"}'
# c: the H1b pod (the webhook made it ColdStart), its decision set back to Restore with kubectl;
# when admission refused that pod, a plain pod given the token and the decision afterwards
snapshot H1c "$V" "$L"
H1C=h1-token out=""
if ! kubectl -n "$NS" get pod h1-token >/dev/null 2>&1; then
  H1C=h1-annotate
  attacker_pod "$H1C" "$(with_decl '{}')" '{}' "$SPEC" | dev -n "$NS" create -f - >/dev/null 2>&1
  settle "$NS" "$H1C" 15
  out=$(dev -n "$NS" label pod "$H1C" "stasis.dev/claim-token=$T" 2>&1) && out=""
  echo "# dev labels $H1C with the claim token: ${out:-done}"
fi
o2=$(dev -n "$NS" annotate pod "$H1C" stasis.dev/decision=Restore --overwrite stasis.dev/decision-reported- 2>&1) && o2=""
echo "# dev annotates $H1C stasis.dev/decision=Restore: ${o2:-done}"
out=${out:-}${o2}
# (the controller handles the changed pod: it reports its decision again, or 12 s pass)
[ -z "$out" ] && settle "$NS" "$H1C" 12
no_restore_for H1c "$NS" "$H1C"
untouched H1c "$V" "$L"
visible H1c "$NS" "$H1C" "$out"
kubectl -n "$NS" delete pod h1-system h1-token h1-annotate --grace-period=1 --wait=false >/dev/null 2>&1

# ------------------------------------------------------------------ H4
echo "# --- H4: an admin's PodRestore for a pod not created yet (kubectl stasis restore POD --from ...); dev creates a pod of that name"
kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: PodRestore
metadata: {name: h4-target}
spec: {checkpointRef: "$REF", targetPodName: h4-target}
EOF
out=$(attacker_pod h4-target "$(with_decl '{}')" '{}' "$SPEC" | dev -n "$NS" create -f - 2>&1) && out=""
echo "# dev creates pod h4-target: ${out:-created}"
check "H4: dev may create the pod (pods are dev's to create)" test -z "$out"
settle "$NS" h4-target 15
# the agent's PodRestore controller has seen both the PodRestore and the pod by now
check "H4: dev's pod runs" retry 30 bash -c "[ \"\$(kubectl -n $NS get pod h4-target -o jsonpath='{.status.phase}')\" = Running ]"
check "H4: the webhook did not mark dev's pod as waiting for the PodRestore" bash -c \
  "[ -z \"\$(kubectl -n $NS get pod h4-target -o jsonpath='{.metadata.annotations.stasis\\.dev/restore-request}')\" ]"
check "H4: the PodRestore was not prepared for dev's pod (still Pending)" bash -c \
  "case \"\$(kubectl -n $NS get prestore h4-target -o jsonpath='{.status.phase}')\" in ''|Pending) true;; *) false;; esac"
echo "#   PodRestore h4-target: $(kubectl -n "$NS" get prestore h4-target -o jsonpath='{.status.phase} {.status.message}' 2>&1)"
kubectl -n "$NS" delete pod h4-target --grace-period=1 --wait=false >/dev/null 2>&1
kubectl -n "$NS" delete prestore h4-target --wait=false >/dev/null 2>&1

# ------------------------------------------------------------------ M1 and H2, while web's lineage is orphaned
echo "# --- M1 and H2: web scaled to 0 by dev (its lineage orphaned after a final checkpoint)"
N_CKPT_BEFORE=$(victim_ckpts | wc -l)
dev -n "$NS" scale deployment web --replicas=0 >/dev/null
retry 60 bash -c "! kubectl -n $NS get pod $V" || fail "M1: $V is gone after the scale to 0"
retry 30 bash -c "[ \$(kubectl -n $NS get pckpt -o json | jq '[.items[] | select(.status.phase == \"Succeeded\")] | length') -gt $N_CKPT_BEFORE ]" ||
  echo "# (no final checkpoint of $V)"
retry 20 bash -c "[ \"\$(record '$L' | jq -r .orphaned)\" = true ]" || echo "# (lineage $L not orphaned: $(record "$L"))"
echo "#   record: $(record "$L")"
CKPTS=$(record "$L" | jq -r '.checkpoints[]' | tr '\n' '|' | sed 's/|$//')
leaks() { grep -oE "${L}|${CKPTS:-^$}|restore-from" <<<"$1" | sort -u | tr '\n' ' '; }
snapshot M1 "" "$L"
TPL=$(kubectl -n "$NS" get deployment web -o json | jq '.spec.template.spec')
jq -n --argjson s "$TPL" '{apiVersion: "apps/v1", kind: "ReplicaSet",
  metadata: {name: "web-zz9", labels: {made: "by-dev"}},
  spec: {replicas: 1, selector: {matchLabels: {app: "web", "pod-template-hash": "zz9"}},
    template: {metadata: {labels: {app: "web", "pod-template-hash": "zz9", "declare.stasis.dev/engine": "v1"}}, spec: $s}}}' >"$WORK/rs.json"
out=$(dev -n "$NS" create -f "$WORK/rs.json" 2>&1) && out=""
echo "# dev creates ReplicaSet web-zz9: ${out:-created}"
ZP=""
if [ -z "$out" ]; then
  retry 30 bash -c "kubectl -n $NS get pods -l pod-template-hash=zz9 -o name | grep -q ." &&
    ZP=$(kubectl -n "$NS" get pods -l pod-template-hash=zz9 -o jsonpath='{.items[0].metadata.name}')
fi
if [ -n "$ZP" ]; then
  settle "$NS" "$ZP" 20
  echo "# $ZP: lineage $(ann "$NS" "$ZP" lineage), decision $(ann "$NS" "$ZP" decision): $(ann "$NS" "$ZP" decision-reason)"
  check "M1: the ReplicaSet's pod $ZP did not get web's lineage ($(ann "$NS" "$ZP" lineage))" test "$(ann "$NS" "$ZP" lineage)" != "$L"
  no_restore_for M1 "$NS" "$ZP"
  untouched M1 "" "$L"
  visible M1 "$NS" "$ZP"
  kubectl -n "$NS" delete pod "$ZP" --grace-period=1 --wait=false >/dev/null 2>&1
else
  check "M1: refused at creation ($out)" test -n "$out"
fi
dev -n "$NS" delete replicaset web-zz9 --wait=false >/dev/null 2>&1
kubectl -n "$NS" delete pods -l pod-template-hash=zz9 --grace-period=1 --wait=false >/dev/null 2>&1
# (the controller handles the pod's end before the next snapshot)
retry 40 bash -c "! kubectl -n $NS get pods -l pod-template-hash=zz9 -o name | grep -q ."; sleep 3

echo "# --- H2: forged AdmissionReviews posted to the webhook Service from dev's pod"
# review OWNER-RS HASH [OWNER-UID]: a CREATE of a pod of ReplicaSet OWNER-RS (a made-up UID unless
# given), "by" the ReplicaSet controller
review() {
  jq -n --arg ns "$NS" --arg rs "$1" --arg h "$2" --argjson s "$TPL" --arg uid "${3:-$(cat /proc/sys/kernel/random/uuid)}" '{
    apiVersion: "admission.k8s.io/v1", kind: "AdmissionReview",
    request: {uid: $uid, kind: {group: "", version: "v1", kind: "Pod"}, resource: {group: "", version: "v1", resource: "pods"},
      requestKind: {group: "", version: "v1", kind: "Pod"}, requestResource: {group: "", version: "v1", resource: "pods"},
      name: "", namespace: $ns, operation: "CREATE",
      userInfo: {username: "system:serviceaccount:kube-system:replicaset-controller", uid: "1",
        groups: ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]},
      object: {apiVersion: "v1", kind: "Pod",
        metadata: {generateName: ($rs + "-"), namespace: $ns,
          labels: {app: "web", "pod-template-hash": $h, "declare.stasis.dev/engine": "v1"},
          ownerReferences: [{apiVersion: "apps/v1", kind: "ReplicaSet", name: $rs, uid: $uid, controller: true, blockOwnerDeletion: true}]},
        spec: $s},
      oldObject: null, dryRun: false,
      options: {apiVersion: "meta.k8s.io/v1", kind: "CreateOptions"}}}'
}
snapshot H2 "" "$L"
R0=$(n_records)
for i in 1 2 3; do
  review "ghost$i-abc$i" "abc$i" | kubectl -n "$NSA" exec -i client -- /testapp request POST "$WEBHOOK_URL" - >"$WORK/ghost$i" 2>&1
done
R1=$(n_records)
echo "# lineage records before: $R0, after three forged reviews of new workloads: $R1"
echo "# answer to the first: $(head -c 300 "$WORK/ghost1")"
check "H2: forged reviews of new workloads create no lineage records ($R0 -> $R1)" test "$R1" -le "$R0"
review web-abc abc | kubectl -n "$NSA" exec -i client -- /testapp request POST "$WEBHOOK_URL" - >"$WORK/h2" 2>&1
ANS=$(cat "$WORK/h2"); PATCH=$(sed -n '/^{/p' "$WORK/h2" | jq -r '.response.patch // empty | if type == "array" then implode else @base64d end' 2>/dev/null)
echo "# forged review of a pod of web (ReplicaSet web-abc): $(grep -v '^{' <<<"$ANS" | tr '\n' ' ')"
echo "#   patch: $(cut -c1-400 <<<"$PATCH")"
lk=$(leaks "$(grep -v '^{' <<<"$ANS") $PATCH")
if [ -z "$lk" ]; then pass "H2: the answer names no lineage or checkpoint of web"; else fail "H2: the answer names no lineage or checkpoint of web" "it names $lk"; fi
untouched H2 "" "$L"
no_restore_for H2 "$NS" web-abc
if grep -q '^status 200' <<<"$ANS" && [ -n "$PATCH" ]; then
  fail "H2: the forged review is refused visibly (no answer, or an error status)" "$(grep '^status' <<<"$ANS")"
else
  pass "H2: the forged review is refused visibly: $(grep -v '^{' <<<"$ANS" | tr '\n' ' ' | cut -c1-160)"
fi

echo "# --- H2 without webhook.clientCA (what a managed cluster runs): forged reviews of web's real ReplicaSet"
# The webhook then answers anyone; admission has no side effect, so the reviews change nothing and
# web's replacement (below) still restores from its lineage. The chart is upgraded without the CA
# for this part and back with it after (about a minute for the two rollouts).
CA=$(helm get values stasis -n "$SYS" -o json | jq -r '.webhook.clientCA // ""')
RSJ=$(kubectl -n "$NS" get rs -o json | jq -c '[.items[] | select(any(.metadata.ownerReferences[]?; .kind == "Deployment" and .name == "web"))] | sort_by(.metadata.creationTimestamp) | last')
RS=$(jq -r '.metadata.name' <<<"$RSJ"); RSUID=$(jq -r '.metadata.uid' <<<"$RSJ"); RSH=$(jq -r '.metadata.labels["pod-template-hash"]' <<<"$RSJ")
helm_chart() { helm upgrade stasis "$REPO/deploy/helm/stasis" -n "$SYS" --reuse-values --wait --timeout 180s "$@" >/dev/null; }
if [ -z "$CA" ] || [ -z "$RS" ] || [ "$RS" = null ]; then
  fail "H2 without clientCA: the chart has a webhook.clientCA to take away and web has a ReplicaSet" "clientCA ${CA:+set}${CA:-empty}, ReplicaSet '$RS'"
else
  printf '%s\n' "$CA" >"$WORK/webhook-client-ca.crt"
  on_exit "helm upgrade stasis '$REPO/deploy/helm/stasis' -n '$SYS' --reuse-values --set-file webhook.clientCA='$WORK/webhook-client-ca.crt'"
  t=$(date +%s)
  if helm_chart --set webhook.clientCA=; then
    retry 60 bash -c "kubectl -n $SYS rollout status deploy/stasis-controller --timeout=5s" >/dev/null
    echo "# chart upgraded without webhook.clientCA: $(( $(date +%s) - t )) s"
    # until a replica that still asks for a client certificate has left the Service's endpoints
    # (rollout status returns while the old pods terminate)
    answers_anyone() { review "$RS" "$RSH" "$RSUID" | kubectl -n "$NSA" exec -i client -- /testapp request POST "$WEBHOOK_URL" - 2>&1 | grep -qE 'status [0-9]{3}'; }
    retry 60 answers_anyone || echo "# the webhook did not answer a review without a client certificate within 60 s"
    snapshot H2u "" "$L"
    R0=$(n_records)
    for i in 1 2 3; do
      review "$RS" "$RSH" "$RSUID" | kubectl -n "$NSA" exec -i client -- /testapp request POST "$WEBHOOK_URL" - >"$WORK/h2u$i" 2>&1
      review "ghost$i-abc$i" "abc$i" | kubectl -n "$NSA" exec -i client -- /testapp request POST "$WEBHOOK_URL" - >"$WORK/h2g$i" 2>&1
    done
    # (testapp's "status N" line may land inside the body it prints: taken out before parsing)
    ANS=$(tr -d '\n' <"$WORK/h2u1"); STATUS=$(grep -oE 'status [0-9]{3}' <<<"$ANS" | head -1)
    PATCH=$(sed -E 's/ ?status [0-9]{3} ?//g; s/^[^{]*//' <<<"$ANS" | jq -r '.response.patch // empty | if type == "array" then implode else @base64d end' 2>/dev/null)
    echo "# forged review of a pod of web's ReplicaSet $RS (its real UID): $STATUS"
    echo "#   patch (a prediction): $(cut -c1-300 <<<"$PATCH")"
    check "H2 without clientCA: the webhook answered the forged reviews (the attack reached it)" grep -q '"stasis.dev/claim-token"' <<<"$PATCH"
    sleep 5  # (a record would appear within this: admission wrote it synchronously before)
    R1=$(n_records)
    echo "# lineage records before: $R0, after 3 forged reviews of web and 3 of new workloads: $R1"
    check "H2 without clientCA: the forged reviews create no lineage record ($R0 -> $R1)" test "$R1" -eq "$R0"
    untouched H2u "" "$L"
    no_restore_for H2u "$NS" "$RS"
  else
    fail "H2 without clientCA: helm upgrade without webhook.clientCA"
  fi
  t=$(date +%s)
  check "H2 without clientCA: the chart upgraded back with webhook.clientCA" helm_chart --set-file webhook.clientCA="$WORK/webhook-client-ca.crt" &&
    unset 'E2E_CLEANUP[-1]'
  retry 60 bash -c "kubectl -n $SYS rollout status deploy/stasis-controller --timeout=5s" >/dev/null
  echo "# chart upgraded back with webhook.clientCA: $(( $(date +%s) - t )) s"
fi

echo "# --- web back to 1 replica: it resumes its lineage"
snapshot back "" "$L"
kubectl -n "$NS" scale deployment web --replicas=1 >/dev/null
V=$(wait_one_counting "$NS" web 120) || { fail "web's new pod counts"; diagnose "$NS"; finish; }
check "web's new pod $V restored $(restored_from "$V")" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore $V -o jsonpath='{.status.phase}')\" = Restored ]"
check "... from web's lineage $L" bash -c "[ \"\$(ann $NS $V lineage)\" = '$L' ]"
L=$(ann "$NS" "$V" lineage); G=$(ann "$NS" "$V" generation)
echo "# victim $V: lineage $L generation $G"

# ------------------------------------------------------------------ H3
echo "# --- H3a: a bare pod with web's lineage and generation, and a PodCheckpoint of it"
h3() { # TAG NS POD N: dev's pod with the victim's stamp, and N PodCheckpoints of it; what admission
  # refuses is tried again without the stasis.dev/ keys (the attacker's next best), so the agent's
  # and the controller's own checks are exercised too
  local tag=$1 ns=$2 pod=$3 n=$4 out i meta
  H3DENIED=""
  out=$(attacker_pod "$pod" "$(with_decl '{"made": "by-dev"}')" "{\"stasis.dev/lineage\": \"$L\", \"stasis.dev/generation\": \"$G\"}" "$SPEC" | dev -n "$ns" create -f - 2>&1) && out=""
  echo "# dev creates pod $ns/$pod with web's stamp: ${out:-created}"
  if [ -n "$out" ]; then
    H3DENIED=$out
    out=$(attacker_pod "$pod" "$(with_decl '{"made": "by-dev"}')" '{}' "$SPEC" | dev -n "$ns" create -f - 2>&1) && out=""
    echo "# ... and without it: ${out:-created}"
  fi
  retry 60 counting "$ns" "$pod" || echo "# ($ns/$pod does not count: $(kubectl -n "$ns" get pod "$pod" --no-headers 2>&1))"
  for i in $(seq "$n"); do
    meta="  labels: {stasis.dev/policy: hourly}\n  annotations: {stasis.dev/lineage: \"$L\", stasis.dev/generation: \"$G\"}\n"
    for _ in 1 2; do
      out=$(printf "apiVersion: stasis.dev/v1alpha1\nkind: PodCheckpoint\nmetadata:\n  name: %s-%s\n$meta""spec: {sourcePodName: %s, reason: Manual}\n" \
        "$pod" "$i" "$pod" | dev -n "$ns" create -f - 2>&1) && out="" && break
      echo "# dev creates PodCheckpoint $pod-$i${meta:+ (stamped)}: $out"
      H3DENIED=${H3DENIED:-$out}; meta=""
    done
  done
  # (the node's one checkpoint worker takes them one after the other)
  retry $((30 + 15 * n)) bash -c "[ \"\$(kubectl -n $ns get pckpt -o json | jq '[.items[] | select(.metadata.name | startswith(\"$pod-\")) | select(.status.phase == \"Succeeded\" or .status.phase == \"Failed\")] | length')\" = \"\$(kubectl -n $ns get pckpt -o name | grep -c /$pod-)\" ]" ||
    echo "# (not all PodCheckpoints of $pod finished)"
  kubectl -n "$ns" get pckpt -o json | jq -r --arg p "$pod-" '.items[] | select(.metadata.name | startswith($p)) | "#   \(.metadata.name): \(.status.phase) \(.status.lineage // "") \(.status.checkpointRef // "") \([.status.conditions[]? | "\(.reason): \(.message)"] | join(", ") | .[0:200])"'
  sleep 3
}
# h3_visible TAG NS POD: the PodCheckpoints of dev's pod were refused at creation, or failed
# saying why
h3_visible() {
  local r; r=$(kubectl -n "$2" get pckpt -o json | jq -r --arg p "$3-" '[.items[] | select(.metadata.name | startswith($p)) | select(.status.phase == "Failed") | .status.conditions[]? | "\(.reason): \(.message)" | select(test("[a-zA-Z]"))] | unique | join("; ")')
  if [ -n "$r" ]; then pass "$1: refused visibly: the PodCheckpoint failed: $(cut -c1-160 <<<"$r")"
  elif [ -n "$H3DENIED" ]; then pass "$1: refused visibly: $(cut -c1-160 <<<"$H3DENIED")"
  else fail "$1: refused visibly (the PodCheckpoint denied, or failed with its reason)" "$(kubectl -n "$2" get pckpt -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase}; {end}')"; fi
}
snapshot H3a "$V" "$L"
H3REFS=""
h3 H3a "$NS" h3-bare 1
if true; then
  H3REFS=$(kubectl -n "$NS" get pckpt h3-bare-1 -o jsonpath='{.status.checkpointRef}')
  untouched H3a "$V" "$L"
  ph=$(kubectl -n "$NS" get pckpt h3-bare-1 -o json | jq -r '"\(.status.phase): \([.status.conditions[]? | "\(.reason): \(.message)"] | join(", "))"')
  if [ -z "$H3REFS" ] || ! grep -qF "$L/" <<<"$H3REFS"; then pass "H3a: dev's pod's checkpoint is not stamped into web's lineage (${ph:0:160})"
  else fail "H3a: dev's pod's checkpoint is not stamped into web's lineage" "$H3REFS"; fi
  h3_visible H3a "$NS" h3-bare
fi
kubectl -n "$NS" delete pod h3-bare --grace-period=1 --wait=false >/dev/null 2>&1
echo "# web's pod $V deleted by dev at once (--grace-period=0 --force: no final checkpoint): its replacement"
dev -n "$NS" delete pod "$V" --grace-period=0 --force --wait=false >/dev/null 2>&1
OLD=$V
V=$(wait_replacement "$NS" web "$OLD" 120) || { fail "H3a: web's replacement counts"; diagnose "$NS"; finish; }
retry 30 bash -c "kubectl -n $NS get prestore $V -o jsonpath='{.status.phase}' | grep -q ." || true
RR=$(restored_from "$V")
echo "# replacement $V: $RR; Restored Event: $(event "$NS" "$V" Restored | head -1)"
if [ -n "$H3REFS" ] && grep -qF "${H3REFS##*/}" <<<"$RR $(event "$NS" "$V" Restored)"; then
  fail "H3a: web's replacement does not restore dev's checkpoint" "$RR"
else pass "H3a: web's replacement does not restore dev's checkpoint (${RR:-no restore})"; fi
L=$(ann "$NS" "$V" lineage); G=$(ann "$NS" "$V" generation)

echo "# --- H3b: the same from dev's own namespace, keepLast+1 times"
snapshot H3b "$V" "$L"
h3 H3b "$NSA" h3-other 4
if true; then
  untouched H3b "$V" "$L"
  h3_visible H3b "$NSA" h3-other
fi
kubectl -n "$NSA" delete pod h3-other --grace-period=1 --wait=false >/dev/null 2>&1

# ------------------------------------------------------------------ M2
echo "# --- M2: web's template gets an exec liveness probe (by dev): the restore target differs"
snapshot M2 "$V" "$L"
OLD=$V
dev -n "$NS" patch deployment web --type=json -p '[{"op": "add", "path": "/spec/template/spec/containers/0/livenessProbe",
  "value": {"exec": {"command": ["/stasis-counter", "--version"]}, "initialDelaySeconds": 3600}}]' >/dev/null
V=$(wait_replacement "$NS" web "$OLD" 120) || { fail "M2: the probed pod counts"; diagnose "$NS"; finish; }
retry 20 bash -c "kubectl -n $NS get pod $V -o jsonpath='{.metadata.annotations.stasis\\.dev/decision-reported}' | grep -q ." || true
echo "# $V: decision $(ann "$NS" "$V" decision): $(ann "$NS" "$V" decision-reason); PodRestore: $(restored_from "$V")"
check "M2: the pod with the probe was not restored (decision $(ann "$NS" "$V" decision))" bash -c "[ \"\$(ann $NS $V decision)\" != Restore ] && [ -z \"\$(restored_from $V)\" ]"
check "M2: ... it started cold (first count 1)" test "$(first_count "$NS" "$V")" = 1
check "M2: ... and says why: $(ann "$NS" "$V" decision-reason | cut -c1-140)" bash -c "ann $NS $V decision-reason | grep -Eiq 'spec|probe|differ'"

# ------------------------------------------------------------------ the legitimate restore
echo "# --- after the attacks: web still resumes from its checkpoint"
retry 60 bash -c "[ -n \"\$(ann $NS $V lineage)\" ]"
OLD=$V
kubectl -n "$NS" delete pod "$OLD" --grace-period=30 --wait=false >/dev/null
V=$(wait_replacement "$NS" web "$OLD" 120) || { fail "final: web's replacement counts"; diagnose "$NS"; finish; }
check "final: $V restored ($(restored_from "$V"))" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore $V -o jsonpath='{.status.phase}')\" = Restored ]"
check "final: a Restored Event on it" retry 30 bash -c "kubectl -n $NS get events --field-selector involvedObject.name=$V,reason=Restored -o name | grep -q ."
event "$NS" "$V" Restored | sed 's/^/#   /'
check "final: it continued counting (first count $(first_count "$NS" "$V") > 1)" test "$(first_count "$NS" "$V")" -gt 1
check "final: never state=CORRUPT" not_corrupt "$NS" "$V"
echo "# scenarios: $(( $(date +%s) - T_SCEN )) s"
kubectl delete namespace "$NS" "$NSA" --wait=false >/dev/null
finish
