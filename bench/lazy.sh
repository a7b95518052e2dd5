#!/usr/bin/env bash
# Lazy restore against the full restore and the bare tools, in one run (design §6.2a). Prints a
# table and writes JSON to OUT. Run it under a reaping parent: `tini -s -- bench/lazy.sh`.
#
#   baseline    bare `runc restore -d` from the images of a bare `runc checkpoint` on tmpfs
#   full        `stasis restore` from S3 (fetch everything, then runc restore; scratch on tmpfs)
#   lazy        `stasis restore --lazy` from S3 (small files first, pages on demand and in the
#               background; scratch on tmpfs)
#   S3 read     what the S3 server gives a plain parallel client (GETs of the chunk objects,
#               bodies dropped: crates/store/examples/large_profile.rs's plain GET)
#
# For each restore: time to running = from the command's start to the restored counter's first
# new line in its log (polled every 10 ms); for the lazy one also time to full residency (the
# command's end: the lazy-pages daemon is done) and the residency rate. Every restored counter
# is asked for a full check of its state (SIGUSR1) and must answer state=ok.
#
# The S3 server is s3s-fs (scripts/build-platform s3s-fs), its data on disk under BENCH_DIR.
# Environment: STATE_MB (2048), BENCH_DIR (/var/tmp/stasis-lazy), SHM_DIR (/dev/shm/stasis-lazy),
# STASIS (target/release/stasis), PROFILE (target/release/examples/large_profile), OUT (JSON),
# KEEP_BENCH=1 keeps the files.
# Build first: cargo build --release -p stasis-cli --bin stasis &&
#              cargo build --release -p stasis-store --example large_profile
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH_NAME=lazy
# shellcheck source=bench/lib.sh
. bench/lib.sh

# --- the S3 server
s3_start
export STASIS_STORE=s3://bench/lazy STASIS_KEY_FILE=$BENCH_DIR/key STASIS_WORK_DIR=$SHM_DIR/work
"$STASIS" key generate "$STASIS_KEY_FILE" >/dev/null

# first_line <log> <t0>: ms from t0 until the log has a count line
first_line() {
  until grep -q '^count=' "$1" 2>/dev/null; do
    (( $(ms_since "$2") < 300000 )) || { echo "lazy: no count line in $1 after 300 s" >&2; exit 1; }
    sleep 0.01
  done
  ms_since "$2"
}
# checked <id> <log>: the restored counter's full check of its state
checked() {
  runc --root "$R" kill "$1" USR1
  for _ in $(seq 1 600); do grep -q full-check "$2" && break; sleep 0.1; done
  grep full-check "$2" | tail -1 | grep -q 'state=ok' || { echo "lazy: $1 failed its full check: $(grep full-check "$2" | tail -1)" >&2; exit 1; }
  ! grep -q CORRUPT "$2" || { echo "lazy: $1 printed CORRUPT" >&2; exit 1; }
}

# --- the checkpoint: bare images on tmpfs, and the same container into the store
fresh "$BENCH_DIR/bundle-app"
runc --root "$R" run -d --bundle "$BENCH_DIR/bundle-app" app > >(cat >"$BENCH_DIR/app.log") 2>&1 </dev/null
until grep -q 'count=1 ' "$BENCH_DIR/app.log" 2>/dev/null; do sleep 0.2; done
sleep 1
mkdir -p "$SHM_DIR/bare"
runc --root "$R" checkpoint --leave-running --image-path "$SHM_DIR/bare" --work-path "$SHM_DIR/bare" app
ck=$("$STASIS" checkpoint container app --workload lazy --stop -q -o json)

