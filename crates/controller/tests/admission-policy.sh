#!/usr/bin/env bash
# The chart's ValidatingAdmissionPolicies (deploy/helm/stasis/templates/vap.yaml) against a real
# kube-apiserver with RBAC: starts etcd and kube-apiserver (the binaries scripts/build-platform
# builds into its cache) on free local ports, installs the CRDs and the policies as `helm
# template` renders them, and checks, as users of different rights (`kubectl --as`), what the
# API server refuses: a pod created with a restore decision by someone who may not restore, any
# change of stasis.dev/ keys of a pod or checkpoint by anyone but stasis; and, with the agents'
# own bound service-account tokens (RBAC as the chart renders it), any write of an agent to
# another node's Node, PodCheckpoints or PodRestores. With the controller
# binary as argument, also its key broker (`--key-broker`) against real bound service-account
# tokens (`kubectl create token --bound-object-kind Pod`, whose TokenReview names the pod's node):
# a data key only for the agent of a node that holds an opted-in pod of the namespace.
#
# Usage: admission-policy.sh [<stasis-controller>]
#
# Exit 0: all checks pass. Exit 1: a check failed. Exit 77: skipped (binaries not built yet) —
# printed, never silent.
set -euo pipefail

# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need admission-policy helm
APISERVER_NAMESPACE=prod apiserver_start --authorization-mode RBAC

# allowed WHAT COMMAND...: the API server accepts; refused WHAT FRAGMENT COMMAND...: it refuses,
# naming FRAGMENT.
allowed() {
    local what="$1" out; shift
    if out="$("$@" 2>&1)"; then pass "$what"; else fail "$what: refused: $out"; fi
}
refused() {
    local what="$1" frag="$2" out; shift 2
    if out="$("$@" 2>&1)"; then
        fail "$what: accepted"
    elif grep -qF -- "$frag" <<<"$out"; then
        pass "$what"
    else
        fail "$what: refused without \"$frag\": $out"
    fi
}

SNS=stasis-system
CTRL="system:serviceaccount:$SNS:stasis-controller"
AGENT="system:serviceaccount:$SNS:stasis-agent"
RSC="system:serviceaccount:kube-system:replicaset-controller"
# Not `kubectl ... | grep -q`: grep leaving early makes kubectl die of SIGPIPE, a failure under
# pipefail.
grep -qx validatingadmissionpolicies.admissionregistration.k8s.io \
    <<<"$(kubectl api-resources --api-group=admissionregistration.k8s.io -o name)" \
    && pass "ValidatingAdmissionPolicy is served ($(basename "$(dirname "$(dirname "$apiserver")")"))" \
    || fail "no validatingadmissionpolicies in admissionregistration.k8s.io"

kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl wait --for condition=established --timeout=30s crd/podcheckpoints.stasis.dev crd/podrestores.stasis.dev >/dev/null
kubectl create namespace prod >/dev/null
kubectl -n prod create serviceaccount default >/dev/null
# alice: what `edit` gives for pods and checkpoints; bob: alice and the restore permission; the
# controllers: what they need for these calls.
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: t-pods}
rules:
  - {apiGroups: [""], resources: [pods], verbs: [get, list, create, update, patch, delete]}
  - {apiGroups: [stasis.dev], resources: [podcheckpoints], verbs: [get, list, create, update, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: t-restorer}
rules:
  - {apiGroups: [stasis.dev], resources: [podrestores], verbs: [get, list, create, update, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: t-pods}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: t-pods}
subjects:
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: alice}
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: bob}
  - {kind: ServiceAccount, name: replicaset-controller, namespace: kube-system}
  - {kind: ServiceAccount, name: stasis-controller, namespace: stasis-system}
  - {kind: ServiceAccount, name: stasis-agent, namespace: stasis-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: t-restorer, namespace: prod}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: t-restorer}
subjects:
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: bob}
  - {kind: ServiceAccount, name: stasis-controller, namespace: stasis-system}
