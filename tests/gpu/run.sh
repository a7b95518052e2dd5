#!/usr/bin/env bash
# GPU checkpoint/restore test for a lent GPU machine (see docs/gpu.md).
#
# Uses only what it carries (dist/gpu/, built here by tests/gpu/prepare.sh) plus the machine's
# NVIDIA driver and PyTorch; reaches no network. It probes first, then:
#   1. a PyTorch process fills STASIS_GPU_TEST_GIB (default 4) GiB of GPU memory with seeded random
#      data, records checksums, and counts steps;
#   2. driver API round trip in place (lock, checkpoint, restore, unlock) with
#      stasis-gpu-roundtrip, then the workload verifies its tensors and that it kept counting;
#   3. where `criu check` passes, `stasis` drives the GPU itself (it locks, checkpoints, restores
#      and unlocks; nothing else touches the workload's GPU state): `stasis checkpoint process
#      --stop`, the process is gone, `stasis restore --process`, verify tensors and that the count
#      continued; then `stasis checkpoint process` (leave running) of the restored process, verify;
#   4. a cold start of the same process (python, import torch, CUDA init, load the same tensors);
#   5. a table of every phase as stasis measured it (seconds; GB/s from the bytes the driver
#      moved, by NVML), restore vs cold start, what was skipped and why.
# Every phase's figures go to $OUT as soon as the phase ends (gpu-results.md, gpu-results.json,
# gpu-run.log), so a machine that stops answering later still returns them. A live restored CUDA
# process is checkpointed again before it is killed (killing it live can hang the machine:
# NVIDIA cuda-checkpoint #53), and a helper holds the driver open for the whole run instead of
# persistence mode (the machine's settings are left as they are).
#
# Environment: STASIS_GPU_TEST_GIB (4), STASIS_GPU_TEST_BUDGET seconds for the whole run (330),
# STASIS_GPU_DIST (dist/gpu), STASIS_GPU_WORK (parent of the scratch dir, /tmp),
# STASIS_GPU_LOCK_TIMEOUT_MS (10000), STASIS_GPU_KEEP=1 keeps the scratch dir.
# Exit status: 0 every check that ran passed (skips are listed), 1 a check failed, 2 nothing ran.
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
HERE=$ROOT/tests/gpu
DIST=${STASIS_GPU_DIST:-$ROOT/dist/gpu}
GIB=${STASIS_GPU_TEST_GIB:-4}
BUDGET=${STASIS_GPU_TEST_BUDGET:-330}
LOCK_MS=${STASIS_GPU_LOCK_TIMEOUT_MS:-10000}
OUTDIR=${OUT:-}
SECONDS=0

WORK=$(mktemp -d "${STASIS_GPU_WORK:-/tmp}/stasis-gpu.XXXXXX")
RES=$WORK/res
STATE=$WORK/state
mkdir -p "$RES" "$STATE"
LOG=$WORK/run.log
exec > >(tee -a "$LOG") 2>&1

STARTED=()   # every pid this script started or restored; killed on exit
CUDA_PIDS=() # of those, the workload's: their GPU state is checkpointed before they are killed
RAN=0        # checks that ran
FAILS=0
API=0        # the driver has the checkpoint API
RT=""        # stasis-gpu-roundtrip

