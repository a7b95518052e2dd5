#!/usr/bin/env bash
# End-to-end test of what stasis is for, on the local cluster with the Helm chart installed
# (issue 4's "Must show" a-g; h, uninstall, is tests/e2e/install.sh): an evicted, lost, deleted
# pod of `runtimeClassName: stasis` resumes on another node from its latest checkpoint, and what
# must not restore does not. The workload is stasis-counter: a count that continues across a
# restore, and `state=CORRUPT` if its memory came back wrong.
#
#   a. drain after two heartbeat checkpoints -> restored on the other node, Service answers
#   b. node loss (kill-node) -> restored from the last heartbeat; the dead node publishes nothing
#   c. OOM kill from outside -> restarted in place from the latest checkpoint
#   d. delete with a 30 s grace period -> final checkpoint, the replacement resumes within 1 s
#   e. declared engine version changed -> cold start, ColdStart Event naming the mismatch
#   f. a user without the restore permission: PodRestore denied, a bare pod gets no memory
#   g. two replicas -> each resumes its own lineage, no checkpoint restored twice
#   s. an image symlink to a node directory, replaced by a directory in the container, then an
#      OOM restart in place -> the node directory is intact, the workload resumes with its files
#   t. a server with a readiness probe every second, clients holding connections and health checks
#      coming in: checkpointed at every 2 s heartbeat, drained -> restored on the other node, its
#      clients reconnect to the restored process
#
# Needs root. Prints "N passed, M failed", exits non-zero when a
# check failed. STASIS_E2E_KEEP_CLUSTER=1 leaves the cluster up (and stasis installed);
# STASIS_INSTALL_NO_BUILD=1 reuses target/images/stasis.oci.tar.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/scripts/cluster
WORK=$(mktemp -d /tmp/stasis-e2e-restore.XXXXXX)
# shellcheck source=tests/e2e/lib.sh
. "$REPO/tests/e2e/lib.sh"
e2e_begin restore
# (STASIS_E2E_ONLY="d f": run only these scenarios, see want; a and b go together)

# ------------------------------------------------------------------ up, install
up_and_install

# ------------------------------------------------------------------ a. drain
if want a; then
echo "# --- a. drain: 256 MiB counter, 10 s heartbeats"
NS=e2e-drain
scenario "$NS" counter 10s 1 256
kubectl -n "$NS" apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Service
metadata: {name: counter}
spec:
  selector: {app: counter}
  ports: [{port: 7070}]
---
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {name: client, image: stasis.local/testapp:dev, imagePullPolicy: Never, command: [/testapp, sleep]}
EOF
P1=$(wait_one_counting "$NS" counter 90)
if [ -z "$P1" ]; then fail "a: the counter pod runs"; diagnose "$NS"; finish; fi
follow "$NS" "$P1"
N1=$(node_of "$NS" "$P1")
check "a: first pod $P1 on $N1: a ColdStart Event says why (no lineage to continue)" retry 30 bash -c \
  "kubectl -n $NS get events --field-selector involvedObject.name=$P1,reason=ColdStart -o name | grep -q ."
