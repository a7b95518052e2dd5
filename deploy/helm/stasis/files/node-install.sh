#!/bin/sh
# stasis node installer (busybox sh, from the stasis image). Runs as the init container of every
# stasis agent pod, with the node's / (the chart's nodeRoot) at $HOST.
#
# Installs, under the node's /:
#   /opt/stasis/bin/stasis-runc          the runtime wrapper
#   /opt/stasis/lib/criu, /opt/stasis/bin/criu, $CRIU_LINK
#                                        CRIU from the image, only if the node has no CRIU >= min
#   $CONFIG_DIR/$DROPIN                  containerd drop-in: runtime handler $HANDLER
#   /opt/stasis/.installed               what was installed, and by which pod (the uninstaller
#                                        of that pod, and only that one, undoes it)
# and restarts containerd ($RESTART: systemd | file | none) when the drop-in changed.
# Idempotent: a second run with the same files changes nothing and restarts nothing.
set -eu

HOST=${HOST:-/host}
HANDLER=${HANDLER:-stasis}
CONFIG_DIR=${CONFIG_DIR:-/etc/containerd/conf.d}
DROPIN=${DROPIN:-90-stasis.toml}
CONFIG_VERSION=${CONFIG_VERSION:-3}
SYSTEMD_CGROUP=${SYSTEMD_CGROUP:-auto}
RESTART=${RESTART:-systemd}
RESTART_FILE=${RESTART_FILE:-/run/stasis/restart-containerd}
SYSTEMD_UNIT=${SYSTEMD_UNIT:-containerd.service}
INSTALL_CRIU=${INSTALL_CRIU:-true}
CRIU_MIN=${CRIU_MIN:-4.2}
CRIU_LINK=${CRIU_LINK:-/usr/local/sbin/criu}
POD_ANNOTATIONS=${POD_ANNOTATIONS:-stasis.dev/*}
POD_UID=${POD_UID:?POD_UID is not set}
POD_NAME=${POD_NAME:-?}
RELEASE=${RELEASE:-stasis}
IMAGE_CRIU=/usr/local/lib/stasis/criu
BIN=/opt/stasis/bin
MANIFEST=/opt/stasis/.installed
MARK="# written by the stasis node installer"

log() { echo "stasis-node-install: $*"; }
die() { echo "stasis-node-install: ERROR: $*" >&2; exit 1; }

[ -d "$HOST" ] || die "the node root is not mounted at $HOST"
# shellcheck source=node-lock.sh
. "$(dirname "$0")/node-lock.sh"
node_lock
trap node_unlock EXIT
[ -x /usr/local/bin/stasis-runc ] || die "this image has no /usr/local/bin/stasis-runc (scripts/build-images builds it from crates/runtime)"
mkdir -p "$HOST$BIN" "$HOST/run/stasis" "$HOST/var/lib/stasis"
chmod 755 "$HOST/opt/stasis" "$HOST$BIN"
chmod 700 "$HOST/run/stasis" "$HOST/var/lib/stasis"

# install FILE MODE DEST: atomic replace (running shims keep their open file), only when changed
install_file() {
  if [ -f "$HOST$3" ] && cmp -s "$1" "$HOST$3"; then chmod "$2" "$HOST$3"; return 1; fi
  cp "$1" "$HOST$3.tmp.$$"
  chmod "$2" "$HOST$3.tmp.$$"
  mv -f "$HOST$3.tmp.$$" "$HOST$3"
  return 0
}

installed="$BIN/stasis-runc"
if install_file /usr/local/bin/stasis-runc 755 "$BIN/stasis-runc"; then log "installed $BIN/stasis-runc"; else log "$BIN/stasis-runc is up to date"; fi

# --- CRIU ------------------------------------------------------------------------------------
version_ge() { # a b: a >= b (dotted numbers)
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -t. -k1,1n -k2,2n -k3,3n | head -n1)" = "$2" ]
}
node_criu=""; node_criu_version=""
for d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  p=$d/criu
  [ -e "$HOST$p" ] || [ -L "$HOST$p" ] || continue
  # ours (from an earlier install) does not count as the node's
  [ "$(readlink "$HOST$p" 2>/dev/null)" = "$BIN/criu" ] && continue
  node_criu=$p
  node_criu_version=$(chroot "$HOST" "$p" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}') || true
  break
done
criu_installed=no
if [ -n "$node_criu_version" ] && version_ge "$node_criu_version" "$CRIU_MIN"; then
  log "the node has CRIU $node_criu_version at $node_criu (>= $CRIU_MIN): not installing CRIU"
elif [ "$INSTALL_CRIU" != true ]; then
  log "WARNING: the node has ${node_criu:+CRIU ${node_criu_version:-of unknown version} at $node_criu}${node_criu:-no CRIU}, < $CRIU_MIN, and nodeInstaller.installCriu is false: checkpoints will fail on this node"
elif [ ! -x "$IMAGE_CRIU/usr/sbin/criu" ]; then
  log "WARNING: the node has no CRIU >= $CRIU_MIN and this image carries none (scripts/build-images packs /opt/stasis/criu): checkpoints will fail on this node"
else
  v=$(cat "$IMAGE_CRIU/VERSION" 2>/dev/null || echo "?")
  if [ "$(cat "$HOST/opt/stasis/lib/criu/VERSION" 2>/dev/null)" != "$v" ]; then
    rm -rf "$HOST/opt/stasis/lib/criu.tmp"
    mkdir -p "$HOST/opt/stasis/lib"
    cp -a "$IMAGE_CRIU" "$HOST/opt/stasis/lib/criu.tmp"
    rm -rf "$HOST/opt/stasis/lib/criu"
    mv "$HOST/opt/stasis/lib/criu.tmp" "$HOST/opt/stasis/lib/criu"
  fi
  cat >"$HOST$BIN/criu.tmp.$$" <<'W'
#!/bin/sh
# CRIU installed by the stasis node installer, run by its own dynamic loader (the node's libc is untouched)
P=/opt/stasis/lib/criu
exec "$P/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$P/usr/lib/x86_64-linux-gnu" "$P/usr/sbin/criu" "$@"
W
  chmod 755 "$HOST$BIN/criu.tmp.$$"; mv -f "$HOST$BIN/criu.tmp.$$" "$HOST$BIN/criu"
  installed="$installed /opt/stasis/lib/criu $BIN/criu"
  # runc runs `criu` from its PATH: link it there unless something else is there
  if [ -n "$CRIU_LINK" ]; then
    if [ ! -e "$HOST$CRIU_LINK" ] && [ ! -L "$HOST$CRIU_LINK" ]; then
      mkdir -p "$HOST$(dirname "$CRIU_LINK")"
      ln -s "$BIN/criu" "$HOST$CRIU_LINK"
    fi
    [ "$(readlink "$HOST$CRIU_LINK" 2>/dev/null)" = "$BIN/criu" ] && installed="$installed $CRIU_LINK"
  fi
  criu_installed=yes
  log "installed CRIU $v at /opt/stasis/lib/criu (the node has ${node_criu:+CRIU ${node_criu_version:-?} at $node_criu}${node_criu:-none})"
fi

# --- containerd drop-in ----------------------------------------------------------------------
[ -d "$HOST$CONFIG_DIR" ] || die "$CONFIG_DIR does not exist on the node: containerd must import drop-ins from it (config.toml: imports = [\"$CONFIG_DIR/*.toml\"]; chart value containerd.configDir)"
if [ "$SYSTEMD_CGROUP" = auto ]; then
  # follow the node's runc runtime (the kubelet's cgroup driver must match it anyway)
  SYSTEMD_CGROUP=false
  for f in "$HOST/etc/containerd/config.toml" "$HOST$CONFIG_DIR"/*.toml; do
    [ -f "$f" ] && [ "$f" != "$HOST$CONFIG_DIR/$DROPIN" ] || continue
    grep -Eq '^[[:space:]]*SystemdCgroup[[:space:]]*=[[:space:]]*true' "$f" && SYSTEMD_CGROUP=true
  done
fi
annotations=""
for a in $POD_ANNOTATIONS; do annotations="$annotations${annotations:+, }\"$a\""; done
case $CONFIG_VERSION in
  3) plugin="plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.$HANDLER" ;;
  2) plugin="plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.$HANDLER" ;;
  *) die "containerd.configVersion must be 2 (containerd 1.7) or 3 (containerd 2.x), not $CONFIG_VERSION" ;;
esac
cat >/tmp/dropin <<T
$MARK (Helm release $RELEASE); removed on uninstall
version = $CONFIG_VERSION
[$plugin]
  runtime_type = "io.containerd.runc.v2"
  pod_annotations = [$annotations]
  [$plugin.options]
    BinaryName = "$BIN/stasis-runc"
    SystemdCgroup = $SYSTEMD_CGROUP
T
changed=no
if install_file /tmp/dropin 644 "$CONFIG_DIR/$DROPIN"; then changed=yes; log "wrote $CONFIG_DIR/$DROPIN (runtime handler $HANDLER -> $BIN/stasis-runc)"; else log "$CONFIG_DIR/$DROPIN is up to date"; fi
installed="$installed $CONFIG_DIR/$DROPIN"

# --- ownership: the uninstaller of this pod undoes exactly this --------------------------------
{
  echo "owner $POD_UID"
  echo "pod $POD_NAME"
  echo "release $RELEASE"
  echo "criu $criu_installed"
  for p in $installed; do echo "path $p"; done
} >"$HOST$MANIFEST.tmp.$$"
chmod 644 "$HOST$MANIFEST.tmp.$$"; mv -f "$HOST$MANIFEST.tmp.$$" "$HOST$MANIFEST"

# --- restart containerd ----------------------------------------------------------------------
restart_containerd() {
  case $RESTART in
    none) log "containerdRestart=none: containerd must be restarted by the node's manager to load $CONFIG_DIR/$DROPIN" ;;
    file)
      old=$(cat "$HOST/run/containerd/containerd.pid" 2>/dev/null || true)
      : >"$HOST$RESTART_FILE"
      log "asked for a containerd restart ($RESTART_FILE)"
      i=0
      while [ $i -lt 60 ]; do
        new=$(cat "$HOST/run/containerd/containerd.pid" 2>/dev/null || true)
        [ ! -e "$HOST$RESTART_FILE" ] && [ -n "$new" ] && [ "$new" != "$old" ] && { log "containerd restarted (pid $old -> $new)"; return 0; }
        sleep 0.5; i=$((i + 1))
      done
      log "WARNING: containerd did not restart within 30 s (is $RESTART_FILE watched on this node?)" ;;
    systemd)
      nsenter -t 1 -m -u -i -n -p -- systemctl restart "$SYSTEMD_UNIT" ||
        die "systemctl restart $SYSTEMD_UNIT failed (the pod needs hostPID; or set containerdRestart)"
      log "restarted $SYSTEMD_UNIT" ;;
    *) die "containerdRestart must be systemd, file or none, not $RESTART" ;;
  esac
}
if [ $changed = yes ]; then restart_containerd; fi
log "done: runtime handler $HANDLER on this node"