EOF

"$helm" template stasis "$root/deploy/helm/stasis" -n "$SNS" --set store.url=s3://unused/ --show-only templates/vap.yaml \
    --set admissionPolicy.agentOwnNodeOnly=true >"$work/vap.yaml"
if out="$(kubectl apply -f "$work/vap.yaml" 2>&1)"; then pass "the chart's policies are accepted"; else fail "policies: $out"; fi

pod() { # name annotations-json [labels-json]
    printf '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"%s","annotations":%s,"labels":%s},"spec":{"containers":[{"name":"c","image":"i"}]}}' \
        "$1" "$2" "${3:-{\}}"
}
create() { local as="$1"; shift; pod "$@" | kubectl --as="$as" -n prod create -f - >/dev/null; }

# The policies take effect once the API server has compiled them: wait for the first refusal.
for _ in $(seq 60); do
    if ! create alice probe '{"stasis.dev/decision":"Restore"}' 2>/dev/null; then break; fi
    kubectl -n prod delete pod probe --wait=false >/dev/null 2>&1 || true
    sleep 0.5
done
kubectl get validatingadmissionpolicy -o jsonpath='{range .items[*]}{.metadata.name}: {.status.typeChecking}{"\n"}{end}' | grep -i warning \
    && fail "type-check warnings in the policies" || pass "policies type-check without warnings"

# (a) creating a pod with a restore decision
refused "a pod created with decision=Restore by a user who may not restore" "may not create podrestores.stasis.dev in namespace prod" \
    create alice evil1 '{"stasis.dev/decision":"Restore"}'
refused "a pod created with restore-from by a user who may not restore" "may not create podrestores" \
    create alice evil2 '{"stasis.dev/restore-from":"prod_deploy_web.aa/x"}'
allowed "a pod created with decision=Restore by a user who may restore" create bob restored1 '{"stasis.dev/decision":"Restore"}'
allowed "a pod created with decision=Restore by the ReplicaSet controller" create "$RSC" restored2 '{"stasis.dev/decision":"Restore"}'
refused "a pod created with a copied claim token, lineage and generation by a user who may not restore" "stasis.dev/claim-token" \
    create alice evil3 '{"stasis.dev/lineage":"prod_deploy_web.aa","stasis.dev/generation":"3"}' '{"stasis.dev/claim-token":"T"}'
refused "... or with the label that used to skip the webhook" "may not create podrestores" \
    create alice evil4 '{}' '{"stasis.dev/system":"true"}'
allowed "a pod created with decision=ColdStart and its reason (the webhook's answer to anyone), cold-start and other keys" \
    create alice plain '{"stasis.dev/decision":"ColdStart","stasis.dev/decision-reason":"no CheckpointPolicy","stasis.dev/cold-start":"true","a":"b"}' '{"app":"web"}'
allowed "a pod created with a claim, lineage and generation by a user who may restore" \
    create bob claimed '{"stasis.dev/lineage":"prod_deploy_web.aa","stasis.dev/generation":"3","stasis.dev/claim-token":"T"}' '{"stasis.dev/claim-token":"T"}'

# (b) changing stasis.dev/ keys of an existing pod
refused "a user adds decision=Restore to a pod" "only stasis-controller" \
    kubectl --as=alice -n prod annotate pod plain stasis.dev/decision=Restore --overwrite
refused "a user removes the decision annotation the pod was created with" "only stasis-controller" \
    kubectl --as=alice -n prod annotate pod plain stasis.dev/decision-
refused "a user adds a claim-token label" "only stasis-controller" \
    kubectl --as=alice -n prod label pod plain stasis.dev/claim-token=T
refused "a user who may restore adds decision=Restore to a pod" "only stasis-controller" \
    kubectl --as=bob -n prod annotate pod plain stasis.dev/decision=Restore --overwrite
