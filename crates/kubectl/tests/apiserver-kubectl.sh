#!/usr/bin/env bash
# kubectl-stasis against a real kube-apiserver with RBAC (tests/lib/apiserver.sh starts etcd and
# kube-apiserver on free local ports, no cluster), installs the stasis CRDs
# and the chart's user ClusterRoles, and runs every command of the plugin as users of different
# rights. There is no kubelet, controller or agent here: pods stay unscheduled, and where stasis's
# agent would write a PodCheckpoint's status, this script writes it (it says so when it does).
#
# Usage: apiserver-kubectl.sh [path/to/kubectl-stasis]   (default: target/debug/kubectl-stasis)
# Exit 0: all checks pass. Exit 1: a check failed. Exit 77: skipped (binaries not built yet;
# scripts/build-platform builds them) — printed, never silent.
set -euo pipefail

plugin_arg="${1:-}"
# shellcheck source=tests/lib/apiserver.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../../tests/lib/apiserver.sh"
apiserver_need apiserver-kubectl helm
command -v jq >/dev/null || { echo "SKIP apiserver-kubectl: needs jq"; exit 77; }
plugin="${plugin_arg:-$root/target/debug/kubectl-stasis}"
[[ -x "$plugin" ]] || { echo "FAIL apiserver-kubectl: no plugin binary at $plugin (cargo build -p stasis-kubectl)" >&2; exit 1; }

# users: admin (system:masters), dev (a namespace user), ops (dev's rights and stasis-restorer),
# nobody (no rights); this file replaces the harness's admin-only one (the last flag counts)
cat >"$work/users.csv" <<'EOF'
admintoken,admin,admin,system:masters
devtoken,dev,dev
opstoken,ops,ops
nobodytoken,nobody,nobody
EOF
APISERVER_NAMESPACE=prod apiserver_start --authorization-mode RBAC --token-auth-file "$work/users.csv"

server=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
kubeconfig() { # user token: a kubeconfig whose context's namespace is prod
    cat >"$work/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: "$server", insecure-skip-tls-verify: true}}]
users: [{name: $1, user: {token: $2}}]
contexts: [{name: t, context: {cluster: t, user: $1, namespace: prod}}]
current-context: t
EOF
}
kubeconfig admin admintoken; kubeconfig dev devtoken; kubeconfig ops opstoken; kubeconfig nobody nobodytoken

# (STASIS_TEST_SHOW=1 prints each command's output)
as() {
    local u=$1; shift; rc=0; KUBECONFIG="$work/$u.kubeconfig" "$plugin" "$@" >"$work/out" 2>"$work/err" || rc=$?
    [ -z "${STASIS_TEST_SHOW:-}" ] || { echo "\$ kubectl stasis $* (as $u; exit $rc)"; cat "$work/out" "$work/err"; } | sed 's/^/# /'
}
ok_if() { if "${@:2}" >/dev/null; then pass "$1"; else fail "$1: rc=$rc, out: $(head -c 600 "$work/out"), err: $(head -c 600 "$work/err")"; fi; }
out_has() { grep -qF -- "$1" "$work/out"; }
jqe() { [ -s "$work/out" ] && jq -e "$1" "$work/out"; } # (jq -e passes an empty input)
err_has() { grep -qF -- "$1" "$work/err"; }
ts() { date -u -d "@$(( $(date +%s) - $1 ))" +%Y-%m-%dT%H:%M:%SZ; } # RFC 3339, $1 seconds ago

kubectl apply --server-side -f "$root/deploy/helm/stasis/crds/stasis.dev.yaml" >/dev/null
kubectl wait --for condition=established --timeout=30s \
    crd/checkpointpolicies.stasis.dev crd/podcheckpoints.stasis.dev crd/podrestores.stasis.dev >/dev/null
# the chart's user roles, as it renders them
"$helm" template stasis "$root/deploy/helm/stasis" -n stasis-system --set store.url=s3://unused/ \
    --show-only templates/rbac-users.yaml | kubectl apply -f - >/dev/null
kubectl create namespace prod >/dev/null
kubectl -n prod create serviceaccount default >/dev/null # (no controller-manager makes it)
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: stasis}
handler: stasis
---
# what a namespace user reads besides stasis's kinds (the built-in view role's part; no
# controller-manager here aggregates the chart's roles into view and edit)
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: reader, namespace: prod}
rules:
  - {apiGroups: [""], resources: [pods, events], verbs: [get, list, watch]}
  - {apiGroups: [apps], resources: [deployments], verbs: [get, list]}
EOF
kubectl -n prod create rolebinding reader --role=reader --user=dev --user=ops >/dev/null
kubectl -n prod create rolebinding requester --clusterrole=stasis-checkpoint-requester --user=dev --user=ops >/dev/null
kubectl -n prod create rolebinding viewer --clusterrole=stasis-checkpoint-viewer --user=dev --user=ops >/dev/null
kubectl -n prod create rolebinding restorer --clusterrole=stasis-restorer --user=ops >/dev/null

