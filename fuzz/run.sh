#!/usr/bin/env bash
# Builds the fuzz targets on stable Rust (libFuzzer via libfuzzer-sys, coverage from LLVM's
# SanitizerCoverage through -C flags, no sanitizer) and runs each for a bounded time.
#
#   fuzz/run.sh [seconds-per-target] [target...]     # default: 25 s, all targets
#   fuzz/run.sh --build                              # build only
#   fuzz/run.sh --seeds                              # rewrite the seeds made by the real store
#
# Seeds (committed, real valid inputs) are in fuzz/seeds/<target>; what the fuzzer finds is kept
# in fuzz/corpus/<target> (ignored by git); a crashing input is written to
# fuzz/artifacts/<target>/ and the script fails, naming it. Per target it prints executions,
# time and corpus size.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

TARGETS_ALL=(manifest chunk_object planfile node_api crd_fields rootfs kubelet_archive)
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
# The instrumented build's target directory is kept in the machine's cache (STASIS_FUZZ_TARGET),
# as the stasis image's is: a fresh clone (CI) then rebuilds only the stasis crates, not every
# dependency (≈ 6 of the 7 minutes of a cold build on 2 cores).
export CARGO_TARGET_DIR=${STASIS_FUZZ_TARGET:-${STASIS_CACHE:-$HOME/.cache/stasis}/fuzz-target}
BIN=$CARGO_TARGET_DIR/$TRIPLE/release
export RUSTFLAGS="${RUSTFLAGS:-} --cfg fuzzing -Cpasses=sancov-module \
 -Cllvm-args=-sanitizer-coverage-level=3 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
 -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"

build() {
  local t0=$SECONDS
  # --target keeps the instrumentation flags off build scripts and proc macros.
  cargo build --locked --release --target "$TRIPLE" --bins
  echo "fuzz: targets built in $((SECONDS - t0)) s"
}

if [[ ${1:-} == --build ]]; then build; exit 0; fi
if [[ ${1:-} == --seeds ]]; then
  cargo build --locked --release --target "$TRIPLE" --example gen_seeds
  exec "$BIN/examples/gen_seeds" seeds
fi
secs=${1:-25}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${TARGETS_ALL[@]}")
build

# The targets' scratch files (plan files, rootfs trees) go into one directory, removed at the end.
TMPDIR=$(mktemp -d /tmp/stasis-fuzz.XXXXXX)
export TMPDIR
chmod 1777 "$TMPDIR" # the rootfs target runs as uid 65534
trap 'rm -rf "$TMPDIR"' EXIT

rc=0
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log="artifacts/$t/last-run.log"
  # The rootfs and kubelet_archive targets drop root before its first input (a confinement bug must not reach the
  # machine's files): what it writes must be writable by that uid.
  [[ ($t == rootfs || $t == kubelet_archive) && $(id -u) == 0 ]] && chown -R 65534:65534 "corpus/$t" "artifacts/$t"
  # -rss_limit_mb: an input that makes a parser allocate more than this is a finding too.
  if "$BIN/$t" -max_total_time="$secs" -rss_limit_mb=1024 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="artifacts/$t/" "corpus/$t" "seeds/$t" >"$log" 2>&1; then
    status=ok
  else
    status=FAILED; rc=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
  echo "fuzz: $t: $status, ${execs:-?} executions in $secs s, $cov, corpus $(ls "corpus/$t" | wc -l) inputs"
  if [[ $status != ok ]]; then
    tail -n 30 "$log"
    ls -1 "artifacts/$t"/crash-* "artifacts/$t"/oom-* "artifacts/$t"/timeout-* 2>/dev/null | sed 's/^/fuzz: finding: fuzz\//' || true
  fi
done
exit $rc
