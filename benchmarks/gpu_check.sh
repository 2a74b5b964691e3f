#!/usr/bin/env bash
# One GPU check, run from anywhere on a CUDA machine:
#
#   bash benchmarks/gpu_check.sh
#
# 1. the kernel tests, compiled for the GPU (TRITON_INTERPRET unset);
# 2. the kernel benchmark (benchmarks/kernels.py), about 2 minutes on an H200;
# 3. end-to-end: throughput vs transformers, CUDA graphs eager vs captured, FP8 accuracy.
#
# Results and logs go to $OUT (set by the device runner; default ./benchmarks/out).
# Nothing is downloaded: the machine must already have torch, triton,
# transformers and pytest. Only this repository is installed, without
# dependencies, so that kernels/ becomes importable as kvpaging.kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PS4='+ [$(date +%H:%M:%S) ${SECONDS}s] '   # every traced command shows the clock and elapsed time
set -x

# --- the interpreter and its packages, checked in a subprocess -----------------------
"$PYTHON" - <<'EOF'
import sys
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}")
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device")
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
import pytest  # noqa: F401  (the tests need it)
EOF

# --- make kvpaging.kernels importable -------------------------------------------------
# pyproject maps the folder kernels/ to kvpaging.kernels, which only an install
# knows about. An editable install without dependencies and without build
# isolation needs no network; if it fails anyway, fall back to a shadow package
# of symlinks on PYTHONPATH.
if ! "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip_install.log" 2>&1; then
    cat "$OUT/pip_install.log"
    SHADOW="$(mktemp -d)"
    mkdir "$SHADOW/kvpaging"
    for entry in kvpaging/*; do ln -s "$PWD/$entry" "$SHADOW/kvpaging/"; done
    ln -s "$PWD/kernels" "$SHADOW/kvpaging/kernels"
    ln -s "$PWD/visualizers" "$SHADOW/kvpaging/visualizers"
    export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import kvpaging.kernels as k; print('kvpaging.kernels from', k.__file__, 'triton ok:', k.triton_available())"

# --- 1. kernel tests, compiled -----------------------------------------------------------
# A failure is reported at the end; the benchmark still runs, so that one (costly)
# GPU session brings back everything.
tests_rc=0
"$PYTHON" -m pytest tests/test_kernels_reference.py tests/test_kernels_triton.py tests/test_cuda_graphs.py \
    tests/test_engine_triton.py -q -rs --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log" || tests_rc=$?

# --- 2. kernel benchmark -------------------------------------------------------------------
"$PYTHON" benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.md"

# --- 3. end-to-end: throughput, CUDA graphs, FP8 accuracy on a real-shaped model --------
# Each stage has its own time limit so one slow stage cannot eat the whole session.
timeout 150 "$PYTHON" benchmarks/throughput.py --device cuda --dtype bfloat16 --model Qwen3-0.6B \
    --requests 256 --min-prompt 64 --max-prompt 512 --min-output 32 --max-output 256 --hf-batch-size 32 \
    --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.md" || echo "throughput benchmark failed or timed out"
timeout 90 "$PYTHON" benchmarks/cuda_graphs.py --model Qwen3-0.6B --batches 1 8 64 2>&1 \
    | tee "$OUT/cuda_graphs.md" || echo "cuda graphs benchmark failed or timed out"
timeout 60 "$PYTHON" benchmarks/soak.py --device cuda --attention-backend triton --requests 3000 2>&1 \
    | tail -5 | tee "$OUT/soak_triton.md" || echo "triton soak failed or timed out"
timeout 90 "$PYTHON" benchmarks/fp8_accuracy.py --model Qwen3-8B --layers 8 --device cuda --dtype bfloat16 2>&1 \
    | tee "$OUT/fp8_accuracy.md" || echo "fp8 accuracy benchmark failed or timed out"

set +x
echo "gpu_check.sh: done in ${SECONDS}s; results in $OUT"
if [ "$tests_rc" -ne 0 ]; then
    echo "gpu_check.sh: the kernel tests FAILED (exit $tests_rc), see $OUT/kernel_tests.log"
fi
exit "$tests_rc"
