#!/usr/bin/env bash
# The control plane at scale: a real kube-apiserver and etcd (tests/lib/apiserver.sh), the
# stasis CRDs, kwok playing NODES Ready nodes whose PODS pods run, the real stasis-controller
# (reconcilers and webhook) with a CheckpointPolicy of INTERVAL selecting every pod, and a
# stand-in for the agents (crates/controller/examples/scale_sim.rs `agents`): simulated nodes run
# no containers, so it only marks each PodCheckpoint Running, then Succeeded with a new checkpoint
# reference, as the agent's status writes do. Measures, and prints:
#   - the webhook under PODS pod creations at RATE/s (runtimeClassName stasis, through the API
#     server as the ReplicaSet controller, NAMESPACES namespaces of at most 500): the API server's
#     webhook latency histogram and the creates' latency as the client sees them;
#   - steady state (after one INTERVAL and a tenth, every pod has had a heartbeat): API writes
#     per second by verb and resource over STEADY_S s (the API server's apiserver_request_total),
#     the controller's CPU and RSS (/proc);
#   - a controller restart (a new replica, as a rolled pod): time to ready, to the new leader's
#     first heartbeat, and writes per 10 s until RESTART_S s;
#   - the webhook again at size: CHURN more pods (10 s of RATE) while every pod has checkpoints.
#
#   NODES=100 PODS=1000 bench/scale.sh          (make scale; PROFILE=release for a release build)
#   SCALE_LOGS=DIR keeps the logs (API server, kwok, controller, stand-ins) there
#   SCALE_NO_BUILD=1 runs the binaries built before, SCALE_BIN=DIR those in DIR (stasis-controller,
#   examples/scale_sim: another build to compare with); SETTLE_S (300) bounds each wait for pods
#   and lineage records (a run whose controller falls behind says so and goes on)
#
# Needs the platform build (scripts/build-platform kubernetes etcd) and Go (kwok is built from
# its module sigs.k8s.io/kwok through the module proxy once, cached under ~/.cache/stasis).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NODES=${NODES:-100} PODS=${PODS:-1000} RATE=${RATE:-50} INTERVAL=${INTERVAL:-60}
STEADY_S=${STEADY_S:-$((2 * INTERVAL))} RESTART_S=${RESTART_S:-120} PROFILE=${PROFILE:-debug}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
# the controller caps lineage records per namespace (1,000 by default): 500 pods a namespace
NAMESPACES=${NAMESPACES:-$(((PODS + 499) / 500))} CHURN=${CHURN:-$((RATE * 10))}
NS=scale SNS=stasis-system
export LC_ALL=C

export APISERVER_OWN_TRAP=1
. tests/lib/apiserver.sh
apiserver_need scale
log() { echo "# $(date -u +%T) $* (load $(cut -d" " -f1-3 /proc/loadavg))" >&2; }

# kwok from its Go module, as scripts/build-platform builds the platform (a throwaway module,
# -trimpath, cached per version), with the stages it ships for nodes that turn Ready and pods
# that run (kustomize/stage/{node,pod}/fast).
kwok_dir="$cache/kwok-$KWOK_VERSION"
if [[ ! -x $kwok_dir/bin/kwok ]]; then
    log "building kwok $KWOK_VERSION into $kwok_dir (once)"
    t=$(date +%s)
    rm -rf "$kwok_dir/mod" "$kwok_dir/bin.tmp"; mkdir -p "$kwok_dir/mod" "$kwok_dir/bin.tmp"
    printf 'module stasis.local/platform/kwok\n\ngo 1.26\n' >"$kwok_dir/mod/go.mod"
    (cd "$kwok_dir/mod" && export GOFLAGS="-trimpath -buildvcs=false" GOTOOLCHAIN=${GOTOOLCHAIN:-local} &&
        go get "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" &&
        CGO_ENABLED=0 nice -n 19 go build -gcflags=all=-dwarf=false -ldflags "-s -w" -o "$kwok_dir/bin.tmp/" sigs.k8s.io/kwok/cmd/kwok)
    rm -rf "${kwok_dir:?}/bin"; mv "$kwok_dir/bin.tmp" "$kwok_dir/bin"
    echo $(($(date +%s) - t)) >"$kwok_dir/build-seconds"
