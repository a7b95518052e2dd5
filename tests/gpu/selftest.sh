#!/usr/bin/env bash
# MOCK GPU: runs tests/gpu/run.sh on a machine WITHOUT a GPU, against stand-ins: a CPU "torch"
# (tests/gpu/fake/torch) and a stand-in NVIDIA driver (tests/gpu/fake/fakecuda.c, built here into
# libcuda.so.1 / libnvidia-ml.so.1 and loaded by the real `stasis` and the real
# `stasis-gpu-roundtrip` through STASIS_LIBCUDA / STASIS_LIBNVML), with real CRIU and a tiny data
# size. What it checks is stasis's GPU path and run.sh's flow, not a GPU: the driver's state
# machine, who drives it, the compatibility check, the reports; no number it prints is a GPU
# number.
#
# After run.sh (which must pass), on the same stand-in:
#   - stasis itself drove the GPU (the stand-in logs each call with its caller), and the restored
#     process was checkpointed again before it was killed;
#   - the driver's bytes, not the tensors', are what the report divides by;
#   - a checkpoint records the GPU and its restore passes the compatibility check on the same
#     node, and is refused on another model or driver branch with the field named;
#   - a driver call that hangs fails the checkpoint within the deadline, and a GPU restore that
#     fails after a leave-running dump: either way the workload is killed, never left locked;
#   - run.sh killed outright half-way has already written the figures of the phases it finished.
# stasis runs with CUDA_VISIBLE_DEVICES=-1 in its environment throughout, which hides the GPU
# from a process that honours it: stasis must not.
#
# Needs: cc, python3, root, a working `criu` (scripts/setup), and debug or release builds of
# `stasis` and `stasis-gpu-roundtrip` (cargo build -p stasis-cli -p stasis-gpu). Run it under a
# reaping parent (tini -s), as `make integration` does.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
FAKE_DIST=$(mktemp -d /tmp/stasis-gpu-fake.XXXXXX)
WORKLOADS=()
cleanup() {
  local p
  for p in "${WORKLOADS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$FAKE_DIST"
}
trap cleanup EXIT
FAILS=0
ok() { echo "selftest: PASS $*"; }
bad() { echo "selftest: FAIL $*"; FAILS=$((FAILS + 1)); }

binary() { # NAME: $STASIS_GPU_SELFTEST_BINS/NAME (another build, e.g. an older commit's), else ours
  local d
  if [[ -n ${STASIS_GPU_SELFTEST_BINS:-} ]]; then
    echo "$STASIS_GPU_SELFTEST_BINS/$1"
    return 0
  fi
  for d in release debug; do
    if [[ -x $ROOT/target/$d/$1 ]]; then
      echo "$ROOT/target/$d/$1"
      return 0
    fi
  done
  echo "selftest: $1 is not built (cargo build -p stasis-cli -p stasis-gpu)" >&2
  exit 2
}
STASIS_BIN=$(binary stasis)
RT_BIN=$(binary stasis-gpu-roundtrip)
command -v criu >/dev/null || { echo "selftest: no criu (scripts/setup)" >&2; exit 2; }

mkdir -p "$FAKE_DIST/bin" "$FAKE_DIST/criu" "$FAKE_DIST/lib" "$FAKE_DIST/driver"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$FAKE_DIST/lib/libcuda.so.1" tests/gpu/fake/fakecuda.c
ln -s libcuda.so.1 "$FAKE_DIST/lib/libnvidia-ml.so.1"
export STASIS_LIBCUDA=$FAKE_DIST/lib/libcuda.so.1
export STASIS_LIBNVML=$FAKE_DIST/lib/libnvidia-ml.so.1
export STASIS_FAKE_GPU_DIR=$FAKE_DIST/driver
CALLS=$STASIS_FAKE_GPU_DIR/calls.log
for b in stasis:"$STASIS_BIN" stasis-gpu-roundtrip:"$RT_BIN"; do
  printf '#!/bin/sh\n# A caller whose CUDA_VISIBLE_DEVICES hides the GPU: stasis must see it anyway.\nCUDA_VISIBLE_DEVICES=-1 exec "%s" "$@"\n' \
    "${b#*:}" >"$FAKE_DIST/bin/${b%%:*}"
  chmod 755 "$FAKE_DIST/bin/${b%%:*}"