# --- what the S3 server gives a plain parallel client (and stasis's own get, for context)
prof=$("$PROFILE" --image-dir "$SHM_DIR/bare" --store s3://bench/profile --restore-dir "$SHM_DIR/restore")
rm -rf "$SHM_DIR/restore"

# --- baseline: bare runc restore from tmpfs
fresh "$BENCH_DIR/bundle-r0"; sync
t=$(now)
runc --root "$R" restore -d --image-path "$SHM_DIR/bare" --work-path "$SHM_DIR/bare" --bundle "$BENCH_DIR/bundle-r0" r0 > >(cat >"$BENCH_DIR/r0.log") 2>&1 </dev/null
bare_ms=$(first_line "$BENCH_DIR/r0.log" "$t")
checked r0 "$BENCH_DIR/r0.log"
runc --root "$R" delete -f r0
rm -rf "$SHM_DIR/bare"

# --- stasis full restore from S3
fresh "$BENCH_DIR/bundle-r1"; sync
t=$(now)
"$STASIS" restore lazy/latest --bundle "$BENCH_DIR/bundle-r1" --container-id r1 --log "$BENCH_DIR/r1.log" -q -o json >"$BENCH_DIR/r1.json" &
full_pid=$!
full_ms=$(first_line "$BENCH_DIR/r1.log" "$t")
wait "$full_pid"
checked r1 "$BENCH_DIR/r1.log"
runc --root "$R" delete -f r1

# --- stasis lazy restore from S3
fresh "$BENCH_DIR/bundle-r2"; sync
t=$(now)
"$STASIS" restore lazy/latest --lazy --bundle "$BENCH_DIR/bundle-r2" --container-id r2 --log "$BENCH_DIR/r2.log" -q -o json >"$BENCH_DIR/r2.json" &
lazy_pid=$!
lazy_ms=$(first_line "$BENCH_DIR/r2.log" "$t")
wait "$lazy_pid"
resident_ms=$(ms_since "$t")
running r2 || { echo "lazy: the lazily restored container is not running" >&2; exit 1; }
checked r2 "$BENCH_DIR/r2.log"
runc --root "$R" delete -f r2

jq -n --argjson p "$prof" --argjson ck "$ck" --argjson full "$(cat "$BENCH_DIR/r1.json")" \
  --argjson lazy "$(cat "$BENCH_DIR/r2.json")" --argjson bare "$bare_ms" --argjson fullms "$full_ms" \
  --argjson lazyms "$lazy_ms" --argjson res "$resident_ms" --argjson mb "$STATE_MB" --arg load "$(load)" '
  ($ck.stats.logical_bytes / 1e9) as $gb | {
  state_mb: $mb, load_after: $load, bytes: $ck.stats.logical_bytes,
  s3_plain_get_gbs: $p.plain_get_gbs, stasis_get_gbs: $p.stasis_get_gbs,
  to_running_ms: { bare_runc_tmpfs: $bare, stasis_full: $fullms, stasis_lazy: $lazyms },
  full: $full, lazy: $lazy,
  lazy_resident_ms: $res, lazy_resident_gbs: ($gb / ($res / 1000)),
  lazy_resident_vs_s3: (($gb / ($res / 1000)) / $p.plain_get_gbs)
}' | tee "${OUT:-/dev/null}" | jq -r '
  def r2: . * 100 | round / 100;
  "| measure (\(.state_mb) MiB counter) | value | ratio |",
  "|---|---|---|",
  "| time to running: bare `runc restore` from tmpfs | \(.to_running_ms.bare_runc_tmpfs) ms | 1 |",
  "| time to running: `stasis restore` from S3 (fetch \(.full.fetch_ms) ms + runc restore \(.full.restore_ms) ms) | \(.to_running_ms.stasis_full) ms | \(.to_running_ms.stasis_full / .to_running_ms.bare_runc_tmpfs | r2) |",
  "| time to running: `stasis restore --lazy` from S3 (\(.lazy.lazy.staged_bytes / 1048576 | r2) MiB fetched first; runc restore returned at \(.lazy.lazy.running_ms) ms) | \(.to_running_ms.stasis_lazy) ms | \(.to_running_ms.stasis_lazy / .to_running_ms.bare_runc_tmpfs | r2) |",
  "| lazy: full residency (command end) | \(.lazy_resident_ms) ms = \(.lazy_resident_gbs | r2) GB/s | |",
  "| lazy: background fetch of the page images done (from the store) | \(.lazy.lazy.fetched_ms // "n/a") ms | |",
  "| S3 server, plain parallel GET / stasis get | \(.s3_plain_get_gbs) / \(.stasis_get_gbs) GB/s | |",
  "| lazy residency rate / plain GET | | \(.lazy_resident_vs_s3 | r2) |",
  "| lazy: page requests / of them waiting for a chunk fetched on demand | \(.lazy.lazy.requests) / \(.lazy.lazy.demand_fetches) | |",
  "| peak RSS of stasis: full / lazy restore | \(.full.peak_rss_bytes / 1048576 | floor) / \(.lazy.peak_rss_bytes / 1048576 | floor) MiB | |",
  "| load average after the run | \(.load_after) | |"'
