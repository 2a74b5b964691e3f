"""Every Triton kernel compiles for Hopper (sm_90) here, with no GPU, and fits it: no spills,
not at the 255-register limit, shared memory within an H100/H200 block's 227 KB.

The kernels are compiled through their real wrappers under a stand-in driver
(``kvpaging.kernels.compile_check``), in a process of its own: this test process
runs Triton in interpreter mode (``conftest.py``), and an interpreted kernel is
never compiled. About a minute on 2 cores; ``python -m kvpaging.kernels.compile_check --all``
runs the full matrix.
"""

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from kvpaging.kernels.compile_check import HOPPER, KernelReport, failures, max_threads_per_block

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kvpaging.kernels.compile_check", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-20000:])  # the table: shown with -s, and on failure
    if not out.exists():
        pytest.fail(f"the compile check wrote no report (exit {done.returncode}):\n{done.stderr[-5000:]}")
    return json.loads(out.read_text()), done


@needs_triton
def test_every_kernel_compiles_for_sm90_without_spills_or_too_much_shared_memory(report):
    data, done = report
    assert data["target"]["arch"] == 90
    assert data["failures"] == [], "\n".join(data["failures"]) + "\n\n" + done.stdout[-20000:]
    assert done.returncode == 0, done.stderr[-5000:]
    names = {k["kernel"] for k in data["kernels"]}
    assert names == {"store_kv_kernel", "decode_split_kernel", "decode_merge_kernel", "prefill_kernel",
                     "copy_blocks_kernel"}
    for k in data["kernels"]:
        assert k["shared_bytes"] <= HOPPER.max_shared_bytes and k["stack_bytes"] == 0, k


@needs_triton
def test_the_split_count_compiles_one_merge_kernel_per_power_of_two(report):
    """num_splits is a runtime argument of the merge: eager decode, whose split count follows the
    block table's width, compiles one merge per bucket 1, 2, 4, ... 64, not one per count."""
    data, _ = report
    merges = defaultdict(set)  # SPLITS_PAD -> distinct compiles, for one model shape and dtype
    counts = set()
    for k in data["kernels"]:
        configs = [c for c in k["configs"] if c.startswith("decode Qwen3-0.6B bf16 bs16 x1 ")]
        if k["kernel"] == "decode_merge_kernel" and configs:
            pad = dict(part.split("=") for part in k["constants"].split(", "))["SPLITS_PAD"]
            merges[pad].add(k["constants"])
            counts.update(configs)
    assert len(counts) >= 8, counts  # explicit splits 1, 2, 3, 4, 9, 16, 64 and several table widths
    assert all(len(compiles) == 1 for compiles in merges.values()), dict(merges)
    assert len(merges) <= 7


def test_the_stand_in_answers_like_the_driver():
    """Registers per thread -> the most threads a block may have (65,536 registers per SM, given out
    per warp in units of 256), as CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK would answer."""
    assert max_threads_per_block(32) == 1024
    assert max_threads_per_block(64) == 1024
    assert max_threads_per_block(128) == 512
    assert max_threads_per_block(255) == 256


def test_failures_flag_spills_the_register_limit_and_shared_memory():
    def kernel(**kw):
        fields = dict(kernel="k", constants="", num_warps=4, registers=100, stack_bytes=0, shared_bytes=1024,
                      configs=["decode x"], sixteen_bit=True)
        return KernelReport(**(fields | kw))

    assert failures([kernel()]) == []
    assert "spills" in failures([kernel(stack_bytes=8)])[0]
    assert "255-register" in failures([kernel(registers=255)])[0]
    assert "shared memory" in failures([kernel(shared_bytes=HOPPER.max_shared_bytes + 1)])[0]
    # float32 spills fail too, unless asked not to
    assert failures([kernel(stack_bytes=8, sixteen_bit=False)])
    assert failures([kernel(stack_bytes=8, sixteen_bit=False)], strict_fp32=False) == []