# ------------------------------------------------------------------ the namespace's state
# web-0 cold-started, web-1 was restored from web-0's checkpoint; plain is not opted in.
pod() { # name node annotations-json [runtimeClassName]
    printf '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"%s","labels":{"app":"web"},"annotations":%s},"spec":{"nodeName":"%s",%s"containers":[{"name":"c","image":"i"}]}}' \
        "$1" "$3" "$2" "${4-\"runtimeClassName\":\"stasis\",}" | kubectl -n prod create -f - >/dev/null
    kubectl -n prod patch pod "$1" --subresource=status --type=merge -p "{\"status\":{\"startTime\":\"$(ts 600)\"}}" >/dev/null
}
pod web-0 node-1 '{"stasis.dev/decision":"ColdStart","stasis.dev/decision-reason":"no checkpoint of this workload to continue from","stasis.dev/lineage":"prod_deployment_web.1","stasis.dev/generation":"1"}'
pod web-1 node-2 '{"stasis.dev/decision":"Restore","stasis.dev/restore-from":"prod_deployment_web.1/0000000001","stasis.dev/lineage":"prod_deployment_web.1","stasis.dev/generation":"2"}'
pod plain node-1 '{}' ''
UID0=$(kubectl -n prod get pod web-0 -o jsonpath='{.metadata.uid}')
UID1=$(kubectl -n prod get pod web-1 -o jsonpath='{.metadata.uid}')
kubectl -n prod apply -f - >/dev/null <<'EOF'
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: every-30s}
spec: {selector: {matchLabels: {app: web}}, interval: 30s}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 0
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {runtimeClassName: stasis, containers: [{name: c, image: i}]}
EOF
echo "# this script plays stasis's agent and controller: it writes PodCheckpoint statuses and Events as they would (no kubelet, agent or controller runs here)"
ckpt() { # name id pod uid reason phase seconds-ago size freeze-ms node
    local name=$1 id=$2; shift 2
    printf 'apiVersion: stasis.dev/v1alpha1\nkind: PodCheckpoint\nmetadata: {name: %s}\nspec: {sourcePodName: %s, reason: %s}\n' "$name" "$1" "$3" | kubectl -n prod create -f - >/dev/null
    kubectl -n prod patch pckpt "$name" --subresource=status --type=merge -p "$(jq -nc --arg uid "$2" --arg ph "$4" --arg t "$(ts "$5")" \
        --arg ref "prod_deployment_web.1/$id" --argjson size "$6" --argjson fr "$7" --arg node "$8" \
        '{status: {phase: $ph, sourcePodUID: $uid, node: $node, lineage: "prod_deployment_web.1", generation: 1, checkpointRef: $ref, startTime: $t, sizeBytes: $size, freezeMillis: $fr}}')" >/dev/null
}
ckpt web-0-final 0000000001 web-0 "$UID0" Termination Succeeded 300 1048576 40 node-1
ckpt web-1-1796000000 0000000002 web-1 "$UID1" Heartbeat Succeeded 20 3145728 55 node-2
ckpt web-1-1796000030 0000000003 web-1 "$UID1" Heartbeat Failed 10 0 0 node-2
kubectl -n prod create -f - >/dev/null <<EOF
apiVersion: v1
kind: Event
metadata: {name: web-0.coldstart}
involvedObject: {kind: Pod, namespace: prod, name: web-0, uid: "$UID0", apiVersion: v1}
type: Normal
reason: ColdStart
message: "no checkpoint of this workload to continue from"
source: {component: stasis-controller}
firstTimestamp: "$(ts 590)"
lastTimestamp: "$(ts 590)"
---
apiVersion: v1
kind: Event
metadata: {name: web-0.scheduled}
involvedObject: {kind: Pod, namespace: prod, name: web-0, uid: "$UID0", apiVersion: v1}
type: Normal
reason: Scheduled
message: "Successfully assigned prod/web-0 to node-1"
source: {component: default-scheduler}
firstTimestamp: "$(ts 595)"
lastTimestamp: "$(ts 595)"
EOF

# ------------------------------------------------------------------ status
as dev status
ok_if "status: a kubectl table of the opted-in pods (plain, not opted in, is left out)" bash -c \
    "head -1 '$work/out' | grep -Eq '^POD +LINEAGE +CHECKPOINTS +LAST +SIZE +FREEZE +NEXT DUE +DECISION +REASON\$' && [ \$(wc -l <'$work/out') = 3 ] && ! grep -q '^plain' '$work/out'"
ok_if "status: web-1: its lineage's 2 checkpoints, the last 20 s old, 3.0Mi, 55ms, restored from web-0's" bash -c \
    "grep -Eq '^web-1 +prod_deployment_web.1 +2 +2[0-9]s ago +3.0Mi +55ms +in [0-9]+s +Restore +from prod_deployment_web.1/0000000001\$' '$work/out'"
