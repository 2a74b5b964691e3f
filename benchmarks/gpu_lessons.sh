#!/usr/bin/env bash
# Run every lesson on a CUDA machine (the real-shaped-model branch of kvpaging.teach.pick_model),
# as a second device call after benchmarks/gpu_check.sh when device time remains:
#
#   bash benchmarks/gpu_lessons.sh
#
# Executes each notebook with nbval (outputs not compared: GPU numbers differ from the CPU ones
# committed) and writes a log per notebook under $OUT. Nothing is downloaded; needs nbval and
# ipykernel on the machine (pip install --no-deps nbval if missing and a wheel is at hand).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
unset TRITON_INTERPRET
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip_install_lessons.log" 2>&1 || true
status=0
for nb in lessons/[0-9]*.ipynb; do
    name=$(basename "$nb" .ipynb)
    start=$SECONDS
    timeout 120 "$PYTHON" -m pytest --nbval-lax --nbval-current-env -q -p no:cacheprovider "$nb" \
        >"$OUT/lesson_$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/lessons_summary.txt"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
