# stasis — the two commands of the quick start are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo

.PHONY: help setup build images platform demo test lint unit fuzz integration e2e e2e-install e2e-pods e2e-restore e2e-security e2e-notice bench clean cluster-up cluster-down

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: ## install CRIU >= 4.2, runc, iptables, tini... (idempotent)
	@scripts/setup

build: ## release build of the stasis binaries
	$(CARGO) build --release --locked -p stasis-cli

images: ## the stasis-counter rootfs and OCI image
	@scripts/build-counter-image >/dev/null

demo: setup build images ## checkpoint → SIGKILL → restore of a stateful container
	@tini -s -- scripts/demo

lint: ## formatting, clippy, rustdoc, shellcheck, helm lint against the values schema and CRD drift, as CI runs them
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --locked --workspace --no-deps
	scripts/lint
	scripts/check-crd-drift

unit: ## unit tests (no privileges needed)
	$(CARGO) test --locked --workspace --lib --bins

FUZZ_SECONDS ?= 20
fuzz: ## bounded fuzzing of the parsers of untrusted input, FUZZ_SECONDS per target (fuzz/run.sh; stable Rust)
	fuzz/run.sh $(FUZZ_SECONDS)

platform: ## build Kubernetes, containerd, etcd, CoreDNS, Helm, s3s-fs from source (cached in ~/.cache/stasis)
	scripts/build-platform

integration: setup images platform ## integration tests: real CRIU, runc, S3 server, kube-apiserver (root)
	CI=$${CI:-} tini -s -- $(CARGO) test --locked --workspace --test '*' -- --test-threads=1
	@echo "GPU self-test: MOCK GPU (no GPU on this machine): stand-in driver and torch, real CRIU, stasis and stasis-gpu-roundtrip"
	$(CARGO) build --locked -p stasis-cli -p stasis-gpu
	tini -s -- tests/gpu/selftest.sh

# The e2e scripts share one cluster and one build of the stasis image: it is built once (unless
# STASIS_INSTALL_NO_BUILD=1 and target/images/stasis.oci.tar exists: `make test` builds it beside
# the integration tier), each script keeps the cluster up for the next (STASIS_E2E_KEEP_CLUSTER=1;
# install-stasis then upgrades in place), and the cluster goes down once at the end.
e2e: setup images ## end-to-end tests on the local Kubernetes cluster: the cluster, the chart, restores (builds what they need on first use)
	@rc=0; t0=$$(date +%s); \
	if [ -z "$${STASIS_INSTALL_NO_BUILD:-}" ] || [ ! -f target/images/stasis.oci.tar ]; then \
	  t=$$(date +%s); scripts/build-images >/dev/null || exit 1; echo "# e2e: stasis image built in $$(( $$(date +%s) - t )) s"; \
	fi; \
	trap 'scripts/cluster down >/dev/null 2>&1 || echo "# warning: scripts/cluster down failed"' EXIT; \
	export STASIS_INSTALL_NO_BUILD=1 STASIS_E2E_KEEP_CLUSTER=1; \
	for s in $(E2E_SCRIPTS); do tests/e2e/$$s.sh || rc=1; done; \
	echo "# e2e tier: $$(( $$(date +%s) - t0 )) s"; \
	exit $$rc
E2E_SCRIPTS ?= cluster install restore security notice triggers evictions pods soak

e2e-evictions: setup images ## only the eviction paths and workload kinds on the local cluster (tests/e2e/evictions.sh; STASIS_E2E_ONLY="1 2 3 4 5 6 7")
	tests/e2e/evictions.sh

e2e-pods: setup images ## only the pod with several containers, a native sidecar and an init container on the local cluster (tests/e2e/pods.sh)
	tests/e2e/pods.sh

e2e-install: setup images ## only the chart's install, upgrade and uninstall on the local cluster (tests/e2e/install.sh)
	tests/e2e/install.sh

e2e-restore: setup images ## only the restore scenarios on the local cluster (tests/e2e/restore.sh; STASIS_E2E_ONLY="a b c ...")
	tests/e2e/restore.sh

