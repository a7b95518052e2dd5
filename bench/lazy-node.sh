#!/usr/bin/env bash
# The node path's restore at large sizes (issue 11: from the replacement container's create to
# the workload running ≤ 1 s at 2 GiB and at 6 GiB), against the full restore of the same
# checkpoint in the same run. For each size in SIZES it runs the agent's `lazy_node` test in
# release with STASIS_BENCH_STATE_MB: the agent's executor checkpoints a counter of that size
# into s3s-fs, prepares the replacement's restore lazily (small files and eager pages staged),
# times `stasis-runc create` + `start` to running and to full residency, checks every page
# (SIGUSR1, state=ok), then prepares the same checkpoint in full (every chunk fetched and staged
# first) and times the same create. Prints a table; run as root under a reaping parent:
#   tini -s -- bench/lazy-node.sh
# Environment: SIZES ("2048 6144"). Needs what the test needs (CRIU, runc, s3s-fs from
# scripts/build-platform, the counter image from scripts/build-counter-image); builds the test
# binary and stasis-runc in release.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${SIZES:-2048 6144}
cargo build --quiet --release --locked -p stasis-runtime --bins
bin=$(cargo test --quiet --release --locked -p stasis-agent --test lazy_node --no-run --message-format json 2>/dev/null |
  jq -r 'select(.reason == "compiler-artifact" and .target.name == "lazy_node" and .executable != null) | .executable' | tail -1)
[ -x "$bin" ] || { echo "lazy-node: the lazy_node test binary was not built" >&2; exit 1; }
lines=$(mktemp)
trap 'rm -f "$lines"' EXIT
for mb in $SIZES; do
  echo "lazy-node: $mb MiB (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  CI=1 STASIS_BENCH_STATE_MB=$mb "$bin" --exact the_node_path_restores_lazily_and_the_count_goes_on \
    --test-threads=1 --nocapture 2>&1 | tee /dev/stderr | grep '^bench: node_path ' >>"$lines" ||
    { echo "lazy-node: the run at $mb MiB failed" >&2; exit 1; }
done
echo "| state | staged before create (lazy / full) | prepare (lazy / full) | create to running (lazy / full) | ratio | create to full residency (lazy) |"
echo "|---|---|---|---|---|---|"
awk '{ for (i = 3; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
       m = v["state_mb"]; mode = v["mode"]
       staged[m, mode] = v["staged_bytes"]; prep[m, mode] = v["prepare_ms"]; run[m, mode] = v["create_to_running_ms"]
       if (mode == "lazy") res[m] = v["create_to_resident_ms"]; sizes[m] = 1 }
     END { for (m in sizes) printf "| %d MiB | %.1f MB / %.1f MB | %d / %d ms | **%d** / %d ms | %.1fx | %d ms |\n",
       m, staged[m, "lazy"] / 1e6, staged[m, "full"] / 1e6, prep[m, "lazy"], prep[m, "full"],
       run[m, "lazy"], run[m, "full"], run[m, "full"] / (run[m, "lazy"] > 0 ? run[m, "lazy"] : 1), res[m] }' "$lines" | sort -n -k2