done
ln -s "$(command -v criu)" "$FAKE_DIST/criu/criu"
STASIS=$FAKE_DIST/bin/stasis
RT=$FAKE_DIST/bin/stasis-gpu-roundtrip
export PYTHONPATH=$ROOT/tests/gpu/fake${PYTHONPATH:+:$PYTHONPATH}
echo "selftest: MOCK GPU (no GPU on this machine): stand-in driver and torch; real stasis, stasis-gpu-roundtrip and CRIU"

# ---- run.sh on the stand-in ------------------------------------------------------------------
set +e
OUT=$FAKE_DIST/out STASIS_GPU_DIST=$FAKE_DIST STASIS_GPU_TEST_GIB=${STASIS_GPU_TEST_GIB:-0.01} \
  STASIS_GPU_TEST_BUDGET=${STASIS_GPU_TEST_BUDGET:-180} "$ROOT/tests/gpu/run.sh" "$@"
rc=$?
set -e
if ((rc == 0)); then ok "run.sh"; else bad "run.sh exited $rc"; fi
# On the stand-in every part of run.sh can run: a skip here is a failure, not a pass.
skipped=$(python3 -c 'import json,sys; print("; ".join(json.load(open(sys.argv[1]))["meta"]["skipped"]))' \
  "$FAKE_DIST/out/gpu-results.json" 2>/dev/null || echo "no gpu-results.json")
if [[ -z $skipped ]]; then ok "run.sh skipped nothing"; else bad "run.sh skipped: $skipped"; fi

# stasis drove every step of the CRIU part; the roundtrip tool only the in-place round trip and
# the final suspend of the restored process.
for call in lock checkpoint restore unlock; do
  if grep -q "^stasis [0-9]* $call " "$CALLS" 2>/dev/null; then ok "stasis itself called $call"
  else bad "stasis never called $call (the stand-in's log: $(tr '\n' ';' <"$CALLS" 2>/dev/null || echo none))"; fi
done
last=$(tail -n 2 "$CALLS" 2>/dev/null | awk '{print $1, $3}' | tr '\n' ';' || true)
if [[ $last == "stasis-gpu-roun lock;stasis-gpu-roun checkpoint;" ]]; then
  ok "the restored process was checkpointed again before it was killed"
else
  bad "the last driver calls were not the final suspend of the restored process: $last"
fi
if grep -q 'driver held open by pid [0-9]*: {"driver_load_ms"' "$FAKE_DIST/out/gpu-run.log" 2>/dev/null; then
  ok "a helper held the driver open for the run (no persistence mode)"
else
  bad "no helper held the driver open: $(grep -m1 'driver held open' "$FAKE_DIST/out/gpu-run.log" 2>/dev/null || echo 'not started')"
fi
python3 - "$FAKE_DIST/out/gpu-results.json" <<'PY' && ok "report: GB/s from the bytes the driver moved, which exceed the tensors" || bad "report bytes"
import json, sys
r = json.load(open(sys.argv[1]))
b = r["bytes"]
assert b["driver_stop"] and b["driver_stop"] > b["tensors"], b
rows = {(x["group"], x["phase"]): x for x in r["rows"]}
for phase in ("lock", "checkpoint (GPU -> host)", "dump (CRIU)", "restore (host -> GPU)", "unlock"):
    assert ("stasis, stop + restore", phase) in rows, ("missing", phase, sorted(rows))
assert ("stasis, leave running (restored process)", "frozen: CUDA blocked, lock -> unlock") in rows, sorted(rows)
assert r["restore_total_s"] is not None
PY

