"""Kernel benchmark: how close each paged-KV kernel comes to the GPU's memory bandwidth.

Decode attention is limited by reading the KV cache, so its yardstick is the
device's copy bandwidth, measured in the same run with a large device-to-device
copy: achieved bytes/s divided by copy bytes/s is the "% of copy" column. A
kernel near 100% cannot get much faster; far below it is launch-, latency- or
occupancy-bound. Prefill attention is limited by arithmetic, so it reports
TFLOP/s, next to torch's own fused causal attention on the same shapes.

    python benchmarks/kernels.py --out benchmarks/out/kernels.json

CUDA only (the CPU interpreter says nothing about speed), except for a rehearsal:

    python benchmarks/kernels.py --rehearse --out /tmp/kernels.json

runs every case on the CPU under the stand-in GPU of ``kvpaging.kernels.compile_check``:
each kernel is compiled for sm_90 with the very arguments the timed run would pass,
nothing is launched or timed. Decode runs at batch
1, 8, 64 and 256 with contexts 512, 4k and 16k, GQA 8:1 (32 query heads, 4 KV
heads), head dim 128, block size 16, in bf16 and FP8; combinations whose one
layer of K+V cache exceeds ``--max-cache-gib`` are skipped and listed. About
two minutes on an H100/H200.

How it measures (see docs: GUIDE "Measuring"):
* medians of many runs timed with CUDA events, after warm-up;
* the L2 cache is flushed before every timed run (an H200 has 50 MB of L2,
  enough to hold a small decode's whole cache and fake a huge bandwidth);
* decode runs as the engine runs it, replayed from a CUDA graph, so Python
  launch overhead is not counted; prefill runs eagerly, as in the engine;
* random data everywhere, never zeros (zeros can compress and make a kernel
  look faster than it is).

Every case runs on its own: one that fails (out of memory, a kernel error) is
listed under ``errors`` and the rest still run, and ``--time-limit`` stops
starting new cases in time to write the results of those that ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch

LAYOUT = dict(num_heads=32, num_kv_heads=4, head_dim=128, block_size=16)
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 4096, 16384)
PREFILL_CASES = (  # (context already cached, new chunk length)
    (0, 512),
    (0, 2048),
    (0, 8192),
    (14336, 2048),  # the last chunk of a 16k prompt in chunked prefill
)
FP8 = torch.float8_e4m3fn


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/out/kernels.json", help="where to write the JSON results")
    p.add_argument("--iters", type=int, default=30, help="timed runs per measurement (median reported)")
    p.add_argument("--max-cache-gib", type=float, default=4.0,
                   help="skip decode cases whose one-layer K+V cache is larger than this")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no new case after this, so the results of those that ran are written")
    p.add_argument("--rehearse", action="store_true",
                   help="on a CPU: compile every case for sm_90 under the stand-in GPU, launch and time nothing")
    return p.parse_args()


# --- running cases one at a time -----------------------------------------------------

DEVICE = "cuda"  # "cpu" in a rehearsal
REHEARSAL = False


class Cases:
    """Runs each benchmark case on its own: a failure is recorded and the next case runs;
    past the deadline no new case starts."""

    def __init__(self, time_limit: float | None):
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self.errors: list[str] = []
        self.not_run: list[str] = []

    def run(self, label: str, fn):
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.not_run.append(label)
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any failure of one case is a finding, not the end
            message = f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"  ERROR {message}", flush=True)
            traceback.print_exc(limit=3)
            self.errors.append(message)
            return None
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


# --- timing ------------------------------------------------------------------------


class Timer:
    """Median milliseconds of ``fn()`` over CUDA-event-timed runs, L2 flushed before each."""

    def __init__(self, iters: int):
        self.iters = iters
        if REHEARSAL:
            return
        # Writing a buffer larger than L2 evicts whatever the last run left there.
        self.flush_buffer = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, warmup: int = 3) -> float:
        if REHEARSAL:  # one call: it compiles (and records) the kernels; there is nothing to time
            fn()
            return float("nan")
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush_buffer.random_(0, 255)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def copy_bandwidth(timer: Timer) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (each byte read once and written once)."""
    if REHEARSAL:
        return float("nan")
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    src = dst = None  # the 4 GiB back before the kernels run (a lambda's names cannot be deleted)
    return 2 * 2 * 2**30 / (ms * 1e-3)


# --- test data ---------------------------------------------------------------------


