#!/usr/bin/env bash
# End-to-end test of the Helm chart on the local cluster: scripts/cluster install-stasis, what it
# puts on the nodes and into the API, a pod of the stasis RuntimeClass, the RBAC roles, upgrades
# and rollouts that must not disturb the nodes, an upgrade from the previous defaults (every node
# holding the cluster key, agents writing any node's objects) to the key broker and the agent
# policy that restores a checkpoint taken before it, the leading controller's chunk garbage
# collection sweeping an orphan chunk from the cluster's S3, and scripts/cluster uninstall-stasis leaving
# nothing behind. Needs root. Prints "N passed, M failed" (and skips with their reasons) and exits
# non-zero when a check failed. STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up (and stasis
# installed) at the end; STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
# shellcheck disable=SC2034 # (lib.sh uses it)
WORK=$(mktemp -d /tmp/stasis-e2e-install.XXXXXX)
NS=e2e-install
SNS=stasis-system
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin install

# ------------------------------------------------------------------ up, install
t=$(date +%s.%N)
if ! "$CLUSTER" up; then fail "scripts/cluster up"; finish; fi
echo "# cluster up: $(secs "$t") s"
eval "$("$CLUSTER" env)"
NODES=$("$CLUSTER" nodes | tr '\n' ' ')

t=$(date +%s.%N)
# the first install has the defaults of earlier releases (node confinement off); the upgrade below
# turns them to today's
OLD_DEFAULTS="--set keys.broker.enabled=false --set admissionPolicy.agentOwnNodeOnly=false"
out=$(STASIS_HELM_ARGS="$OLD_DEFAULTS ${STASIS_HELM_ARGS:-}" "$CLUSTER" install-stasis 2>&1); rc=$?
echo "$out" | sed 's/^/# /'
check "scripts/cluster install-stasis (keys.broker.enabled=false, admissionPolicy.agentOwnNodeOnly=false)" test $rc -eq 0
echo "# install-stasis: $(secs "$t") s"
[ $rc -eq 0 ] || finish
ROOTFS=$REPO/target/images/stasis/rootfs
# stand-ins: install-stasis runs them for components the image does not have yet
VALUES=$(helm get values stasis -n "$SNS" -a -o json)
AGENT_REAL=1 CONTROLLER_REAL=1
[ "$(jq -r .agent.standIn <<<"$VALUES")" = true ] && AGENT_REAL=0
[ "$(jq -r .controller.standIn <<<"$VALUES")" = true ] && CONTROLLER_REAL=0
[ $AGENT_REAL = 1 ] || skip "stasisd checks" "the agent runs as a stand-in (the image has no stasisd, or STASIS_HELM_ARGS asked for it)"

# ------------------------------------------------------------------ API objects
for crd in checkpointpolicies podcheckpoints podrestores; do
  check "CRD $crd.stasis.dev established" kubectl wait --for=condition=Established "crd/$crd.stasis.dev" --timeout=30s
done
for r in stasis-checkpoint-viewer stasis-checkpoint-requester stasis-restorer; do
  check "ClusterRole $r exists" kubectl get clusterrole "$r"
done
check "RuntimeClass stasis: handler stasis, nodeSelector stasis.dev/ready=true" \
  test "$(kubectl get runtimeclass stasis -o jsonpath='{.handler} {.scheduling.nodeSelector.stasis\.dev/ready}')" = "stasis true"
check "cluster key Secret (made by stasis-controller at its start): 64 hex digits" retry 60 bash -c \
  "kubectl -n $SNS get secret stasis-cluster-key -o jsonpath='{.data.cluster\.key}' | base64 -d | grep -Eqx '[0-9a-f]{64}'"
check "cluster key Secret made by stasis-controller, not by the chart (not in the Helm release)" bash -c \
  "kubectl -n $SNS get secret stasis-cluster-key -o json | jq -e '.metadata.labels[\"app.kubernetes.io/managed-by\"] == \"stasis-controller\" and (.metadata.annotations[\"meta.helm.sh/release-name\"] == null)'"
check "helm template renders no key material (GitOps renders cannot replace the cluster key)" bash -c \
  "set -o pipefail; out=\$(helm get values stasis -n $SNS -o yaml | helm template stasis $REPO/deploy/helm/stasis -n $SNS -f -) && grep -q 'kind: DaemonSet' <<<\"\$out\" && ! grep -Eq 'cluster\.key:|retired\.keys:' <<<\"\$out\""

