#!/usr/bin/env bash
# Runs tests/gpu/run.sh on a machine WITHOUT a GPU, against stand-ins: a CPU "torch"
# (tests/gpu/fake/torch) and a driver-less stasis-gpu-roundtrip (tests/gpu/fake/), with a tiny
# data size. What it checks is run.sh itself: probing, the workload's verification protocol, the
# real CRIU checkpoint (leave running, then --stop), kill, real `stasis restore --process`, step
# continuity, the cold start, the report and the cleanup. No number it prints is a GPU number.
#
# Needs: python3, and for the CRIU part a built `stasis` (target/release or target/debug) and a
# working `criu` (scripts/setup), as root.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
FAKE_DIST=$(mktemp -d /tmp/stasis-gpu-fake.XXXXXX)
trap 'rm -rf "$FAKE_DIST"' EXIT
mkdir -p "$FAKE_DIST/bin" "$FAKE_DIST/criu"
ln -s "$ROOT/tests/gpu/fake/stasis-gpu-roundtrip" "$FAKE_DIST/bin/stasis-gpu-roundtrip"
for d in release debug; do
  if [[ -x $ROOT/target/$d/stasis ]]; then
    ln -s "$ROOT/target/$d/stasis" "$FAKE_DIST/bin/stasis"
    break
  fi
done
if command -v criu >/dev/null; then ln -s "$(command -v criu)" "$FAKE_DIST/criu/criu"; fi
echo "selftest: fakes for torch and the GPU driver; real CRIU and stasis where present"
PYTHONPATH=$ROOT/tests/gpu/fake${PYTHONPATH:+:$PYTHONPATH} \
  STASIS_GPU_DIST=$FAKE_DIST STASIS_GPU_TEST_GIB=${STASIS_GPU_TEST_GIB:-0.01} \
  STASIS_GPU_TEST_BUDGET=${STASIS_GPU_TEST_BUDGET:-180} \
  "$ROOT/tests/gpu/run.sh" "$@"