ok_if "status: web-0: why it cold-started" out_has "ColdStart   no checkpoint of this workload to continue from"
as dev status web-1 -o json
ok_if "status -o json: the fields, the next heartbeat due within the 30 s interval after the last attempt (10 s ago)" \
    jqe '.[0] | .pod == "web-1" and .checkpoints == 2 and .lastCheckpoint.name == "web-1-1796000000" and .lastCheckpoint.sizeBytes == 3145728
        and .lastCheckpoint.freezeMillis == 55 and .policy == "every-30s" and .nextDueSeconds >= 15 and .nextDueSeconds <= 20
        and .decision == "Restore"'
as dev status deployment/web -o yaml
ok_if "status deployment/web -o yaml: the pods its selector selects" bash -c \
    "grep -c '^- namespace: prod' '$work/out' | grep -qx 3 && grep -q 'pod: web-0' '$work/out'"
as dev status nosuch
ok_if "status of a pod that does not exist: an error naming it and the workload form" \
    bash -c "[ $rc = 1 ] && grep -qF 'pod prod/nosuch not found (for a workload name its kind: deployment/nosuch' '$work/err'"
as nobody status
ok_if "status as a user who may not list pods: the API server's refusal, passed on" \
    bash -c "[ $rc = 1 ] && grep -qF 'forbidden: pods is forbidden: User \"nobody\" cannot list resource \"pods\"' '$work/err'"

