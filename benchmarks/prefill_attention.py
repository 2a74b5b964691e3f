"""The cpu backend's two prefill attentions, one chunk at a time: the C kernel against the torch backend's SDPA call.

For each (context, queries) shape one sequence's chunk of ``queries`` tokens at the end of ``context`` cached tokens
(after a cached prefix, the kernel's case) is attended by ``kernels/cpu/prefill_attention.c`` (whatever the limit
below says) and by
``torch_backend.paged_prefill_attention``, the trained model's heads (9 query heads, 3 KV heads of 64), the best of
``--repeats`` calls each. Where the C kernel is the faster decides ``cpu_backend.PREFILL_C_MAX_PAIRS``: a chunk of at
most that many query-key pairs goes to C, a larger one to SDPA.

    python benchmarks/prefill_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

SHAPES = ((128, 32), (300, 64), (256, 128), (512, 64), (1024, 128), (1024, 512), (2048, 512), (2048, 1024),
          (4096, 512), (4096, 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvpaging.kernels import cpu_backend, torch_backend
    from kvpaging.kernels.testing import cu_seqlens, random_paged_kv

    print(f"machine: {platform.machine()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for context, queries in SHAPES:
            kv = random_paged_kv([context], 3, 64, 16, dtype=dtype, generator=gen)
            cu = cu_seqlens([queries])
            query = torch.randn(9, queries, 64, generator=gen).to(dtype).transpose(0, 1)
            call = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
            best = []
            routed = "C" if queries * context <= cpu_backend.PREFILL_C_MAX_PAIRS[dtype] else "SDPA"
            limits = dict(cpu_backend.PREFILL_C_MAX_PAIRS)
            cpu_backend.PREFILL_C_MAX_PAIRS[dtype] = queries * context  # the C kernel, whatever the limit says
            try:
                for fn in (cpu_backend.paged_prefill_attention, torch_backend.paged_prefill_attention):
                    fn(*call)
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        fn(*call)
                        times.append(time.perf_counter() - start)
                    best.append(min(times) * 1e3)
            finally:
                cpu_backend.PREFILL_C_MAX_PAIRS.update(limits)
            print(f"{name:8} context {context:5d}, {queries:5d} queries ({queries * context:9,d} pairs): C kernel "
                  f"{best[0]:7.2f} ms, the torch backend's SDPA {best[1]:7.2f} ms ({best[0] / best[1]:.2f}x); the cpu "
                  f"backend takes {routed}")


if __name__ == "__main__":
    main()
