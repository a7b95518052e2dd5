#!/usr/bin/env bash
# End-to-end test of the local cluster (scripts/cluster): issue 3's "Must show" list.
# Needs root. Brings the cluster up (building the platform binaries if they are not cached),
# runs the checks, and takes it down again (STASIS_E2E_KEEP_CLUSTER=1 leaves it up).
# Prints "N passed, M failed" and exits non-zero when a check failed.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
# shellcheck disable=SC2034 # (lib.sh uses it)
WORK=$(mktemp -d /tmp/stasis-e2e-cluster.XXXXXX)
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin cluster

# ------------------------------------------------------------------ up
t=$(date +%s.%N)
if ! "$CLUSTER" up; then fail "scripts/cluster up"; finish; fi
echo "# cluster up: $(secs "$t") s"
eval "$("$CLUSTER" env)"
for v in KUBECONFIG AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY STASIS_S3_BUCKET; do
  [ -n "${!v:-}" ] || fail "env exports $v"
done
check "env puts kubectl and helm on PATH" bash -c 'command -v kubectl && command -v helm && helm version --short'

node_ready() { [ "$(kubectl get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = "$2" ]; }
check "worker-1 Ready" node_ready worker-1 True
check "worker-2 Ready" node_ready worker-2 True

NS=e2e-cluster
new_ns "$NS"
kubectl -n "$NS" create secret generic stasis-s3 --from-env-file <("$CLUSTER" env | sed 's/^export //') >/dev/null
kubectl -n "$NS" apply -f - >/dev/null <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo}
spec:
  replicas: 2
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      terminationGracePeriodSeconds: 2
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule,
         nodeTaintsPolicy: Honor, labelSelector: {matchLabels: {app: echo}}}
      tolerations:
      - {key: node.kubernetes.io/not-ready, operator: Exists, effect: NoExecute, tolerationSeconds: 5}
      - {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 5}
      containers:
      - name: echo
        image: stasis.local/testapp:dev
        imagePullPolicy: Never
        envFrom: [{secretRef: {name: stasis-s3}}]
        ports: [{containerPort: 8080}]
        readinessProbe: {httpGet: {path: /healthz, port: 8080}, periodSeconds: 2}
---
apiVersion: v1
kind: Pod
metadata: {name: target, labels: {app: target}}
spec:
  nodeSelector: {kubernetes.io/hostname: worker-2}
  terminationGracePeriodSeconds: 1
  containers:
  - name: target
    image: stasis.local/testapp:dev
    imagePullPolicy: Never
    envFrom: [{secretRef: {name: stasis-s3}}]
---
apiVersion: v1
kind: Service
metadata: {name: target}
spec:
  selector: {app: target}
  ports: [{port: 80, targetPort: 8080}]
