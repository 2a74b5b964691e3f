"""A float32 decode step's linear products: MKL's (``F.linear``) against ``linear_f32.c``, weights from memory.

The trained model's float32 decode step reads every linear weight once (538 MB for SmolLM2-135M). This times the
products of one step at given row counts both ways: ``F.linear`` (Intel MKL's sgemm in torch's x86 wheels) on the
weight as ``nn.Linear`` keeps it, and ``kernels/cpu/linear_f32.c`` on the weight laid out once as blocks of 16
outputs, summing each output's inputs in MKL's runs (its run length for each shape found here as the engine finds
it, ``kernels/cpu/layers.py``). The weights are the model's shapes (q, k and v, o, gate and up, down, for each of 30
layers, and the 49,152 x 576 LM head), random, 30 distinct copies, so every product reads its weight from memory as
in a step. The two run in turns, ``--repeats`` rounds; medians are printed with the bytes per second, and whether
the C product gave ``F.linear``'s bits at that row count (the engine uses it only where it does).

    OMP_NUM_THREADS=1 python benchmarks/f32_linear.py --threads 1
    OMP_NUM_THREADS=2 python benchmarks/f32_linear.py --threads 2 --rows 16 48 128
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from kvpaging.kernels.cpu import f32_linear_unchecked, f32_pack
from kvpaging.kernels.cpu.layers import f32_run_length

LAYERS = 30
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # q k v o gate up down
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) for _ in range(LAYERS) for shape in SHAPES]
    weights.append(torch.randn(HEAD, generator=g))
    packed = [f32_pack(w) for w in weights]
    total = sum(w.numel() * 4 for w in weights)
    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{len(weights)} products, {total / 1e6:.0f} MB of float32 weights a step")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}
        runs = {}
        for w, p in zip(weights, packed):
            if tuple(w.shape) not in runs:
                x = xs[w.shape[1]]
                runs[tuple(w.shape)] = f32_run_length(x, p, F.linear(x, w))  # as the engine searches for it
        exact = all(runs.values())
        kcs = {shape: kc or min(384, shape[1]) for shape, kc in runs.items()}  # timed either way

        def mkl():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def c_product():
            for w, p in zip(weights, packed):
                f32_linear_unchecked(xs[w.shape[1]], p, w.shape[0], kcs[tuple(w.shape)])

        times = {"MKL (F.linear)": [], "linear_f32.c": []}
        mkl(), c_product()
        for _ in range(args.repeats):
            for name, fn in (("MKL (F.linear)", mkl), ("linear_f32.c", c_product)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        line = ", ".join(f"{name} {statistics.median(t) * 1e3:6.1f} ms ({total / statistics.median(t) / 1e9:4.1f} GB/s)"
                         for name, t in times.items())
        print(f"{rows:4d} rows (F.linear's bits: {'yes' if exact else 'no'}): {line}")


if __name__ == "__main__":
    main()