t=$(date +%s.%N)
check "a: two heartbeat PodCheckpoints Succeeded" retry 90 n_ckpts $NS $P1 2
echo "# two heartbeats after $(secs "$t") s:"; ckpts "$NS" "$P1" | sed 's/^/#   /'
kubectl -n "$NS" get pckpt -o custom-columns=NAME:.metadata.name,PHASE:.status.phase,NODE:.status.node,SIZE:.status.sizeBytes,FREEZE_MS:.status.freezeMillis,TOTAL_MS:.status.totalMillis | sed 's/^/#   /'
LAST=$(ckpts "$NS" "$P1" | tail -1)
C_CKPT=$(count_before "$P1" "${LAST%% *}")
t=$(date +%s.%N)
out=$(drain "$N1" --ignore-daemonsets --delete-emptydir-data --pod-selector app=counter --timeout=120s 2>&1); rc=$?
check "a: kubectl drain $N1" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
echo "# drain: $(secs "$t") s"
P2=$(wait_replacement "$NS" counter "$P1" 120) || { fail "a: a replacement pod counts"; diagnose "$NS"; }
if [ -n "$P2" ]; then
  echo "# replacement $P2 counting $(secs "$t") s after the drain began"
  C_FIRST=$(first_count "$NS" "$P2"); C_STOP=$(last_count "$P1")
  echo "# count at the last heartbeat >= $C_CKPT, last count of $P1: $C_STOP, first count of $P2: $C_FIRST"
  check "a: the replacement runs on the other node ($(node_of "$NS" "$P2"))" test "$(node_of "$NS" "$P2")" = "$(other_node "$N1")"
  check "a: its first count ($C_FIRST) > the count at the last heartbeat checkpoint ($C_CKPT), and not a cold start's 1" resumed "$C_FIRST" "$C_CKPT"
  check "a: ... and not beyond where the old pod stopped ($C_STOP)" ge "$((C_STOP + 1))" "$C_FIRST"
  check "a: never state=CORRUPT" not_corrupt "$NS" "$P2"
  check "a: a PodRestore for it, phase Restored" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore --field-selector spec.targetPodName=$P2 -o jsonpath='{.items[*].status.phase}')\" = Restored ]"
  echo "# restored from: $(restore_ref "$NS" "$P2")"
  check "a: a Restored Event on it" retry 30 bash -c "kubectl -n $NS get events --field-selector involvedObject.name=$P2,reason=Restored -o name | grep -q ."
  event "$NS" "$P2" Restored | sed 's/^/#   /'
  svc() { kubectl -n "$NS" exec client -- /testapp tcp counter:7070 2>/dev/null | grep -o 'count=[0-9]* state=ok'; }
  check "a: it answers on its port through the Service ($(svc))" retry 30 svc
fi
kubectl uncordon "$N1" >/dev/null

