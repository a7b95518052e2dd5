#!/usr/bin/env bash
# Builds what tests/gpu/run.sh carries to a GPU machine, into dist/gpu/ (ignored by git, carry it):
#
#   dist/gpu/bin/stasis, stasis-counter, stasis-gpu-roundtrip   release binaries, stripped
#   dist/gpu/criu/                                               CRIU from /opt/stasis/criu (if
#                                                                present) + a relocatable wrapper
#   dist/gpu/MANIFEST                                            what is in it, and from which commit
#
# Then, from a session that has a GPU machine:
#   run(command="tests/gpu/run.sh", carry=["dist/gpu"], timeout_s=300)
#
# Options (environment):
#   STASIS_GPU_DIST=dir      output directory (default dist/gpu)
#   STASIS_CRIU_PREFIX=dir   CRIU prefix to copy (default /opt/stasis/criu)
#   SKIP_BUILD=1             do not run cargo; copy whatever target/release holds
set -euo pipefail
shopt -s nullglob

cd "$(dirname "$0")/../.."
DIST=${STASIS_GPU_DIST:-dist/gpu}
CRIU_PREFIX=${STASIS_CRIU_PREFIX:-/opt/stasis/criu}
LIMIT_MIB=60   # the device tool carries 64 MiB in all; leave room for the working tree

if [[ -z ${SKIP_BUILD:-} ]]; then
  cargo build --release --locked -p stasis-cli -p stasis-counter -p stasis-gpu 2>&1 |
    tail -n 3 || cargo build --release -p stasis-cli -p stasis-counter -p stasis-gpu
fi

rm -rf "$DIST"
mkdir -p "$DIST/bin"
# Never committed: the directory ignores itself.
printf '*\n' >"$DIST/.gitignore"

for b in stasis stasis-counter stasis-gpu-roundtrip; do
  src=target/release/$b
  if [[ -x $src ]]; then
    strip -o "$DIST/bin/$b" "$src" 2>/dev/null || cp "$src" "$DIST/bin/$b"
  else
    echo "prepare: $src missing (build failed?); run.sh will skip what needs it" >&2
  fi
done

if [[ -x $CRIU_PREFIX/usr/sbin/criu ]]; then
  mkdir -p "$DIST/criu"
  # Binaries and libraries only: docs, man pages, locales and iconv modules stay behind.
  (cd "$CRIU_PREFIX" && tar --exclude=./usr/share --exclude='./usr/lib/*/gconv' -cf - .) | tar -xf - -C "$DIST/criu"
  libdir=$(cd "$DIST/criu" && dirname "$(find . -name 'ld-linux-x86-64.so.2' -path '*/lib/*' | head -n1)")
  libdir=${libdir#./}
  cat >"$DIST/criu/criu" <<EOF
#!/bin/sh
# CRIU from a private prefix next to this script, run by the prefix's own dynamic loader so the
# host's libc is never used. exec keeps every inherited fd (\`criu swrk <fd>\` needs its fd).
P=\$(dirname "\$(readlink -f "\$0")")
exec "\$P/$libdir/ld-linux-x86-64.so.2" --library-path "\$P/$libdir" "\$P/usr/sbin/criu" "\$@"
EOF
  chmod 755 "$DIST/criu/criu"
  "$DIST/criu/criu" --version >/dev/null || { echo "prepare: the CRIU wrapper does not run" >&2; exit 1; }
else
  echo "prepare: no CRIU at $CRIU_PREFIX (run scripts/setup); run.sh will skip the CRIU part" >&2
fi

{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "built $(date -u +%FT%TZ)"
  for f in "$DIST"/bin/*; do echo "$(basename "$f") $(du -k "$f" | cut -f1) KiB"; done
  [[ -x $DIST/criu/criu ]] && echo "criu $("$DIST/criu/criu" --version | head -n1)"
} >"$DIST/MANIFEST"

size_kib=$(du -sk "$DIST" | cut -f1)
echo "prepare: $DIST is $((size_kib / 1024)) MiB"
cat "$DIST/MANIFEST"
if ((size_kib > LIMIT_MIB * 1024)); then
  echo "prepare: $DIST is over ${LIMIT_MIB} MiB: the device tool would not carry it" >&2
  exit 1
fi