# ------------------------------------------------------------------ list
as dev list
ok_if "list: newest first, with kubectl's columns and ages" bash -c \
    "head -1 '$work/out' | grep -Eq '^NAME +POD +REASON +PHASE +CHECKPOINT +SIZE +FREEZE +NODE +AGE\$' &&
     [ \"\$(awk 'NR>1 {print \$1}' '$work/out' | tr '\n' ' ')\" = 'web-1-1796000030 web-1-1796000000 web-0-final ' ]"
as dev list web-0 -o json
ok_if "list web-0 -o json: a List of its lineage's PodCheckpoints" \
    jqe '.kind == "List" and (.items | length) == 3 and .items[0].kind == "PodCheckpoint"'
rc=0; KUBECONFIG=/nonexistent "$plugin" --kubeconfig "$work/dev.kubeconfig" list >"$work/out" 2>"$work/err" || rc=$?
ok_if "--kubeconfig: the file given, not KUBECONFIG" bash -c "[ $rc = 0 ] && grep -q '^web-0-final ' '$work/out'"
kubectl create namespace empty >/dev/null
kubectl -n empty create rolebinding viewer --clusterrole=stasis-checkpoint-viewer --user=dev >/dev/null
as dev list -n empty
ok_if "list in a namespace without checkpoints: kubectl's words" bash -c "[ $rc = 0 ] && [ \"\$(cat '$work/out')\" = 'No resources found in empty namespace.' ]"

# ------------------------------------------------------------------ why
as dev why web-0
ok_if "why web-0: the decision, its reason, the lineage" bash -c \
    "grep -q '^Decision: *ColdStart\$' '$work/out' && grep -q '^Reason: *no checkpoint of this workload to continue from\$' '$work/out' && grep -q '^Lineage: *prod_deployment_web.1\$' '$work/out'"
ok_if "why web-0: stasis's Event, not the scheduler's" bash -c \
    "grep -Eq '^  Normal +ColdStart +[0-9]+m[0-9]*s? +stasis-controller +no checkpoint' '$work/out' && ! grep -q Scheduled '$work/out'"
as dev why plain -o json
ok_if "why plain -o json: no decision, not opted in" jqe '.decision == null and .runtimeClass == null and .events == []'

# ------------------------------------------------------------------ checkpoint
agent() { # phase-after-running [reason message]: plays the agent for the next manual PodCheckpoint of web-1
    local n=""
    for _ in $(seq 100); do
        n=$(kubectl -n prod get pckpt -o json | jq -r '[.items[] | select(.spec.reason == "Manual" and .status == null)][0].metadata.name // empty')
        [ -n "$n" ] && break; sleep 0.1
    done
    [ -n "$n" ] || return 0
    kubectl -n prod patch pckpt "$n" --subresource=status --type=merge -p '{"status":{"phase":"Running","node":"node-2","conditions":[{"type":"Ready","status":"False","reason":"CheckpointInProgress","message":"freezing","lastTransitionTime":"'"$(ts 0)"'"}]}}' >/dev/null
    sleep 1.2
    if [ "$1" = Succeeded ]; then
        kubectl -n prod patch pckpt "$n" --subresource=status --type=merge -p '{"status":{"phase":"Succeeded","checkpointRef":"prod_deployment_web.1/0000000009","sizeBytes":2097152,"freezeMillis":33,"totalMillis":800}}' >/dev/null
    else
        kubectl -n prod patch pckpt "$n" --subresource=status --type=merge -p '{"status":{"phase":"Failed","conditions":[{"type":"Ready","status":"False","reason":"'"$2"'","message":"'"$3"'","lastTransitionTime":"'"$(ts 0)"'"}]}}' >/dev/null
    fi
}
agent Succeeded & apid=$!
as dev checkpoint web-1
wait $apid
ok_if "checkpoint web-1: follows it to Succeeded (exit 0)" bash -c "[ $rc = 0 ] && grep -q '^podcheckpoint.stasis.dev/web-1-manual-' '$work/out'"
ok_if "checkpoint web-1: a progress line per step: created, Running on node-2, Succeeded with its figures" bash -c \
    "grep -q 'created\$' '$work/err' && grep -Eq ': Running on node-2 \(CheckpointInProgress\) [0-9.]+s\$' '$work/err' &&
     grep -Eq ': Succeeded on node-2 \(prod_deployment_web.1/0000000009, 2.0Mi, frozen 33 ms, total 800 ms\) [0-9.]+s\$' '$work/err'"
name=$(sed -n 's|^podcheckpoint.stasis.dev/||p' "$work/out")
ok_if "checkpoint web-1: the PodCheckpoint is Manual, for web-1's UID, with no stasis.dev/ keys" bash -c \
    "set -o pipefail; [ -n '$name' ] && kubectl -n prod get pckpt '$name' -o json | jq -e '.spec.reason == \"Manual\" and .spec.sourcePodUID == \"$UID1\" and (.metadata.labels // {} | keys | map(select(startswith(\"stasis.dev/\"))) == [])'"
agent Failed Fenced "no lineage record names this pod as its holder" & apid=$!
as dev checkpoint web-1 --timeout-seconds 30
wait $apid
ok_if "checkpoint web-1 that fails: exit 1 with the agent's reason" bash -c \
    "[ $rc = 1 ] && grep -qF 'failed: Fenced: no lineage record names this pod as its holder' '$work/err'"
as dev checkpoint web-1 --no-wait -o json
ok_if "checkpoint --no-wait -o json: the created object, not followed" \
    bash -c "[ $rc = 0 ] && [ -s '$work/out' ] && jq -e '.kind == \"PodCheckpoint\" and .spec.sourcePodName == \"web-1\" and .status == null' '$work/out'"
as dev checkpoint plain
ok_if "checkpoint of a pod that did not opt in: refused, naming why" bash -c \
    "[ $rc = 1 ] && grep -qF 'pod prod/plain is not opted in (runtimeClassName unset, not stasis)' '$work/err'"
as nobody checkpoint web-1
ok_if "checkpoint as a user without rights: the API server's Forbidden" bash -c "[ $rc = 1 ] && grep -qF 'forbidden: pods \"web-1\" is forbidden' '$work/err'"

# ------------------------------------------------------------------ restore
before=$(kubectl -n prod get prestore -o name | wc -l)
as dev restore web-1 --from web-0-final
ok_if "restore as dev (edit rights, not stasis-restorer): refused with the reason and the role to ask for" bash -c \
    "[ $rc = 1 ] && grep -qF 'you may not restore in namespace prod: creating podrestores.stasis.dev is not allowed' '$work/err' && grep -qF 'stasis-restorer' '$work/err'"
ok_if "... and nothing was created" test "$(kubectl -n prod get prestore -o name | wc -l)" = "$before"
as admin restore web-1 --from web-0-final --as dev
ok_if "restore as admin with --as dev (impersonation, as kubectl's): refused as dev" bash -c \
    "[ $rc = 1 ] && grep -qF 'you may not restore in namespace prod' '$work/err'"
as ops restore web-1 --from web-1-1796000030
ok_if "restore from a checkpoint that failed: refused before anything" bash -c "[ $rc = 1 ] && grep -qF 'is Failed, not Succeeded' '$work/err'"
as ops restore web-1 --from 'not a ref/x'
ok_if "restore from a malformed reference: refused naming it" bash -c "[ $rc = 1 ] && grep -qF -- '--from not a ref/x' '$work/err'"
as ops restore web-1 --from web-0-final --dry-run
ok_if "restore --dry-run as ops: the API server accepts, nothing is created" bash -c \
    "[ $rc = 0 ] && grep -q 'server dry run' '$work/out' && [ \"\$(kubectl -n prod get prestore -o name | wc -l)\" = '$before' ]"
as ops restore web-1 --from web-0-final -o json
ok_if "restore as ops (stasis-restorer): a PodRestore of web-0's checkpoint into web-1, its lineage and UID" bash -c \
    "set -o pipefail; [ $rc = 0 ] && n=\$(jq -er .metadata.name '$work/out') && kubectl -n prod get prestore \"\$n\" -o json | jq -e '.spec.checkpointRef == \"prod_deployment_web.1/0000000001\" and .spec.lineage == \"prod_deployment_web.1\" and .spec.targetPodName == \"web-1\" and .spec.targetPodUID == \"$UID1\" and .spec.sourcePodName == \"web-0\"'"
as ops why web-1
ok_if "why web-1: shows that PodRestore" bash -c "grep -Eq '^  web-1-restore-[a-z0-9]+ +prod_deployment_web.1/0000000001' '$work/out'"
# a pod not created yet: the PodRestore is named as the pod (the webhook makes the pod wait for it)
as ops restore web-9 --from web-0-final
ok_if "restore into web-9, not created yet: a PodRestore named web-9, without a target UID, said to wait for the pod" bash -c \
    "[ $rc = 0 ] && grep -qF 'podrestore.stasis.dev/web-9 created: pod web-9 resumes from prod_deployment_web.1/0000000001 once it is created' '$work/out' &&
     kubectl -n prod get prestore web-9 -o json | jq -e '.spec.targetPodName == \"web-9\" and (.spec | has(\"targetPodUID\") | not)'"
as ops restore web-9 --from web-0-final
ok_if "... a second time: refused, naming the PodRestore to delete first" bash -c \
    "[ $rc = 1 ] && grep -qF 'podrestore prod/web-9 exists already' '$work/err' && grep -qF 'kubectl -n prod delete podrestore web-9' '$work/err'"

# ------------------------------------------------------------------ advise
# Namespace spot: one Deployment per check (its pods made by hand, owned by a ReplicaSet
# <app>-h1 as the Deployment controller names them; no controller-manager runs here), one that
# passes every check, and two nodes as GKE labels them: a spot node of pool gpu with GKE's own
# taint, an on-demand node of pool main.
kubectl create namespace spot >/dev/null
kubectl -n spot create serviceaccount default >/dev/null
kubectl create -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Node
metadata: {name: gke-spot-1, labels: {cloud.google.com/gke-nodepool: gpu, cloud.google.com/gke-spot: "true"}}
spec:
  providerID: gce://proj/europe-west4-a/gke-spot-1
  taints: [{key: cloud.google.com/gke-spot, value: "true", effect: NoSchedule}]
---
apiVersion: v1
kind: Node
metadata: {name: gke-main-1, labels: {cloud.google.com/gke-nodepool: main}}
spec: {providerID: gce://proj/europe-west4-a/gke-main-1}
EOF
tolerate='{"tolerations":[{"key":"cloud.google.com/gke-spot","operator":"Equal","value":"true","effect":"NoSchedule"}]}'
affinity='{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"cloud.google.com/gke-spot","operator":"In","values":["true"]}]}]}}}}'
onspot=$(jq -nc --argjson t "$tolerate" --argjson a "$affinity" '$t + $a + {nodeName: "gke-spot-1", terminationGracePeriodSeconds: 25}')
spod() { # name app spec-json [annotations-json] [extra-labels-json]
    jq -nc --arg n "$1" --arg app "$2" --argjson spec "$3" --argjson ann "${4:-{\}}" --argjson l "${5:-{\"policy\":\"fixed\",\"pdb\":\"yes\"\}}" \
        '{apiVersion: "v1", kind: "Pod", metadata: {name: $n, labels: ({app: $app, "pod-template-hash": "h1"} + $l), annotations: $ann,
          ownerReferences: [{apiVersion: "apps/v1", kind: "ReplicaSet", name: ($app + "-h1"), uid: "00000000-0000-4000-8000-000000000001", controller: true}]},
          spec: ({runtimeClassName: "stasis", containers: [{name: "c", image: "i"}]} + $spec)}' | kubectl -n spot create -f - >/dev/null
}
spod grace-h1-a grace "$(jq -c '.terminationGracePeriodSeconds = 120' <<<"$onspot")"  # 120 s on GKE spot (30 s notice)
spod nopdb-h1-a nopdb "$onspot" '{}' '{"policy":"fixed"}'                                # no PodDisruptionBudget selects it
spod pinned-h1-a pinned "$onspot" '{"karpenter.sh/do-not-disrupt":"true"}'               # blocks consolidation
spod tolerates-h1-a tolerates "$(jq -c '. + {nodeName: "gke-main-1"}' <<<"$tolerate")"   # toleration, no affinity
spod wants-h1-a wants "$affinity"                                                          # affinity, no toleration (pending)
spod good-h1-a good "$onspot" '{"stasis.dev/lineage":"spot_deploy_good.1"}' '{"pdb":"yes"}'
spod plain-h1-a plain '{"runtimeClassName":null,"nodeName":"gke-spot-1"}'                 # not opted in: no advice
kubectl -n spot apply -f - >/dev/null <<'EOF'
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: spot-apps}
spec: {maxUnavailable: 1, selector: {matchLabels: {pdb: "yes"}}}
---
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: every-30s}
spec: {selector: {matchLabels: {policy: fixed}}, interval: 30s}
---
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: auto}
spec: {selector: {matchLabels: {app: good}}, interval: auto}
EOF
echo "# (advise) this script writes, as stasis's controller and agent would: the auto policy's status, a checkpoint's and a restore's"
kubectl -n spot patch ckptpolicy auto --subresource=status --type=merge -p '{"status":{"autoIntervals":[{"pod":"good-h1-a","nodePool":"gpu/spot","intervalMillis":72480,"optimumMillis":72480,"costMillis":1500,"costMeasured":true,"mtbfSeconds":1800,"interruptions":3,"exposureSeconds":5400}]}}' >/dev/null
GOOD_UID=$(kubectl -n spot get pod good-h1-a -o jsonpath='{.metadata.uid}')
printf 'apiVersion: stasis.dev/v1alpha1\nkind: PodCheckpoint\nmetadata: {name: good-1}\nspec: {sourcePodName: good-h1-a, reason: Heartbeat}\n' | kubectl -n spot create -f - >/dev/null
kubectl -n spot patch pckpt good-1 --subresource=status --type=merge -p "{\"status\":{\"phase\":\"Succeeded\",\"sourcePodUID\":\"$GOOD_UID\",\"lineage\":\"spot_deploy_good.1\",\"startTime\":\"$(ts 40)\",\"freezeMillis\":300,\"uploadMillis\":1200,\"totalMillis\":1600,\"sizeBytes\":1048576}}" >/dev/null
printf 'apiVersion: stasis.dev/v1alpha1\nkind: PodRestore\nmetadata: {name: good-r}\nspec: {checkpointRef: spot_deploy_good.1/0000000001, targetPodName: good-h1-a, lineage: spot_deploy_good.1}\n' | kubectl -n spot create -f - >/dev/null
kubectl -n spot patch prestore good-r --subresource=status --type=merge -p '{"status":{"phase":"Restored","fetchMillis":1200,"restoreMillis":800}}' >/dev/null