allowed "stasis-controller labels and annotates a pod" \
    kubectl --as="$CTRL" -n prod label pod plain stasis.dev/claim-token=T
allowed "stasis-controller marks the decision reported" \
    kubectl --as="$CTRL" -n prod annotate pod plain stasis.dev/decision-reported=true
refused "a user changes the claim-token label stasis set" "only stasis-controller" \
    kubectl --as=alice -n prod label pod plain stasis.dev/claim-token=U --overwrite
refused "a user removes the decision-reported annotation stasis set" "only stasis-controller" \
    kubectl --as=alice -n prod annotate pod plain stasis.dev/decision-reported-
allowed "a user sets and removes stasis.dev/cold-start" bash -c \
    "$kubectl --as=alice -n prod annotate pod plain stasis.dev/cold-start=false --overwrite >/dev/null && $kubectl --as=alice -n prod annotate pod plain stasis.dev/cold-start-"
allowed "a user changes other labels of a pod carrying stasis's keys" \
    kubectl --as=alice -n prod label pod plain app=api --overwrite
refused "the agent may not change a pod's stasis keys" "only stasis-controller" \
    kubectl --as="$AGENT" -n prod annotate pod plain stasis.dev/generation=9

# (c) PodCheckpoints and PodRestores
ckpt() { # name annotations-json
    printf '{"apiVersion":"stasis.dev/v1alpha1","kind":"PodCheckpoint","metadata":{"name":"%s","annotations":%s},"spec":{"sourcePodName":"plain","reason":"Manual"}}' "$1" "$2"
}
allowed "a user asks for a checkpoint" bash -c "$(declare -f ckpt); ckpt c1 '{}' | $kubectl --as=alice -n prod create -f - >/dev/null"
refused "a user's checkpoint naming a lineage and generation" "only stasis-controller and stasis-agent" \
    bash -c "$(declare -f ckpt); ckpt c2 '{\"stasis.dev/lineage\":\"prod_deploy_web.aa\",\"stasis.dev/generation\":\"7\"}' | $kubectl --as=alice -n prod create -f -"
allowed "stasis-controller's checkpoint with its stamp" \
    bash -c "$(declare -f ckpt); ckpt c3 '{\"stasis.dev/lineage\":\"prod_deploy_web.aa\"}' | $kubectl --as=$CTRL -n prod create -f - >/dev/null"
refused "a user restamps a checkpoint" "only stasis-controller and stasis-agent" \
    kubectl --as=alice -n prod annotate podcheckpoint c3 stasis.dev/lineage=prod_deploy_api.bb --overwrite
refused "stasis-agent without a node in its credentials (impersonated: no bound token) labels a checkpoint" "name no node" \
    kubectl --as="$AGENT" -n prod label podcheckpoint c1 stasis.dev/node=w1
refused "a user marks a restore accounted" "only stasis-controller and stasis-agent" \
    bash -c "printf '{\"apiVersion\":\"stasis.dev/v1alpha1\",\"kind\":\"PodRestore\",\"metadata\":{\"name\":\"r1\",\"annotations\":{\"stasis.dev/accounted\":\"true\"}},\"spec\":{\"checkpointRef\":\"l/c\",\"targetPodName\":\"plain\"}}' | $kubectl --as=bob -n prod create -f -"

# pod templates of workload controllers
deploy() { # name template-annotations-json
    printf '{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"%s"},"spec":{"selector":{"matchLabels":{"app":"%s"}},"template":{"metadata":{"labels":{"app":"%s"},"annotations":%s},"spec":{"containers":[{"name":"c","image":"i"}]}}}}' "$1" "$1" "$1" "$2"
}
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: t-deploy}
rules:
  - {apiGroups: [apps], resources: [deployments], verbs: [get, list, create, update, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: t-deploy}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: t-deploy}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: bob}]
