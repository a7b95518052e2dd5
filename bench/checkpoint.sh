#!/usr/bin/env bash
# Benchmark of the foundation (issue 2, "Performance"): stasis against the baseline a user would
# script, in the same run, on the same disk, with the counter holding STATE_MB of incompressible
# state. Prints a table with ratios; run it under a reaping parent (`make bench` uses tini -s).
#
#   checkpoint  stasis checkpoint (leave-running) to a file:// store on disk
#               vs runc checkpoint --leave-running to a directory + tar | zstd -1 to the same disk
#   incremental second stasis checkpoint after DIRTY_PCT (5) % of the state changed: new bytes
#   restore     stasis restore from the store (scratch on tmpfs)
#               vs zstd -d | tar -x into tmpfs + runc restore; and vs a bare runc restore from an
#               uncompressed image directory already on tmpfs
#   memory      peak RSS of the stasis process during checkpoint and restore
#
# Environment: STATE_MB (default 2048), BENCH_DIR (default /var/tmp/stasis-bench, on disk),
# SHM_DIR (default /dev/shm/stasis-bench), OUT (optional file for the JSON results).
set -euo pipefail
cd "$(dirname "$0")/.."

STATE_MB=${STATE_MB:-2048}
DIRTY_PCT=${DIRTY_PCT:-5}
BENCH_DIR=${BENCH_DIR:-/var/tmp/stasis-bench}
SHM_DIR=${SHM_DIR:-/dev/shm/stasis-bench}
STASIS=${STASIS:-$PWD/target/release/stasis}
R=$BENCH_DIR/runc
export STASIS_STORE=file://$BENCH_DIR/store STASIS_KEY_FILE=$BENCH_DIR/key STASIS_RUNC_ROOT=$R

now() { date +%s%N; }
ms_since() { echo $(( ($(now) - $1) / 1000000 )); }
cleanup() {
  for id in $(runc --root "$R" list -q 2>/dev/null); do runc --root "$R" delete -f "$id" >/dev/null 2>&1 || true; done
  rm -rf "$SHM_DIR"
}
# The stores and images of a 2 GiB run take ~6 GiB of disk: removed at exit (KEEP_BENCH=1 keeps them).
trap 'cleanup; [[ ${KEEP_BENCH:-0} == 1 ]] || rm -rf "$BENCH_DIR"' EXIT
cleanup
rm -rf "$BENCH_DIR"; mkdir -p "$BENCH_DIR" "$SHM_DIR"
"$STASIS" key generate "$STASIS_KEY_FILE" >/dev/null

start() { # id bundle
  scripts/make-bundle --force "$2" STATE_MB="$STATE_MB" DIRTY_PCT="$DIRTY_PCT" >/dev/null
  # stdout must be a pipe: CRIU cannot dump a host file opened outside the container
  runc --root "$R" run -d --bundle "$2" "$1" > >(cat >"$BENCH_DIR/$1.log") 2>&1 </dev/null
  until grep -q 'full-check count=0' "$BENCH_DIR/$1.log" 2>/dev/null || grep -q 'count=1 ' "$BENCH_DIR/$1.log" 2>/dev/null; do sleep 0.2; done
  sleep 1
}
running() { [[ $(runc --root "$R" state "$1" | jq -r .status) == running ]]; }
fresh() { scripts/make-bundle --force "$1" STATE_MB="$STATE_MB" DIRTY_PCT="$DIRTY_PCT" >/dev/null; }

echo "bench: counter with $STATE_MB MiB of incompressible state; disk: $BENCH_DIR, tmpfs: $SHM_DIR" >&2

# --- baseline checkpoint: runc checkpoint to a directory, then tar | zstd -1 to the same disk
start base "$BENCH_DIR/bundle-base"
t=$(now)
runc --root "$R" checkpoint --leave-running --tcp-established --image-path "$BENCH_DIR/base-img" --work-path "$BENCH_DIR/base-img" base
base_dump_ms=$(ms_since "$t")
tar -C "$BENCH_DIR/base-img" -cf - . | zstd -1 -q -T1 -o "$BENCH_DIR/base.tar.zst"
base_ckpt_ms=$(ms_since "$t")
base_bytes=$(stat -c %s "$BENCH_DIR/base.tar.zst")
runc --root "$R" delete -f base

# --- stasis checkpoint (first, then incremental)
export STASIS_WORK_DIR=$BENCH_DIR/work
start app "$BENCH_DIR/bundle-app"
t=$(now)
c1=$("$STASIS" checkpoint container app --workload bench -q -o json)
st_ckpt_ms=$(ms_since "$t")
running app || { echo "bench: app not running after the checkpoint" >&2; exit 1; }
kill -USR2 "$(runc --root "$R" state app | jq .pid)"
sleep 2
c2=$("$STASIS" checkpoint container app --workload bench -q -o json)
runc --root "$R" delete -f app