e2e-security: setup images ## only the security review's attacks on the local cluster (tests/e2e/security.sh)
	tests/e2e/security.sh

e2e-notice: setup images ## only the cloud notice (spot reclaim) on the local cluster (tests/e2e/notice.sh)
	tests/e2e/notice.sh

e2e-triggers: setup images ## only the memory trigger and interval: auto on the local cluster (tests/e2e/triggers.sh; STASIS_E2E_ONLY="m" or "i")
	tests/e2e/triggers.sh

# On a new machine the platform's build (Kubernetes, containerd, etcd, CoreDNS, Helm, s3s-fs from
# their modules: half of a cold run, much of it downloads) starts first, niced, in the background:
# what needs a component before it is built waits for it (scripts/build-platform builds each one
# once, under a lock), and on a machine whose cache has them it finds them all at once.
# The stasis image's static release build (its own target directory and lock) runs niced beside
# unit, fuzz and integration, which leave CPU idle while CRIU, runc and the API server work; e2e
# then takes the built image. Its target directory is kept in the machine's cache
# (STASIS_IMAGE_CARGO_TARGET), so a fresh clone rebuilds only the stasis crates in release.
IMAGE_BUILD = target/images/build-images
STASIS_IMAGE_CARGO_TARGET ?= $(or $(STASIS_CACHE),$(HOME)/.cache/stasis)/image-target
test: setup ## everything CI runs: lint, unit, integration (real CRIU/runc), e2e (local cluster)
	@mkdir -p target; \
	( nice -n 19 scripts/build-platform >target/platform-build.log 2>&1 || \
	  echo "# the platform's build in the background failed (target/platform-build.log): make integration tries again" ) & \
	echo "# the platform builds in the background, beside lint and the Rust builds (log: target/platform-build.log)"
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory images
	$(CARGO) build --locked --workspace --all-targets
	@mkdir -p target/images; rm -f $(IMAGE_BUILD).rc; \
	( STASIS_IMAGE_CARGO_TARGET=$(STASIS_IMAGE_CARGO_TARGET) nice -n 19 scripts/build-images >$(IMAGE_BUILD).log 2>&1; \
	  echo $$? >$(IMAGE_BUILD).rc ) & \
	echo "# the stasis image builds in the background (log: $(IMAGE_BUILD).log)"
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory fuzz
	$(MAKE) --no-print-directory integration
	@t=$$(date +%s); until [ -f $(IMAGE_BUILD).rc ]; do sleep 2; done; \
	echo "# waited $$(( $$(date +%s) - t )) s for the stasis image build"; \
	[ "$$(cat $(IMAGE_BUILD).rc)" = 0 ] || { tail -30 $(IMAGE_BUILD).log; echo "scripts/build-images failed (log: $(IMAGE_BUILD).log)"; exit 1; }
	STASIS_INSTALL_NO_BUILD=1 $(MAKE) --no-print-directory e2e

bench: setup build images ## benchmarks (see docs/benchmarks.md)
	@tini -s -- bench/checkpoint.sh
ITERATIONS ?= 200
soak: setup images ## faults at random phases while a counter is checkpointed and drained back and forth (tests/e2e/soak.sh; ITERATIONS=200; `make test` runs 8)
	@if [ ! -f target/images/stasis.oci.tar ] || [ -z "$${STASIS_INSTALL_NO_BUILD:-}" ]; then scripts/build-images >/dev/null || exit 1; fi; \
	[ -x target/debug/kubectl-stasis ] || $(CARGO) build --locked -p stasis-kubectl; \
	SOAK_ITERATIONS=$(ITERATIONS) STASIS_INSTALL_NO_BUILD=1 tests/e2e/soak.sh
scale: ## the control plane at scale: kube-apiserver, kwok nodes, the controller (bench/scale.sh; NODES=100 PODS=1000)
	bench/scale.sh

clean:
	$(CARGO) clean

cluster-up: ## start the local Kubernetes cluster (scripts/cluster up)
	scripts/cluster up

cluster-down: ## stop it, leaving nothing behind
	scripts/cluster down