EOF
refused "a Deployment whose pod template carries a lineage (even by a user who may restore)" "carries stasis.dev/ keys" \
    bash -c "$(declare -f deploy); deploy web '{\"stasis.dev/lineage\":\"prod_deploy_web.aa\"}' | $kubectl --as=bob -n prod create -f -"
allowed "a Deployment whose pod template asks for a cold start" \
    bash -c "$(declare -f deploy); deploy api '{\"stasis.dev/cold-start\":\"true\"}' | $kubectl --as=bob -n prod create -f - >/dev/null"
allowed "... and its update" kubectl --as=bob -n prod patch deployment api --type merge -p '{"spec":{"replicas":2}}'
kubectl create namespace "$SNS" >/dev/null
allowed "stasis's own Deployment in the release namespace (its pods labelled stasis.dev/system)" \
    bash -c "$(declare -f deploy); deploy stasis-controller '{}' | sed 's/\"labels\":{\"app\":\"stasis-controller\"}/\"labels\":{\"app\":\"stasis-controller\",\"stasis.dev\/system\":\"true\"}/' | $kubectl -n $SNS create -f - >/dev/null"

# A node's agent writes only its own node's objects (vap.yaml, the agent policy), shown with
# the agents' own tokens: bound to their pods, so the API server puts the node in the request's
# userInfo.extra (authentication.kubernetes.io/node-name).
kubectl -n "$SNS" create serviceaccount stasis-agent >/dev/null
kubectl -n "$SNS" create serviceaccount default >/dev/null
kubectl create namespace other >/dev/null
kubectl -n other create serviceaccount default >/dev/null
kubectl apply -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: stasis}
handler: stasis
---
apiVersion: v1
kind: Node
metadata: {name: node-1}
---
apiVersion: v1
kind: Node
metadata: {name: node-2}
---
apiVersion: v1
kind: Pod
metadata: {name: agent-1, namespace: $SNS}
spec: {nodeName: node-1, serviceAccountName: stasis-agent, containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: agent-2, namespace: $SNS}
spec: {nodeName: node-2, serviceAccountName: stasis-agent, containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: app-1, namespace: prod}
spec: {nodeName: node-1, runtimeClassName: stasis, containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: plain-1, namespace: other}
spec: {nodeName: node-1, containers: [{name: c, image: i}]}
EOF
"$helm" template stasis "$root/deploy/helm/stasis" -n "$SNS" --set store.url=s3://unused/ --show-only templates/rbac-agent.yaml >"$work/rbac-agent.yaml"
kubectl apply -f "$work/rbac-agent.yaml" >/dev/null
grep -q "name: stasis-agent" "$work/rbac-agent.yaml" || fail "the chart's agent RBAC names the service account stasis-agent"
a1=$(kubectl create token stasis-agent -n "$SNS" --bound-object-kind Pod --bound-object-name agent-1)
a2=$(kubectl create token stasis-agent -n "$SNS" --bound-object-kind Pod --bound-object-name agent-2)
a0=$(kubectl create token stasis-agent -n "$SNS")
if grep -q '"node-1"' <<<"$(kubectl --token="$a1" auth whoami -o json)"; then
    pass "agent-1's bound token names its node in userInfo.extra"
else
    fail "no node in agent-1's token: $(kubectl --token="$a1" auth whoami -o json 2>&1 | tr -d '\n')"
fi
as1() { kubectl --token="$a1" "$@"; }
as2() { kubectl --token="$a2" "$@"; }
allowed "the agent of node-1 labels its own Node" as1 label node node-1 stasis.dev/ready=true
refused "... another Node" "may change only its own Node, not node-2" as1 label node node-2 stasis.dev/ready=true
refused "... another Node's control-plane taint away (review H4)" "may change only its own Node" \
    as1 patch node node-2 --type merge -p '{"spec":{"taints":[]}}'
