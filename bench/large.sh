#!/usr/bin/env bash
# Large state: where the time of a checkpoint and a restore goes, against this machine's limits
# and the bare tools, in one run (issue "large pods"). Prints a table with ratios and writes
# JSON to OUT. Run it under a reaping parent: `tini -s -- bench/large.sh`.
#
#   memory      memcpy and first-touch bandwidth (bench/membw.c): the floors under a freeze
#               (every page copied once) and a restore (every page faulted in once)
#   freeze      bare `runc checkpoint --leave-running` with the images on tmpfs and on disk,
#               with CRIU's own split (stats-dump: memdump = pages into pipes, memwrite = pipes
#               into image files); then `stasis checkpoint container` with its work directory
#               on disk (the agent's default, /var/lib/stasis/work) and on tmpfs, to an S3 store
#   store       the store's stages on one core (chunk, hash, encode, decode), a plain parallel
#               S3 client's PUT and GET against stasis's put and get of the same images, and a
#               get through a node chunk cache (crates/store/examples/large_profile.rs)
#   restore     bare `runc restore` from images on tmpfs against `stasis restore` from S3
#
# The S3 server is s3s-fs (scripts/build-platform s3s-fs), its data on disk under BENCH_DIR.
# Environment: STATE_MB (2048), BENCH_DIR (/var/tmp/stasis-large), SHM_DIR
# (/dev/shm/stasis-large), STASIS (target/release/stasis), PROFILE
# (target/release/examples/large_profile), OUT (JSON results), KEEP_BENCH=1 keeps the files.
# Build first: cargo build --release -p stasis-cli --bin stasis &&
#              cargo build --release -p stasis-store --example large_profile
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH_NAME=large
# shellcheck source=bench/lib.sh
. bench/lib.sh

# --- memory limits
cc -O2 -o "$BENCH_DIR/membw" bench/membw.c
mem=$("$BENCH_DIR/membw" "$STATE_MB")

# --- the S3 server
s3_start

start() { # id bundle
  scripts/make-bundle --force "$2" STATE_MB="$STATE_MB" >/dev/null
  # stdout must be a pipe: CRIU cannot dump a host file opened outside the container
  runc --root "$R" run -d --bundle "$2" "$1" > >(cat >"$BENCH_DIR/$1.log") 2>&1 </dev/null
  until grep -q 'count=1 ' "$BENCH_DIR/$1.log" 2>/dev/null; do sleep 0.2; done
  sleep 1
}
bare_dump() { # image-dir → ms of runc checkpoint; CRIU's split in <image-dir>.stats
  mkdir -p "$1"; sync
  local t; t=$(now)
  runc --root "$R" checkpoint --leave-running --image-path "$1" --work-path "$1" app
  ms_since "$t"
  bench/criu-stats.py "$1" >"$1.stats"
}

start app "$BENCH_DIR/bundle-app"
bare_shm_ms=$(bare_dump "$SHM_DIR/bare")
bare_disk_ms=$(bare_dump "$BENCH_DIR/bare-disk")
bare_shm_stats=$(cat "$SHM_DIR/bare.stats"); bare_disk_stats=$(cat "$BENCH_DIR/bare-disk.stats")
rm -rf "$BENCH_DIR/bare-disk"

# stasis checkpoints, each to a store of its own (its own key: nothing deduplicated)
stasis_ckpt() { # name work-dir → JSON
  "$STASIS" key generate "$BENCH_DIR/key-$1" >/dev/null
  sync
  STASIS_STORE=s3://bench/$1 STASIS_KEY_FILE=$BENCH_DIR/key-$1 STASIS_WORK_DIR=$2 \
    "$STASIS" checkpoint container app --workload large -q -o json
}
ck_disk=$(stasis_ckpt disk "$BENCH_DIR/work")
ck_shm=$(stasis_ckpt shm "$SHM_DIR/work")
running app || { echo "large: app not running after the checkpoints" >&2; exit 1; }
runc --root "$R" delete -f app

