#!/usr/bin/env bash
# Where the freeze's pages can go (issue 11's freeze goal): one run compares, on the same
# running STATE_MB `stasis-counter`, CRIU writing its pages into image files on tmpfs (what
# stasis does today) against CRIU's page server receiving them into memory faulted in before
# the freeze (`runc checkpoint --page-server` to bench/page-server.py), each with CRIU's own
# split (bench/criu-stats.py); then the three transports alone (bench/xfer.c: tmpfs files,
# loopback TCP, a pipe read into faulted-in memory), the floor under each. ROUNDS alternations;
# run as root under a reaping parent:
#   tini -s -- bench/freeze-transport.sh
# Environment: STATE_MB (2048), ROUNDS (2), BENCH_DIR (/var/tmp/stasis-transport),
# IMAGES (/dev/shm/stasis-transport), PORT (27001).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE_MB=${STATE_MB:-2048}; ROUNDS=${ROUNDS:-2}; PORT=${PORT:-27001}
BENCH_DIR=${BENCH_DIR:-/var/tmp/stasis-transport}; IMAGES=${IMAGES:-/dev/shm/stasis-transport}
R=$BENCH_DIR/runc
cleanup() {
  jobs -p | xargs -r kill 2>/dev/null || true
  runc --root "$R" delete -f app >/dev/null 2>&1 || true
  rm -rf "$BENCH_DIR" "$IMAGES"
}
trap cleanup EXIT
rm -rf "$BENCH_DIR" "$IMAGES"; mkdir -p "$BENCH_DIR" "$IMAGES"
cc -O2 -pthread -o "$BENCH_DIR/xfer" bench/xfer.c
scripts/make-bundle --force "$BENCH_DIR/bundle" STATE_MB="$STATE_MB" >/dev/null
runc --root "$R" run -d --bundle "$BENCH_DIR/bundle" app > >(cat >"$BENCH_DIR/app.log") 2>&1 </dev/null
until grep -q 'count=1 ' "$BENCH_DIR/app.log" 2>/dev/null; do sleep 0.2; done; sleep 1
split() { bench/criu-stats.py "$1" | jq -r '"\(.frozen_ms) / \(.memdump_ms) / \(.memwrite_ms)"'; }
echo "| round | pages go to | runc checkpoint (ms) | CRIU frozen / memdump / memwrite (ms) | per GiB frozen (s) | load |"
echo "|---|---|---|---|---|---|"
for i in $(seq "$ROUNDS"); do
  d=$IMAGES/files; mkdir -p "$d"
  t=$(date +%s%N)
  runc --root "$R" checkpoint --leave-running --image-path "$d" --work-path "$d" app
  ms=$(( ($(date +%s%N) - t) / 1000000 )); s=$(split "$d")
  echo "| $i | image files on tmpfs | $ms | $s | $(awk -v f="${s%% *}" -v m="$STATE_MB" 'BEGIN{printf "%.2f", f/1000/(m/1024)}') | $(cut -d' ' -f1 /proc/loadavg) |"
  rm -rf "$d"
  d=$IMAGES/server; mkdir -p "$d"
  bench/page-server.py "$PORT" $((STATE_MB + 256)) >"$BENCH_DIR/ps.log" 2>&1 &
  until grep -q ready "$BENCH_DIR/ps.log" 2>/dev/null; do sleep 0.1; done
  t=$(date +%s%N)
  runc --root "$R" checkpoint --leave-running --page-server "127.0.0.1:$PORT" --image-path "$d" --work-path "$d" app
  ms=$(( ($(date +%s%N) - t) / 1000000 )); wait; s=$(split "$d")
  echo "| $i | page server, memory faulted in ($(tail -1 "$BENCH_DIR/ps.log" | jq -r '"\(.received_mib) MiB in \(.receive_ms) ms"')) | $ms | $s | $(awk -v f="${s%% *}" -v m="$STATE_MB" 'BEGIN{printf "%.2f", f/1000/(m/1024)}') | $(cut -d' ' -f1 /proc/loadavg) |"
  rm -rf "$d"
done
echo
echo "| round | transport alone ($STATE_MB MiB, bench/xfer.c) | ms | GB/s | vmsplice drain (ms) |"
echo "|---|---|---|---|---|"
for i in $(seq "$ROUNDS"); do
  for m in tmpfs tcp pipe; do
    "$BENCH_DIR/xfer" "$STATE_MB" "$m" "$IMAGES/xfer.img" |
      jq -r --arg i "$i" '"| \($i) | \(.mode) | \(.ms) | \(.gbs) | \(.drain_ms) |"'
  done
done