refused "... a label of its own Node outside stasis.dev/" "only the stasis.dev/ labels" as1 label node node-1 app=x
refused "... its own Node unschedulable" "only the stasis.dev/ labels" as1 patch node node-1 --type merge -p '{"spec":{"unschedulable":true}}'
refused "an agent token bound to no pod (no node) labels a Node" "name no node" kubectl --token="$a0" label node node-1 stasis.dev/x=y
mk() { # kind (ck|rs) name node-label (empty: none)
    jq -nc --arg k "$1" --arg n "$2" --arg node "$3" '{apiVersion: "stasis.dev/v1alpha1",
        metadata: ({name: $n} + (if $node == "" then {} else {labels: {"stasis.dev/node": $node}} end))}
        + (if $k == "ck" then {kind: "PodCheckpoint", spec: {sourcePodName: "app-1", reason: "Termination"}}
           else {kind: "PodRestore", spec: {checkpointRef: "l/c", targetPodName: "app-1"}} end)'
}
allowed "the agent of node-1 creates a termination PodCheckpoint labelled with its node" bash -c "$(declare -f mk); mk ck t1 node-1 | $kubectl --token=$a1 -n prod create -f - >/dev/null"
refused "... one labelled with another node" "not one labelled stasis.dev/node=node-2" bash -c "$(declare -f mk); mk ck t2 node-2 | $kubectl --token=$a1 -n prod create -f -"
refused "... one without the node label" "labelled stasis.dev/node=node-1" bash -c "$(declare -f mk); mk ck t3 '' | $kubectl --token=$a1 -n prod create -f -"
allowed "the agent of node-1 records a restart in place (PodRestore) labelled with its node" bash -c "$(declare -f mk); mk rs r-in-place node-1 | $kubectl --token=$a1 -n prod create -f - >/dev/null"
refused "... a PodRestore for another node's pod" "not one labelled stasis.dev/node=node-2" bash -c "$(declare -f mk); mk rs r2 node-2 | $kubectl --token=$a1 -n prod create -f -"
refused "... relabels its checkpoint to another node" "was node-1" as1 -n prod label podcheckpoint t1 stasis.dev/node=node-2 --overwrite
# status: the controller's heartbeat checkpoints carry the node label; a user's do not.
mk ck hb2 node-2 | kubectl --as="$CTRL" -n prod create -f - >/dev/null
st() { printf '{"status":{"phase":"%s","node":"%s","sourcePodUID":"u"}}' "$1" "$2"; }
refused "the agent of node-1 writes the status of node-2's checkpoint" "stasis.dev/node=node-2" \
    as1 -n prod patch podcheckpoint hb2 --subresource=status --type merge -p "$(st Succeeded node-1)"
allowed "... the agent of node-2 does" as2 -n prod patch podcheckpoint hb2 --subresource=status --type merge -p "$(st Running node-2)"
allowed "the agent of node-1 takes a user's checkpoint (no node label) of a pod on its node" \
    as1 -n prod patch podcheckpoint c1 --subresource=status --type merge -p "$(st Running node-1)"
refused "... the agent of node-2 then writes its status (review H4: a forged Succeeded)" "written by node node-1" \
    as2 -n prod patch podcheckpoint c1 --subresource=status --type merge -p "$(st Succeeded node-2)"
refused "... or claims to be node-1" "status.node node-2" \
    as2 -n prod patch podcheckpoint c1 --subresource=status --type merge -p "$(st Succeeded node-1)"
refused "the agent of node-2 writes the status of node-1's restart in place" "stasis.dev/node=node-1" \
    as2 -n prod patch podrestore r-in-place --subresource=status --type merge -p '{"status":{"phase":"Failed","node":"node-2"}}'
allowed "... the agent of node-1 does" as1 -n prod patch podrestore r-in-place --subresource=status --type merge -p '{"status":{"phase":"Ready","node":"node-1"}}'
allowed "the agent of node-1 labels a checkpoint of its node" as1 -n prod label podcheckpoint t1 stasis.dev/accounted=true

