# Set-up and tests. `make install` once, then `make test` (everything) or `make test-fast`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast run clean

install:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,plot]'

test:
	$(BIN)/python -m pytest -q

test-fast:
	$(BIN)/python -m pytest -q -m "not slow"

run:
	$(BIN)/hybridflow run graphs/grpo.yaml

clean:
	rm -rf runs .pytest_cache