# ------------------------------------------------------------------ the nodes
for n in $NODES; do
  R=$("$CLUSTER" node-root "$n")
  check "$n: an agent pod is Running and ready" bash -c \
    "kubectl -n $SNS get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=$n -o jsonpath='{.items[*].status.containerStatuses[*].ready}' | grep -qw true"
  check "$n: stasis-runc installed at /opt/stasis/bin (the image's binary, mode 755)" bash -c \
    "cmp -s '$ROOTFS/usr/local/bin/stasis-runc' '$R/opt/stasis/bin/stasis-runc' && test \"\$(stat -c %a '$R/opt/stasis/bin/stasis-runc')\" = 755"
  check "$n: containerd drop-in registers handler stasis -> /opt/stasis/bin/stasis-runc" bash -c \
    "grep -q 'runtimes.stasis\]' '$R/etc/containerd/conf.d/90-stasis.toml' && grep -q 'BinaryName = \"/opt/stasis/bin/stasis-runc\"' '$R/etc/containerd/conf.d/90-stasis.toml' && grep -q 'pod_annotations = \[\"stasis.dev/\*\"\]' '$R/etc/containerd/conf.d/90-stasis.toml'"
  check "$n: the kubelet reports runtime handler stasis" retry 30 bash -c \
    "kubectl get node $n -o jsonpath='{.status.runtimeHandlers[*].name}' | tr ' ' '\n' | grep -qx stasis"
  check "$n: CRIU not installed (the node has CRIU >= 4.2)" test ! -e "$R/opt/stasis/lib/criu"
done
echo "# installer log (worker-1):"
kubectl -n "$SNS" logs "$(kubectl -n "$SNS" get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=worker-1 -o name | head -1)" -c node-installer 2>&1 | sed 's/^/#   /'

if [ $CONTROLLER_REAL = 1 ]; then
  check "controller Deployment available" kubectl -n "$SNS" wait --for=condition=Available deploy/stasis-controller --timeout=60s
  check "webhook: failurePolicy Ignore, caBundle = the chart's CA" bash -c \
    "test \"\$(kubectl get mutatingwebhookconfiguration stasis-$SNS -o jsonpath='{.webhooks[0].failurePolicy}')\" = Ignore &&
     test \"\$(kubectl get mutatingwebhookconfiguration stasis-$SNS -o jsonpath='{.webhooks[0].clientConfig.caBundle}')\" = \"\$(kubectl -n $SNS get secret stasis-webhook-tls -o jsonpath='{.data.ca\.crt}')\""
else
  skip "controller and webhook" "the controller runs as a stand-in (the image has no stasis-controller, or STASIS_HELM_ARGS asked for it): no webhook registered"
fi

# ------------------------------------------------------------------ a pod of the RuntimeClass
new_ns "$NS"
if [ $AGENT_REAL = 1 ]; then
  check "the agents label their nodes stasis.dev/ready=true" retry 60 bash -c \
    "test \"\$(kubectl get nodes -l stasis.dev/ready=true -o name | wc -l)\" -ge 2"
else
  skip "node-ready label set by the agent" "stand-in agent: the test labels the nodes stasis.dev/ready=true itself"
  kubectl label node $NODES stasis.dev/ready=true --overwrite >/dev/null
fi
kubectl -n "$NS" apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: opted-in}
spec:
  runtimeClassName: stasis
  nodeSelector: {kubernetes.io/hostname: worker-1}
  terminationGracePeriodSeconds: 2
  containers:
  - {name: app, image: stasis.local/testapp:dev, imagePullPolicy: Never}
