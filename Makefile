# One-command set-up: `make demo` and `make test` create .venv when missing,
# install the pinned CPU build of torch and the package with its test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckptstore-installed

.PHONY: setup test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The integrations extra (ckptstore.integrations), torch kept at 2.13.0;
	# DS_BUILD_OPS=0: DeepSpeed compiles no op at install (the tests switch its JIT comm op off)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[integrations]' torch==2.13.0
	$(PY) -m pip check
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/ckptstore demo

bench: setup
	$(PY) -m benchmarks.save_load

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