# ---- a workload of our own for the checks below ------------------------------------------------
start_workload() { # DIR: a CUDA process (the stand-ins); prints its pid
  mkdir -p "$1"
  setsid python3 "$ROOT/tests/gpu/workload.py" --dir "$1" --gib 0.001 </dev/null >"$1/log" 2>&1 &
  WORKLOADS+=($!)
  local _
  for _ in $(seq 100); do [[ -e $1/ready ]] && break; sleep 0.1; done
  python3 "$ROOT/tests/gpu/report.py" get "$1/ready" pid
}
counting() { # DIR: the workload's step count moves on
  local a b
  a=$(cat "$1/step" 2>/dev/null || echo 0)
  sleep 1
  b=$(cat "$1/step" 2>/dev/null || echo 0)
  ((b > a))
}
dead_within() { # PID SECS
  local _
  for _ in $(seq $(($2 * 10))); do
    [[ -e /proc/$1 ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]] || return 0
    sleep 0.1
  done
  return 1
}
W=$FAKE_DIST/w
KEY=$W/key
mkdir -p "$W/store" "$W/scratch"
"$STASIS" key generate "$KEY" >/dev/null
COMMON=(--store "file://$W/store" --key "$KEY" --work-dir "$W/scratch")

# F1: the compatibility check on restore, with the GPU the checkpoint recorded.
pid=$(start_workload "$W/a")
"$STASIS" -q -o json checkpoint process "$pid" "${COMMON[@]}" --workload f1 --stop >"$W/a.json"
ref=$(python3 "$ROOT/tests/gpu/report.py" get "$W/a.json" reference)
dead_within "$pid" 5 || kill -9 "$pid"
wait "$pid" 2>/dev/null || true
recorded=$("$STASIS" -q -o json inspect "$ref" "${COMMON[@]:0:4}" 2>/dev/null | python3 -c \
  'import json,sys; print(json.load(sys.stdin)["requirements"]["node"]["gpu"]["devices"][0]["name"])' || true)
if [[ $recorded == "NVIDIA H200" ]]; then ok "the checkpoint records the stand-in's GPU ($recorded)"
else bad "the checkpoint records no GPU (inspect says: ${recorded:-nothing})"; fi
refused() { # FIELD ENV...: a restore on that other node is refused naming FIELD
  local field=$1
  shift
  if env "$@" "$STASIS" restore "$ref" "${COMMON[@]}" --process >"$W/refused.out" 2>&1; then
    bad "a restore with $* was not refused"
  elif grep -q "$field" "$W/refused.out"; then
    ok "a restore with $* is refused: $(grep -m1 "$field" "$W/refused.out")"
  else
    bad "a restore with $* was refused without naming $field: $(cat "$W/refused.out")"
  fi
}
refused gpu.model STASIS_FAKE_GPU_MODEL="NVIDIA H100 80GB HBM3"
refused gpu.driver_branch STASIS_FAKE_GPU_DRIVER=570.172.08
if "$STASIS" -q -o json restore "$ref" "${COMMON[@]}" --process >"$W/restored.json" 2>"$W/restored.err"; then
  npid=$(python3 "$ROOT/tests/gpu/report.py" get "$W/restored.json" pid)
  WORKLOADS+=("$npid")
  if counting "$W/a"; then ok "the same node restores it (GPU restored and unlocked by stasis: the workload counts on)"
  else bad "restored pid $npid does not count on (left locked?)"; fi
  "$RT" "$npid" --tree --action suspend >/dev/null && kill -9 "$npid"
else
  bad "the restore on the same node failed: $(cat "$W/restored.err")"
fi

# A hung driver call: the checkpoint fails at the deadline; the workload is killed, not locked.
pid=$(start_workload "$W/b")
t0=$SECONDS
if STASIS_FAKE_GPU_HANG=checkpoint STASIS_GPU_CALL_DEADLINE_MS=2000 timeout 60 \
  "$STASIS" checkpoint process "$pid" "${COMMON[@]}" --workload hang >"$W/hang.out" 2>&1; then
  bad "a checkpoint whose driver call hangs succeeded"
elif ((SECONDS - t0 > 30)); then
  bad "a hung driver call held stasis for $((SECONDS - t0)) s"
