#!/usr/bin/env bash
# stasis-runc under containerd 2.x's real runc shim (containerd-shim-runc-v2), driven by ctr:
#
#   1. c1: `ctr run` with --runc-binary stasis-runc (no plan: every call passes through to runc);
#   2. runc checkpoint of c1 (stop mode) into an image dir; the agent's part done by hand: the
#      verification stamp and a plan file for the next container id;
#   3. c2: `ctr run` again: the shim's `create` becomes a restore, its `start` a no-op; the task is
#      RUNNING, its log continues the count, its port answers inside its own network namespace
#      (loopback brought up after the restore);
#   4. SIGTERM through `ctr task kill`: the counter's exit line; the task stops.
#
# Usage: shim-e2e.sh <stasis-runc> <containerd bin dir>; run as root under a reaping subreaper
# (tini -s). Cleans up everything it made.
set -euo pipefail

WRAPPER=$1
CTD=$2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OCI=$REPO/target/images/stasis-counter.oci.tar
IMAGE=docker.io/stasis/counter:dev
NS=stasis-rt-test-$$
T=$(mktemp -d /tmp/stasis-rt-shim-XXXXXX)
R=/run/stasis-rt-test-shim-$$
SOCK=$R/containerd.sock
RUNC_ROOT=$R/runc
PORT=18080
CTD_PID=

ctr() { "$CTD/ctr" --address "$SOCK" -n "$NS" "$@" 2>>"$T/ctr.err"; }
say() { echo "shim-e2e: $*" >&2; }
fail() {
  say "FAIL: $*"
  tail -5 "$T/ctr.err" "$T/containerd.log" >&2 2>/dev/null
  exit 1
}