fi
# ------------------------------------------------------------------ b. node loss
if want b; then
echo "# --- b. node loss"
if [ -n "${P2:-}" ]; then
  NB=$(node_of "$NS" "$P2")
  follow "$NS" "$P2"
  check "b: a heartbeat of $P2 Succeeded" retry 60 n_ckpts $NS $P2 1
  LAST=$(ckpts "$NS" "$P2" | tail -1)
  wait_for 10 "the followed log of $P2 to pass its heartbeat" logged_after "$P2" "${LAST%% *}"
  C_CKPT=$(count_before "$P2" "${LAST%% *}")
  T_KILL=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  t=$(date +%s.%N)
  check "b: kill-node $NB" kill_node "$NB"
  C_DEAD=$(last_count "$P2")
  P3=$(wait_replacement "$NS" counter "$P2" 180) || { fail "b: a replacement pod counts after the node loss"; diagnose "$NS"; }
  if [ -n "$P3" ]; then
    echo "# replacement $P3 on $(node_of "$NS" "$P3") counting $(secs "$t") s after the node was killed"
    C_FIRST=$(first_count "$NS" "$P3")
    echo "# count at the last heartbeat >= $C_CKPT, last count seen from the dead node: $C_DEAD, first count of $P3: $C_FIRST"
    check "b: restored (PodRestore Restored, from $(restore_ref "$NS" "$P3"))" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore --field-selector spec.targetPodName=$P3 -o jsonpath='{.items[*].status.phase}')\" = Restored ]"
    check "b: first count ($C_FIRST) > the count at the last heartbeat ($C_CKPT), and not a cold start's 1" resumed "$C_FIRST" "$C_CKPT"
    check "b: ... and <= the last count the dead node printed + 1 ($C_DEAD)" ge "$((C_DEAD + 1))" "$C_FIRST"
    check "b: never state=CORRUPT" not_corrupt "$NS" "$P3"
  fi
  t=$(date +%s.%N)
  check "b: the node boots again (start-node $NB)" "$CLUSTER" start-node "$NB"
  echo "# node back: $(secs "$t") s"
  check "b: its agent is back" retry 90 bash -c "kubectl -n stasis-system get pods -l app.kubernetes.io/component=agent --field-selector spec.nodeName=$NB -o jsonpath='{.items[*].status.containerStatuses[*].ready}' | grep -qw true"
  sleep 15
  late=$(kubectl -n "$NS" get pckpt -o json | jq -r --arg n "$NB" --arg t "$T_KILL" \
    '.items[] | select(.status.node == $n and .status.phase == "Succeeded" and (.status.completionTime // "") > $t) | .metadata.name')
  check "b: nothing from the dead node published a checkpoint after its loss${late:+ ($late)}" test -z "$late"
  check "b: the old pod is gone once its node is back" retry 60 bash -c "! kubectl -n $NS get pod $P2"
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ c. OOM kill
if want c; then
echo "# --- c. OOM kill from outside the workload"
NS=e2e-oom
scenario "$NS" oom 10s 1 64
if first_pod P1 c "$NS" oom; then
  NO=$(node_of "$NS" "$P1")
  check "c: a heartbeat of $P1 Succeeded" retry 60 n_ckpts "$NS" "$P1" 1
  follow "$NS" "$P1"
  LAST=$(ckpts "$NS" "$P1" | tail -1)
  wait_for 10 "the followed log of $P1 to pass its heartbeat" logged_after "$P1" "${LAST%% *}"
  C_CKPT=$(count_before "$P1" "${LAST%% *}")
  PID=$(counter_pid "$NS" "$P1" "$NO")
  # What the node keeps for the restart in place (security review M6)
  IMGS=$(pod_images "$NS" "$P1" "$NO")
  check_kept_reference c "$IMGS" "the heartbeat"
  # SIGRTMIN: the counter grows its memory until the OOM killer acts (its limit is 256 MiB)
  check "c: SIGRTMIN to the counter (pid $PID on $NO) from the host" kill -s RTMIN "$PID"
  t=$(date +%s.%N)
  if check "c: the container is restarted in place and counts again" retry 60 restarted "$NS" "$P1"; then
    echo "# counting again $(secs "$t") s after the signal"
    check_resumed_after_oom c "$NS" "$P1" "$C_CKPT" "the latest checkpoint"
    check "c: a PodRestore of the restart in place, Restored" retry 30 restored_in_place "$NS" "$P1"
    check "c: a Restored Event on the pod" retry 30 bash -c "kubectl -n $NS get events --field-selector involvedObject.name=$P1,reason=Restored -o name | grep -q ."
    event "$NS" "$P1" Restored | sed 's/^/#   /'
    check "c: the restore directory is gone after the restore: no memory image under images/<pod-uid>/" \
      retry 10 bash -c "[ -z \"\$(find '$IMGS' -name 'pages-*.img' 2>/dev/null)\" ]"
    AGENT=$(kubectl -n stasis-system get pod -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$NO" -o name | head -1)
    PREPARED=$(kubectl -n stasis-system logs "$AGENT" --all-containers 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep 'restart in place prepared' | tail -1)
    echo "# agent on $NO: ${PREPARED#*INFO }"
    check "c: the agent fetched it through the chunk cache (cache_hits > 0)" \
      bash -c "grep -Eq 'cache_hits=[1-9]' <<<'$PREPARED'"
    sleep 15
    check "c: no second OOM kill follows (restartCount still 1 after 15 s)" test \
      "$(kubectl -n "$NS" get pod "$P1" -o jsonpath='{.status.containerStatuses[0].restartCount}')" = 1
  else
    diagnose "$NS"
  fi
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ s. image symlink to the node
if want s; then
echo "# --- s. a restore in place leaves a node directory named by an image symlink alone"
NS=e2e-symlink
# the counter image plus /w (0777) and /w/x -> /etc/stasis-canary; the node's /etc is the host's
CANARY_IMAGE=$("$REPO/tests/images/counter-canary/build")
"$CLUSTER" load-image "$REPO/target/images/counter-canary.oci.tar" >/dev/null
mkdir -p /etc/stasis-canary && echo node >/etc/stasis-canary/keep
on_exit "rm -rf /etc/stasis-canary"
COUNTER_IMAGE=$CANARY_IMAGE scenario "$NS" canary 10s 1 64
if first_pod P1 s "$NS" canary; then
  NO=$(node_of "$NS" "$P1")
  PID=$(counter_pid "$NS" "$P1" "$NO")
  # The workload's `rm /w/x; mkdir /w/x; touch /w/x/a`, in its own root (the image has no shell):
  # overlayfs records /w/x as an opaque directory in the container's upper directory.
  R=/proc/$PID/root
  check "s: /w/x of $P1 (pid $PID on $NO) replaced by a directory with a file" \
    bash -c "rm '$R/w/x' && mkdir '$R/w/x' && touch '$R/w/x/a'"
  T_CHANGE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  s_after() { ckpts "$NS" "$P1" | awk -v t="$T_CHANGE" '$1 > t' | grep -q .; }
  check "s: a heartbeat of $P1 that started after the change Succeeded" retry 60 s_after
  check "s: SIGRTMIN to the counter (the OOM kill and restart in place of c)" kill -s RTMIN "$PID"
  if check "s: the container is restarted in place and counts again" retry 60 restarted "$NS" "$P1"; then
    check "s: the node's /etc/stasis-canary/keep still exists" test -f /etc/stasis-canary/keep
    check "s: it was restored in place (PodRestore Restored)" retry 30 restored_in_place "$NS" "$P1"
    PID2=$(counter_pid "$NS" "$P1" "$NO")
    check "s: /w/x/a is in the restored container (pid $PID2)" test -f "/proc/$PID2/root/w/x/a"
    check "s: never state=CORRUPT" not_corrupt "$NS" "$P1"
  else
    diagnose "$NS"
  fi
fi
check "s: the node's /etc/stasis-canary/keep exists at the end" test -f /etc/stasis-canary/keep
rm -rf /etc/stasis-canary
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ d. graceful termination
if want d; then
echo "# --- d. delete with a 30 s grace period"
NS=e2e-grace
scenario "$NS" grace 30s 1 64
if first_pod P1 d "$NS" grace; then
  follow "$NS" "$P1"
  wait_for 10 "the log of $P1 followed" followed "$P1"
  t=$(date +%s.%N)
  kubectl -n "$NS" delete pod "$P1" --grace-period=30 --wait=false >/dev/null
  P2=$(wait_replacement "$NS" grace "$P1" 90) || { fail "d: a replacement pod counts"; diagnose "$NS"; }
  if [ -n "$P2" ]; then
    echo "# replacement $P2 counting $(secs "$t") s after the delete"
    retry 40 bash -c "! kubectl -n $NS get pod $P1"
    C_STOP=$(last_count "$P1"); C_FIRST=$(first_count "$NS" "$P2")
    final=$(kubectl -n "$NS" get pckpt --field-selector "spec.sourcePodName=$P1" -o json | jq -r '.items[] | select(.spec.reason == "Termination") | "\(.status.phase) \(.status.checkpointRef) freeze \(.status.freezeMillis) ms total \(.status.totalMillis) ms"')
    echo "# final checkpoint: $final"
    echo "# last count of $P1: $C_STOP, first count of $P2: $C_FIRST"
    check "d: a Termination PodCheckpoint Succeeded" grep -q '^Succeeded' <<<"$final"
    REF=$(restore_ref "$NS" "$P2")
    check "d: restored from it ($REF)" bash -c "[ -n '$REF' ] && grep -qF -- '$REF' <<<'$final'"
    check "d: the replacement resumes within a second's worth of counts of where $P1 stopped ($C_FIRST vs $C_STOP, 10 counts/s)" \
      bash -c "[ -n \"$C_FIRST\" ] && [ -n \"$C_STOP\" ] && d=\$(( $C_STOP - $C_FIRST )) && [ \${d#-} -le 10 ]"
    check "d: never state=CORRUPT" not_corrupt "$NS" "$P2"
  fi
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ e. incompatible checkpoint
if want e; then
echo "# --- e. the declared engine version changes"
NS=e2e-compat
scenario "$NS" engine 10s 1 64 Recreate v1
if first_pod P1 e "$NS" engine; then
  check "e: a heartbeat of $P1 (engine v1) Succeeded" retry 60 n_ckpts $NS $P1 1
  counter "$NS" engine 1 64 Recreate v2
  P2=$(wait_replacement "$NS" engine "$P1" 120) || { fail "e: the v2 pod counts"; diagnose "$NS"; }
  if [ -n "$P2" ]; then
    msg=$(retry 30 bash -c "kubectl -n $NS get events --field-selector involvedObject.name=$P2,reason=ColdStart -o name | grep -q ." ; event "$NS" "$P2" ColdStart)
    echo "# ColdStart: $msg"
    check "e: a ColdStart Event names the mismatch (declared.engine v1 -> v2)" bash -c "grep -q 'declared.engine' <<<\"$msg\" && grep -q v1 <<<\"$msg\" && grep -q v2 <<<\"$msg\""
    check "e: the v2 pod started cold (first count 1)" test "$(first_count "$NS" "$P2")" = 1 ||
      kubectl -n "$NS" logs "$P2" -c counter | head -3 | sed 's/^/#   /'
    check "e: no PodRestore of it Restored" test "$(restore_phase "$NS" "$P2")" != Restored
  fi
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ f. permissions
if want f; then
echo "# --- f. restore is a permission of its own"
NS=e2e-perm
scenario "$NS" perm 10s 1 64
kubectl -n "$NS" create rolebinding dev-edit --clusterrole=edit --user=dev >/dev/null
kubectl -n "$NS" create rolebinding ops-restore --clusterrole=stasis-restorer --user=ops >/dev/null
if first_pod P1 f "$NS" perm; then
  check "f: a heartbeat of $P1 Succeeded" retry 60 n_ckpts $NS $P1 1
  REF=$(ckpts "$NS" "$P1" | tail -1 | awk '{print $3}')
  pr() { printf 'apiVersion: stasis.dev/v1alpha1\nkind: PodRestore\nmetadata: {name: steal}\nspec: {checkpointRef: "%s", targetPodName: thief, sourcePodName: "%s"}\n' "$REF" "$P1"; }
  # (RBAC bindings take effect within a moment: wait until dev may create pods)
  retry 30 bash -c "[ \"\$(kubectl -n $NS auth can-i create pods --as=dev)\" = yes ]"
  out=$(pr | kubectl -n "$NS" create -f - --as=dev 2>&1); rc=$?
  check "f: user dev (edit) may not create a PodRestore ($(tail -1 <<<"$out" | cut -c1-120))" bash -c "[ $rc -ne 0 ] && grep -q forbidden <<<\"$out\""
  ops_may() { pr | kubectl -n "$NS" create -f - --as=ops --dry-run=server; }
  check "f: user ops (stasis-restorer) may (server dry run)" retry 30 ops_may
  kubectl -n "$NS" get pod "$P1" -o json | jq '{apiVersion, kind, metadata: {name: "thief", labels: {stolen: "true"}}, spec: (.spec | del(.nodeName, .priority) | .containers |= map(del(.volumeMounts)) | del(.volumes))}' >"$WORK/thief.json"
  out=$(kubectl -n "$NS" create -f "$WORK/thief.json" --as=dev 2>&1); rc=$?
  check "f: dev may create a bare pod with the source's spec" test $rc -eq 0 || echo "# $out"
  check "f: ... it runs" retry 90 counting "$NS" thief
  check "f: ... the webhook decided ColdStart for it: $(ann "$NS" thief decision-reason)" bash -c \
    "[ \"\$(kubectl -n $NS get pod thief -o jsonpath='{.metadata.annotations.stasis\.dev/decision}')\" = ColdStart ]"
  check "f: ... no PodRestore targets it" test -z "$(restore_ref "$NS" thief)"
  check "f: ... it did not receive the memory (first count 1)" test "$(first_count "$NS" thief)" = 1 ||
    kubectl -n "$NS" logs thief -c counter | head -3 | sed 's/^/#   /'
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ g. two replicas
if want g; then
echo "# --- g. two replicas"
NS=e2e-two
scenario "$NS" two 10s 2 64
OLD=""
two_running() { [ "$(pods_of "$NS" two | wc -l)" = 2 ]; }
retry 90 two_running && OLD=$(pods_of "$NS" two | tr '\n' ' ')
if [ -z "$OLD" ]; then fail "g: two counter pods run"; diagnose "$NS"; else
  for p in $OLD; do
    check "g: a heartbeat of $p Succeeded" retry 60 n_ckpts $NS $p 1
  done
  LINEAGES_OLD=$(for p in $OLD; do ann "$NS" "$p" lineage; echo; done | sort | tr '\n' ' ')
  kubectl -n "$NS" delete pod $OLD --wait=false >/dev/null
  ok=0
  for _ in $(seq 240); do
    NEW=$(pods_of "$NS" two | grep -vxF -f <(tr ' ' '\n' <<<"$OLD" | grep .) | tr '\n' ' ')
    [ "$(wc -w <<<"$NEW")" = 2 ] && [ "$(for p in $NEW; do restore_phase "$NS" "$p"; echo; done | grep -c Restored)" = 2 ] && { ok=1; break; }
    sleep 0.5
  done
  check "g: both replacements restored ($NEW)" test $ok = 1 || diagnose "$NS"
  LINEAGES_NEW=$(for p in $NEW; do ann "$NS" "$p" lineage; echo; done | sort | tr '\n' ' ')
  REFS=$(for p in $NEW; do restore_ref "$NS" "$p"; echo; done | grep . | sort)
  echo "# lineages before: $LINEAGES_OLD after: $LINEAGES_NEW; restored: $(tr '\n' ' ' <<<"$REFS")"
  check "g: each resumes its own lineage (the two lineages of the old pods, one each)" bash -c \
    "[ '$LINEAGES_OLD' = '$LINEAGES_NEW' ] && [ \$(tr ' ' '\n' <<<'$LINEAGES_NEW' | grep . | sort -u | wc -l) = 2 ]"
  check "g: no checkpoint restored twice (PodRestores of the namespace name distinct checkpoints)" bash -c \
    "all=\$(kubectl -n $NS get prestore -o jsonpath='{range .items[*]}{.spec.checkpointRef}{\"\\n\"}{end}'); [ -n \"\$all\" ] && [ \"\$(sort <<<\"\$all\" | uniq -d)\" = '' ]"
  for p in $NEW; do check "g: $p never state=CORRUPT" not_corrupt "$NS" "$p"; done
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
# ------------------------------------------------------------------ t. a server with clients
if want t; then
echo "# --- t. a server: a readiness probe every second, clients holding connections, 2 s heartbeats, drain"
NS=e2e-tcp
new_ns "$NS"
# (keepLast 10: retention deletes the PodCheckpoints of dropped checkpoints, and five are counted)
policy "$NS" every-2s server 2s "retention: {keepLast: 10}"
kubectl -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: server}
spec:
  replicas: 1
  selector: {matchLabels: {app: server}}
  template:
    metadata: {labels: {app: server}}
    spec:
      runtimeClassName: stasis
      terminationGracePeriodSeconds: 30
      containers:
      - name: counter
        image: $COUNTER_IMAGE
        imagePullPolicy: Never
        env:
        - {name: STATE_MB, value: "32"}
        - {name: INTERVAL_MS, value: "100"}
        - {name: LISTEN_PORT, value: "7070"}
        - {name: STREAM_PORT, value: "7071"}
        ports: [{containerPort: 7070}, {containerPort: 7071}]
        readinessProbe: {tcpSocket: {port: 7070}, periodSeconds: 1, failureThreshold: 3}
        resources:
          limits: {memory: "224Mi"}
