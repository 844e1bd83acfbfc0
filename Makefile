# Every target sets itself up first: a fresh clone needs only `make demo` or `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
export LMCACHE_TRACK_USAGE := false
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup redis hostbed test faults lint demo bench docs clean

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch pinned by constraints-cpu.txt; unpinned pip would pull a multi-GB CUDA build.
	# [lmcache]: the tests, the demo and the bench run LMCache; a pool node needs only the core.
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[lmcache,test]'
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

# The host bed (bench/hosts.py, tests/hosts): network namespaces shaped with ip, tc and nft, as root.
hostbed:
	@if ! command -v nft >/dev/null || ! command -v tc >/dev/null || ! command -v ip >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing nftables and iproute2 (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2 >/dev/null; \
	  else \
	    echo "the host tests need root and nft, tc, ip: run 'sudo apt-get install -y nftables iproute2' and run as root"; \
	  fi; \
	fi

setup: $(STAMP) redis hostbed

lint: setup
	$(VENV)/bin/ruff check backend nccl_channel bench tests
	$(VENV)/bin/ruff format --check backend nccl_channel bench tests
	$(VENV)/bin/mypy backend nccl_channel

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider

# The fault-injection and host-bed suites in full (make test runs their short versions): longer runs, more rounds.
faults: setup
	KVPOOL_FULL=1 $(PY) -m pytest -q -p no:cacheprovider tests/faults tests/hosts

docs: setup
	$(PY) -m tests.test_cli_docs

demo: setup
	$(PY) -m bench.demo

# LMCache's backends side by side (docs/benchmarks.md); the targets: make bench BENCH_ARGS=--targets
BENCH_ARGS ?=
bench: setup
	$(PY) -m bench.harness $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .kvpool .pytest_cache .mypy_cache .ruff_cache
