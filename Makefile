# Set-up is idempotent: the venv is (re)built only when it is missing or pyproject.toml changed.
# The venv must come from the system interpreter: the Triton Python stub embeds its libpython.
SYSTEM_PYTHON ?= /usr/bin/python3
VENV := .venv
PYTHON := $(VENV)/bin/python
MODEL_REPOSITORY ?= model_repository
PYTEST_ARGS ?=

.PHONY: setup serve probe lint format test soak stress hostile conformance compat bench mutate clean

# HAProxy, the front door of `make serve` (plugin/ops/proxy.py), installed like jemalloc: root + apt.
INSTALL_HAPROXY = command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq haproxy >/dev/null; } ; }

setup: $(VENV)/.installed

# The routers RL teams put in front of replicas, each in a venv of its own (their dependencies are theirs,
# and both wheels install a console script named smg): client_tests/test_router.py and bench/load/router.py
# start them through docker/router/launch.py. smg's version is the router image's (docker/router/Dockerfile).
# A router is installed from its wheel only (--only-binary: both are Rust builds, no toolchain is assumed);
# where PyPI has none for this platform, or cannot be reached, a note, and the router tests skip.
ROUTERS := $(VENV)/routers
SMG_VERSION := $(shell sed -n 's/^ARG SMG_VERSION=//p' docker/router/Dockerfile)
SGLANG_ROUTER_VERSION := 0.3.2
define INSTALL_ROUTER
test -f $(ROUTERS)/$(1)/.installed-$(2) || { rm -rf $(ROUTERS)/$(1) && $(SYSTEM_PYTHON) -m venv $(ROUTERS)/$(1) && \
  $(ROUTERS)/$(1)/bin/pip install --quiet --only-binary=:all: $(1)==$(2) && touch $(ROUTERS)/$(1)/.installed-$(2); } || \
  { rm -rf $(ROUTERS)/$(1); echo "note: $(1) $(2) not installed (no wheel for this platform, or no PyPI); its router tests skip"; }
endef

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# torch==2.13.0 pins the CPU wheel kept on these machines; elsewhere any torch>=2.4 will do.
	$(PYTHON) -m pip install --quiet torch==2.13.0 || $(PYTHON) -m pip install --quiet 'torch>=2.4'
	$(PYTHON) -m pip install --quiet -e '.[server,client,proxy,test,lint,generate,api,tracing]'
	# checkov (the Helm chart's static analysis) in a venv of its own: its pins would downgrade ours.
	test -x $(VENV)/checkov/bin/checkov || { $(SYSTEM_PYTHON) -m venv $(VENV)/checkov && $(VENV)/checkov/bin/pip install --quiet checkov==3.3.30; }
	@$(call INSTALL_ROUTER,smg,$(SMG_VERSION))
	@$(call INSTALL_ROUTER,sglang-router,$(SGLANG_ROUTER_VERSION))
	# jemalloc for tritonserver (plugin/ops/allocator.py); glibc's malloc is the fallback where it can't be installed.
	@ldconfig -p 2>/dev/null | grep -q libjemalloc.so.2 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq libjemalloc2 >/dev/null; } ; } || \
	  echo "note: libjemalloc2 not installed; tritonserver runs with glibc malloc"
	@$(INSTALL_HAPROXY) || echo "note: haproxy not installed; the front-door tests skip and make serve needs SERVE_ARGS=--no-proxy"
	# the HAProxy of each image line (2.4, 2.8), unpacked under .venv for tests/test_haproxy_lines.py, never installed
	@$(PYTHON) scripts/haproxy_lines.py || echo "note: the image lines' HAProxy could not be fetched; their config checks skip"
	touch $@

# tritonserver under the supervisor (restarts, model watchdog, :8003/ready, admin APIs locked) behind
# HAProxy on the public ports (installed here where root and apt allow; without it the launcher
# refuses to start unless SERVE_ARGS=--no-proxy); SERVE_ARGS=--no-supervise execs tritonserver itself.
# Environment variables: docs/settings.md.
SERVE_ARGS ?=
serve: setup
	@$(INSTALL_HAPROXY) || true
	exec $(PYTHON) -m triton_sampling_mask.ops.launcher --model-repository $(MODEL_REPOSITORY) $(SERVE_ARGS)

# One real inference per model against a running server (exit 0/1), as a Kubernetes exec probe runs it.
PROBE_ARGS ?= --model sampler --model generate
probe:
	$(PYTHON) -m triton_sampling_mask.ops.probe --url localhost:$${TRITON_HTTP_PORT:-8000} $(PROBE_ARGS)

# ruff over the whole tree (pyproject.toml [tool.ruff]): lint, import order, formatting.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The unit tests (tests/: no shared server) on TEST_WORKERS processes, then the client tests
# (client_tests/: one session server, load and latency checks that want the machine) in one; both
# run, and the target fails if either did.
TEST_WORKERS ?= 2
test: lint
	$(PYTHON) -m pytest -n $(TEST_WORKERS) tests $(PYTEST_ARGS); unit=$$?; \
	  $(PYTHON) -m pytest client_tests $(PYTEST_ARGS) && exit $$unit