fi
if [[ ! -s $kwok_dir/stages.yaml ]]; then
    m=$(cd "$kwok_dir/mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
    for f in node/fast/node-initialize pod/fast/pod-ready pod/fast/pod-delete; do
        cat "$m/kustomize/stage/$f.yaml"; echo "---"
    done >"$kwok_dir/stages.yaml"
fi

flag=(); [[ $PROFILE == release ]] && flag=(--release)
if [[ -z ${SCALE_NO_BUILD:-}${SCALE_BIN:-} ]]; then # (SCALE_NO_BUILD=1: the binaries built before)
    log "building stasis-controller and the stand-ins ($PROFILE)"
    cargo build -q "${flag[@]}" -p stasis-controller --bin stasis-controller --example scale_sim
fi
bin=${SCALE_BIN:-$root/target/$PROFILE}
ctl=$bin/stasis-controller sim=$bin/examples/scale_sim
log "controller: $ctl"

pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [[ -n ${SCALE_LOGS:-} ]]; then mkdir -p "$SCALE_LOGS" && cp "$work"/*.log "$work"/*.out "$SCALE_LOGS"/ 2>/dev/null || true; fi
    apiserver_stop
}
trap cleanup EXIT
trap 'exit 130' INT TERM # (so that a stopped run cleans up too)
apiserver_start --max-requests-inflight 800 --max-mutating-requests-inflight 400
log "kube-apiserver up ($work)"
kubectl apply --server-side -f deploy/helm/stasis/crds/stasis.dev.yaml >/dev/null
kubectl create namespace $SNS >/dev/null
for ((n = 0; n < NAMESPACES; n++)); do
    kubectl create namespace "$NS-$n" >/dev/null; kubectl -n "$NS-$n" create serviceaccount default >/dev/null
    kubectl apply -f - >/dev/null <<EOF
apiVersion: stasis.dev/v1alpha1
kind: CheckpointPolicy
metadata: {name: scale, namespace: $NS-$n}
spec:
  selector: {matchLabels: {app: scale}}
  interval: ${INTERVAL}s
EOF
done
echo '{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "stasis"}, "handler": "stasis"}' |
    kubectl apply -f - >/dev/null

# kwok and its nodes
kwok_port=$(free_port)
"$kwok_dir/bin/kwok" --kubeconfig "$KUBECONFIG" --config "$kwok_dir/stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr 10.0.0.1/12 --node-ip 10.255.0.1 --server-address "127.0.0.1:$kwok_port" >"$work/kwok.log" 2>&1 &
pids+=($!)
for ((i = 0; i < NODES; i++)); do
    cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$i
  annotations: {kwok.x-k8s.io/node: fake}
  labels: {type: kwok, kubernetes.io/hostname: kwok-node-$i, stasis.dev/ready: "true", stasis.dev/cpu-arch: amd64}
---
EOF
done >"$work/nodes.yaml"
kubectl create -f "$work/nodes.yaml" >/dev/null
ready_nodes() { kubectl get nodes --no-headers 2>/dev/null | grep -c ' Ready ' || true; }
wait_for 300 bash -c "[[ \$(kubectl get nodes --no-headers | grep -c ' Ready ') -ge $NODES ]]" ||
    { echo "FAIL: $(ready_nodes) of $NODES simulated nodes Ready after 300 s; kwok's log:" >&2; tail -20 "$work/kwok.log" >&2; exit 1; }
log "$NODES simulated nodes Ready (kwok $KWOK_VERSION: they run no containers)"

# the controller, its webhook on a local port (the chart's rules, failurePolicy and timeout)
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
    -keyout "$work/tls.key" -out "$work/tls.crt" 2>/dev/null
webhook_port=$(free_port)
start_controller() { # NAME: a replica (its metrics port in $metrics_port, its PID in $ctl_pid)
    metrics_port=$(free_port)
    # (the server's debug line times each admission review as the controller answers it)
    POD_NAMESPACE=$SNS POD_NAME=$1 RUST_LOG=${RUST_LOG:-warn,kube_client=error,stasis_controller::server=debug} "$ctl" --webhook-addr "127.0.0.1:$webhook_port" \
        --tls-cert "$work/tls.crt" --tls-key "$work/tls.key" --metrics-addr "127.0.0.1:$metrics_port" \
        >>"$work/controller.log" 2>&1 &
    ctl_pid=$!; pids+=("$ctl_pid")
}
controller_ready() { curl -sf "http://127.0.0.1:$metrics_port/readyz" >/dev/null; }
start_controller scale-controller-1
wait_for 120 controller_ready || { echo "FAIL: the controller is not ready; its log:" >&2; tail -20 "$work/controller.log" >&2; exit 1; }
kubectl apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: stasis-scale}
webhooks:
  - name: pods.stasis.dev
    admissionReviewVersions: [v1]
    clientConfig: {url: "https://127.0.0.1:$webhook_port/mutate", caBundle: $(base64 -w0 "$work/tls.crt")}
    rules: [{operations: [CREATE], apiGroups: [""], apiVersions: [v1], resources: [pods], scope: Namespaced}]
    failurePolicy: Ignore
    matchPolicy: Equivalent
    sideEffects: NoneOnDryRun
    timeoutSeconds: 30
    reinvocationPolicy: Never
    namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [$SNS, kube-system]}]}
EOF
"$sim" agents --records-namespace $SNS >"$work/agents.log" 2>&1 &
pids+=($!)
echo "NOTE: simulated nodes (kwok) run no containers; a stand-in process marks each checkpoint Running, then Succeeded (nothing is frozen or uploaded)."

# API writes: apiserver_request_total by verb and resource (subresource), summed over codes
writes() { requests 'POST|PUT|PATCH|APPLY|DELETE|DELETECOLLECTION'; }
requests() { # VERBS (an awk regex): apiserver_request_total by verb and resource
    kubectl get --raw /metrics | awk -v verbs="^($1)$" '/^apiserver_request_total\{/ {
        v=$0; sub(/.*verb="/, "", v); sub(/".*/, "", v)
        if (v !~ verbs) next
        r=$0; sub(/.*[{,]resource="/, "", r); sub(/".*/, "", r)
        s=""; if ($0 ~ /subresource="[^"]+"/) { s=$0; sub(/.*subresource="/, "", s); sub(/".*/, "", s); s="/" s }
        n[v " " r s] += $NF } END { for (k in n) print k, n[k] }' | sort
}
delta() { # BEFORE AFTER SECONDS: writes/s by verb and resource, and the total
    join -a2 -e0 -o 2.1,1.3,2.3 <(awk '{print $1"_"$2, $1, $3}' "$1" | sort) <(awk '{print $1"_"$2, $1, $3}' "$2" | sort) |
        awk -v s="$3" '{split($1, k, "_"); d=$3-$2; if (d > 0) { printf "  %-7s %-34s %8.2f/s\n", k[1], substr($1, length(k[1])+2), d/s; t+=d } }
            END { printf "  %-42s %8.2f/s\n", "all writes", t/s }'
}
webhook_hist() { echo "# the webhook's latency"; kubectl get --raw /metrics | grep '^apiserver_admission_webhook_admission_duration_seconds_\(bucket\|sum\|count\)' | grep 'pods.stasis.dev' || true; }
proc_cpu() { awk '{print $14+$15}' "/proc/$1/stat"; } # utime+stime, ticks
proc_rss() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
hz=$(getconf CLK_TCK)

