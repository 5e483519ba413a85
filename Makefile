# Set-up is idempotent: the venv is (re)built only when it is missing or pyproject.toml changed.
# The venv must come from the system interpreter: the Triton Python stub embeds its libpython.
SYSTEM_PYTHON ?= /usr/bin/python3
VENV := .venv
PYTHON := $(VENV)/bin/python
MODEL_REPOSITORY ?= model_repository
PYTEST_ARGS ?=

.PHONY: setup serve test soak bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# torch==2.13.0 pins the CPU wheel kept on these machines; elsewhere any torch>=2.4 will do.
	$(PYTHON) -m pip install --quiet torch==2.13.0 || $(PYTHON) -m pip install --quiet 'torch>=2.4'
	$(PYTHON) -m pip install --quiet -e '.[server,client,test,lint,generate]'
	touch $@

serve: setup
	exec $(PYTHON) -m triton_sampling_mask.ops.launcher --model-repository $(MODEL_REPOSITORY)

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# 32 clients (HTTP and gRPC) for 60 s against a fresh server; prints the report, fails on loss/5xx/RSS growth.
SOAK_ARGS ?= --clients 32 --duration 60
soak: setup
	$(PYTHON) -m triton_sampling_mask.ops.soak --model-repository $(MODEL_REPOSITORY) $(SOAK_ARGS)

# Kernel + served benchmark (not part of the tests): table on stdout, bench/results/latest.json and
# ratios.png. matplotlib comes from the `bench` extra, installed here only, not by `make setup`.
bench: setup
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install --quiet -e '.[bench]'
	$(PYTHON) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
