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

install-test: install
	$(BIN)/pip install -e ".[test]"

run: install
	$(BIN)/hybridrl train $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	mkdir -p bench_out
	$(BIN)/pip install -e ".[bench]"
	for b in benchmarks/[a-z]*.py; do $(BIN)/python $$b --quick --json bench_out/$$(basename $$b .py).json || exit 1; done

clean:
	rm -rf $(VENV) runs