# 1. the webhook under pod creations (again in 4., with every pod's checkpoints there)
answered() { sed 's/\x1b\[[0-9;]*m//g' "$work/controller.log" | grep -o 'admission review answered ms=[0-9.]*' | sed 's/.*ms=//' || true; }
create_pods() { # PREFIX COUNT: pods at RATE/s through the webhook; the webhook's latency
    webhook_hist >"$work/h0"; answered >"$work/a0"; requests 'GET|LIST' >"$work/q0"
    log "creating $2 pods at $RATE/s through the webhook, in $NAMESPACES namespaces on $NODES simulated nodes"
    "$sim" pods --namespace $NS --namespaces "$NAMESPACES" --prefix "$1" --count "$2" --rate "$RATE" --nodes "$NODES" |
        tee -a "$work/pods.out"
    webhook_hist >"$work/h1"; requests 'GET|LIST' >"$work/q1"
    # (every client's reads: the webhook's, the controller's commits, kwok's, the stand-in's)
    echo "API reads while creating, per pod created, by verb and resource (over 0.05):"
    join -a2 -e0 -o 2.1,1.3,2.3 <(awk '{print $1"_"$2, $1, $3}' "$work/q0" | sort) <(awk '{print $1"_"$2, $1, $3}' "$work/q1" | sort) |
        awk -v n="$2" '{ d=($3-$2)/n; if (d > 0.05) printf "  %-50s %6.2f\n", $1, d }'
    awk 'FNR==NR { a[$1]=$2; next } /^#/ { next } { d=$2-a[$1]; if ($1 ~ /_count/) c=d; else if ($1 ~ /_sum/) s=d;
            else { le=$1; sub(/.*le="/, "", le); sub(/".*/, "", le); b[le]=d; o[++n]=le } }
         END { if (!c) { print "webhook: no admissions counted"; exit }
               for (i=1; i<=n; i++) if (b[o[i]] >= 0.99*c) { p=o[i]; break }
               printf "webhook (the API server'"'"'s histogram): %d admissions, mean %.1f ms, p99 <= %s s (its bucket bound)\n", c, 1000*s/c, p }' \
        "$work/h0" "$work/h1"
    answered | tail -n +$(($(wc -l <"$work/a0") + 1)) | sort -n | awk '{ a[NR]=$1 } END {
        if (NR) printf "webhook (the controller, review in to answer out): %d reviews, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
            NR, a[int((NR+1)/2)], a[int(NR*0.99) + (int(NR*0.99) < 1)], a[NR] }'
    curl -s "http://127.0.0.1:$metrics_port/metrics" | grep -E '^stasis_controller_admissions_total' | sed 's/^/  /' || true
}
create_pods scale "$PODS"
running() { kubectl get pods -A -l app=scale --no-headers --field-selector status.phase=Running 2>/dev/null | wc -l; }
records() { kubectl -n $SNS get configmaps -l stasis.dev/lineage-record=true --no-headers 2>/dev/null | wc -l; }
export -f running records; export SNS
# (a create the client gave up on may still have been made: count the pods there are)
made=$(kubectl get pods -A -l app=scale --no-headers | wc -l)
wait_for "${SETTLE_S:-300}" bash -c "(( \$(running) >= $made ))" || log "warning: $(running) of $made pods Running"
t=$(date +%s)
wait_for "${SETTLE_S:-300}" bash -c "(( \$(records) >= $made ))" || log "warning: $(records) of $made pods have a lineage record (the controller is behind)"
log "$(running) pods Running, $(records) lineage records ($(($(date +%s) - t)) s after they ran)"

