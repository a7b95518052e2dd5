# A real kube-apiserver for the API-server tests (crates/*/tests/*.sh), sourced by them: etcd and
# kube-apiserver from the binaries scripts/build-platform builds into its cache
# (scripts/cluster up builds them too), on free local ports, in a scratch directory; an admin
# token in a kubeconfig; no kubelet, no cluster: seconds, not minutes.
#
#   . tests/lib/apiserver.sh
#   apiserver_need NAME [helm]     the binaries (and kubectl, openssl); exit 77 with a SKIP line
#                                  naming what is missing (the Rust runners fail on it in CI)
#   apiserver_start [FLAGS...]     start etcd and kube-apiserver (extra kube-apiserver flags,
#                                  e.g. --authorization-mode RBAC; AlwaysAllow by default), export
#                                  KUBECONFIG (namespace $APISERVER_NAMESPACE, default "default"),
#                                  wait until /readyz answers (exit 1 with its log when not)
#   apiserver_stop                 stop them and remove the scratch directory (a test's EXIT trap
#                                  calls it; apiserver_start sets that trap unless the test set
#                                  APISERVER_OWN_TRAP=1 and calls it from its own cleanup)
#   stop_at_exit PID               stop that process with them (e.g. a binary under test)
#   pass WHAT / fail WHAT          a check's line ("ok   WHAT" / "FAIL WHAT" on stderr), counted
#                                  in $failures
#   wait_for SECONDS COMMAND...    until the command succeeds (polled every 0.2 s)
#   free_port                      a free local TCP port
#   cri_counter_bundle DIR UID POD [VAR=VALUE...]
#                                  a stasis-counter bundle (scripts/make-bundle with VARs) whose
#                                  annotations make it container "counter" of pod default/POD
#                                  (UID) as containerd's CRI plugin writes them (no image digest)
#   containerd_dropin DIR BINARY   DIR/stasis.toml registering the stasis runtime handler with
#                                  BINARY, as the node installer writes it (containerd 2.x)
#
# Sets: root (the repository), work (the scratch directory), apiserver, etcd, kubectl, helm.
# shellcheck shell=bash

# shellcheck disable=SC2034 # (for the tests that source this)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="${STASIS_CACHE:-$HOME/.cache/stasis}/platform"
work="${work:-$(mktemp -d /tmp/stasis-apiserver-XXXXXX)}"
failures=0
harness_pids=()

pass() { echo "ok   $1"; }
fail() { echo "FAIL $1" >&2; failures=$((failures + 1)); }
wait_for() {
    local n=$(($1 * 5)); shift
    for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    return 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
stop_at_exit() { harness_pids+=("$1"); }
cri_counter_bundle() {
    local dir=$1 uid=$2 pod=$3; shift 3
    "$root/scripts/make-bundle" "$dir" "$@" >/dev/null
    jq --arg uid "$uid" --arg pod "$pod" 'del(.annotations["dev.stasis.image.digest"]) | .annotations += {"io.kubernetes.cri.container-type":"container",
        "io.kubernetes.cri.sandbox-uid":$uid, "io.kubernetes.cri.sandbox-namespace":"default",
        "io.kubernetes.cri.sandbox-name":$pod, "io.kubernetes.cri.container-name":"counter"}' \
        "$dir/config.json" >"$dir/c.json" && mv "$dir/c.json" "$dir/config.json"
}
containerd_dropin() {
    mkdir -p "$1"
    cat >"$1/stasis.toml" <<EOF
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.stasis]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.stasis.options]
    BinaryName = "$2"
EOF
}
newest() { ls -d "$cache"/$1 2>/dev/null | sort -V | tail -1 || true; }

# apiserver_need NAME [helm]
apiserver_need() {
    local name=$1 want_helm=${2:-}
    apiserver="$(newest 'kubernetes-v*/bin/kube-apiserver')"
    etcd="$(newest 'etcd-v*/bin/etcd')"
    kubectl="$(newest 'kubernetes-v*/bin/kubectl')"
    [[ -n "$kubectl" ]] || kubectl="$(command -v kubectl || true)"
    helm="$(newest 'helm-v*/bin/helm')"
    [[ -n "$helm" ]] || helm="$(command -v helm || true)"
    local missing=()
    [[ -n "$apiserver" ]] || missing+=(kube-apiserver)
    [[ -n "$etcd" ]] || missing+=(etcd)
    [[ -n "$kubectl" ]] || missing+=(kubectl)
    [[ -z "$want_helm" || -n "$helm" ]] || missing+=(helm)
    command -v openssl >/dev/null || missing+=(openssl)
    if ((${#missing[@]})); then
        echo "SKIP $name: needs ${missing[*]} (kube-apiserver, etcd, kubectl and helm: scripts/build-platform builds them under $cache; openssl: scripts/setup)"
        exit 77
    fi
    # (the kubectl of the same Kubernetes first, also for `bash -c` and the binaries under test)
    PATH="$(dirname "$kubectl"):$PATH"
}

# apiserver_start [KUBE-APISERVER FLAGS...]
apiserver_start() {
    local etcd_port peer_port api_port authz=(--authorization-mode AlwaysAllow) a
    for a in "$@"; do [[ $a == --authorization-mode* ]] && authz=(); done
    etcd_port="$(free_port)"; peer_port="$(free_port)"; api_port="$(free_port)"
    [[ -n "${APISERVER_OWN_TRAP:-}" ]] || trap apiserver_stop EXIT
    openssl genrsa -out "$work/sa.key" 2048 2>/dev/null
    echo "admintoken,admin,admin,system:masters" >"$work/tokens.csv"
    "$etcd" --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
        >"$work/etcd.log" 2>&1 &
    harness_pids+=($!)
    "$apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" --secure-port "$api_port" --bind-address 127.0.0.1 \
        --cert-dir "$work/certs" --token-auth-file "$work/tokens.csv" "${authz[@]}" \
        --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$work/sa.key" \
        --service-account-signing-key-file "$work/sa.key" --service-cluster-ip-range 10.96.0.0/16 \
        "$@" >"$work/apiserver.log" 2>&1 &
    harness_pids+=($!)
    cat >"$work/kubeconfig" <<EOC
apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: "https://127.0.0.1:$api_port", insecure-skip-tls-verify: true}}]
users: [{name: a, user: {token: admintoken}}]
contexts: [{name: t, context: {cluster: t, user: a, namespace: ${APISERVER_NAMESPACE:-default}}}]
current-context: t
EOC
    export KUBECONFIG="$work/kubeconfig"
    if ! wait_for 60 kubectl get --raw /readyz; then
        echo "FAIL: kube-apiserver did not become ready within 60 s; its log:" >&2
        tail -20 "$work/apiserver.log" >&2
        exit 1
    fi
}

# apiserver_stop: TERM, then KILL after 5 s, each process (the test's given to stop_at_exit,
# etcd, kube-apiserver); the scratch directory goes
apiserver_stop() {
    local p
    for p in "${harness_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${harness_pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    rm -rf "$work"
}