EOF
# The clients run on the host (it routes to the pod network): three hold a connection to the
# stream port of the current pod (looked up again on every reconnect) and log each line with the
# pod's IP; a fourth opens a connection to the line port every ~20 ms, as health checks do.
cat >"$WORK/clients.py" <<'PY'
import os, socket, subprocess, sys, threading, time
ns, log, stop = sys.argv[1], sys.argv[2], sys.argv[3]
out = open(log, "a", buffering=1)
lock = threading.Lock()
def say(*a):
    with lock:
        out.write("%.3f %s\n" % (time.time(), " ".join(str(x) for x in a)))
def pod_ip():
    r = subprocess.run(["kubectl", "-n", ns, "get", "pods", "-l", "app=server", "-o",
        "jsonpath={range .items[?(@.status.phase=='Running')]}{.metadata.deletionTimestamp}{' '}{.status.podIP}{'\\n'}{end}"],
        capture_output=True, text=True)
    ips = [l.split()[-1] for l in r.stdout.splitlines() if l.strip() and len(l.split()) == 1]
    return ips[0] if ips else None
def holder(i):
    while not os.path.exists(stop):
        ip = pod_ip()
        if not ip:
            time.sleep(0.5); continue
        try:
            s = socket.create_connection((ip, 7071), timeout=3)
        except OSError:
            time.sleep(0.3); continue
        s.settimeout(5)
        say("holder", i, "connected", ip)
        buf = b""
        try:
            while not os.path.exists(stop):
                d = s.recv(4096)
                if not d:
                    break
                buf += d
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    say("holder", i, ip, line.decode(errors="replace"))
        except OSError as e:
            say("holder", i, ip, "error", e)
        say("holder", i, "closed", ip)
        s.close()