# --- the store on its own, on the bare images
prof=$("$PROFILE" --image-dir "$SHM_DIR/bare" --store s3://bench/profile \
  --restore-dir "$SHM_DIR/restore" --cache-dir "$BENCH_DIR/cache")

# --- restore: bare runc restore from tmpfs, stasis restore from S3
fresh "$BENCH_DIR/bundle-r1"
sync
t=$(now)
runc --root "$R" restore -d --image-path "$SHM_DIR/bare" --work-path "$SHM_DIR/bare" --bundle "$BENCH_DIR/bundle-r1" r1 >/dev/null 2>&1 </dev/null
bare_restore_ms=$(ms_since "$t")
runc --root "$R" delete -f r1
rm -rf "$SHM_DIR/bare"

fresh "$BENCH_DIR/bundle-r2"
sync
t=$(now)
rs=$(STASIS_STORE=s3://bench/shm STASIS_KEY_FILE=$BENCH_DIR/key-shm STASIS_WORK_DIR=$SHM_DIR/work \
  "$STASIS" restore large/latest --bundle "$BENCH_DIR/bundle-r2" --container-id r2 --log "$BENCH_DIR/r2.log" -q -o json)
st_restore_ms=$(ms_since "$t")
sleep 1
running r2 || { echo "large: restored container not running" >&2; exit 1; }
grep -q CORRUPT "$BENCH_DIR/r2.log" && { echo "large: restored state corrupt" >&2; exit 1; }
runc --root "$R" delete -f r2