# 2. steady state: one interval and a tenth (the jitter) after the last pod started, every pod
# has had its first heartbeat
warm=$((INTERVAL * 11 / 10 + 10))
log "warming up $warm s (every pod's first heartbeat)"
sleep "$warm"
writes >"$work/w0"; c0=$(proc_cpu "$ctl_pid"); t0=$(date +%s.%N); rss_max=0
end=$(($(date +%s) + STEADY_S))
while (($(date +%s) < end)); do r=$(proc_rss "$ctl_pid"); ((r > rss_max)) && rss_max=$r; sleep 2; done
writes >"$work/w1"; c1=$(proc_cpu "$ctl_pid"); t1=$(date +%s.%N)
secs=$(echo "$t1 - $t0" | bc)
echo "steady state, $NODES nodes, $PODS pods, interval ${INTERVAL}s, over ${secs%.*} s: API writes per second"
delta "$work/w0" "$work/w1" "$secs" | tee "$work/steady.out"
rate() { awk -v k="$1" '$0 ~ k {gsub("/s", "", $NF); print $NF}' "$work/steady.out"; }
all=$(rate 'all writes') hbs=$(rate 'POST +podcheckpoints ')
awk -v t="$all" -v h="${hbs:-0}" -v p="$PODS" -v i="$INTERVAL" 'BEGIN {
    printf "  = %.2f writes per pod per interval; %.2f heartbeats/s (the policy asks %.2f/s), %.2f writes per heartbeat\n", t*i/p, h, p/i, (h > 0 ? t/h : 0) }'
echo "controller: CPU $(echo "scale=3; ($c1 - $c0) / $hz / $secs" | bc) cores, RSS max $((rss_max / 1024)) MiB (now $(($(proc_rss "$ctl_pid") / 1024)) MiB)"
echo "objects: $(kubectl get podcheckpoints -A --no-headers | wc -l) PodCheckpoints, $(records) lineage records; $(tail -1 "$work/agents.log")"

# 3. a restart: a new replica (a rolled pod has a new name: it waits for the lease to lapse)
writes >"$work/r0"
kill "$ctl_pid"; wait "$ctl_pid" 2>/dev/null || true
t0=$(date +%s.%N)
start_controller scale-controller-2
wait_for 120 controller_ready; t_ready=$(echo "$(date +%s.%N) - $t0" | bc)
hb() { awk '$1=="POST" && $2=="podcheckpoints" {print $3}' "$1"; }
hb0=$(hb "$work/r0"); t_first=
echo "restart: ready after ${t_ready} s; writes per 10 s after the restart (POST podcheckpoints = heartbeats):"
prev="$work/r0"
for ((k = 1; k * 10 <= RESTART_S; k++)); do
    while (($(date +%s) < ${t0%.*} + k * 10)); do sleep 0.5; done
    writes >"$work/r$k"
    all=$(join -a2 -e0 -o 1.3,2.3 <(awk '{print $1"_"$2, $1, $3}' "$prev" | sort) <(awk '{print $1"_"$2, $1, $3}' "$work/r$k" | sort) | awk '{t+=$2-$1} END {print t}')
    h=$(( $(hb "$work/r$k") - $(hb "$prev") ))
    [[ -z $t_first && $(hb "$work/r$k") -gt $hb0 ]] && t_first=$((k * 10))
    echo "  +$((k * 10)) s: $all writes, $h heartbeats created"
    prev="$work/r$k"
done
echo "restart: first heartbeat of the new replica within ${t_first:-(none in $RESTART_S s)} s; RSS $(($(proc_rss "$ctl_pid") / 1024)) MiB"

# 4. the webhook again, the cluster at size (each admission reads its namespace's checkpoints)
create_pods churn "$CHURN"