as admin advise -n spot -o json
[ -z "${STASIS_ADVISE_SAMPLE:-}" ] || cp "$work/out" "$STASIS_ADVISE_SAMPLE.json"
ok_if "advise -o json: exit 0 with findings (advice, not an error), the six opted-in workloads (plain is not)" \
    bash -c "[ $rc = 0 ] && jq -e '[.workloads[].workload] == [\"deployment/good\",\"deployment/grace\",\"deployment/nopdb\",\"deployment/pinned\",\"deployment/tolerates\",\"deployment/wants\"] and .notes == [] and .scope == \"namespace spot\"' '$work/out'"
ok_if "advise: each workload fails its own check and no other; the one set up right gets none" \
    jqe '[.workloads[] | {(.workload): [.findings[].code]}] | add == {"deployment/good": [], "deployment/grace": ["GraceExceedsNotice"],
         "deployment/nopdb": ["NoDisruptionBudget"], "deployment/pinned": ["DoNotDisruptBlocksConsolidation"],
         "deployment/tolerates": ["TolerationWithoutAffinity"], "deployment/wants": ["AffinityWithoutToleration"]}'
ok_if "advise: a finding says what, why and how to fix (the grace against GCP's 30 s notice)" \
    jqe '.workloads[1].findings[0] | .severity == "warning" and (.what | contains("120 s")) and (.what | contains("gcp")) and (.fix | contains("at most 30"))'