jq -n --argjson mem "$mem" --argjson bs "$bare_shm_ms" --argjson bd "$bare_disk_ms" \
  --argjson bss "$bare_shm_stats" --argjson bds "$bare_disk_stats" \
  --argjson cd "$ck_disk" --argjson cs "$ck_shm" --argjson p "$prof" \
  --argjson br "$bare_restore_ms" --argjson rs "$rs" --argjson sr "$st_restore_ms" \
  --argjson mb "$STATE_MB" --arg load "$(load)" '
  ($mb / 1024) as $gib | ($mb * 1048576 / 1e9) as $gb | {
  state_mb: $mb, load_after: $load, memory: $mem,
  floors_ms: { copy: ($gb / $mem.copy_gbs * 1000 | round), first_touch: ($gb / $mem.first_touch_gbs * 1000 | round) },
  freeze: {
    bare_runc_tmpfs_ms: $bs, bare_runc_tmpfs_criu: $bss,
    bare_runc_disk_ms: $bd, bare_runc_disk_criu: $bds,
    stasis_disk: $cd.timings, stasis_tmpfs: $cs.timings,
    stasis_peak_rss_mib: ($cs.peak_rss_bytes / 1048576 | floor),
    per_gib_s: { stasis_disk: ($cd.timings.frozen_ms / 1000 / $gib), stasis_tmpfs: ($cs.timings.frozen_ms / 1000 / $gib),
                 bare_tmpfs: ($bs / 1000 / $gib) }
  },
  store: $p,
  restore: { bare_runc_tmpfs_ms: $br, stasis_ms: $sr, stasis: $rs,
             fetch_gbs: ($gb / ($rs.fetch_ms / 1000)), ratio_to_bare: ($sr / $br) }
}' | tee "${OUT:-/dev/null}" | jq -r '
  def r2: . * 100 | round / 100;
  "| measure | stasis | baseline | ratio |",
  "|---|---|---|---|",
  "| memory: copy / first touch (one core) | | \(.memory.copy_gbs) / \(.memory.first_touch_gbs) GB/s | |",
  "| freeze, work dir on disk | \(.freeze.stasis_disk.frozen_ms) ms (dump \(.freeze.stasis_disk.dump_ms), rootfs \(.freeze.stasis_disk.rootfs_ms)) | \(.freeze.bare_runc_disk_ms) ms bare runc checkpoint to disk | \(.freeze.stasis_disk.frozen_ms / .freeze.bare_runc_disk_ms | r2) |",
  "| freeze, work dir on tmpfs | \(.freeze.stasis_tmpfs.frozen_ms) ms (dump \(.freeze.stasis_tmpfs.dump_ms), rootfs \(.freeze.stasis_tmpfs.rootfs_ms)) | \(.freeze.bare_runc_tmpfs_ms) ms bare runc checkpoint to tmpfs | \(.freeze.stasis_tmpfs.frozen_ms / .freeze.bare_runc_tmpfs_ms | r2) |",
  "| freeze per GiB (disk / tmpfs) | \(.freeze.per_gib_s.stasis_disk | r2) / \(.freeze.per_gib_s.stasis_tmpfs | r2) s | \(.freeze.per_gib_s.bare_tmpfs | r2) s (bare, tmpfs) | |",
  "| freeze vs memory-copy floor (tmpfs) | \(.freeze.stasis_tmpfs.frozen_ms) ms | \(.floors_ms.copy) ms | \(.freeze.stasis_tmpfs.frozen_ms / .floors_ms.copy | r2) |",
  "| CRIU inside the bare dump, tmpfs: frozen / memdump / memwrite | | \(.freeze.bare_runc_tmpfs_criu.frozen_ms) / \(.freeze.bare_runc_tmpfs_criu.memdump_ms) / \(.freeze.bare_runc_tmpfs_criu.memwrite_ms) ms | |",
  "| CRIU inside the bare dump, disk: frozen / memdump / memwrite | | \(.freeze.bare_runc_disk_criu.frozen_ms) / \(.freeze.bare_runc_disk_criu.memdump_ms) / \(.freeze.bare_runc_disk_criu.memwrite_ms) ms | |",
  "| upload after the thaw (store_ms, tmpfs images) | \(.freeze.stasis_tmpfs.store_ms) ms | | |",
  "| store stages, one core: chunk / hash / encode / decode | \(.store.one_core_gbs.chunk) / \(.store.one_core_gbs.hash) / \(.store.one_core_gbs.encode) / \(.store.one_core_gbs.decode) GB/s | | |",
  "| put to S3 | \(.store.stasis_put_gbs) GB/s | \(.store.plain_put_gbs) GB/s plain parallel PUT (\(.store.concurrency) in flight) | \(.store.stasis_put_gbs / .store.plain_put_gbs | r2) |",
  "| get from S3 | \(.store.stasis_get_gbs) GB/s | \(.store.plain_get_gbs) GB/s plain parallel GET | \(.store.stasis_get_gbs / .store.plain_get_gbs | r2) |",
  "| client CPU seconds per GB read: stasis get (fetch, decode, write) / plain GET (fetch) | \(.store.cpu_s_per_gb.stasis_get | r2) s | \(.store.cpu_s_per_gb.plain_get | r2) s | |",
  "| get filling the node cache / from the cache | \(.store.cache.get_filling_gbs) / \(.store.cache.get_from_cache_gbs) GB/s | | |",
  "| restore to running (S3, scratch on tmpfs) | \(.restore.stasis_ms) ms (fetch \(.restore.stasis.fetch_ms), runc restore \(.restore.stasis.restore_ms)) | \(.restore.bare_runc_tmpfs_ms) ms bare runc restore from tmpfs | \(.restore.ratio_to_bare | r2) |",
  "| restore vs first-touch floor | \(.restore.stasis_ms) ms | \(.floors_ms.first_touch) ms | \(.restore.stasis_ms / .floors_ms.first_touch | r2) |",
  "| peak RSS of stasis: checkpoint / restore | \(.freeze.stasis_peak_rss_mib) / \(.restore.stasis.peak_rss_bytes / 1048576 | floor) MiB | | |",
  "| load average after the run | \(.load_after) | | |"'