say() { printf '[%3ds] %s\n' "$SECONDS" "$*"; }
skip() { say "SKIP $1: $2"; echo "$1: $2" >>"$RES/skipped.txt"; }
fail() { say "FAIL $1"; echo "$1" >>"$RES/failed.txt"; FAILS=$((FAILS + 1)); }
pass() { say "PASS $1"; RAN=$((RAN + 1)); }
meta() { echo "$1=$2" >>"$RES/meta.env"; }
left() { echo $((BUDGET - SECONDS)); }
jget() { python3 "$HERE/report.py" get "$1" "$2" 2>/dev/null || true; }
# Alive and not a zombie (a killed child of this script stays a zombie until reaped).
alive() {
  [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null &&
    [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]
}
reap() { alive "$1" || wait "$1" 2>/dev/null || true; }

# T SECS CMD...: run CMD with a timeout, never past the budget.
T() {
  local t=$1 l
  shift
  l=$(left)
  if ((l < 5)); then
    say "out of time budget before: $*"
    return 124
  fi
  ((t > l)) && t=$l
  timeout -k 3 "$t" "$@"
}

wait_file() { # FILE SECS
  local end=$((SECONDS + $2))
  while [[ ! -e $1 ]]; do
    ((SECONDS >= end)) && return 1
    sleep 0.2
  done
}

# The results so far, to $OUT now: if the machine stops answering later, these come back.
snapshot() {
  [[ -n $OUTDIR ]] || return 0
  mkdir -p "$OUTDIR"
  python3 "$HERE/report.py" table "$RES" "$OUTDIR" >/dev/null 2>&1 || true
  cp "$LOG" "$OUTDIR/gpu-run.log" 2>/dev/null || true
}

# stop_cuda PID: ends a workload process without killing a live CUDA process: its GPU state is
# checkpointed first (terminating a live restored CUDA process took the host down in NVIDIA
# cuda-checkpoint #53; "suspending the CUDA state again before the kill makes teardown safe").
stop_cuda() {
  local p=$1
  if ! alive "$p"; then
    reap "$p"
    return 0
  fi
  if [[ -n $RT ]] && ((API)); then
    if timeout -k 3 60 "$RT" "$p" --tree --action suspend --lock-timeout-ms "$LOCK_MS" \
      >"$RES/final-suspend-$p.json" 2>&1; then
      say "pid $p: GPU state checkpointed before the kill"
    else
      say "pid $p: could not checkpoint its GPU state before the kill: $(tail -n1 "$RES/final-suspend-$p.json")"
    fi
  fi
  kill -9 "$p" 2>/dev/null || true
  for _ in $(seq 25); do alive "$p" || break; sleep 0.2; done
  reap "$p"
}

cleanup() {
  local rc=$?
  set +e
  for p in "${CUDA_PIDS[@]}"; do stop_cuda "$p"; done
  for p in "${STARTED[@]}"; do
    alive "$p" && kill -9 "$p" 2>/dev/null
  done
  sleep 0.3
  snapshot
  if [[ -z ${STASIS_GPU_KEEP:-} ]]; then
    rm -rf "$WORK"
  else
    echo "kept $WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "stasis GPU test: ${GIB} GiB, budget ${BUDGET}s, work dir $WORK"
meta gib "$GIB"

# ---------------------------------------------------------------------------------------------
say "== probe"
bin() { # the carried binary, else a local release build
  local b=""
  if [[ -x $DIST/bin/$1 ]]; then b=$DIST/bin/$1
  elif [[ -x $ROOT/target/release/$1 ]]; then b=$ROOT/target/release/$1
  fi
  [[ -n $b ]] || return 0
  # Built on another image: if this one's glibc is too old, run it with the carried CRIU
  # prefix's loader and libc (newer, and backward compatible).
  if "$b" --help >/dev/null 2>"$WORK/ld.err" || ! grep -q 'GLIBC_' "$WORK/ld.err"; then
    echo "$b"
    return 0
  fi
  local ld
  ld=$(find "$DIST/criu" -name ld-linux-x86-64.so.2 -path '*/lib/*' 2>/dev/null | head -n1)
  if [[ -z $ld ]]; then
    echo "$1 needs a newer glibc than this machine has: $(head -n1 "$WORK/ld.err")" >&2
    return 0
  fi
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' "$ld" "$(dirname "$ld")" "$b" >"$WORK/bin/$1"
  chmod 755 "$WORK/bin/$1"
  echo "$1: this machine's glibc is too old; running it with the carried loader" >&2
  echo "$WORK/bin/$1"
}
RT=$(bin stasis-gpu-roundtrip)
STASIS=$(bin stasis)
CRIU=""
if [[ -x $DIST/criu/criu ]]; then CRIU=$DIST/criu/criu
elif command -v criu >/dev/null; then CRIU=$(command -v criu)
fi
# Before anything runs stasis (doctor included): the CRIU stasis uses.
[[ -n $CRIU ]] && export STASIS_CRIU=$CRIU
[[ -f $DIST/MANIFEST ]] && sed 's/^/  dist: /' "$DIST/MANIFEST"
say "kernel $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/{printf "%d GiB", $2/1048576}' /proc/meminfo) RAM"
RUNTIME="kernel $(uname -r)"
if dmesg 2>/dev/null | grep -qi gvisor || grep -qi gvisor /proc/version 2>/dev/null; then
  RUNTIME="gVisor ($RUNTIME)"
fi
meta runtime "$RUNTIME"

if command -v nvidia-smi >/dev/null; then
  T 30 nvidia-smi --query-gpu=name,driver_version,memory.total,persistence_mode,mig.mode.current \
    --format=csv,noheader || true
fi

HAVE_DRIVER=0
if [[ -z $RT ]]; then
  skip "driver API" "stasis-gpu-roundtrip not carried (run tests/gpu/prepare.sh and carry dist/gpu)"
else
  set +e
  T 60 "$RT" --probe --json >"$RES/probe.json"
  prc=$?
  set -e
  cat "$RES/probe.json"
  if ((prc == 3)); then
    skip "everything on the GPU" "no NVIDIA driver ($(jget "$RES/probe.json" no_driver))"
  elif ((prc != 0)); then
    fail "probe (stasis-gpu-roundtrip --probe exited $prc)"
  else
    HAVE_DRIVER=1
    meta driver "$(jget "$RES/probe.json" driver_version)"
    meta persistence_mode "$(jget "$RES/probe.json" persistence_mode)"
    meta cuda_driver "$(jget "$RES/probe.json" cuda_driver_version)"
    meta gpu "$(jget "$RES/probe.json" fingerprint.devices.0.name) x $(python3 -c "import json;print(len(json.load(open('$RES/probe.json'))['fingerprint']['devices']))" 2>/dev/null || echo '?')"
    if [[ $(jget "$RES/probe.json" checkpoint_api) == true ]]; then
      API=1
      pass "probe: driver has the CUDA checkpoint API"
    else
      skip "driver API round trip" "driver lacks the checkpoint API: $(jget "$RES/probe.json" problems)"
    fi
  fi
fi

TORCH=0
if ((HAVE_DRIVER)); then
  if T 90 python3 -c 'import json, torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}))' >"$RES/torch.json"; then
    cat "$RES/torch.json"
    if [[ $(jget "$RES/torch.json" available) == true ]]; then
      TORCH=1
    else
      skip "workload" "PyTorch sees no CUDA device"
    fi
  else
    skip "workload" "python3 -c 'import torch' failed on this machine (no PyTorch)"
  fi
fi

CRIU_OK=0
if [[ -z $CRIU ]]; then
  skip "CRIU part" "no CRIU carried (dist/gpu/criu) or installed"
elif [[ -z $STASIS ]]; then
  skip "CRIU part" "stasis binary not carried"
else
  meta criu "$("$CRIU" --version 2>/dev/null | head -n1)"
  if T 60 "$CRIU" check >"$RES/criu-check.txt" 2>&1; then
    CRIU_OK=1
    say "criu check: $(tail -n1 "$RES/criu-check.txt")"
  else
    skip "CRIU part" "criu check failed: $(grep -m1 -iE 'error|fail' "$RES/criu-check.txt" || tail -n1 "$RES/criu-check.txt")"
  fi
  T 30 "$STASIS" doctor 2>&1 | sed 's/^/  doctor: /' || true
fi
snapshot

# A helper that holds the driver initialised for the whole run: a restore needs persistence
# mode or cuInit done (CUDA docs, cuCheckpointProcessRestore), and without either the driver
# tears the GPU down between the --stop and the restore; the machine's settings stay as they are.
if ((API)); then
  mkfifo "$WORK/keeper.in"
  "$RT" --keep-driver <"$WORK/keeper.in" >"$RES/keeper.json" 2>"$RES/keeper.err" &
  STARTED+=($!)
  disown # ended by cleanup: no "Killed" notice
  # The write end stays open in this shell: the helper ends when this script does (end of file).
  exec 9>"$WORK/keeper.in"
  sleep 1
  if alive "${STARTED[-1]}" && [[ -s $RES/keeper.json ]]; then
    say "driver held open by pid ${STARTED[-1]}: $(cat "$RES/keeper.json")"
  else
    say "the helper that holds the driver open did not start: $(cat "$RES/keeper.err" 2>/dev/null)"
  fi
fi

# ---------------------------------------------------------------------------------------------
WPID=""
if ((TORCH)); then
  say "== workload: ${GIB} GiB of random data on the GPU"
  free_mib=$(df -BM --output=avail "$WORK" | tail -n1 | tr -dc 0-9)
  SAVE=(--save "$WORK/saved")
  # saved tensors + the store + one checkpoint's images at a time, a quarter more and 256 MiB
  need=$(python3 -c "import math; print(math.ceil(3 * $GIB * 1024 * 1.25) + 256)")
  if ((free_mib < need)); then
    SAVE=()
    skip "cold start" "only ${free_mib} MiB free on $WORK, ${need} MiB needed for saved tensors, store and images"
  fi
  # No expandable segments: PyTorch would map them with exportable VMM handles, which the
  # checkpoint API does not support (CUDA_ERROR_NOT_SUPPORTED).
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
    setsid python3 "$HERE/workload.py" --dir "$STATE" --gib "$GIB" "${SAVE[@]}" \
    </dev/null >"$WORK/workload.log" 2>&1 9>&- & # fd 9: the driver helper's pipe, not the workload's
  STARTED+=($!)
  if wait_file "$STATE/ready" "$(( $(left) > 150 ? 150 : $(left) ))"; then
    cp "$STATE/ready" "$RES/ready.json"
    WPID=$(jget "$RES/ready.json" pid)
    STARTED+=("$WPID")
    CUDA_PIDS+=("$WPID")
    say "workload pid $WPID ready: $(cat "$RES/ready.json")"
  else
    fail "workload did not become ready"
    tail -n 20 "$WORK/workload.log" || true
  fi
fi

verify() { # ID SECS [MIN_STEP]: ask the workload to check its tensors; pass/fail
  local id=$1 f=$STATE/verify-$1.json
  echo "$id" >"$STATE/verify-request.tmp" && mv "$STATE/verify-request.tmp" "$STATE/verify-request"
  if ! wait_file "$f" "$2"; then
    fail "verify $id: no answer from the workload in $2 s"
    return 1
  fi
  sleep 0.1
  cp "$f" "$RES/verify-$id.json"
  local ok step
  ok=$(jget "$f" ok)
  step=$(jget "$f" step)
  if [[ $ok != true ]]; then
    fail "verify $id: $(cat "$f")"
    return 1
  fi
  if [[ -n ${3:-} ]] && ((step <= $3)); then
    fail "verify $id: step $step did not continue past $3"
    return 1
  fi
  pass "verify $id: ${GIB} GiB intact, step $step (GPU counter agrees)"
}
step_now() { cat "$STATE/step" 2>/dev/null || echo 0; }

if [[ -n $WPID ]]; then
  sleep 1
  verify base 60 || true
fi
snapshot

# ---------------------------------------------------------------------------------------------
if [[ -n $WPID ]] && ((API)); then
  say "== driver API round trip in place (lock, checkpoint, restore, unlock)"
  s0=$(step_now)
  if T 120 "$RT" "$WPID" --tree --hold-ms 1000 --lock-timeout-ms "$LOCK_MS" >"$RES/roundtrip.json"; then
    cat "$RES/roundtrip.json"
    pass "driver API round trip"
    sleep 0.5
    verify rt 60 "$s0" || true
  elif [[ $RUNTIME == gVisor* ]]; then
    # The driver API goes through gVisor's nvproxy, which may not pass the checkpoint calls on.
    skip "driver API round trip" "the checkpoint API failed under gVisor (see the log above)"
    API=0
  else
    fail "driver API round trip (stasis-gpu-roundtrip $WPID)"
  fi
elif [[ -n $WPID ]]; then
  skip "driver API round trip" "no checkpoint API"
fi

# ---------------------------------------------------------------------------------------------
criu_logs() {
  find "$WORK/scratch" -name '*.log' -newer "$RES/ready.json" 2>/dev/null | while read -r l; do
    say "--- $l (tail)"
    tail -n 25 "$l"
  done
}
nvidia_fds() { # PID WHEN: NVIDIA files a process still holds (CRIU cannot dump them)
  local f t held=()
  for f in /proc/"$1"/fd/*; do
    t=$(readlink "$f" 2>/dev/null) || continue
    [[ $t == /dev/nvidia* ]] && held+=("$t")
  done
  say "pid $1 $2: ${#held[@]} /dev/nvidia* fds open${held[*]:+: ${held[*]}}"
}
# stasis_gpu NAME WHAT: stasis's report must show that stasis itself drove the GPU.
stasis_gpu() {
  local n
  n=$(jget "$RES/$1.json" gpu.processes)
  if [[ $n =~ ^[0-9]+$ ]] && ((n >= 1)); then
    pass "$2: stasis drove the GPU of $n CUDA process(es)"
    return 0
  fi
  fail "$2: stasis's report has no GPU phases (stasis did not drive the GPU): $(cat "$RES/$1.json")"
  return 1
}

if [[ -n $WPID ]] && ((API)) && ((CRIU_OK)); then
  free_mib=$(df -BM --output=avail "$WORK" | tail -n1 | tr -dc 0-9)
  need=$(python3 -c "import math; print(math.ceil(2 * $GIB * 1024 * 1.25) + 256)")
  # stop + restore: two CRIU passes over the data and a store round trip.
  need_s=$(python3 -c "import math; print(math.ceil(45 + 25 * $GIB))")
  if ((free_mib < need)); then
    skip "CRIU part" "only ${free_mib} MiB free on $WORK, ${need} MiB needed for the store and the images"
  elif (($(left) < need_s)); then
    skip "CRIU part" "only $(left) s of the budget left, ${need_s} s needed at ${GIB} GiB"
  else
    say "== CRIU, driven by stasis: checkpoint --stop, restore, then checkpoint the restored process (leave running)"
    KEY=$WORK/key
    STORE=file://$WORK/store
    mkdir -p "$WORK/store" "$WORK/scratch"
    meta store "file:// on $(df --output=source "$WORK" | tail -n1) (local disk)"
    "$STASIS" key generate "$KEY" >/dev/null
    COMMON=(--store "$STORE" --key "$KEY" --work-dir "$WORK/scratch")
    # a) stop, restore: stasis locks and checkpoints, CRIU dumps and kills; stasis restores with
    #    CRIU, then restores the GPU state and unlocks.
    NEWPID=""
    nvidia_fds "$WPID" "before the checkpoint"
    if T 240 "$STASIS" -q -o json checkpoint process "$WPID" "${COMMON[@]}" --workload gpu-test --stop >"$RES/ckpt2.json"; then
      say "checkpoint --stop: $(cat "$RES/ckpt2.json")"
      s_dump=$(step_now)
      pass "stasis checkpoint process --stop"
      stasis_gpu ckpt2 "checkpoint --stop" || true
      for _ in $(seq 50); do alive "$WPID" || break; sleep 0.2; done
      if alive "$WPID"; then
        say "pid $WPID still there after --stop; stopping it"
        stop_cuda "$WPID"
      fi
      reap "$WPID" # the restore needs its pid free
      snapshot
      REF=$(jget "$RES/ckpt2.json" reference)
      if T 240 "$STASIS" -q -o json restore "$REF" "${COMMON[@]}" --process >"$RES/restore.json"; then
        say "restore: $(cat "$RES/restore.json")"
        NEWPID=$(jget "$RES/restore.json" pid)
        STARTED+=("$NEWPID")
        CUDA_PIDS+=("$NEWPID")
        pass "stasis restore --process ($REF as pid $NEWPID)"
        stasis_gpu restore "restore" || true
        nvidia_fds "$NEWPID" "after the restore"
        T 30 "$RT" "$NEWPID" --action state >"$RES/state-restored.json" && say "driver: $(cat "$RES/state-restored.json")"
        sleep 0.5
        verify restored 90 "$s_dump" || true
      else
        fail "stasis restore --process"
        cat "$RES/restore.json" 2>/dev/null
        criu_logs
      fi
    else
      fail "stasis checkpoint process --stop"
      cat "$RES/ckpt2.json" 2>/dev/null
      criu_logs
    fi
    snapshot
    # b) leave running, of the restored process: stasis locks, checkpoints, CRIU dumps, stasis
    #    restores and unlocks; the workload must keep counting from where it was.
    need_s=$(python3 -c "import math; print(math.ceil(20 + 12 * $GIB))")
    if [[ -z $NEWPID ]]; then
      skip "CRIU leave-running" "no restored process"
    elif (($(left) < need_s)); then
      skip "CRIU leave-running" "only $(left) s of the budget left, ${need_s} s needed at ${GIB} GiB"
    else
      if T 240 "$STASIS" -q -o json checkpoint process "$NEWPID" "${COMMON[@]}" --workload gpu-test >"$RES/ckpt1.json"; then
        say "checkpoint (leave running): $(cat "$RES/ckpt1.json")"
        pass "stasis checkpoint process (leave running, of the restored process)"
        stasis_gpu ckpt1 "checkpoint, leave running" || true
        s0=$(step_now)
        nvidia_fds "$NEWPID" "after the leave-running checkpoint"
        sleep 0.5
        verify lr 60 "$s0" || true
      else
        fail "stasis checkpoint process (leave running)"
        cat "$RES/ckpt1.json" 2>/dev/null
        criu_logs
      fi
    fi
  fi
elif [[ -n $WPID ]] && ((CRIU_OK)); then
  skip "CRIU part" "no checkpoint API"
fi
snapshot

# ---------------------------------------------------------------------------------------------
for p in "${CUDA_PIDS[@]}"; do stop_cuda "$p"; done
CUDA_PIDS=()
if [[ -d $WORK/saved ]]; then
  need_s=$(python3 -c "import math; print(math.ceil(20 + 5 * $GIB))")
  if (($(left) < need_s)); then
    skip "cold start" "only $(left) s of the budget left, ${need_s} s needed"
  else
    say "== cold start: python, import torch, CUDA init, load ${GIB} GiB from $WORK/saved (page cache warm, like the store)"
    t0=$(date +%s.%N)
    if T 150 python3 "$HERE/workload.py" --cold-start "$WORK/saved" --dir "$STATE" >"$RES/cold.json"; then
      t1=$(date +%s.%N)
      meta cold_wall_s "$(python3 -c "print(round($t1 - $t0, 3))")"
      cat "$RES/cold.json"
      pass "cold start (tensors verified)"
    else
      fail "cold start"
    fi
  fi
elif [[ -n $WPID ]]; then
  [[ -f $RES/skipped.txt ]] && grep -q '^cold start' "$RES/skipped.txt" || skip "cold start" "no saved tensors"
fi

# ---------------------------------------------------------------------------------------------
say "== results"
python3 "$HERE/report.py" table "$RES" "$OUTDIR" || cat "$RES"/*.json
say "done in ${SECONDS}s: $RAN checks passed, $FAILS failed"
if ((FAILS > 0)); then exit 1; fi
if ((RAN == 0)); then exit 2; fi
exit 0
