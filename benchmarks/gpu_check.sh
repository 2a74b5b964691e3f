#!/usr/bin/env bash
# The GPU check, as two device calls of under 5 minutes each; each is useful alone.
#
#   bash benchmarks/gpu_check.sh kernels      # 1. kernel + engine tests compiled for the GPU, the kernel
#                                             #    benchmark, the sm_90 compile report with this machine's triton
#   bash benchmarks/gpu_check.sh end-to-end   # 2. throughput vs transformers, CUDA graphs, the Triton soak,
#                                             #    FP8 accuracy on a real shape, then as many lessons as time allows
#   bash benchmarks/gpu_check.sh              # both, one after the other (on a machine of your own)
#
#   REHEARSE=1 bash benchmarks/gpu_check.sh kernels      # on a CPU, before any GPU is touched
#   REHEARSE=1 bash benchmarks/gpu_check.sh end-to-end
#
# A rehearsal runs every stage on the CPU at toy sizes: the same setup, the same commands and
# arguments, the same bundle. The kernel tests run under the interpreter, and the kernel
# benchmark compiles every one of its cases for sm_90 under the stand-in GPU of
# kvpaging.kernels.compile_check (benchmarks/kernels.py --rehearse). Only the launches, and so
# the timings, are missing.
#
# What comes back: $OUT/gpu_check_<part>.txt (the summary: one line per stage, then the tail of
# each log) and $OUT/gpu_check_<part>.tar.gz (every log, JSON and JUnit file): two files per
# call, where a device call brings back at most 8.
#
# Time: every stage has a limit, and the call a budget (BUDGET_S, default 280 s). A stage gets
# the smaller of its limit and the time left; one that would start with under 15 s left
# (MIN_STAGE_S) is skipped and listed, so the bundle is always written. The kernel benchmark stops starting new
# cases before its limit and writes what it measured.
#
# Nothing is installed or downloaded. kvpaging is put on the path as a folder of links
# (kvpaging/, with kernels/ and visualizers/ inside, as pyproject.toml maps them) instead of
# `pip install -e .`, which needs setuptools >= 77 for this pyproject. Every command runs from
# an empty working folder with absolute paths, so the repository root, whose ./kvpaging has no
# kernels/, is never first on sys.path. The machine must already have torch, triton,
# transformers and pytest (nbval for the lessons).
set -uo pipefail

PART="${1:-all}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$PART" = "all" ]; then
    bash "$0" kernels; first=$?
    bash "$0" end-to-end; second=$?
    exit $(( first || second ))
fi
case "$PART" in
    kernels|end-to-end) ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [kernels|end-to-end]" >&2; exit 2 ;;
esac

OUT="${OUT:-$REPO/benchmarks/out}"
PYTHON="${PYTHON:-python3}"
REHEARSE="${REHEARSE:-0}"
BUDGET_S="${BUDGET_S:-280}"
RESERVE_S=10            # kept back for bundling
MIN_STAGE_S="${MIN_STAGE_S:-15}"  # a stage that would get less than this is skipped
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_${PART}.XXXXXX")"
mkdir -p "$WORK/logs" "$WORK/run"
SUMMARY="$WORK/logs/summary.txt"
DEADLINE=$(( SECONDS + BUDGET_S ))
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
failed=0

note() { echo "$*" | tee -a "$SUMMARY"; }