EOF
t=$(date +%s.%N)
check "2-replica Deployment rolls out" kubectl -n "$NS" rollout status deploy/echo --timeout=180s
check "pod on worker-2 Running" kubectl -n "$NS" wait --for=condition=Ready pod/target --timeout=120s
echo "# pods Running: $(secs "$t") s"
pod_on() { kubectl -n "$NS" get pods -l app=echo --field-selector "spec.nodeName=$1,status.phase=Running" -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }
P1=$(pod_on worker-1) P2=$(pod_on worker-2)
check "Deployment spread across both nodes" test -n "$P1" -a -n "$P2"
check "kubectl logs" bash -c "kubectl -n $NS logs $P1 | grep -q 'testapp serving on :8080'"
check "kubectl exec" test "$(kubectl -n "$NS" exec "$P1" -- /testapp hostname 2>&1)" = "$P1"
# (a Service just made is reached once kube-proxy has programmed its endpoints: a moment after
# the pod is Ready, longer on a loaded machine, where a first try was refused)
for _ in $(seq 30); do
  out=$(kubectl -n "$NS" exec "$P1" -- /testapp get http://target/ 2>&1)
  [ "$out" = "hello from target" ] && break
  sleep 0.5
done
check "pod on worker-1 reaches pod on worker-2 through Service name 'target'" test "$out" = "hello from target"
[ "$out" = "hello from target" ] || echo "# got: $out"
out=$(kubectl -n "$NS" exec "$P1" -- /testapp get "http://target.$NS.svc.cluster.local/" 2>&1)
check "... and through its FQDN" test "$out" = "hello from target"

KEY=e2e/object-$RANDOM$RANDOM
VAL="written on worker-1 at $(date +%s)"
check "S3 PUT from a pod on worker-1" kubectl -n "$NS" exec "$P1" -- /testapp s3put "$STASIS_S3_BUCKET" "$KEY" "$VAL"
check "S3 GET of that object from a pod on worker-2" test "$(kubectl -n "$NS" exec target -- /testapp s3get "$STASIS_S3_BUCKET" "$KEY" 2>&1)" = "$VAL"

# ------------------------------------------------------------------ load-image
IMG=$(mktemp -d)
"$REPO/scripts/cluster.d/oci-image" "$IMG/loaded.tar" stasis.local/loaded:e2e '["/testapp","serve"]' \
  "$("$REPO/scripts/build-platform" --print-dir testbins)/bin/testapp:/testapp" >/dev/null
check "load-image imports an OCI archive into every node" "$CLUSTER" load-image "$IMG/loaded.tar"
rm -rf "$IMG"
kubectl -n "$NS" run loaded --image=stasis.local/loaded:e2e --image-pull-policy=Never \
  --overrides='{"spec":{"nodeSelector":{"kubernetes.io/hostname":"worker-2"}}}' >/dev/null
check "a pod of the loaded image runs (worker-2)" kubectl -n "$NS" wait --for=condition=Ready pod/loaded --timeout=120s
kubectl -n "$NS" delete pod loaded --wait=false >/dev/null 2>&1

# ------------------------------------------------------------------ node root, containerd drop-in, restart
# what the chart's node installer does: write into the node's / through hostPath volumes, register
# a runtime handler with a containerd drop-in, ask for a containerd restart
R1=$("$CLUSTER" node-root worker-1) R2=$("$CLUSTER" node-root worker-2)
kubectl -n "$NS" apply -f - >/dev/null <<'EOF2'
apiVersion: v1
kind: Pod
metadata: {name: installer}
spec:
  nodeSelector: {kubernetes.io/hostname: worker-1}
  terminationGracePeriodSeconds: 1
  containers:
  - name: installer
    image: stasis.local/testapp:dev
    imagePullPolicy: Never
    command: [/testapp, sleep]
    volumeMounts:
    - {name: opt, mountPath: /host/opt/stasis}
    - {name: run, mountPath: /host/run/stasis}
  volumes:
  - {name: opt, hostPath: {path: /opt/stasis, type: DirectoryOrCreate}}
  - {name: run, hostPath: {path: /run/stasis, type: DirectoryOrCreate}}
EOF2
check "installer pod Running on worker-1" kubectl -n "$NS" wait --for=condition=Ready pod/installer --timeout=120s
MARK="e2e-$RANDOM"
kubectl -n "$NS" exec installer -- /testapp write /host/opt/stasis/marker "$MARK" >/dev/null
check "a hostPath write lands in worker-1's node root" test "$(cat "$R1/opt/stasis/marker" 2>/dev/null)" = "$MARK"
check "... and not on the host or worker-2" bash -c "! grep -qs '$MARK' /opt/stasis/marker '$R2/opt/stasis/marker'"
mkdir -p "$R1/opt/stasis/bin" "$R1/etc/containerd/conf.d"
printf '#!/bin/sh\necho "$*" >> /var/lib/stasis/e2e-runc.log\nexec %s "$@"\n' "$(command -v runc)" > "$R1/opt/stasis/bin/e2e-runc"
chmod +x "$R1/opt/stasis/bin/e2e-runc"
cat > "$R1/etc/containerd/conf.d/e2e-runc.toml" <<'EOF2'
version = 3
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.e2e-runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.e2e-runc.options]
    BinaryName = "/opt/stasis/bin/e2e-runc"
