#!/usr/bin/env bash
# The freeze against the filesystem CRIU's image files land on: a plain tmpfs against a tmpfs
# mounted with huge=always (2 MiB pages: a fraction of the page allocations that dominate
# CRIU's memwrite), for a bare `runc checkpoint --leave-running` (with CRIU's own split, from
# bench/criu-stats.py) and for `stasis checkpoint container` with its work directory on each
# (file:// store on disk). Alternates ROUNDS times; run under a reaping parent:
#   tini -s -- bench/freeze-tmpfs.sh        (root: it mounts a tmpfs at $HUGE, removed at exit)
# Environment: STATE_MB (2048), ROUNDS (2), STASIS (target/release/stasis), BENCH_DIR
# (/var/tmp/stasis-freeze), HUGE (/mnt/stasis-huge-tmpfs), PLAIN (/dev/shm/stasis-freeze).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE_MB=${STATE_MB:-2048}; ROUNDS=${ROUNDS:-2}
STASIS=${STASIS:-$PWD/target/release/stasis}
BENCH_DIR=${BENCH_DIR:-/var/tmp/stasis-freeze}
HUGE=${HUGE:-/mnt/stasis-huge-tmpfs}; PLAIN=${PLAIN:-/dev/shm/stasis-freeze}
R=$BENCH_DIR/runc
export STASIS_RUNC_ROOT=$R STASIS_STORE=file://$BENCH_DIR/store STASIS_KEY_FILE=$BENCH_DIR/key
cleanup() {
  runc --root "$R" delete -f app >/dev/null 2>&1 || true
  mountpoint -q "$HUGE" && umount "$HUGE"
  rm -rf "$BENCH_DIR" "$PLAIN"
}
trap cleanup EXIT
rm -rf "$BENCH_DIR" "$PLAIN"; mkdir -p "$BENCH_DIR" "$PLAIN" "$HUGE"
mount -t tmpfs -o size=$((STATE_MB * 3))m,huge=always tmpfs "$HUGE"
"$STASIS" key generate "$STASIS_KEY_FILE" >/dev/null
scripts/make-bundle --force "$BENCH_DIR/bundle" STATE_MB="$STATE_MB" >/dev/null
runc --root "$R" run -d --bundle "$BENCH_DIR/bundle" app > >(cat >"$BENCH_DIR/app.log") 2>&1 </dev/null
until grep -q 'count=1 ' "$BENCH_DIR/app.log" 2>/dev/null; do sleep 0.2; done; sleep 1
echo "| round | images on | bare runc checkpoint | CRIU frozen / memdump / memwrite | stasis freeze (dump) | load |"
echo "|---|---|---|---|---|---|"
for i in $(seq "$ROUNDS"); do
  for fs in "$PLAIN" "$HUGE"; do
    d=$fs/bare; rm -rf "$d"; mkdir -p "$d"; sync
    t=$(date +%s%N)
    runc --root "$R" checkpoint --leave-running --image-path "$d" --work-path "$d" app
    bare=$(( ($(date +%s%N) - t) / 1000000 ))
    criu=$(bench/criu-stats.py "$d" | jq -r '"\(.frozen_ms) / \(.memdump_ms) / \(.memwrite_ms) ms"')
    rm -rf "$d"; sync
    st=$(STASIS_WORK_DIR=$fs/work "$STASIS" checkpoint container app --workload freeze -q -o json |
      jq -r '"\(.timings.frozen_ms) ms (\(.timings.dump_ms))"')
    echo "| $i | $([[ $fs == "$HUGE" ]] && echo "tmpfs huge=always" || echo "tmpfs") | $bare ms | $criu | $st | $(cut -d' ' -f1 /proc/loadavg) |"
  done
done
