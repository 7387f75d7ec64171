#!/usr/bin/env bash
# `make gpu-check`: everything that needs a GPU, in one run on a fresh machine without internet.
#   1. report what is there (GPU, python, torch, CuPy, nvcc, wheels carried in .whl/)
#   2. install torch (CUDA) / CuPy from .whl/ if missing, and the project itself (--no-deps)
#   3. compile every kernel (NVRTC, in parallel, warming CuPy's cache), run the GPU tests (the kernels,
#      the runner on CUDA against the CPU's, the sampler, the quantized linear), failing if any skips
#   4. the goals side by side (bench/gpu_bench.py): docs/gpu-check.json and a markdown table
# Results go to $OUT (or bench/results); each stage has its own time limit, the whole under 8 minutes.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
status=0
say() { echo "== $*" | tee -a "$LOG"; }
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log, remember failure
  local name=$1 limit=$2
  shift 2
  say "$name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "$name: rc=$rc in $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
}

say "environment"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
  echo "python: $($PY --version 2>&1) ($PY)"
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not found (CI compile test will skip)"
  ls -1 .whl/*.whl 2>/dev/null | sed 's/^/wheel: /' || true
  $PY - <<'EOF'
import importlib.metadata as md
for name in ("torch", "cupy-cuda12x", "cupy-cuda13x", "numpy", "pytest", "matplotlib"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: missing")
try:
    import torch
    print("torch cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
except Exception as e:
    print("torch import failed:", e)
EOF
} 2>&1 | tee -a "$LOG"

# Install from the carried wheels only (no index: the machine is offline).
need_torch=$($PY -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && echo no || echo yes)
if [ "$need_torch" = yes ] && ls .whl/torch-*.whl >/dev/null 2>&1; then
  stage "install torch from .whl" 300 $PY -m pip install --no-index --find-links .whl torch
fi
if ! $PY -c "import cupy" 2>/dev/null; then
  major=$($PY -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null || echo 12)
  if ls .whl/cupy_cuda${major}x-*.whl >/dev/null 2>&1; then
    stage "install cupy-cuda${major}x from .whl" 120 $PY -m pip install --no-index --find-links .whl "cupy-cuda${major}x"
  else
    say "no cupy-cuda${major}x wheel in .whl/; the CUDA kernels cannot load"
  fi
fi
# The project's other dependencies, where the machine lacks them: every wheel `make gpu-wheels` put in .whl/
# (without resolving: what the machine has already stays).
if ls .whl/*.whl >/dev/null 2>&1; then
  stage "install the carried wheels" 120 $PY -m pip install --quiet --no-index --no-deps --find-links .whl .whl/*.whl
fi
if ! $PY -c "import pagedserve.kernels.cuda_ops" 2>/dev/null; then
  stage "install pagedserve (no deps)" 120 $PY -m pip install --no-deps --no-build-isolation -e .
fi

# CuPy finds NVRTC through the loader path; torch's pip wheels bring it under site-packages/nvidia/*/lib.
NV_LIBS=$($PY -c "
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    dirs += glob.glob(os.path.join(sp, 'nvidia', '*', 'lib'))
print(':'.join(dirs))" 2>/dev/null)
export LD_LIBRARY_PATH="${NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$PWD/.cupy_cache}"

stage "kernel availability" 60 $PY -c "
from pagedserve.kernels import cuda_ops
cuda_ops._cupy()
import cupy; print('cupy', cupy.__version__, 'runtime', cupy.cuda.runtime.runtimeGetVersion())"

# (The nvcc compile test is the CI check and runs without a GPU; it is not repeated here.)
# The GPU tests: the kernels against the reference, the runner on CUDA against the CPU's, the sampler on
# CUDA, the quantized linear (its GEMM against a float64 oracle, a GPTQ checkpoint kept quantized). A skipped
# test counts as a failure here: a GPU check that skips (no CuPy, no device) proves nothing.
stage "GPU tests" 240 $PY -m pytest -q -p no:cacheprovider --maxfail 20 --timeout 220 -m cuda -rs \
  tests/test_kernels_cuda.py tests/test_cuda_runner.py tests/test_sampler.py tests/test_quant_cuda.py \
  --junitxml "$OUT_DIR/gpu_tests.xml"
stage "no GPU test skipped" 10 $PY -c '
import sys, xml.etree.ElementTree as ET
counts = [(int(s.get("tests", 0)), int(s.get("skipped", 0))) for s in ET.parse(sys.argv[1]).getroot().iter("testsuite")]
tests, skipped = sum(t for t, _ in counts), sum(s for _, s in counts)
print(f"{tests} GPU tests, {skipped} skipped")
sys.exit(1 if skipped or not tests else 0)' "$OUT_DIR/gpu_tests.xml"
# The goals side by side on a Llama-3-8B-shaped model: offline throughput against transformers, the single
# stream against its floor, the decode attention against the copy bandwidth, the served stack. It writes
# docs/gpu-check.json (commit it) and a markdown table, after each part.
stage "GPU goals" 330 $PY bench/gpu_bench.py --junit "$OUT_DIR/gpu_tests.xml" --json "$OUT_DIR/gpu-check.json" \
  --markdown "$OUT_DIR/gpu_bench.md"
cp "$OUT_DIR/gpu-check.json" docs/gpu-check.json 2>/dev/null || true
say "done: status=$status, results in $OUT_DIR (the full kernel sweep: make bench-kernels)"
exit $status