ok_if "advise: the spot node's pool and cloud; a taint every spot node carries is named in the fix" \
    jqe '(.workloads[1] | .nodePool == "gpu/spot" and .spot and .provider == "gcp") and (.workloads[5].findings[0].fix | contains("cloud.google.com/gke-spot"))'
ok_if "advise: each figure with its source (policy, policy status: its own pod's or its pool's, measured, default) and the goodput" \
    jqe '(.workloads[0] | .intervalSeconds == {value: 72.48, source: "policyStatus", from: "policy auto (auto), its status for pod good-h1-a"}
         and .evictionsPerHour.value == 2 and .evictionsPerHour.source == "policyStatus"
         and .checkpointSeconds.value == 1.5 and .checkpointSeconds.source == "measured" and .freezeSeconds.value == 0.3
         and .restoreSeconds == {value: 2, source: "measured", from: "its last restore (the PodRestore'"'"'s creation to restored)"}
         and .coldStartSeconds.source == "default" and .goodput.lossPerEvictionSeconds == 38.24 and .goodput.withStasis > 0 and .goodput.withoutStasis > 0)
         and (.workloads[1] | .intervalSeconds.value == 30 and .intervalSeconds.source == "policy"
              and .evictionsPerHour.source == "policyStatus" and (.evictionsPerHour.from | contains("pool gpu/spot")))
         and (.workloads[4] | .nodePool == "main" and .evictionsPerHour.source == "default")'