EOF2
OLD_PID=$(cat "$R1/run/containerd/containerd.pid")
kubectl -n "$NS" exec installer -- /testapp write /host/run/stasis/restart-containerd now >/dev/null
check "a pod's request restarts worker-1's containerd" retry 60 bash -c "test \"\$(cat '$R1/run/containerd/containerd.pid')\" != '$OLD_PID' && test ! -e '$R1/run/stasis/restart-containerd'"
check "running pods survive the containerd restart" retry 30 kubectl -n "$NS" exec "$P1" -- /testapp hostname
kubectl apply -f - >/dev/null <<'EOF2'
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: e2e-runc}
handler: e2e-runc
EOF2
kubectl -n "$NS" apply -f - >/dev/null <<'EOF2'
apiVersion: v1
kind: Pod
metadata: {name: handler}
spec:
  runtimeClassName: e2e-runc
  nodeSelector: {kubernetes.io/hostname: worker-1}
  terminationGracePeriodSeconds: 1
  containers:
  - {name: handler, image: stasis.local/testapp:dev, imagePullPolicy: Never}
EOF2
check "a pod of the runtime handler registered by the drop-in runs" kubectl -n "$NS" wait --for=condition=Ready pod/handler --timeout=120s
check "... through the handler's binary in the node root" grep -qs ' create ' "$R1/var/lib/stasis/e2e-runc.log"
kubectl -n "$NS" delete pod installer handler --wait=false >/dev/null 2>&1

# ------------------------------------------------------------------ helm
CHART=$(mktemp -d)
mkdir -p "$CHART/templates"
printf 'apiVersion: v2\nname: e2e\nversion: 0.1.0\n' > "$CHART/Chart.yaml"
printf 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: e2e-helm}\ndata: {k: v}\n' > "$CHART/templates/cm.yaml"
check "helm install" helm install e2e "$CHART" -n "$NS" --wait --timeout 60s
check "... created its objects" kubectl -n "$NS" get configmap e2e-helm
check "helm uninstall" helm uninstall e2e -n "$NS"
rm -rf "$CHART"

# ------------------------------------------------------------------ drain
kubectl -n "$NS" delete pod target --wait=false >/dev/null
t=$(date +%s.%N)
check "kubectl drain worker-2" kubectl drain worker-2 --ignore-daemonsets --delete-emptydir-data --force --timeout=120s
both_on_worker1() {
  local n; n=$(kubectl -n "$NS" get pods -l app=echo --field-selector spec.nodeName=worker-1 -o json |
    jq '[.items[] | select(.metadata.deletionTimestamp == null and (.status.conditions // [] | any(.type == "Ready" and .status == "True")))] | length')
  [ "$n" = 2 ]
}
check "drained pod moved to worker-1 and is Ready" retry 120 both_on_worker1
echo "# drain and reschedule: $(secs "$t") s"
kubectl uncordon worker-2 >/dev/null

# ------------------------------------------------------------------ kill-node
# put one replica back on worker-2 (the spread constraint sends the replacement there)
kubectl -n "$NS" delete pod "$(pod_on worker-1)" --wait=false >/dev/null
check "a replica is back on worker-2" retry 120 bash -c "test -n \"\$(kubectl -n $NS get pods -l app=echo --field-selector spec.nodeName=worker-2,status.phase=Running -o name)\""
t=$(date +%s.%N)
check "kill-node worker-2" "$CLUSTER" kill-node worker-2
check "no process of worker-2 is left" bash -c "! ( for p in /proc/[0-9]*/cgroup; do grep -l 'freezer:/stasis-cluster/worker-2' \$p 2>/dev/null; done | grep -q . )"
check "worker-2 becomes NotReady" retry 90 bash -c "test \"\$(kubectl get node worker-2 -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}')\" != True"
echo "# NotReady after: $(secs "$t") s"
check "pods of worker-2 rescheduled to worker-1 after taint-based eviction" retry 150 both_on_worker1
echo "# rescheduled after: $(secs "$t") s"
check "kubectl still works against the surviving node" kubectl -n "$NS" exec "$(pod_on worker-1)" -- /testapp hostname

