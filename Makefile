# moestream: two set-up commands on a fresh machine (README): `make run` and `make test`.
# They create .venv with the pinned CPU builds: a bare `torch` requirement would pull a
# multi-GB CUDA build. numpy stays below 2.3 because Triton 3.6's interpreter converts
# one-element arrays to Python ints, which numpy 2.3 turned into an error.
#
# GPU machines (torch and triton preinstalled, nothing to download): `make test-gpu`,
# `make bench`, `make bench-gemm` run the project in place with the system python3.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_PINS := torch==2.13.0 triton==3.6.0 numpy==2.2.6
GPU_PY ?= python3
RESULTS ?= benchmarks/results
# the GEMM bench's variants (moestream.bench_kernels.VARIANTS); layer-call: what the layer runs
GEMM_VARIANTS ?= layer-call

.PHONY: install run test test-gpu bench bench-gemm check clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(CPU_PINS)
	$(PY) -m pip install -q -e ".[test,hf]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/moestream run

# Two workers: CI's machine has 2 cores and the interpreter tests are single-threaded.
# loadgroup: the sm_90 compile file (one ~5-minute fixture) runs whole, first, on one worker.
test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup

check: install
	$(VENV)/bin/moestream check

# ---- GPU machine (in place, no installs) --------------------------------------------------
# One GPU's tests in GPU_WORKERS pytest-xdist workers where xdist is installed (most of their
# time is Triton compiling on the CPU), then the multi-GPU tests one at a time.
GPU_WORKERS ?= 8
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -m "gpu and not multigpu" tests \
		$$($(GPU_PY) -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS)")
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -m multigpu tests

bench:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m moestream.cli bench --out $(RESULTS)/ep_h200x2.jsonl \
		--plot $(RESULTS)/ep_h200x2.png

bench-gemm:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m moestream.cli bench --virtual-ranks 1 --shapes dsv3,qwen3 \
		--variants $(GEMM_VARIANTS) --out $(RESULTS)/gemm_h200.jsonl

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