ok_if "advise -o json: the workload keys scripts read" \
    jqe '.workloads[0] | keys == ["checkpointSeconds","coldStartSeconds","evictionsPerHour","findings","freezeSeconds","goodput","intervalSeconds",
         "lostWorkWithoutSeconds","namespace","nodePool","pods","policy","provider","restoreSeconds","spot","workload"]'
as admin advise -n spot
cp "$work/out" "$work/advise.txt"
ok_if "advise: a kubectl table, one row per workload, then the figures with their sources and the findings" bash -c \
    "head -1 '$work/out' | grep -Eq '^WORKLOAD +PODS +POOL +CHECKS FAILED +INTERVAL +CHECKPOINT +LOSS/EVICTION +GOODPUT WITHOUT → WITH\$' &&
     grep -Eq '^deployment/good +1 +gpu/spot +0 +72s +1.5s \(frozen 300ms\) +38s +[0-9.]+% → [0-9.]+%\$' '$work/out' &&
     grep -Eq '^deployment/grace +1 +gpu/spot +1 +30s ' '$work/out' &&
     grep -q '^  interval          72s       policy status: policy auto (auto)' '$work/out' &&
     grep -q '^  Warning  GraceExceedsNotice: terminationGracePeriodSeconds is 120 s' '$work/out' && grep -q '^           fix: ' '$work/out'"
as admin advise -A
ok_if "advise -A: a NAMESPACE column and the workloads of every namespace (prod's pods without an owner are their own workloads)" bash -c \
    "[ $rc = 0 ] && head -1 '$work/out' | grep -Eq '^NAMESPACE +WORKLOAD +PODS ' && grep -Eq '^prod +pod/web-0 +1 ' '$work/out' &&
     grep -Eq '^spot +deployment/good +1 ' '$work/out' && grep -q '^deployment/good in spot:' '$work/out'"
