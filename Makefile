# moestream: two set-up commands on a fresh machine (README): `make run` and `make test`.
# They create .venv with the pinned CPU builds (a bare `torch` requirement would pull a
# multi-GB CUDA build), the newest numpy the package allows.
#
# GPU machines (torch and triton preinstalled, nothing to download): `make test-gpu`,
# `make bench`, `make bench-one-gpu`, `make bench-gemm` run the project in place with the
# system python3; results update benchmarks/results/<machine>/*.jsonl.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_PINS := torch==2.13.0 triton==3.6.0 numpy==2.4.6
GPU_PY ?= python3
# the GEMM bench's variants (moestream.tools.bench_kernels.VARIANTS): what the layer runs in
# bf16, fp8 and fp4w
GEMM_VARIANTS ?= layer-call,fp8-layer-call,fp4w-layer-call
MOESTREAM := PYTHONPATH=$(CURDIR) $(GPU_PY) -m moestream.tools.cli
ONE_GPU_TOKENS ?= 1,8,64,512,2048,8192
ONE_GPU_DTYPES ?= bf16,fp8,fp4w

.PHONY: install run test test-gpu bench bench-one-gpu bench-gemm performance check clean

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

# the layer over every GPU of the machine: benchmarks/results/<machine>/ep.jsonl and ep.png
bench:
	$(MOESTREAM) bench

# the layer on one GPU (world size 1) at the one-GPU shapes: qwen3 (128 experts), mixtral (8),
# dsv3 and v4flash with 32 experts (one EP8 rank's share): <gpu>/layer.jsonl
bench-one-gpu:
	CUDA_VISIBLE_DEVICES=$${CUDA_VISIBLE_DEVICES:-0} $(MOESTREAM) bench --shapes qwen3,mixtral \
		--tokens $(ONE_GPU_TOKENS) --dtype $(ONE_GPU_DTYPES) --no-plot
	CUDA_VISIBLE_DEVICES=$${CUDA_VISIBLE_DEVICES:-0} $(MOESTREAM) bench --shapes dsv3,v4flash \
		--experts 32 --tokens $(ONE_GPU_TOKENS) --dtype $(ONE_GPU_DTYPES) --no-plot

# the grouped GEMMs as the layer launches them vs torch._grouped_mm: <gpu>/gemm.jsonl
bench-gemm:
	$(MOESTREAM) bench --virtual-ranks 1 --shapes dsv3,qwen3 --variants $(GEMM_VARIANTS)

# docs/performance.md and its plots, from the results files (no GPU)
performance: install
	$(PY) benchmarks/performance.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