# 128 clients x 16 x 151936 rows for 3 rounds of 30 s through the front door: shed share, p99 and RSS
# per round (docs/operations.md, "Stress").
STRESS_ARGS ?= --clients 128 --rows 16 --vocab 151936 --rounds 3 --duration 30
stress: setup
	$(PYTHON) -m bench.load.stress --model-repository $(MODEL_REPOSITORY) $(STRESS_ARGS)

# Each attack of testbed/hostile.py against a fresh `make serve` stack (in a memory cgroup where one can be
# made): outcome, what was measured, time until it answered again; exit 1 if one got through.
HOSTILE_ARGS ?=
hostile: setup
	@$(INSTALL_HAPROXY) || true
	$(PYTHON) -m bench.hostile $(HOSTILE_ARGS)

# The KServe v2 routes (bench/conformance/openapi_v2.yaml) fuzzed with schemathesis, route probes and a
# raw request-head fuzz against a fresh `make serve` stack, bounded (about 3-4 minutes with the start):
# per failure class one reproducer; exit 1 on any 5xx, non-strict JSON answer or wrong status.
# schemathesis comes from the `conformance` extra, installed here only, not by `make setup`.
CONFORMANCE_ARGS ?=
conformance: setup
	@$(INSTALL_HAPROXY) || true
	$(PYTHON) -c "import schemathesis" 2>/dev/null || $(PYTHON) -m pip install --quiet -e '.[conformance]'
	$(PYTHON) -m bench.conformance.run $(CONFORMANCE_ARGS)

# The RL frameworks' published clients (verifiers/prime-rl, AReaL, skyrl-train, TRL, sglang-router, smg;
# client_tests/compat/clients.txt) driven against fresh `make serve` stacks, with slime's and Miles's exact
# payloads as fixtures (docs/compat.md). They install into .venv/compat (--no-deps, plus what their modules
# import: client_tests/compat/imports.txt) so their pins never reach the project's venv; rebuilt when those
# files change. Without that venv the suite's tests skip in `make test`.
COMPAT_ARGS ?=
compat: setup
	@$(INSTALL_HAPROXY) || true
	$(PYTHON) -m client_tests.compat.venv
	$(PYTHON) -m pytest client_tests/compat $(COMPAT_ARGS)

# 32 clients (HTTP and gRPC) for 60 s against a fresh server; prints the report, fails on loss/5xx/RSS growth.
SOAK_ARGS ?= --clients 32 --duration 60
soak: setup
	$(PYTHON) -m bench.load.soak --model-repository $(MODEL_REPOSITORY) $(SOAK_ARGS)

# Kernel + served benchmark, the front door's and the HTTP API's cost (bench/api_cost.py); not part of
# the tests: table on stdout, bench/results/latest.json, ratios.png and the figures of bench/plots.py.
# matplotlib comes from the `bench` extra, installed here only.
# perf_analyzer 2.51 (Triton's C++ load generator) drives the served points: its binary ships in the
# tritonclient==2.51.0 wheel (the server's line; later wheels dropped it), installed without its Python
# dependencies into a venv of its own so the project's newer tritonclient (BF16 via ml_dtypes) stays;
# it needs libcudart.so.12 (nvidia-cuda-runtime-cu12, found by bench/perf_analyzer.py) and
# libb64.so.0d (Debian libb64-0d). Where any of it is missing, bench/ uses its Python load generator.
PA_VENV := $(VENV)/perf-analyzer
bench: setup
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install --quiet -e '.[bench]'
	@test -x $(PA_VENV)/bin/perf_analyzer || { $(SYSTEM_PYTHON) -m venv $(PA_VENV) && \
	  $(PA_VENV)/bin/pip install --quiet --no-deps tritonclient==2.51.0 'nvidia-cuda-runtime-cu12>=12,<13'; } || \
	  echo "note: perf_analyzer not installed; the served points use the Python load generator"
	@ldconfig -p 2>/dev/null | grep -q libb64.so.0d || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq libb64-0d >/dev/null; } ; } || \
	  echo "note: libb64-0d not installed; the served points use the Python load generator"
	$(PYTHON) -m bench.run $(BENCH_ARGS)

# Mutation testing of plugin/sampling/ and plugin/generation/ against their unit tests (mutmut, from the
# `mutate` extra, installed here only): kill rate, survivors and the reviewed equivalent mutants in
# bench/results/mutation.md (tests/mutation/). Hours on two cores: run before a release, not in CI.
# MUTATE_ARGS="--modules sampling/sampler.py generation/engine.py" narrows the run; after adding
# tests, MUTATE_ARGS=--rerun-survivors runs only the last run's survivors against them.
MUTATE_ARGS ?=
mutate: setup
	$(PYTHON) -c "import mutmut" 2>/dev/null || $(PYTHON) -m pip install --quiet -e '.[mutate]'
	nice -n 19 $(PYTHON) -m tests.mutation.mutate $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