elif grep -q "did not return within" "$W/hang.out" && dead_within "$pid" 5; then
  ok "a hung cuCheckpointProcessCheckpoint fails the checkpoint in $((SECONDS - t0)) s and the workload is killed, not left locked"
else
  bad "hung call: $(cat "$W/hang.out"); workload alive: $(dead_within "$pid" 0 && echo no || echo yes)"
fi

# A GPU restore that fails after a leave-running dump (cuda-checkpoint #44).
pid=$(start_workload "$W/c")
if STASIS_FAKE_GPU_FAIL=restore "$STASIS" checkpoint process "$pid" "${COMMON[@]}" \
  --workload oom >"$W/oom.out" 2>&1; then
  bad "a leave-running checkpoint whose GPU restore failed succeeded"
elif grep -q "were killed" "$W/oom.out" && dead_within "$pid" 5; then
  ok "a failed GPU restore after a leave-running dump: $(grep -m1 '^error' "$W/oom.out")"
else
  bad "failed restore: $(cat "$W/oom.out"); workload alive: $(dead_within "$pid" 0 && echo no || echo yes)"
fi

# A machine that stops answering in the middle of run.sh: what was measured so far must already be
# in $OUT. run.sh is killed outright (no exit trap) once stasis has unlocked the restored process,
# which is after the --stop checkpoint's phase ended.
mv "$CALLS" "$CALLS.1"
OUT2=$FAKE_DIST/out2
OUT=$OUT2 STASIS_GPU_DIST=$FAKE_DIST STASIS_GPU_TEST_GIB=0.01 STASIS_GPU_TEST_BUDGET=180 \
  "$ROOT/tests/gpu/run.sh" >"$W/cut.log" 2>&1 &
run_pid=$!
for _ in $(seq 600); do
  grep -q "^stasis [0-9]* unlock " "$CALLS" 2>/dev/null && break
  sleep 0.1
done
restored_pid=$(awk '$1 == "stasis" && $3 == "unlock" {p = $4} END {print p}' "$CALLS" 2>/dev/null)
children=$(ps -o pid= --ppid "$run_pid" 2>/dev/null || true)
kill -9 "$run_pid" 2>/dev/null || true
wait "$run_pid" 2>/dev/null || true
# What run.sh's exit would have stopped: its children, the restored workload (checkpointed
# first, as run.sh does), the driver helper, its work dir.
for p in $children; do kill -9 "$p" 2>/dev/null || true; done
if [[ -n $restored_pid ]]; then
  "$RT" "$restored_pid" --tree --action suspend >/dev/null 2>&1 || true
  kill -9 "$restored_pid" 2>/dev/null || true
fi
helper=$(grep -o 'driver held open by pid [0-9]*' "$W/cut.log" | grep -o '[0-9]*$' || true)
[[ -n $helper ]] && kill -9 "$helper" 2>/dev/null || true
cut_work=$(grep -o 'work dir /[^ ]*' "$W/cut.log" | head -n1 | cut -d' ' -f3)
[[ $cut_work == /tmp/stasis-gpu.* ]] && rm -rf "$cut_work"
if [[ -z $restored_pid ]]; then
  bad "run.sh never reached the restore before it was cut off: $(tail -n 3 "$W/cut.log")"
elif python3 - "$OUT2/gpu-results.json" <<'PY'
import json, sys
rows = {(x["group"], x["phase"]) for x in json.load(open(sys.argv[1]))["rows"]}
assert ("stasis, stop + restore", "checkpoint (GPU -> host)") in rows, sorted(rows)
PY
then
  ok "run.sh cut off after the restore: the --stop checkpoint's figures were already in \$OUT"
else
  bad "run.sh cut off after the restore: \$OUT lacks the --stop checkpoint's figures ($(ls "$OUT2" 2>&1 | tr '\n' ' '))"
fi

if ((FAILS > 0)); then
  echo "selftest: $FAILS check(s) failed (MOCK GPU)"
  exit 1
fi
echo "selftest: all checks passed (MOCK GPU: no GPU number above is a GPU measurement)"
