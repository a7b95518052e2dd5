# stasis node lock (busybox sh), sourced by node-install.sh and node-uninstall.sh: one of them at
# a time changes the node. An agent pod deleted by hand is replaced at once, so the old pod's
# uninstaller (on its SIGTERM) and the new pod's installer run together: unlocked, the
# uninstaller could read the manifest's owner before the installer rewrote it and then remove
# the stasis-runc the installer had just found in place (the new agent: "not ready for restores:
# /opt/stasis/bin/stasis-runc is not installed"). This busybox has no flock: mkdir is atomic, and
# the holder's pid (both run with hostPID: /proc is the node's) tells a lock whose holder died.
NODE_LOCK=/opt/stasis/.lock

node_lock() {
  mkdir -p "$HOST/opt/stasis"
  waited=0
  until mkdir "$HOST$NODE_LOCK" 2>/dev/null; do
    holder=$(cat "$HOST$NODE_LOCK/pid" 2>/dev/null || true)
    if [ -n "$holder" ] && [ ! -d "/proc/$holder" ]; then
      log "taking over the node lock of process $holder, which has ended"
      rm -rf "$HOST$NODE_LOCK"
      continue
    fi
    # 120 s: a holder killed between its mkdir and its pid, or a pid reused
    if [ "$waited" -ge 1200 ]; then
      log "WARNING: the node lock ($NODE_LOCK) was held for 120 s by ${holder:-a process that left no pid}: taking it"
      rm -rf "$HOST$NODE_LOCK"
      continue
    fi
    [ $((waited % 100)) -eq 0 ] && log "waiting for the node lock ($NODE_LOCK, held by process ${holder:-?})"
    sleep 0.1
    waited=$((waited + 1))
  done
  echo $$ >"$HOST$NODE_LOCK/pid"
}

node_unlock() { rm -rf "$HOST$NODE_LOCK"; }