cleanup() {
  set +e
  for c in c1 c2; do
    ctr task kill -s KILL "$c" >/dev/null 2>&1
    ctr task delete -f "$c" >/dev/null 2>&1
    ctr container delete "$c" >/dev/null 2>&1
  done
  ctr images rm "$IMAGE" >/dev/null 2>&1
  if [[ -n $CTD_PID ]]; then
    kill "$CTD_PID" 2>/dev/null
    wait "$CTD_PID" 2>/dev/null
  fi
  for c in c1 c2; do runc --root "$RUNC_ROOT/$NS" delete -f "$c" >/dev/null 2>&1; done
  grep -o " ${T}[^ ]*\| ${R}[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
  for d in /sys/fs/cgroup/*/"$NS"; do [[ -d $d ]] && rmdir "$d" 2>/dev/null; done
  rm -rf "$T" "$R"
}
trap cleanup EXIT

mkdir -p "$R" "$T/run"
chmod 700 "$T/run"
cat >"$T/config.toml" <<CFG
version = 3
root = "$T/root"
state = "$R/state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
CFG
STASIS_RUN_DIR=$T/run "$CTD/containerd" --config "$T/config.toml" >"$T/containerd.log" 2>&1 &
CTD_PID=$!
for _ in $(seq 100); do ctr version >/dev/null 2>&1 && break; sleep 0.1; done
ctr version >/dev/null 2>&1 || { tail -20 "$T/containerd.log" >&2; fail "containerd did not start"; }
ctr images import "$OCI" >/dev/null

run() { # id, log
  ctr run -d --runc-binary "$WRAPPER" --runc-root "$RUNC_ROOT" --log-uri "file://$2" \
    --env STATE_MB=16 --env INTERVAL_MS=100 --env LISTEN_PORT=$PORT "$IMAGE" "$1"
}
counts() { grep -o '^count=[0-9]*' "$1" | cut -d= -f2; }
wait_lines() { # file, n
  for _ in $(seq 100); do [[ $(counts "$1" | wc -l) -ge $2 ]] && return 0; sleep 0.1; done
  fail "$1: fewer than $2 counts"
}
task_status() { ctr task ls | awk -v id="$1" '$1 == id {print $3}'; }
task_pid() { ctr task ls | awk -v id="$1" '$1 == id {print $2}'; }
ask() { # pid
  nsenter -t "$1" -n bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT && timeout 5 head -1 <&3" 2>/dev/null || true
}

# 1. A cold container through the wrapper.
run c1 "$T/c1.log"
wait_lines "$T/c1.log" 8
[[ $(task_status c1) == RUNNING ]] || fail "c1 is $(task_status c1)"
[[ $(ask "$(task_pid c1)") == count=* ]] || fail "c1 does not answer on its port"
BUNDLE1=$R/state/io.containerd.runtime.v2.task/$NS/c1
grep -q "cold start of c1: no restore plan" "$BUNDLE1/log.json" || fail "no cold-start line in c1's runc log"

# 2. Checkpoint (stop mode), as the agent would with the engine; then the agent's plan.
IMG=$T/img
mkdir -p "$IMG/criu"
runc --root "$RUNC_ROOT/$NS" checkpoint --tcp-established --file-locks \
  --image-path "$IMG/criu" --work-path "$T/work1" c1 || fail "runc checkpoint c1"
# The shim copies the container's output to the log asynchronously: wait until it settles.
for _ in $(seq 50); do
  a=$(wc -c <"$T/c1.log"); sleep 0.2; b=$(wc -c <"$T/c1.log")
  [[ $a == "$b" && $(task_status c1) == STOPPED ]] && break
done
LAST=$(counts "$T/c1.log" | tail -1)
ctr task delete -f c1 >/dev/null 2>&1 || true
ctr container delete c1
printf '{"v":1,"checkpoint_ref":"shim-e2e/1","verified_at_unix_ms":1}' >"$IMG/.stasis-verified"
mkdir -p "$T/run/plans" && chmod 700 "$T/run" "$T/run/plans"
printf '{"v":1,"container_id":"c2","image_dir":"%s","checkpoint_ref":"shim-e2e/1","tcp_established":true}' \
  "$IMG" >"$T/run/plans/.c2.tmp"
chmod 600 "$T/run/plans/.c2.tmp" "$IMG/.stasis-verified"
mv "$T/run/plans/.c2.tmp" "$T/run/plans/c2.json"

# 3. The replacement: the shim's create becomes a restore.
run c2 "$T/c2.log"
wait_lines "$T/c2.log" 3
FIRST=$(counts "$T/c2.log" | head -1)
say "c1 checkpointed at count=$LAST; c2's first count=$FIRST"
# A line still in the pipe at the dump is in CRIU's image of the pipe and comes out again after
# the restore, while the shim may also have read it from the old pipe: FIRST may equal LAST.
((FIRST >= LAST && FIRST <= LAST + 3)) || fail "c2 starts at $FIRST after a checkpoint at $LAST"
grep -q "state=CORRUPT" "$T/c2.log" && fail "c2's state is corrupt"
[[ $(task_status c2) == RUNNING ]] || fail "c2 is $(task_status c2)"
ANSWER=$(ask "$(task_pid c2)")
[[ $ANSWER == count=*state=ok ]] || fail "c2 does not answer on its port in its netns: '$ANSWER'"
BUNDLE2=$R/state/io.containerd.runtime.v2.task/$NS/c2
grep -q "restored c2 from checkpoint shim-e2e/1" "$BUNDLE2/log.json" || fail "no restore line in c2's runc log"
[[ -e $T/run/plans/c2.json.consumed && ! -e $T/run/restored/c2 ]] || fail "plan not consumed or start marker left"

# 4. Graceful stop through the shim.
ctr task kill -s TERM c2
for _ in $(seq 100); do [[ $(task_status c2) == STOPPED ]] && break; sleep 0.1; done
[[ $(task_status c2) == STOPPED ]] || fail "c2 did not stop on SIGTERM"
grep -q "exiting on SIGTERM" "$T/c2.log" || fail "no exit line from c2"
ctr task delete c2 >/dev/null
ctr container delete c2
[[ ! -e $T/run/work/c2 ]] || fail "work dir left after delete"
say "ok: restore through containerd-shim-runc-v2 (create → restore, start → no-op), port answers, SIGTERM stops it"