# ------------------------------------------------------------------ down leaves nothing
t=$(date +%s.%N)
check "scripts/cluster down" "$CLUSTER" down
echo "# down: $(secs "$t") s"
leftovers() {
  local bad=0
  ls /var/lib/stasis-cluster >/dev/null 2>&1 && { echo "# state dir left"; bad=1; }
  ip link show stasis0 >/dev/null 2>&1 && { echo "# bridge left"; bad=1; }
  grep -q stasis-cluster /proc/self/mountinfo && { echo "# mounts left"; bad=1; }
  compgen -G "/sys/fs/cgroup/*/stasis-cluster" >/dev/null && { echo "# cgroups left"; bad=1; }
  ls /run/netns/cni-* >/dev/null 2>&1 && { echo "# pod netns files left in /run/netns"; bad=1; }
  local z; z=$(ps -eo stat=,comm= | awk '$1 ~ /^Z/ && $2 ~ /^(containerd|containerd-shim|kubelet|kube-|etcd|coredns|s3s-fs|pause|testapp|supervisor|runc)/')
  [ -n "$z" ] && { echo "# zombies left: $z"; bad=1; }
  local p; p=$(ps -eo pid=,args= | grep -E '/stasis/platform/|testapp serve|/pause$' | grep -v grep)
  [ -n "$p" ] && { echo "# processes left: $p"; bad=1; }
  return $bad
}
check "down leaves no processes, zombies, mounts, namespaces, cgroups, bridge or state" leftovers

# ------------------------------------------------------------------ bad input
# a port in use
python3 -c 'import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9000)); s.listen(); time.sleep(120)' &
LPID=$!
wait_for 10 "the test's listener on port 9000" bash -c "ss -Hltn 'sport = :9000' | grep -q ."
out=$("$CLUSTER" up 2>&1); rc=$?
kill $LPID 2>/dev/null; wait $LPID 2>/dev/null
check "up with port 9000 in use fails" test $rc -ne 0
check "... naming the port and the fix" bash -c "grep -q 'port 9000 is already in use' <<<\"\$1\" && grep -q 'STASIS_CLUSTER_S3_PORT' <<<\"\$1\"" _ "$out"
echo "# message: $(grep error <<<"$out")"
"$CLUSTER" down >/dev/null 2>&1

# a missing tool: a PATH that has everything but runc
FAKE=$(mktemp -d)
for d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  for f in "$d"/*; do [ -e "$FAKE/$(basename "$f")" ] || ln -s "$f" "$FAKE/" 2>/dev/null; done
done
rm -f "$FAKE/runc"
out=$(STASIS_CLUSTER_NO_INSTALL=1 PATH=$FAKE "$CLUSTER" up 2>&1); rc=$?
rm -rf "$FAKE"
check "up without runc fails" test $rc -ne 0
check "... naming the tool and the fix" bash -c "grep -q 'runc' <<<\"\$1\" && grep -q 'apt-get install -y runc' <<<\"\$1\"" _ "$out"
echo "# message: $(grep error <<<"$out")"

# platform binaries missing (and building not allowed)
out=$(STASIS_CLUSTER_NO_BUILD=1 STASIS_CACHE=$(mktemp -d) "$CLUSTER" up 2>&1); rc=$?
check "up without the platform binaries fails" test $rc -ne 0
check "... naming the build command" grep -q 'run: scripts/build-platform' <<<"$out"
echo "# message: $(grep error <<<"$out")"

# a stale state dir from a killed run: kill `up` half way (SIGKILL to its process group once the
# supervisor runs), then the supervisor too, leaving orphaned daemons, namespaces, mounts, cgroups;
# `up` must recover by itself
setsid "$CLUSTER" up >/dev/null 2>&1 &
UP_PID=$!
retry 120 test -S /var/lib/stasis-cluster/supervisor/supervisor.sock
sleep 1
kill -9 -- -"$UP_PID" 2>/dev/null; wait "$UP_PID" 2>/dev/null
kill -9 "$(cat /var/lib/stasis-cluster/supervisor/supervisor.pid 2>/dev/null)" 2>/dev/null
sleep 1
t=$(date +%s.%N)
out=$("$CLUSTER" up 2>&1); rc=$?
echo "$out" | sed 's/^/# /'
check "up after a killed up recovers by itself" test $rc -eq 0
check "... said it cleaned the stale state" grep -q 'found state from an earlier run' <<<"$out"
check "... and both nodes are Ready" bash -c 'node_ready() { [ "$(kubectl get node "$1" -o jsonpath="{.status.conditions[?(@.type==\"Ready\")].status}")" = True ]; }; node_ready worker-1 && node_ready worker-2'
echo "# up after killed run: $(secs "$t") s"
t=$(date +%s.%N)
check "up again is idempotent" "$CLUSTER" up
echo "# idempotent up: $(secs "$t") s"

if [ -z "${STASIS_E2E_KEEP_CLUSTER:-}" ]; then
  check "final down" "$CLUSTER" down
fi
finish
