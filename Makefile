# Two commands for a fresh machine: `make demo` and `make test` (each creates .venv if missing).
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build on a CPU-only machine.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test lint clean

$(BIN)/.rxf-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.rxf-installed

demo: install
	$(BIN)/rxf chat examples/demo.toml "What is the capital of France?"

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check rxf tests

clean:
	rm -rf $(VENV) .pytest_cache