bundle() {
    {
        echo
        echo "=== the last lines of each log ==="
        for log in "$WORK"/logs/*.log; do
            [ -e "$log" ] || continue
            echo "--- $(basename "$log")"
            tail -n 12 "$log"
        done
    } >>"$SUMMARY"
    cp "$SUMMARY" "$OUT/gpu_check_$PART.txt"
    tar -czf "$OUT/gpu_check_$PART.tar.gz" -C "$WORK" logs
    rm -rf "$WORK"
    echo "gpu_check.sh $PART: done in ${SECONDS} s; $OUT/gpu_check_$PART.txt and .tar.gz"
}
trap bundle EXIT

# stage NAME LIMIT_S COMMAND...: run COMMAND (from $WORK/run) for at most LIMIT_S seconds,
# or the time left if less; its output goes to logs/NAME.log.
stage() {
    local name=$1 limit=$2; shift 2
    local left=$(( DEADLINE - SECONDS - RESERVE_S ))
    if [ "$left" -lt "$MIN_STAGE_S" ] && [ "$name" != environment ]; then
        note "$name: SKIPPED, ${left} s of the budget left"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS rc=0
    echo "[$(date +%H:%M:%S) ${SECONDS}s] $name (limit ${limit} s): $*"
    (cd "$WORK/run" && timeout --kill-after=5 "$limit" "$@") >"$WORK/logs/$name.log" 2>&1 || rc=$?
    local took=$(( SECONDS - start )) status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMED OUT"; failed=1
    elif [ "$rc" -ne 0 ]; then
        status="FAILED (exit $rc)"; failed=1
    fi
    note "$name: $status in ${took} s (limit ${limit} s)"
    tail -n 4 "$WORK/logs/$name.log" | sed 's/^/    /'
}

note "gpu_check.sh $PART, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET_S} s$([ "$REHEARSE" = 1 ] && echo ', REHEARSAL on the CPU')"
note "repository $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"

# --- kvpaging on the path, without pip -----------------------------------------------------
SITE="$WORK/site"
mkdir -p "$SITE/kvpaging"
for entry in "$REPO"/kvpaging/*; do ln -s "$entry" "$SITE/kvpaging/"; done
ln -s "$REPO/kernels" "$SITE/kvpaging/kernels"
ln -s "$REPO/visualizers" "$SITE/kvpaging/visualizers"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# --- the interpreter, its packages, the device ---------------------------------------------
stage environment 60 "$PYTHON" - "$REHEARSE" "$SITE" <<'EOF'
import importlib.util, os, platform, shutil, subprocess, sys
rehearse, site = sys.argv[1] == "1", sys.argv[2]
import torch, triton, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPUs")
for name in ("pytest", "nbval", "hypothesis"):
    print(f"{name}: {'yes' if importlib.util.find_spec(name) else 'MISSING'}")
import kvpaging, kvpaging.kernels as k
print("kvpaging from", kvpaging.__file__, "| Triton kernels usable here:", k.triton_available())
if not kvpaging.__file__.startswith(site):
    sys.exit(f"kvpaging was imported from {kvpaging.__file__}, not from the linked folder {site}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}: {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
              f"{p.multi_processor_count} SMs")
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
elif not rehearse:
    sys.exit("torch sees no CUDA device (REHEARSE=1 runs the check on a CPU)")
EOF
if ! grep -q "^environment: ok" "$SUMMARY"; then
    note "the environment is not usable; nothing else runs"
    exit 1
fi

if [ "$REHEARSE" = 1 ]; then INTERPRET=(env TRITON_INTERPRET=1); else INTERPRET=(env); fi
JOBS=$(( $(nproc) > 8 ? 8 : $(nproc) ))

if [ "$PART" = kernels ]; then
    # 1. the kernel tests, the engine on the Triton backend, CUDA graphs: compiled on the GPU
    #    (interpreted in a rehearsal: conftest.py turns the interpreter on when there is no GPU)
    stage kernel_tests 110 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/logs/kernel_tests.xml" \
        "$REPO/tests/test_kernels_triton.py" "$REPO/tests/test_kernels_reference.py" \
        "$REPO/tests/test_engine_triton.py" "$REPO/tests/test_cuda_graphs.py" \
        "$REPO/tests/test_state_layers.py::test_triton_kernels_and_an_fp8_cache_on_a_hybrid_model" \
        "$REPO/tests/test_layer_groups.py::test_triton_kernels_and_an_fp8_cache"
    # 2. the kernel benchmark; it stops starting cases 15 s before its limit and writes what it measured
    if [ "$REHEARSE" = 1 ]; then BENCH=(--rehearse); else BENCH=(); fi
    left=$(( DEADLINE - SECONDS - RESERVE_S )); limit=$(( left < 120 ? left : 120 ))
    stage kernel_benchmark 120 "$PYTHON" "$REPO/benchmarks/kernels.py" --out "$WORK/logs/kernels.json" \
        --time-limit $(( limit > 30 ? limit - 15 : 15 )) ${BENCH[@]+"${BENCH[@]}"}
    # 3. registers, spills and shared memory for sm_90, compiled by this machine's triton
    stage compile_sm90 "$([ "$REHEARSE" = 1 ] && echo 150 || echo 90)" "$PYTHON" -m kvpaging.kernels.compile_check --jobs "$JOBS" --json "$WORK/logs/compile_sm90.json"
else
    if [ "$REHEARSE" = 1 ]; then
        DEVICE=cpu
        THROUGHPUT=(--device cpu --model tiny --requests 6 --min-prompt 8 --max-prompt 32 --min-output 4
                    --max-output 8 --hf-batch-size 3)
        GRAPHS=(--device cpu --model tiny --dtype float32 --batches 1 2 --prompt 16 --tokens 4)
        SOAK=(--requests 20 --solo-checks 2)
        FP8=(--model tiny --device cpu --sequences 2 --length 64)
        LESSONS="${LESSONS:-00_setup}"
    else
        DEVICE=cuda
        THROUGHPUT=(--device cuda --dtype bfloat16 --model Qwen3-0.6B --requests 128 --min-prompt 64 --max-prompt 512
                    --min-output 32 --max-output 256 --hf-batch-size 32)
        GRAPHS=(--model Qwen3-0.6B --batches 1 8 64)
        SOAK=(--device cuda --requests 1500)
        FP8=(--model Qwen3-8B --layers 8 --device cuda --dtype bfloat16)
        # the lessons with the most to show on a GPU first
        LESSONS="${LESSONS:-08_cuda_graphs 09_fp8_kv_cache 01_decode_is_memory_bound 10_putting_it_together 04_paged_kv_cache 04b_paged_attention_kernel 06_continuous_batching 05_copy_on_write_and_grpo 07_scheduler_chunked_prefill_preemption 03_fragmentation_and_oom 02_kv_cache_math 00_setup}"
    fi
    stage throughput 75 "$PYTHON" "$REPO/benchmarks/throughput.py" "${THROUGHPUT[@]}" --json "$WORK/logs/throughput.json"
    stage cuda_graphs 50 "$PYTHON" "$REPO/benchmarks/cuda_graphs.py" "${GRAPHS[@]}"
    stage soak_triton 35 "${INTERPRET[@]}" "$PYTHON" "$REPO/benchmarks/soak.py" --attention-backend triton "${SOAK[@]}"
    stage fp8_accuracy 40 "$PYTHON" "$REPO/benchmarks/fp8_accuracy.py" "${FP8[@]}"
    # the lessons, one at a time, while the budget lasts (outputs are not compared: GPU numbers differ)
    for name in $LESSONS; do
        stage "lesson_$name" 90 "$PYTHON" -m pytest --nbval-lax --nbval-current-env -q -p no:cacheprovider \
            "$REPO/lessons/$name.ipynb"
    done
    note "device: $DEVICE"
fi

[ "$failed" -eq 0 ] || note "some stages FAILED or timed out: see above and the logs in the bundle"
exit "$failed"