def churn():
    n = e = 0
    while not os.path.exists(stop):
        ip = pod_ip()
        for _ in range(50):
            try:
                s = socket.create_connection((ip, 7070), timeout=2); s.recv(100); s.close(); n += 1
            except (OSError, TypeError):
                e += 1
            time.sleep(0.02)
        say("churn", "answered", n, "refused", e)
ts = [threading.Thread(target=holder, args=(i,), daemon=True) for i in range(3)] + [threading.Thread(target=churn, daemon=True)]
for t in ts: t.start()
while not os.path.exists(stop): time.sleep(0.2)
PY
T_LOG=$WORK/clients.log T_STOP=$WORK/clients.stop
if first_pod P1 t "$NS" server; then
  follow "$NS" "$P1"
  N1=$(node_of "$NS" "$P1"); IP1=$(kubectl -n "$NS" get pod "$P1" -o jsonpath='{.status.podIP}')
  python3 "$WORK/clients.py" "$NS" "$T_LOG" "$T_STOP" &
  T_CLIENTS=$!
  check "t: three clients hold connections to $P1 ($IP1)" retry 30 bash -c "[ \$(grep -c 'connected $IP1' '$T_LOG') -ge 3 ]"
  T0=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  t=$(date +%s.%N)
  after_t0() { [ "$(ckpts "$NS" "$P1" | awk -v t="$T0" '$1 > t' | wc -l)" -ge 5 ]; }
  check "t: five heartbeats of $P1 Succeeded while the clients held on and the probe and health checks came in" retry 90 after_t0
  echo "# five heartbeats in $(secs "$t") s; $(grep churn "$T_LOG" | tail -1 | cut -d' ' -f2-)"
  failed=$(kubectl -n "$NS" get pckpt -o json | jq -r --arg p "$P1" '.items[] | select(.spec.sourcePodName == $p and .status.phase == "Failed") | "\(.metadata.name): \(.status.message // .status.conditions)"')
  check "t: no checkpoint of $P1 failed${failed:+ ($failed)}" test -z "$failed"
  check "t: the held connections lived through the heartbeats (none closed)" bash -c "grep -q 'connected $IP1' '$T_LOG' && ! grep -q 'closed $IP1' '$T_LOG'"
  check "t: $P1 stayed Ready" test "$(kubectl -n "$NS" get pod "$P1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True
  echo "# readiness probe failures: $(kubectl -n "$NS" get events --field-selector involvedObject.name="$P1",reason=Unhealthy -o name | wc -l)"
  LAST=$(ckpts "$NS" "$P1" | tail -1)
  C_CKPT=$(count_before "$P1" "${LAST%% *}")
  t=$(date +%s.%N)
  out=$(drain "$N1" --ignore-daemonsets --delete-emptydir-data --pod-selector app=server --timeout=120s 2>&1); rc=$?
  check "t: kubectl drain $N1" test $rc -eq 0 || echo "$out" | sed 's/^/# /'
  P2=$(wait_replacement "$NS" server "$P1" 120) || { fail "t: a replacement pod counts"; diagnose "$NS"; }
  if [ -n "$P2" ]; then
    IP2=$(kubectl -n "$NS" get pod "$P2" -o jsonpath='{.status.podIP}')
    echo "# replacement $P2 ($IP2, $(node_of "$NS" "$P2")) counting $(secs "$t") s after the drain began"
    C_FIRST=$(first_count "$NS" "$P2"); C_STOP=$(last_count "$P1")
    echo "# count at the last heartbeat >= $C_CKPT, last count of $P1: $C_STOP, first count of $P2: $C_FIRST"
    check "t: a PodRestore for it, phase Restored (not a cold start)" retry 30 bash -c "[ \"\$(kubectl -n $NS get prestore --field-selector spec.targetPodName=$P2 -o jsonpath='{.items[*].status.phase}')\" = Restored ]"
    event "$NS" "$P2" Restored | sed 's/^/#   /'
    check "t: its first count ($C_FIRST) > the count at the last heartbeat ($C_CKPT), and not a cold start's 1" resumed "$C_FIRST" "$C_CKPT"
    check "t: never state=CORRUPT" not_corrupt "$NS" "$P2"
    check "t: $P2 is Ready (its probe answers)" retry 30 bash -c "[ \"\$(kubectl -n $NS get pod $P2 -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}')\" = True ]"
    reconnected() { [ "$(grep -c "connected $IP2" "$T_LOG")" -ge 3 ] && [ "$(awk -v ip="$IP2" '$2 == "holder" && $4 == ip && $5 ~ /^count=/' "$T_LOG" | wc -l)" -ge 30 ]; }
    check "t: the three clients reconnected to the restored process and stream its counts" retry 60 reconnected
    C_CLIENT=$(awk -v ip="$IP2" '$2 == "holder" && $4 == ip && $5 ~ /^count=/ { print substr($5, 7); exit }' "$T_LOG")
    check "t: ... which continue from the checkpoint (first count a client got: $C_CLIENT >= $C_FIRST)" ge "$C_CLIENT" "$C_FIRST"
    check "t: a heartbeat of the restored $P2 Succeeded with the clients connected" retry 60 n_ckpts "$NS" "$P2" 1
  fi
  touch "$T_STOP"; wait "$T_CLIENTS" 2>/dev/null
  echo "# clients: $(grep -c connected "$T_LOG") connections held in all, $(grep churn "$T_LOG" | tail -1 | cut -d' ' -f2-)"
  kubectl uncordon "$N1" >/dev/null
fi
kubectl delete namespace "$NS" --wait=false >/dev/null

fi
finish
