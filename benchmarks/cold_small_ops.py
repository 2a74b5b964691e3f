"""Why a small operation costs more inside a decode step than on its own: the weights just read evict its code and data.

A decode step reads every weight of the model once, a few megabytes per matrix product, more than a core's L2
cache holds. So the operations that follow a product (a norm, an add, the attention's Python) find the interpreter's,
torch's and their own code and data gone from the nearby caches, and pay for bringing them back. This times a few
small operations on their own (the same call again and again: everything stays close) and right after a bfloat16
product on packed weights of the trained model's sizes (each call after its own product, the products' weights
taken in turn so that none stays cached), at one and 48 rows::

    OMP_NUM_THREADS=2 python benchmarks/cold_small_ops.py --threads 2

The engine's answer is to make fewer, larger calls after each product (``kernels/cpu``: a whole RMSNorm in one C
call, the residual add with it, the keys' store and the attention in two calls a layer): what is paid per call is
paid less often.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpaging.kernels import cpu


def timed(op, before, repeats: int) -> float:
    """Median seconds of ``op()``, each call right after ``before(i)`` (untimed)."""
    times = []
    for i in range(repeats):
        before(i)
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pointwise = torch.ops.mkldnn._linear_pointwise.default
    g = torch.Generator().manual_seed(0)
    # the trained model's largest per-layer product (gate and up, 2 x 1536 x 576) and its smallest (576 x 576)
    for out_features in (3072, 576):
        weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_features, 576, generator=g).bfloat16(), 64)
                   for _ in range(16)]
        megabytes = out_features * 576 * 2 / 1e6
        for rows in (1, 48):
            x = torch.randn(rows, 576, generator=g).bfloat16()
            small = torch.randn(rows, 576, generator=g).bfloat16()
            norm_weight = torch.randn(576, generator=g).bfloat16()
            ops = {"a tiny add (4 x 4, float32)": lambda t=torch.ones(4, 4): t.add(1),
                   f"an add of two [{rows}, 576] bfloat16": lambda: small.add(small),
                   f"a C RMSNorm of [{rows}, 576] bfloat16": lambda: cpu.rms_norm(small, norm_weight, 1e-5)}
            for name, op in ops.items():
                alone = timed(op, lambda i: None, args.repeats)
                after = timed(op, lambda i: pointwise(x, weights[i % len(weights)], None, "none", [], ""), args.repeats)
                print(f"{name:40s} alone {alone * 1e6:6.1f} us   after a {megabytes:.1f} MB product of {rows:2d} rows "
                      f"{after * 1e6:6.1f} us   ({after / alone:.1f}x)")


if __name__ == "__main__":
    main()
