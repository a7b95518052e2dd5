#!/bin/sh
# stasis node uninstaller (busybox sh). The main process of the agent pod's `node-uninstaller`
# sidecar: it waits, and undoes the node installer's work when the pod is terminated (SIGTERM:
# the DaemonSet is deleted by `helm uninstall`, or the pod deleted) — but only if the node's
# install belongs to this pod: during a rolling update the new pod installs first (maxSurge), so
# the old pod finds a newer owner and leaves the node alone.
#
#   node-uninstall.sh wait    wait for SIGTERM, then uninstall
#   node-uninstall.sh now     uninstall now (whatever pod installed)
#
# Undoes: the drop-in (then restarts containerd), /opt/stasis/bin/stasis-runc and the exit-0
# program stasis-runc writes beside itself (stasis-exit0, run in place of an init container that
# already ran before the checkpoint a pod restores) — unless containers of the handler still run
# on the node: containerd needs the handler for their exec, logs and stop, their shims call
# stasis-runc (plain runc without the agent), and an init container's mount may name
# stasis-exit0, so they stay and the log says so —, the CRIU it installed, the agent's state (/run/stasis, /var/lib/stasis
# contents) and the manifest.
set -u

HOST=${HOST:-/host}
HANDLER=${HANDLER:-stasis}
CONFIG_DIR=${CONFIG_DIR:-/etc/containerd/conf.d}
DROPIN=${DROPIN:-90-stasis.toml}
RESTART=${RESTART:-systemd}
RESTART_FILE=${RESTART_FILE:-/run/stasis/restart-containerd}
SYSTEMD_UNIT=${SYSTEMD_UNIT:-containerd.service}
POD_UID=${POD_UID:-}
BIN=/opt/stasis/bin
MANIFEST=/opt/stasis/.installed
MARK="# written by the stasis node installer"

log() { echo "stasis-node-uninstall: $*"; }
# shellcheck source=node-lock.sh
. "$(dirname "$0")/node-lock.sh"

# containers whose shim runs stasis-runc (containerd keeps each task's runc options in its bundle)
handler_containers() {
  for o in "$HOST"/run/containerd/io.containerd.runtime.v2.task/*/*/options.json; do
    [ -f "$o" ] || continue
    grep -q "$BIN/stasis-runc" "$o" 2>/dev/null || continue
    d=${o%/options.json}
    # a task whose init process is gone is not running (the pod has hostPID: /proc is the node's)
    pid=$(cat "$d/init.pid" 2>/dev/null || true)
    [ -n "$pid" ] && [ -d "/proc/$pid" ] || continue
    echo "${d##*/}"
  done
}

uninstall() {
  mode=$1
  node_lock
  uninstall_locked "$mode"
  node_unlock
}

uninstall_locked() {
  mode=$1
  if [ ! -f "$HOST$MANIFEST" ]; then
    log "nothing installed on this node ($MANIFEST is missing)"
  fi
  owner=$(awk '$1 == "owner" {print $2}' "$HOST$MANIFEST" 2>/dev/null)
  if [ "$mode" = wait ] && [ -n "$owner" ] && [ "$owner" != "$POD_UID" ]; then
    log "the node's install belongs to pod $owner (a newer agent pod), not this one ($POD_UID): leaving it"
    return 0
  fi
  restart=no
  running=$(handler_containers | tr '\n' ' ')
  if [ -n "$running" ]; then
    # containerd needs the handler's config for exec, logs and stop of these pods' containers,
    # and their shims call stasis-runc: both stay (no agent: plain runc), no restart
    log "containers of the $HANDLER handler still run on this node ($running): $CONFIG_DIR/$DROPIN, $BIN/stasis-runc and $BIN/stasis-exit0 stay for them until they end (install and uninstall again to remove them)"
  elif [ -f "$HOST$CONFIG_DIR/$DROPIN" ]; then
    if head -n1 "$HOST$CONFIG_DIR/$DROPIN" | grep -qF "$MARK"; then
      rm -f "$HOST$CONFIG_DIR/$DROPIN"; restart=yes
      log "removed $CONFIG_DIR/$DROPIN"
    else
      log "WARNING: $CONFIG_DIR/$DROPIN was not written by the installer: left alone"
    fi
  fi
  [ -n "$running" ] || rm -f "$HOST$BIN/stasis-runc" "$HOST$BIN/stasis-exit0" "$HOST$BIN"/.stasis-exit0.tmp-*
  # CRIU, only what the installer put there
  for p in $(awk '$1 == "path" {print $2}' "$HOST$MANIFEST" 2>/dev/null); do
    case $p in
      /opt/stasis/lib/criu) rm -rf "$HOST$p" ;;
      "$BIN/criu") rm -f "$HOST$p" ;;
      "$BIN/stasis-runc"|"$CONFIG_DIR/$DROPIN") ;;
      *) [ "$(readlink "$HOST$p" 2>/dev/null)" = "$BIN/criu" ] && rm -f "$HOST$p" ;;
    esac
  done
  rmdir "$HOST/opt/stasis/lib" 2>/dev/null
  rm -f "$HOST$MANIFEST" "$HOST$BIN"/*.tmp.* "$HOST$MANIFEST".tmp.*
  rmdir "$HOST$BIN" 2>/dev/null
  # the agent's state: sockets, plans, scratch, cached archives
  for d in /run/stasis /var/lib/stasis; do
    [ -d "$HOST$d" ] || continue
    find "$HOST$d" -mindepth 1 -maxdepth 1 ! -name "$(basename "$RESTART_FILE")" -exec rm -rf {} + 2>/dev/null
  done
  log "removed stasis from the node${running:+ (but the drop-in, $BIN/stasis-runc and $BIN/stasis-exit0)}"
  # last: a restart ends the exec streams of this pod, never the work above
  if [ $restart = yes ]; then
    case $RESTART in
      none) log "containerdRestart=none: containerd keeps the $HANDLER handler until it is restarted" ;;
      file) : >"$HOST$RESTART_FILE"; log "asked for a containerd restart ($RESTART_FILE)" ;;
      systemd) nsenter -t 1 -m -u -i -n -p -- systemctl restart "$SYSTEMD_UNIT" && log "restarted $SYSTEMD_UNIT" ;;
    esac
  fi
}

case ${1:-wait} in
  now) uninstall now ;;
  wait)
    log "waiting (pod $POD_UID); on SIGTERM the node's install is undone if this pod owns it"
    trap 'uninstall wait; exit 0' TERM INT
    while :; do sleep 3600 & wait $!; done ;;
  *) echo "usage: $0 wait|now" >&2; exit 2 ;;
esac