as admin advise -n spot -o yaml
ok_if "advise -o yaml: the same report" bash -c "[ $rc = 0 ] && grep -q '^scope: namespace spot' '$work/out' && grep -q 'code: GraceExceedsNotice' '$work/out'"
kubectl -n spot create rolebinding viewer --clusterrole=stasis-checkpoint-viewer --user=dev >/dev/null
kubectl -n spot create role reader --verb=get,list --resource=pods,poddisruptionbudgets >/dev/null
kubectl -n spot create rolebinding reader --role=reader --user=dev >/dev/null
as dev advise -n spot -o json
ok_if "advise as a namespace user who may not list nodes: exit 0, the report says what it could not check" \
    bash -c "[ $rc = 0 ] && jq -e '(.notes[0] | contains(\"nodes are not readable\")) and (.workloads[0].nodePool == \"gpu/spot\") and .workloads[1].provider == null
             and (.workloads[1].findings | map(.code) | index(\"GraceExceedsNotice\") == null)' '$work/out'"
as nobody advise -n spot
ok_if "advise without the right to list pods: exit 1, the API server's refusal" \
    bash -c "[ $rc = 1 ] && grep -qF 'listing pods: forbidden' '$work/err'"
[ -z "${STASIS_ADVISE_SAMPLE:-}" ] || cp "$work/advise.txt" "$STASIS_ADVISE_SAMPLE"

# ------------------------------------------------------------------ export
# A checkpoint of web-1 in a real S3 store (s3s-fs): a minimal kubelet archive imported by the
# stasis CLI under prod's data key; that key wrapped by a cluster key in stasis's namespace, as
# stasis keeps them; a PodCheckpoint naming it, as the agent would write it.
s3fs="$(newest 's3s-fs-*/bin/s3s-fs')"
stasis_cli="${STASIS_CLI:-$root/target/debug/stasis}"
if [[ -z "$s3fs" || ! -x "$stasis_cli" ]]; then
    echo "SKIP export checks: need s3s-fs (scripts/build-platform s3s-fs) and the stasis CLI at $stasis_cli (cargo build -p stasis-cli)"
    [ -z "${CI:-}" ] || fail "export checks cannot run in CI"
else
    s3port=$(free_port); mkdir -p "$work/s3/ckpts"
    "$s3fs" --host 127.0.0.1 --port "$s3port" --access-key stasis --secret-key stasis-secret "$work/s3" >"$work/s3.log" 2>&1 &
    stop_at_exit $!
    export AWS_ENDPOINT_URL=http://127.0.0.1:$s3port AWS_ACCESS_KEY_ID=stasis AWS_SECRET_ACCESS_KEY=stasis-secret AWS_REGION=us-east-1
    export STASIS_STORE=s3://ckpts/c
    wait_for 10 bash -c "exec 3<>/dev/tcp/127.0.0.1/$s3port"
    ck=$(openssl rand -hex 32); dk=$(openssl rand -hex 32)
    (umask 077; echo "$dk" >"$work/prod.key")
    # wrapped as stasis wraps a data key: 01 ‖ nonce ‖ AES-256-GCM(cluster key, aad = the namespace's)
    wrapped=$(python3 -c 'import base64, os, sys
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
n = os.urandom(12)
print(base64.b64encode(b"\x01" + n + AESGCM(bytes.fromhex(sys.argv[1])).encrypt(n, bytes.fromhex(sys.argv[2]), b"stasis.dev/data-key/v1/prod")).decode())' "$ck" "$dk")
    kubectl create namespace stasis-system >/dev/null
    kubectl -n stasis-system create secret generic stasis-cluster-key --from-literal=cluster.key="$ck" >/dev/null
    printf 'apiVersion: v1\nkind: Secret\nmetadata: {name: stasis-key-prod, labels: {stasis.dev/namespace: prod}}\ndata: {wrapped: %s}\n' "$wrapped" \
        | kubectl -n stasis-system create -f - >/dev/null
    mkdir -p "$work/arc/checkpoint" "$work/scratch"
    head -c 300000 /dev/urandom >"$work/arc/checkpoint/pages-1.img"; echo i >"$work/arc/checkpoint/inventory.img"
    echo '{"id":"c0ffee","name":"c"}' >"$work/arc/config.dump"
    tar -C "$work/arc" -cf "$work/in.tar" config.dump checkpoint
    ref=$("$stasis_cli" import "$work/in.tar" --key "$work/prod.key" --workload prod_deployment_web.1 --work-dir "$work/scratch" -o json | jq -r .reference)
    ckpt web-1-export "${ref#*/}" web-1 "$UID1" Manual Succeeded 1 300000 10 node-2

    as dev export web-1 -f "$work/dev.tar" --work-dir "$work/scratch"
    ok_if "export without the permission to restore: refused with restore's reason, no file" bash -c \
        "[ $rc = 1 ] && grep -qF 'exporting a checkpoint needs the permission to restore it: you may not restore in namespace prod' '$work/err' && grep -qF stasis-restorer '$work/err' && [ ! -e '$work/dev.tar' ]"
    as ops export web-1 -f "$work/ops.tar" --work-dir "$work/scratch"
    ok_if "export by a restorer who may not read stasis's key Secrets: refused, naming the Secret and --key-file" bash -c \
        "[ $rc = 1 ] && grep -qF 'Secret stasis-system/stasis-cluster-key' '$work/err' && grep -qF -- '--key-file' '$work/err' && [ ! -e '$work/ops.tar' ]"
    as ops export web-1 -f "$work/ops.tar" --key-file "$work/prod.key" --work-dir "$work/scratch"
    ok_if "export web-1 with the namespace's key file: its newest checkpoint, CRIU's files as imported" bash -c \
        "[ $rc = 0 ] && grep -qF 'exported $ref to $work/ops.tar' '$work/out' && tar -xOf '$work/ops.tar' checkpoint/pages-1.img | cmp -s - '$work/arc/checkpoint/pages-1.img'"
    as admin export web-1-export -f "$work/admin.tar" -o json --work-dir "$work/scratch"
    ok_if "export of a named PodCheckpoint with the key from the cluster (an operator): the archive, 0600, -o json" bash -c \
        "[ $rc = 0 ] && jq -e '.reference == \"$ref\" and .images == 2' '$work/out' && [ \$(stat -c %a '$work/admin.tar') = 600 ] && tar -xOf '$work/admin.tar' checkpoint/pages-1.img | cmp -s - '$work/arc/checkpoint/pages-1.img'"
    as admin export web-1 -f "$work/admin.tar" --work-dir "$work/scratch"
    ok_if "export onto an existing file: refused, the file left" bash -c "[ $rc = 1 ] && grep -qF 'exists: choose another --file' '$work/err' && tar -xOf '$work/admin.tar' checkpoint/pages-1.img | cmp -s - '$work/arc/checkpoint/pages-1.img'"
    as admin export web-1 -f "$work/c.tar" --container other --work-dir "$work/scratch"
    ok_if "export --container of a one-container checkpoint: refused, as stasis export does" bash -c "[ $rc = 1 ] && grep -qF 'leave out --container' '$work/err'"
    as admin export web-0-final -f "$work/gone.tar" --work-dir "$work/scratch"
    ok_if "export of a PodCheckpoint whose reference the store cannot take: an error naming it" bash -c "[ $rc = 1 ] && grep -qF 'prod_deployment_web.1/0000000001' '$work/err'"
    ok_if "export leaves no plaintext scratch behind" bash -c "[ -z \"\$(ls -A '$work/scratch')\" ]"
fi

if [ "$failures" -gt 0 ]; then
    echo "apiserver-kubectl: $failures check(s) failed" >&2
    exit 1
fi
echo "apiserver-kubectl: all checks passed"
