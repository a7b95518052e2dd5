# stasis — the two commands of the quick start are `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo

.PHONY: help setup build images platform demo test lint unit fuzz integration e2e e2e-install e2e-restore e2e-security e2e-notice bench clean cluster-up cluster-down

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

e2e: setup images ## end-to-end tests on the local Kubernetes cluster: the cluster, the chart, restores (builds what they need on first use)
	@rc=0; \
	tests/e2e/cluster.sh || rc=1; \
	tests/e2e/install.sh || rc=1; \
	STASIS_INSTALL_NO_BUILD=1 tests/e2e/restore.sh || rc=1; \
	STASIS_INSTALL_NO_BUILD=1 tests/e2e/security.sh || rc=1; \
	STASIS_INSTALL_NO_BUILD=1 tests/e2e/notice.sh || rc=1; \
	exit $$rc

e2e-install: setup images ## only the chart's install, upgrade and uninstall on the local cluster (tests/e2e/install.sh)
	tests/e2e/install.sh

e2e-restore: setup images ## only the restore scenarios on the local cluster (tests/e2e/restore.sh; STASIS_E2E_ONLY="a b c ...")
	tests/e2e/restore.sh

e2e-security: setup images ## only the security review's attacks on the local cluster (tests/e2e/security.sh)
	tests/e2e/security.sh

e2e-notice: setup images ## only the cloud notice (spot reclaim) on the local cluster (tests/e2e/notice.sh)
	tests/e2e/notice.sh

test: setup lint images ## everything CI runs: lint, unit, integration (real CRIU/runc), e2e (local cluster)
	$(CARGO) build --locked --workspace --all-targets
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory fuzz
	$(MAKE) --no-print-directory integration
	$(MAKE) --no-print-directory e2e

bench: setup build images ## benchmarks (see docs/benchmarks.md)
	@tini -s -- bench/checkpoint.sh

clean:
	$(CARGO) clean

cluster-up: ## start the local Kubernetes cluster (scripts/cluster up)
	scripts/cluster up

cluster-down: ## stop it, leaving nothing behind
	scripts/cluster down