def random_cache(num_blocks: int, dtype: torch.dtype):
    """One layer's K and V caches in ``dtype`` full of random numbers, and their
    FP8 scales (None for bf16). FP8 caches are quantized a slice at a time, so
    the float32 temporaries stay small."""
    shape = (num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    if REHEARSAL:  # nothing reads them: a few blocks of the right layout (the strides do not depend on the count)
        shape = (min(num_blocks, 8),) + shape[1:]
        scale = torch.ones(LAYOUT["num_kv_heads"]) if dtype == FP8 else None
        return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), scale, scale
    if dtype != FP8:
        return torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, dtype=dtype, device="cuda"), None, None
    from kvpaging.kernels import fp8

    caches, scales = [], []
    for _ in range(2):
        cache = torch.empty(shape, dtype=FP8, device="cuda")
        scale = torch.full((LAYOUT["num_kv_heads"],), 4.5 / fp8.FP8_MAX, device="cuda")  # randn stays within ~4.5
        for start in range(0, num_blocks, 4096):
            part = torch.randn((min(4096, num_blocks - start),) + shape[1:], device="cuda")
            cache[start : start + 4096] = fp8.quantize_fp8(part, scale)
        caches.append(cache)
        scales.append(scale)
    return caches[0], caches[1], scales[0], scales[1]


def scattered_block_tables(batch: int, blocks_per_seq: int, num_blocks: int) -> torch.Tensor:
    """Each sequence's blocks drawn from a random permutation of the pool, as after a long run."""
    if REHEARSAL:
        return torch.zeros(batch, blocks_per_seq, dtype=torch.int32)
    order = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per_seq]
    return order.reshape(batch, blocks_per_seq).to(torch.int32)


def cache_gib(batch: int, context: int, dtype: torch.dtype) -> float:
    element = 1 if dtype == FP8 else 2
    return 2 * batch * context * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * element / 2**30


# --- benchmarks --------------------------------------------------------------------


def bench_decode(timer, copy_bytes_per_s, max_cache_gib, cases):
    from kvpaging.kernels import paged_decode_attention
    from kvpaging.kernels.triton_decode_attention import choose_num_splits

    rows, skipped = [], []
    block_size, head_dim = LAYOUT["block_size"], LAYOUT["head_dim"]

    def one(dtype, batch, context, size):
        blocks_per_seq = context // block_size
        num_blocks = batch * blocks_per_seq + 1
        k_cache, v_cache, k_scale, v_scale = random_cache(num_blocks, dtype)
        tables = scattered_block_tables(batch, blocks_per_seq, num_blocks)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        query = torch.randn(batch, LAYOUT["num_heads"], head_dim, dtype=torch.bfloat16, device=DEVICE)

        def decode():
            return paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5,
                                          k_scale, v_scale)

        if REHEARSAL:
            ms = timer(decode)
        else:
            decode()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode()
            ms = timer(graph.replay)

        kv_bytes = size * 2**30
        other_bytes = 2 * query.numel() * query.element_size() + tables.numel() * 4
        achieved = (kv_bytes + other_bytes) / (ms * 1e-3)
        row = dict(
            dtype=dtype_name(dtype), batch=batch, context=context,
            num_splits=choose_num_splits(batch, LAYOUT["num_kv_heads"], blocks_per_seq, block_size, query.device),
            us=round(ms * 1e3, 1), GB_per_s=round(achieved / 1e9, 1),
            pct_of_copy=round(100 * achieved / copy_bytes_per_s, 1),
        )
        print_row("decode", row)
        return row

    for dtype in (torch.bfloat16, FP8):
        for context in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                size = cache_gib(batch, context, dtype)
                if size > max_cache_gib:
                    skipped.append(f"decode batch={batch} context={context} {dtype_name(dtype)} "
                                   f"({size:.1f} GiB > --max-cache-gib {max_cache_gib})")
                    continue
                row = cases.run(f"decode {dtype_name(dtype)} batch={batch} context={context}",
                                lambda: one(dtype, batch, context, size))
                if row is not None:
                    rows.append(row)
    return rows, skipped


