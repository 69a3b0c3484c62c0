# batchgen: `make demo` installs and runs the main job on the embedded default model;
# `make test` runs the test suite (what .ci/run calls).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch: pinned to 2.13.0. On machines set up like our CI, pip takes its CPU build from
# local disk in seconds. On a GPU machine the same pin from PyPI is the CUDA build. For a
# CPU-only machine elsewhere pass TORCH_INDEX=<PyTorch's CPU wheel index> to skip the
# multi-GB CUDA download.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
PIP_TORCH_FLAGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
PYTEST_FLAGS ?=
# Test processes at once (pytest-xdist): CI's 2 cores; each test runs torch on one thread
TEST_WORKERS ?= 2

.PHONY: install demo test test-quick lint format bench gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_TORCH_FLAGS) "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(BIN)/batchgen run builtin:samples/prompts.parquet --output out/demo --id-column id --max-new-tokens 32
	@echo "batchgen is installed in $(BIN)/, not on PATH: run $(BIN)/batchgen (e.g." \
		"$(BIN)/batchgen report out/demo), or 'source $(BIN)/activate' first"

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_FLAGS)

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow and not slurm" $(PYTEST_FLAGS)

lint: install
	$(BIN)/ruff check batchgen tests scripts
	$(BIN)/ruff format --check batchgen tests scripts

format: install
	$(BIN)/ruff check --fix batchgen tests scripts
	$(BIN)/ruff format batchgen tests scripts

bench: install
	$(BIN)/python scripts/bench.py --workload mixed,labeling,long-tail --pairs 2 --out out/bench-cpu.json --markdown out/bench-cpu.md

gpu-check: install
	bash scripts/gpu_check.sh

clean:
	rm -rf out .pytest_cache

-include mk/pipeline.mk
