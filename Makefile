# Two commands: `make run` trains the built-in default, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: run test install install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null

# Torch first, pinned to the CPU build; GPU users: `make TORCH_SPEC=torch install`
# or preinstall their own build into .venv.
install: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e .

# Test extras: `vllm` is vLLM's CPU build, so the vLLM backend's tests run for real
# (tests/vllm_backend). The index's torchvision / torchaudio / torchcodec wheels it pulls are
# CUDA builds that fail to load and break `import vllm` and transformers' model imports; nothing
# here uses them, so each one that does not import is removed. Without vLLM
# (`make test TEST_EXTRAS=test`, e.g. on a CUDA torch) those tests skip; .ci/run checks that
# path in a second venv (`VENV=.venv-novllm`).
TEST_EXTRAS ?= test,vllm

install-test: install
	$(BIN)/pip install -e ".[$(TEST_EXTRAS)]"
	for p in torchvision torchaudio torchcodec; do \
	  $(BIN)/python -c "import $$p" 2>/dev/null || $(BIN)/pip uninstall -y -q $$p 2>/dev/null || true; done

run: install
	$(BIN)/hybridrl train $(ARGS)

# The suite on pytest-xdist workers, one per core (at most 8), each pinned to its cores
# (tests/conftest.py: torch's spinning OpenMP threads must not share a core); tests that
# cannot run beside each other (vLLM tensor parallel, Ray) take a host-wide lock.
# PYTEST_WORKERS=0: one process, in order.
PYTEST_WORKERS ?= auto

test: install-test
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 8 $(PYTEST_ARGS)

# Every benchmark once (--quick; BENCH_ARGS="--full", "--only masks,packing", ...), then one
# table of that run: bench_out/README_table.md (benchmarks/report.py).
BENCH_ARGS ?=

bench: install
	$(BIN)/pip install -e ".[bench]"
	$(BIN)/python benchmarks/report.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs
