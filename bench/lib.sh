# What bench/large.sh and bench/lazy.sh share, sourced by them after `cd` to the repository and
# with BENCH_NAME set: the settings (STATE_MB, BENCH_DIR, SHM_DIR, STASIS, PROFILE, the s3s-fs
# binary), the scratch directories and their cleanup on exit (KEEP_BENCH=1 keeps BENCH_DIR), the
# counter bundle helpers and a local S3 server.
#
#   s3_start       s3s-fs on a free port, its data under BENCH_DIR/s3 (bucket "bench"), and the
#                  AWS_* variables stasis and the profile read
#   fresh DIR      a new counter bundle of STATE_MB MiB
#   running ID     whether container ID runs
#   now / ms_since T0   nanoseconds now; milliseconds since T0
# shellcheck shell=bash
# shellcheck disable=SC2034 # (settings the sourcing scripts read)

STATE_MB=${STATE_MB:-2048}
BENCH_DIR=${BENCH_DIR:-/var/tmp/stasis-$BENCH_NAME}
SHM_DIR=${SHM_DIR:-/dev/shm/stasis-$BENCH_NAME}
STASIS=${STASIS:-$PWD/target/release/stasis}
PROFILE=${PROFILE:-$PWD/target/release/examples/large_profile}
S3S_FS=${STASIS_S3S_FS:-$(ls -d "$HOME"/.cache/stasis/platform/s3s-fs-*/bin/s3s-fs 2>/dev/null | head -1)}
R=$BENCH_DIR/runc
export STASIS_RUNC_ROOT=$R

[[ -x $STASIS && -x $PROFILE ]] || { echo "$BENCH_NAME: build $STASIS and $PROFILE first (see the header)" >&2; exit 1; }
[[ -x $S3S_FS ]] || { echo "$BENCH_NAME: no s3s-fs (scripts/build-platform s3s-fs)" >&2; exit 1; }

now() { date +%s%N; }
ms_since() { echo $(( ($(now) - $1) / 1000000 )); }
s3_pid=
cleanup() {
  for id in $(runc --root "$R" list -q 2>/dev/null); do runc --root "$R" delete -f "$id" >/dev/null 2>&1 || true; done
  if [[ -n $s3_pid ]]; then kill "$s3_pid" 2>/dev/null; wait "$s3_pid" 2>/dev/null || true; fi
  rm -rf "$SHM_DIR"
}
trap 'cleanup; [[ ${KEEP_BENCH:-0} == 1 ]] || rm -rf "$BENCH_DIR"' EXIT
cleanup
rm -rf "$BENCH_DIR"; mkdir -p "$BENCH_DIR" "$SHM_DIR"
load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "$BENCH_NAME: counter with $STATE_MB MiB of incompressible state; load $(load)" >&2

s3_start() {
  mkdir -p "$BENCH_DIR/s3/bench"
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$S3S_FS" --host 127.0.0.1 --port "$port" --access-key stasis --secret-key stasis-secret "$BENCH_DIR/s3" >/dev/null 2>&1 &
  s3_pid=$!
  export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ACCESS_KEY_ID=stasis AWS_SECRET_ACCESS_KEY=stasis-secret AWS_REGION=us-east-1
  until (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; do sleep 0.1; done
}
fresh() { scripts/make-bundle --force "$1" STATE_MB="$STATE_MB" >/dev/null; }
running() { [[ $(runc --root "$R" state "$1" | jq -r .status) == running ]]; }