def bench_prefill(timer, cases):
    from kvpaging.kernels import paged_prefill_attention
    import torch.nn.functional as F

    h, kvh, d, block_size = LAYOUT["num_heads"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"], LAYOUT["block_size"]

    def one(context, chunk):
        seq_len = context + chunk
        blocks = math.ceil(seq_len / block_size)
        k_cache, v_cache, _, _ = random_cache(blocks + 1, torch.bfloat16)
        tables = scattered_block_tables(1, blocks, blocks + 1)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
        query = torch.randn(chunk, h, d, dtype=torch.bfloat16, device=DEVICE)
        ms = timer(lambda: paged_prefill_attention(query, k_cache, v_cache, tables, cu, seq_lens, d**-0.5))

        # Query j sees context + j + 1 keys; two matmuls of 2 FLOPs per multiply-add.
        visible_pairs = chunk * context + chunk * (chunk + 1) // 2
        flops = 4 * visible_pairs * h * d
        row = dict(context=context, chunk=chunk, ms=round(ms, 3), TFLOP_per_s=round(flops / (ms * 1e-3) / 1e12, 1))

        if context == 0 and not REHEARSAL:  # torch's fused causal attention on contiguous K/V, for scale
            q = query.transpose(0, 1).unsqueeze(0)
            k = torch.randn(1, kvh, chunk, d, dtype=torch.bfloat16, device=DEVICE)
            v = torch.randn_like(k)
            try:
                sdpa_ms = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
                row["sdpa_TFLOP_per_s"] = round(flops / (sdpa_ms * 1e-3) / 1e12, 1)
            except (TypeError, RuntimeError) as exc:  # older torch without enable_gqa
                row["sdpa_TFLOP_per_s"] = f"n/a ({type(exc).__name__})"
        print_row("prefill", row)
        return row

    rows = [cases.run(f"prefill context={context} chunk={chunk}", lambda: one(context, chunk))
            for context, chunk in PREFILL_CASES]
    return [r for r in rows if r is not None]


def bench_store_kv(timer, copy_bytes_per_s, cases):
    from kvpaging.kernels import store_kv

    kvh, d, block_size = LAYOUT["num_kv_heads"], LAYOUT["head_dim"], LAYOUT["block_size"]
    num_tokens = 16384

    def one(dtype):
        num_blocks = 4 * num_tokens // block_size
        k_cache, v_cache, k_scale, v_scale = random_cache(num_blocks, dtype)
        key = torch.randn(num_tokens, kvh, d, dtype=torch.bfloat16, device=DEVICE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
        ms = timer(lambda: store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale))
        moved = 2 * key.numel() * (key.element_size() + k_cache.element_size()) + slots.numel() * 8
        achieved = moved / (ms * 1e-3)
        row = dict(dtype=dtype_name(dtype), tokens=num_tokens, us=round(ms * 1e3, 1),
                   GB_per_s=round(achieved / 1e9, 1), pct_of_copy=round(100 * achieved / copy_bytes_per_s, 1))
        print_row("store_kv", row)
        return row

    rows = [cases.run(f"store_kv {dtype_name(dtype)}", lambda: one(dtype)) for dtype in (torch.bfloat16, FP8)]
    return [r for r in rows if r is not None]


def bench_copy_blocks(timer, copy_bytes_per_s, cases):
    from kvpaging.kernels import copy_blocks

    def one():
        num_layers, num_pairs, num_blocks = 32, 256, 2048
        if REHEARSAL:  # the same block layout, fewer of everything
            num_layers, num_pairs, num_blocks = 2, 4, 8
        shape = (num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
        k_caches = [torch.randn(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(num_layers)]
        v_caches = [torch.randn(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(num_layers)]
        pairs = torch.randperm(num_blocks, device=DEVICE)[: 2 * num_pairs].reshape(num_pairs, 2)
        # (the wrapper reads the pairs on the host to refuse racing ones: counted, as the engine pays it too)
        ms = timer(lambda: copy_blocks(k_caches, v_caches, pairs))
        block_bytes = k_caches[0][0].numel() * k_caches[0].element_size()
        moved = 2 * num_layers * num_pairs * block_bytes * 2  # K and V, read and write
        achieved = moved / (ms * 1e-3)
        row = dict(layers=num_layers, pairs=num_pairs, us=round(ms * 1e3, 1), GB_per_s=round(achieved / 1e9, 1),
                   pct_of_copy=round(100 * achieved / copy_bytes_per_s, 1))
        print_row("copy_blocks", row)
        return row

    row = cases.run("copy_blocks", one)
    return [] if row is None else [row]


# --- reporting ---------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8 else str(dtype).removeprefix("torch.")


def print_row(kind, row):
    print(f"  {kind}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def fp8_speedups(decode_rows: list[dict], context: int) -> list[dict]:
    """bf16 time / fp8 time per batch size at one context length (2.0 = twice as fast)."""
    by_key = {(r["dtype"], r["batch"], r["context"]): r["us"] for r in decode_rows}
    out = []
    for batch in DECODE_BATCHES:
        bf16, fp8 = by_key.get(("bfloat16", batch, context)), by_key.get(("fp8", batch, context))
        if bf16 and fp8:
            out.append(dict(batch=batch, context=context, bf16_us=bf16, fp8_us=fp8, speedup=round(bf16 / fp8, 2)))
    return out


def main():
    args = parse_args()
    if args.rehearse:
        return rehearse(args)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py measures GPU kernels and needs a CUDA device; none found. "
                 "(On a CPU, the kernel tests run under TRITON_INTERPRET=1, which checks correctness, not speed; "
                 "--rehearse compiles every case for sm_90 without running it.)")
    props = torch.cuda.get_device_properties(0)
    device = dict(name=props.name, memory_gib=round(props.total_memory / 2**30), sms=props.multi_processor_count)
    return run_all(args, device)


def rehearse(args):
    """Every case, on the CPU, under the stand-in GPU: compiled for sm_90, never launched."""
    global DEVICE, REHEARSAL
    from kvpaging.kernels.compile_check import HOPPER, compile_only

    DEVICE, REHEARSAL = "cpu", True
    with compile_only(HOPPER) as stand_in:
        status = run_all(args, dict(name=f"rehearsal: stand-in {HOPPER.name}, nothing launched", memory_gib=0,
                                    sms=HOPPER.num_sms))
    kernels = sorted({(launch.kernel, launch.num_warps, launch.usage.registers, launch.usage.stack_bytes,
                       launch.shared_bytes) for launch in stand_in.launches})
    print(f"rehearsal: {len(stand_in.launches)} launches recorded, {len(kernels)} distinct compiled kernels "
          "(kernel, warps, registers, stack bytes, shared bytes):")
    for k in kernels:
        print("  ", k)
    return status


def run_all(args, device: dict) -> int:
    import triton

    torch.manual_seed(0)
    cases = Cases(args.time_limit)
    timer = Timer(args.iters)
    print(f"device: {device['name']}, {device['memory_gib']} GiB, {device['sms']} SMs")

    copy_bytes_per_s = copy_bandwidth(timer)
    print(f"device-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s")

    decode_rows, skipped = bench_decode(timer, copy_bytes_per_s, args.max_cache_gib, cases)
    speedups = fp8_speedups(decode_rows, 16384)
    prefill_rows = bench_prefill(timer, cases)
    store_rows = bench_store_kv(timer, copy_bytes_per_s, cases)
    copy_rows = bench_copy_blocks(timer, copy_bytes_per_s, cases)

    report = [
        f"## Kernel benchmark: {device['name']}",
        f"copy bandwidth {copy_bytes_per_s / 1e9:.0f} GB/s; layout {LAYOUT}",
        "\n### Decode (CUDA graph replay)\n" + markdown_table(decode_rows),
        "\n### FP8 vs bf16 decode at 16k context\n" + markdown_table(speedups),
        "\n### Prefill (bf16, batch 1)\n" + markdown_table(prefill_rows),
        "\n### store_kv\n" + markdown_table(store_rows),
        "\n### copy_blocks (bf16)\n" + markdown_table(copy_rows),
    ]
    if skipped:
        report.append("\nSkipped (over the memory cap):\n" + "\n".join(f"- {s}" for s in skipped))
    if cases.not_run:
        report.append(f"\nNot run (past --time-limit {args.time_limit} s):\n" + "\n".join(f"- {s}" for s in cases.not_run))
    if cases.errors:
        report.append("\nErrors:\n" + "\n".join(f"- {s}" for s in cases.errors))
    print("\n".join(report))

    results = dict(
        machine=dict(gpu=device["name"], sms=device["sms"], host=platform.node(),
                     python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                     cuda=torch.version.cuda),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([sys.executable, *sys.argv]),
        rehearsal=REHEARSAL,
        copy_GB_per_s=round(copy_bytes_per_s / 1e9, 1),
        layout=LAYOUT,
        decode=decode_rows, fp8_speedup_16k=speedups, prefill=prefill_rows,
        store_kv=store_rows, copy_blocks=copy_rows, skipped=skipped,
        not_run=cases.not_run, errors=cases.errors,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 1 if cases.errors else 0


if __name__ == "__main__":
    sys.exit(main())