# --- restore: baseline (zstd -d | tar -x into tmpfs, runc restore), bare runc restore, stasis
fresh "$BENCH_DIR/bundle-r1"
t=$(now)
mkdir -p "$SHM_DIR/img"
zstd -d -q -c "$BENCH_DIR/base.tar.zst" | tar -C "$SHM_DIR/img" -xf -
runc --root "$R" restore -d --tcp-established --image-path "$SHM_DIR/img" --work-path "$SHM_DIR/img" --bundle "$BENCH_DIR/bundle-r1" r1 >/dev/null 2>&1 </dev/null
base_restore_ms=$(ms_since "$t")
runc --root "$R" delete -f r1
fresh "$BENCH_DIR/bundle-r2"
t=$(now)
runc --root "$R" restore -d --tcp-established --image-path "$SHM_DIR/img" --work-path "$SHM_DIR/img" --bundle "$BENCH_DIR/bundle-r2" r2 >/dev/null 2>&1 </dev/null
bare_restore_ms=$(ms_since "$t")
runc --root "$R" delete -f r2
rm -rf "$SHM_DIR/img"

fresh "$BENCH_DIR/bundle-r3"
t=$(now)
r=$(STASIS_WORK_DIR=$SHM_DIR/work "$STASIS" restore bench/latest --bundle "$BENCH_DIR/bundle-r3" --container-id r3 --log "$BENCH_DIR/r3.log" -q -o json)
st_restore_ms=$(ms_since "$t")
sleep 1
running r3 || { echo "bench: restored container not running" >&2; exit 1; }
grep -q CORRUPT "$BENCH_DIR/r3.log" && { echo "bench: restored state corrupt" >&2; exit 1; }
runc --root "$R" delete -f r3

jq -n --argjson c1 "$c1" --argjson c2 "$c2" --argjson r "$r" \
  --argjson base_ckpt "$base_ckpt_ms" --argjson base_dump "$base_dump_ms" --argjson base_bytes "$base_bytes" \
  --argjson st_ckpt "$st_ckpt_ms" --argjson base_restore "$base_restore_ms" --argjson bare_restore "$bare_restore_ms" \
  --argjson st_restore "$st_restore_ms" --argjson state_mb "$STATE_MB" --argjson dirty "$DIRTY_PCT" '{
  state_mb: $state_mb,
  checkpoint: { stasis_ms: $st_ckpt, baseline_ms: $base_ckpt, ratio: ($st_ckpt / $base_ckpt),
                stasis_frozen_ms: $c1.timings.frozen_ms, baseline_frozen_ms: $base_dump,
                stasis_written_bytes: $c1.stats.written_bytes, baseline_bytes: $base_bytes },
  incremental: { dirty_pct: $dirty, first_new_bytes: $c1.stats.new_bytes, second_new_bytes: $c2.stats.new_bytes,
                 ratio: ($c2.stats.new_bytes / $c1.stats.new_bytes), second_ms: $c2.timings.total_ms },
  restore: { stasis_ms: $st_restore, baseline_ms: $base_restore, bare_runc_ms: $bare_restore,
             ratio_to_baseline: ($st_restore / $base_restore), ratio_to_bare_runc: ($st_restore / $bare_restore) },
  peak_rss_mib: { checkpoint: ($c1.peak_rss_bytes / 1048576 | floor), restore: ($r.peak_rss_bytes / 1048576 | floor) }
}' | tee "${OUT:-/dev/null}" | jq -r '
  "| measure | stasis | baseline | ratio |",
  "|---|---|---|---|",
  "| checkpoint, total (\(.state_mb) MiB) | \(.checkpoint.stasis_ms) ms | \(.checkpoint.baseline_ms) ms (runc checkpoint + tar | zstd -1) | \(.checkpoint.ratio*100|round/100) |",
  "| workload frozen | \(.checkpoint.stasis_frozen_ms) ms | \(.checkpoint.baseline_frozen_ms) ms (runc checkpoint) | \(.checkpoint.stasis_frozen_ms / .checkpoint.baseline_frozen_ms*100|round/100) |",
  "| bytes written | \(.checkpoint.stasis_written_bytes/1048576|floor) MiB | \(.checkpoint.baseline_bytes/1048576|floor) MiB | |",
  "| 2nd checkpoint after \(.incremental.dirty_pct)% changed: new bytes | \(.incremental.second_new_bytes/1048576|floor) MiB of \(.incremental.first_new_bytes/1048576|floor) MiB | | \(.incremental.ratio*1000|round/10)% |",
  "| restore to running | \(.restore.stasis_ms) ms | \(.restore.baseline_ms) ms (zstd -d | tar -x + runc restore) | \(.restore.ratio_to_baseline*100|round/100) |",
  "| restore vs bare runc restore from tmpfs | \(.restore.stasis_ms) ms | \(.restore.bare_runc_ms) ms | \(.restore.ratio_to_bare_runc*100|round/100) |",
  "| peak RSS of stasis | checkpoint \(.peak_rss_mib.checkpoint) MiB, restore \(.peak_rss_mib.restore) MiB | | |"'