# The key broker (crates/controller/src/broker.rs): the agent's bound token names its node.
controller_bin="${1:-}"
if [[ -n $controller_bin ]]; then
    (cd "$work" && openssl req -x509 -newkey rsa:2048 -nodes -keyout tls.key -out tls.crt -days 1 \
        -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>/dev/null)
    broker_port="$(free_port)"
    "$controller_bin" run --namespace "$SNS" --no-webhook --key-broker --key-broker-addr "127.0.0.1:$broker_port" \
        --cluster-key-secret stasis-cluster-key --create-cluster-key --tls-cert "$work/tls.crt" --tls-key "$work/tls.key" \
        --metrics-addr "127.0.0.1:$(free_port)" >"$work/controller.log" 2>&1 &
    stop_at_exit $!
    aud=stasis.dev/key-broker
    token() { kubectl create token "$1" -n "$2" --audience "$aud" --bound-object-kind Pod --bound-object-name "$3"; }
    t1=$(token stasis-agent "$SNS" agent-1)
    t2=$(token stasis-agent "$SNS" agent-2)
    t_api=$(kubectl create token stasis-agent -n "$SNS" --bound-object-kind Pod --bound-object-name agent-1)
    t_app=$(token default prod app-1)
    t_unbound=$(kubectl create token stasis-agent -n "$SNS" --audience "$aud")
    # key <token> <namespace>: the HTTP code and body
    key() { curl -sS --cacert "$work/tls.crt" -H "Authorization: Bearer $1" -w ' %{http_code}' "https://localhost:$broker_port/v1/keys/$2" 2>&1; }
    for _ in $(seq 60); do curl -s --cacert "$work/tls.crt" "https://localhost:$broker_port/" >/dev/null 2>&1 && break; sleep 0.5; done
    # expect <what> <code> <fragment> <token> <namespace>
    expect() {
        local out; out="$(key "$4" "$5")"
        if [[ $out == *" $2" && $out == *"$3"* ]]; then pass "key broker: $1 ($2)"; else fail "key broker: $1: $out"; fi
    }
    expect "the agent of node-1, which holds an opted-in pod of prod, gets prod's key" 200 '"key":"' "$t1" prod
    if [[ $(kubectl -n "$SNS" get secret stasis-key-prod -o jsonpath='{.data.wrapped}' | base64 -d | wc -c) == 61 ]]; then
        pass "key broker: prod's data key kept wrapped by the cluster key in $SNS/stasis-key-prod"
    else
        fail "key broker: no wrapped data key Secret"
    fi
    expect "a namespace with no opted-in pod on the node (other: only a plain pod)" 403 "no pod of namespace other" "$t1" other
    expect "the agent of node-2, where no pod of prod is" 403 "bound to node node-2" "$t2" prod
    expect "the agent's token for the API server (wrong audience)" 401 "does not authenticate" "$t_api" prod
    expect "another service account's bound token" 403 "only stasis's node agents" "$t_app" prod
    expect "the agent's token bound to no pod (no node claim)" 403 "names no node" "$t_unbound" prod
    expect "no token" 401 "no bearer token" "" prod
    expect "a garbage token" 401 "does not authenticate" "not-a-token" prod
    kubectl -n prod delete pod app-1 --grace-period=0 --force --wait=false >/dev/null 2>&1
    for _ in $(seq 20); do kubectl -n prod get pod app-1 >/dev/null 2>&1 || break; sleep 0.5; done
    expect "once prod's pod is gone from node-1, its key is not given any more" 403 "no pod of namespace prod" "$t1" prod
    if ((failures)); then echo "--- controller log (tail)" >&2; tail -20 "$work/controller.log" >&2; fi
else
    echo "skip key broker: no stasis-controller binary given"
fi

if ((failures)); then
    echo "admission-policy: $failures check(s) failed" >&2
    exit 1
fi
echo "admission-policy: all checks passed"