EOF
check "a pod with runtimeClassName: stasis runs (cold start)" kubectl -n "$NS" wait --for=condition=Ready pod/opted-in --timeout=120s
R1=$("$CLUSTER" node-root worker-1)
CID=$(kubectl -n "$NS" get pod opted-in -o jsonpath='{.status.containerStatuses[0].containerID}'); CID=${CID#containerd://}
BUNDLE=$R1/run/containerd/io.containerd.runtime.v2.task/k8s.io/$CID
check "... its shim runs /opt/stasis/bin/stasis-runc" grep -qs '/opt/stasis/bin/stasis-runc' "$BUNDLE/options.json"
check "... and the wrapper logged a cold start" grep -qs 'cold start' "$BUNDLE/log.json"
check "... and it answers" retry 30 kubectl -n "$NS" exec opted-in -- /testapp get http://localhost:8080/

# ------------------------------------------------------------------ RBAC
kubectl -n "$NS" create rolebinding e2e-edit --clusterrole=edit --user=e2e-editor >/dev/null
kubectl -n "$NS" create rolebinding e2e-admin --clusterrole=admin --user=e2e-admin >/dev/null
kubectl -n "$NS" create rolebinding e2e-view --clusterrole=view --user=e2e-viewer >/dev/null
kubectl -n "$NS" create rolebinding e2e-restore --clusterrole=stasis-restorer --user=e2e-restorer >/dev/null
can() { [ "$(kubectl -n "$NS" auth can-i "$1" "$2" --as="$3" 2>/dev/null)" = "$4" ]; }
check "RBAC: view may list podcheckpoints (aggregated viewer role)" retry 20 can list podcheckpoints.stasis.dev e2e-viewer yes
check "RBAC: view may not create podcheckpoints" can create podcheckpoints.stasis.dev e2e-viewer no
check "RBAC: edit may create podcheckpoints (aggregated requester role)" retry 20 can create podcheckpoints.stasis.dev e2e-editor yes
check "RBAC: edit may not create podrestores" can create podrestores.stasis.dev e2e-editor no
check "RBAC: admin may not create podrestores (restore is never aggregated)" can create podrestores.stasis.dev e2e-admin no
check "RBAC: stasis-restorer may create podrestores" can create podrestores.stasis.dev e2e-restorer yes
check "RBAC: stasis-restorer is bound in its namespace only" bash -c "[ \"\$(kubectl -n default auth can-i create podrestores.stasis.dev --as=e2e-restorer)\" = no ]"

# ------------------------------------------------------------------ stasis.dev/ keys are stasis's (admission)
# The chart's ValidatingAdmissionPolicies (the API server refuses) and the webhook (removes what a
# pod was created with); crates/controller/tests/admission-policy.sh covers the policies in full.
check "admission policies installed and bound" bash -c \
  "kubectl get validatingadmissionpolicy stasis-$SNS-pods stasis-$SNS-checkpoints stasis-$SNS-templates && kubectl get validatingadmissionpolicybinding stasis-$SNS-pods stasis-$SNS-checkpoints stasis-$SNS-templates"
kpod() { # name labels-json annotations-json
  printf '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"%s","labels":%s,"annotations":%s},"spec":{"runtimeClassName":"stasis","nodeSelector":{"kubernetes.io/hostname":"worker-1"},"terminationGracePeriodSeconds":2,"containers":[{"name":"app","image":"stasis.local/testapp:dev","imagePullPolicy":"Never"}]}}' "$1" "$2" "$3"
}
refused_as() { # fragment user command...: the API server refuses, naming fragment
  local frag=$1 user=$2 out; shift 2
  out=$("$@" --as="$user" 2>&1) && return 1
  grep -qF -- "$frag" <<<"$out"
}
# (a pod of another RuntimeClass: the webhook leaves it alone, so only the policy decides)
check "edit may not create a pod with stasis.dev/decision=Restore (refused by the API server)" \
  refused_as "may not create podrestores.stasis.dev" e2e-editor bash -c "$(declare -f kpod); kpod evil '{}' '{\"stasis.dev/decision\":\"Restore\"}' | jq 'del(.spec.runtimeClassName)' | kubectl -n $NS create -f - \"\$@\"" _
check "edit may not annotate a running pod stasis.dev/decision=Restore" \
  refused_as "only stasis-controller" e2e-editor kubectl -n "$NS" annotate pod opted-in stasis.dev/decision=Restore --overwrite
check "edit may set stasis.dev/cold-start" kubectl -n "$NS" annotate pod opted-in stasis.dev/cold-start=true --as=e2e-editor
if [ $CONTROLLER_REAL = 1 ]; then
  kpod copied '{"stasis.dev/claim-token":"0123456789abcdef0123456789abcdef","stasis.dev/system":"true"}' '{"stasis.dev/lineage":"x","stasis.dev/decision-reported":"true"}' \
    | kubectl -n "$NS" create -f - --as=e2e-editor >/dev/null 2>&1
  check "the webhook removes the stasis.dev/ keys a pod was created with (the label that skipped it too)" bash -c \
    "kubectl -n $NS get pod copied -o json | jq -e '(.metadata.labels // {} | has(\"stasis.dev/system\") | not) and (.metadata.labels[\"stasis.dev/claim-token\"] // \"\") != \"0123456789abcdef0123456789abcdef\" and (.metadata.annotations[\"stasis.dev/lineage\"] // \"\") != \"x\"'"
  kubectl -n "$NS" delete pod copied --wait=false >/dev/null 2>&1
  # scripts/cluster gives the API server a client certificate for webhooks and the chart its CA:
  # an admission review from anywhere else ends in the TLS handshake
  out=$(echo '{}' | kubectl -n "$NS" exec -i opted-in -- /testapp request POST "https://stasis-controller.$SNS.svc/mutate" - 2>&1)
  check "the webhook serves only the API server: a review from a pod is refused in the TLS handshake ($(tr '\n' ' ' <<<"$out" | cut -c1-100))" \
    grep -Eq "tls: (certificate required|handshake failure|bad certificate)" <<<"$out"
fi

# ------------------------------------------------------------------ a checkpoint taken under the old defaults
# A counter Deployment checkpointed by agents that hold the cluster key, scaled to 0 (its final
# checkpoint); after the upgrade it must resume from that checkpoint through the key broker.
UNS=e2e-upgrade
if [ $AGENT_REAL = 1 ] && [ $CONTROLLER_REAL = 1 ]; then
  [ -f "$REPO/target/images/stasis-counter.oci.tar" ] || "$REPO/scripts/build-counter-image" >/dev/null
  "$CLUSTER" load-image "$REPO/target/images/stasis-counter.oci.tar" >/dev/null
  check "old defaults: the agents mount the cluster key Secret" bash -c \
    "kubectl -n $SNS get daemonset stasis-agent -o json | jq -e '[.spec.template.spec.volumes[].secret.secretName // empty] | index(\"stasis-cluster-key\")'"
  scenario "$UNS" up 10s 1 64
  U1=$(wait_one_counting "$UNS" up 90) || { fail "old defaults: the counter pod runs"; diagnose "$UNS"; }
fi
if [ -n "${U1:-}" ]; then
  follow "$UNS" "$U1"
  check "old defaults: a heartbeat PodCheckpoint Succeeded" retry 60 n_ckpts "$UNS" "$U1" 1
  kubectl -n "$UNS" scale deployment up --replicas=0 >/dev/null
  check "old defaults: scaled to 0, its pod gone" retry 60 bash -c "! kubectl -n $UNS get pod $U1"
  U_LAST=$(ckpts "$UNS" "$U1" | tail -1); U_REF=$(awk '{print $3}' <<<"$U_LAST")
  U_STOP=$(last_count "$U1")
  echo "# checkpoints of $U1 (old defaults):"; ckpts "$UNS" "$U1" | sed 's/^/#   /'
  check "old defaults: its newest checkpoint is its final one ($U_REF)" grep -q ' Termination$' <<<"$U_LAST"
fi

# ------------------------------------------------------------------ upgrade and rollout leave the nodes alone
PIDS_BEFORE=$(for n in $NODES; do cat "$("$CLUSTER" node-root "$n")/run/containerd/containerd.pid"; done | tr '\n' ' ')
CERT_BEFORE=$(kubectl -n "$SNS" get secret stasis-webhook-tls -o jsonpath='{.data.tls\.crt}' 2>/dev/null)
KEY_BEFORE=$(kubectl -n "$SNS" get secret stasis-cluster-key -o jsonpath='{.data.cluster\.key}')
# (the chunk garbage collection every 5 s instead of 6 h: its check below)
out=$(STASIS_INSTALL_NO_BUILD=1 STASIS_HELM_ARGS="--set gc.intervalSeconds=5 ${STASIS_HELM_ARGS:-}" "$CLUSTER" install-stasis 2>&1); rc=$?
check "install-stasis again (helm upgrade to the chart's defaults)" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
VALUES=$(helm get values stasis -n "$SNS" -a -o json)
check "... which turn the key broker and the agent policy on" \
  jq -e '.keys.broker.enabled == true and .admissionPolicy.agentOwnNodeOnly == true' <<<"$VALUES"
check "... the agents mount no cluster key and may read no Secret" bash -c \
  "kubectl -n $SNS get daemonset stasis-agent -o json | jq -e '[.spec.template.spec.volumes[].secret.secretName // empty] | index(\"stasis-cluster-key\") == null' &&
   [ \"\$(kubectl -n $SNS auth can-i get secrets --as=system:serviceaccount:$SNS:stasis-agent)\" = no ]"
check "... the agent policy is installed and bound" bash -c \
  "kubectl get validatingadmissionpolicy stasis-$SNS-agent && kubectl get validatingadmissionpolicybinding stasis-$SNS-agent"
check "... keeps the cluster key" test "$(kubectl -n "$SNS" get secret stasis-cluster-key -o jsonpath='{.data.cluster\.key}')" = "$KEY_BEFORE"
if [ $CONTROLLER_REAL = 1 ]; then
  check "... keeps the webhook certificate" test "$(kubectl -n "$SNS" get secret stasis-webhook-tls -o jsonpath='{.data.tls\.crt}')" = "$CERT_BEFORE"
fi
check "... and restarts no containerd" test "$(for n in $NODES; do cat "$("$CLUSTER" node-root "$n")/run/containerd/containerd.pid"; done | tr '\n' ' ')" = "$PIDS_BEFORE"
t=$(date +%s.%N)
kubectl -n "$SNS" rollout restart daemonset/stasis-agent >/dev/null
check "a rolling update of the agents completes" kubectl -n "$SNS" rollout status daemonset/stasis-agent --timeout=180s
echo "# agent rollout: $(secs "$t") s"
check "... and the old pods left the nodes installed (new owner in the manifest)" bash -c "for n in $NODES; do
    r=\$('$CLUSTER' node-root \$n)
    test -x \$r/opt/stasis/bin/stasis-runc && test -f \$r/etc/containerd/conf.d/90-stasis.toml || exit 1
    owner=\$(awk '\$1 == \"owner\" {print \$2}' \$r/opt/stasis/.installed)
    kubectl -n $SNS get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=\$n -o jsonpath='{.items[*].metadata.uid}' | grep -qw \"\$owner\" || exit 1
  done"
check "... the handler is still registered" bash -c "for n in $NODES; do kubectl get node \$n -o jsonpath='{.status.runtimeHandlers[*].name}' | tr ' ' '\n' | grep -qx stasis || exit 1; done"
check "... the opted-in pod still runs" kubectl -n "$NS" exec opted-in -- /testapp hostname
# An agent pod deleted by hand is replaced at once: the old pod's uninstaller and the new pod's
# installer run together, and take turns on the node (the node lock); whichever goes first, the
# node ends installed and owned by the new pod.
OLD_AGENT=$(kubectl -n "$SNS" get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=worker-2 -o jsonpath='{.items[0].metadata.name}')
kubectl -n "$SNS" delete pod "$OLD_AGENT" --wait=false >/dev/null
check "an agent pod deleted by hand ($OLD_AGENT) is replaced, and its successor is ready" retry 120 bash -c "
    p=\$(kubectl -n $SNS get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=worker-2 -o jsonpath='{range .items[?(@.metadata.name!=\"$OLD_AGENT\")]}{.metadata.name}{\"\\n\"}{end}' | head -1)
    [ -n \"\$p\" ] && kubectl -n $SNS wait --for=condition=Ready pod/\$p --timeout=2s >/dev/null 2>&1"
check "... the old pod is gone" retry 120 bash -c "! kubectl -n $SNS get pod $OLD_AGENT >/dev/null 2>&1"
check "... worker-2 stays installed, owned by the successor" retry 30 bash -c "
    r=\$('$CLUSTER' node-root worker-2)
    test -x \$r/opt/stasis/bin/stasis-runc && test -f \$r/etc/containerd/conf.d/90-stasis.toml || exit 1
    owner=\$(awk '\$1 == \"owner\" {print \$2}' \$r/opt/stasis/.installed)
    kubectl -n $SNS get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=worker-2 -o jsonpath='{.items[*].metadata.uid}' | grep -qw \"\$owner\""
check "... and no node lock is left behind" bash -c "! test -e \$('$CLUSTER' node-root worker-2)/opt/stasis/.lock"
check "... the handler is registered on worker-2" retry 60 bash -c "kubectl get node worker-2 -o jsonpath='{.status.runtimeHandlers[*].name}' | tr ' ' '\\n' | grep -qx stasis"
if [ $AGENT_REAL = 1 ]; then
  # its node checks log each change; a stasis-runc removed under it leaves "not ready" last
  check "... and its agent finds the node ready for restores" retry 90 bash -c "
      p=\$(kubectl -n $SNS get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=worker-2 -o jsonpath='{.items[0].metadata.name}')
      kubectl -n $SNS logs \$p -c agent 2>/dev/null | grep -E '(node|not) ready for restores' | tail -1 | grep -q 'node ready for restores'"
fi
if [ -n "${U_REF:-}" ]; then
  t=$(date +%s.%N)
  kubectl -n "$UNS" scale deployment up --replicas=1 >/dev/null
  U2=$(wait_one_counting "$UNS" up 120) || { fail "new defaults: the counter pod runs again"; diagnose "$UNS"; }
fi
if [ -n "${U2:-}" ]; then
  follow "$UNS" "$U2"
  echo "# $U2 counting $(secs "$t") s after the scale-up, on $(node_of "$UNS" "$U2")"
  U_FIRST=$(first_count "$UNS" "$U2")
  check "new defaults: a PodRestore of $U2, Restored" retry 30 bash -c "$(declare -f restore_phase); [ \"\$(restore_phase $UNS $U2)\" = Restored ]"
  U_RREF=$(restore_ref "$UNS" "$U2")
  check "new defaults: ... from the checkpoint taken before the upgrade ($U_RREF)" bash -c "[ -n '$U_RREF' ] && grep -qF -- '$U_RREF' <<<'$U_LAST'"
  check "new defaults: it resumes where the old pod stopped (first count $U_FIRST, last $U_STOP)" \
    bash -c "[ -n '$U_FIRST' ] && [ -n '$U_STOP' ] && d=\$(( $U_STOP - $U_FIRST )) && [ \${d#-} -le 10 ]"
  check "new defaults: never state=CORRUPT" not_corrupt "$UNS" "$U2"
  check "new defaults: a heartbeat checkpoint of it Succeeded (key from the broker, status under the agent policy)" \
    retry 60 bash -c "$(declare -f ckpts); ckpts $UNS $U2 | grep -q ' Heartbeat\$'"
  echo "# checkpoints of $U2 (new defaults):"; ckpts "$UNS" "$U2" | sed 's/^/#   /'
fi

# ------------------------------------------------------------------ chunk garbage collection in the cluster
# What a checkpoint that retention dropped leaves in the bucket: chunk objects no manifest names.
# One is planted beside the counter's chunks (a copy of one of them under a name no manifest
# has, two hours old: past the 1 h grace); the leading controller's collection must delete it
# and keep every chunk the kept checkpoints name (the restore above and the heartbeats after it
# read them).
if [ $CONTROLLER_REAL = 1 ] && [ -n "${U2:-}" ]; then
  BUCKET_DIR=${STASIS_CLUSTER_STATE:-/var/lib/stasis-cluster}/s3/${STASIS_S3_BUCKET:-stasis-checkpoints}
  KEYDIR=$(find "$BUCKET_DIR/chunks" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -1 | cut -d' ' -f2)
  REAL=$(find "$KEYDIR" -type f 2>/dev/null | head -1)
  if [ -n "$REAL" ]; then
    ORPHAN=$KEYDIR/00/00$(openssl rand -hex 31)
    mkdir -p "$(dirname "$ORPHAN")" && cp "$REAL" "$ORPHAN" && touch -d '2 hours ago' "$ORPHAN"
    t=$(date +%s.%N)
    check "gc: the leading controller sweeps an orphan chunk from the cluster's S3" retry 30 test ! -e "$ORPHAN"
    echo "# orphan chunk swept after $(secs "$t") s"
    check "gc: ... and keeps the kept checkpoints' chunks ($(basename "$REAL"))" test -e "$REAL"
    check "gc: ... and logs each run (chunk garbage collection, chunks_swept)" bash -c \
      "kubectl -n $SNS logs -l app.kubernetes.io/component=controller --tail=-1 | grep 'chunk garbage collection' | grep -q chunks_swept"
  else
    fail "gc: no chunks of the counter in the cluster's S3 ($BUCKET_DIR)"
  fi
fi

# gone before the uninstall, whose checks count the nodes' opted-in pods
kubectl delete namespace "$UNS" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1


# ------------------------------------------------------------------ uninstall with an opted-in pod running
[ $AGENT_REAL = 1 ] || kubectl label node $NODES stasis.dev/ready- >/dev/null
t=$(date +%s.%N)
out=$("$CLUSTER" uninstall-stasis 2>&1); rc=$?
echo "$out" | sed 's/^/# /'
check "uninstall-stasis with an opted-in pod running" test $rc -eq 0
echo "# uninstall-stasis: $(secs "$t") s"
check "... says it kept the runtime handler on worker-1 for it" grep -q 'kept the stasis runtime handler .* on worker-1:' <<<"$out"
check "... the opted-in pod keeps running and answers (exec)" kubectl -n "$NS" exec opted-in -- /testapp get http://localhost:8080/
check "... stasis-runc and the drop-in kept on worker-1, gone from worker-2" bash -c \
  "test -x '$R1/opt/stasis/bin/stasis-runc' && test -f '$R1/etc/containerd/conf.d/90-stasis.toml' && R2=\$('$CLUSTER' node-root worker-2) && test ! -e \$R2/opt/stasis/bin/stasis-runc && test ! -e \$R2/etc/containerd/conf.d/90-stasis.toml"
check "... the runtime handler is gone from worker-2" retry 30 bash -c \
  "! kubectl get node worker-2 -o jsonpath='{.status.runtimeHandlers[*].name}' | tr ' ' '\n' | grep -qx stasis"
out=$(kubectl -n "$NS" run late --image=stasis.local/testapp:dev --image-pull-policy=Never \
  --overrides='{"apiVersion":"v1","spec":{"runtimeClassName":"stasis"}}' 2>&1); rc=$?
refused() { [ "$rc" -ne 0 ] && grep -q 'RuntimeClass "stasis" not found' <<<"$out"; }
check "... a new opted-in pod is refused ($(tail -1 <<<"$out"))" refused
t=$(date +%s.%N)
check "... the opted-in pod stops when deleted (through the kept wrapper)" kubectl -n "$NS" delete pod opted-in --wait=true --timeout=60s
echo "# delete of the opted-in pod after uninstall: $(secs "$t") s"

# ------------------------------------------------------------------ install and uninstall again: nothing left
out=$(STASIS_INSTALL_NO_BUILD=1 "$CLUSTER" install-stasis 2>&1); rc=$?
check "install-stasis again after the uninstall" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
[ $AGENT_REAL = 1 ] || kubectl label node $NODES stasis.dev/ready- >/dev/null
t=$(date +%s.%N)
out=$("$CLUSTER" uninstall-stasis 2>&1); rc=$?
echo "$out" | sed 's/^/# /'
check "scripts/cluster uninstall-stasis (its own check: nothing left on the nodes)" test $rc -eq 0
echo "# uninstall-stasis: $(secs "$t") s"
for n in $NODES; do
  R=$("$CLUSTER" node-root "$n")
  check "$n: no stasis files left (/opt/stasis but the node's CRIU, /var/lib/stasis, /run/stasis, drop-in)" bash -c \
    "test -z \"\$(ls -A '$R/opt/stasis' | grep -vx criu)\" && test -z \"\$(ls -A '$R/var/lib/stasis' '$R/run/stasis' 2>/dev/null | grep -v ':\$' | grep -v '^\$')\" && ! ls '$R/etc/containerd/conf.d' | grep -q stasis"
  check "$n: runtime handler stasis gone" retry 30 bash -c \
    "! kubectl get node $n -o jsonpath='{.status.runtimeHandlers[*].name}' | tr ' ' '\n' | grep -qx stasis"
  check "$n: the host's CRIU is still there for the node" test -x /opt/stasis/criu/usr/sbin/criu
done
check "no stasis.dev/ labels left on the nodes (but the cluster's own stasis.dev/cluster-node)" bash -c \
  "! kubectl get nodes -o json | jq -r '.items[].metadata.labels | keys[]' | grep '^stasis.dev/' | grep -vx stasis.dev/cluster-node"
check "no admission policies left" bash -c \
  "! kubectl get validatingadmissionpolicy,validatingadmissionpolicybinding -o name | grep -q stasis"
check "no stasis API objects left (CRDs, RuntimeClass, ClusterRoles, webhook, namespace)" bash -c \
  "! kubectl get crd -o name | grep -q stasis.dev && ! kubectl get runtimeclass stasis 2>/dev/null && ! kubectl get clusterrole -o name | grep -q stasis && ! kubectl get mutatingwebhookconfiguration -o name | grep -q stasis && ! kubectl get ns $SNS 2>/dev/null"
kubectl delete namespace "$NS" --ignore-not-found --wait=false >/dev/null 2>&1
finish
