"""A float32 decode step's linear products: MKL's (``F.linear``) against the C products, weights from memory.

The trained model's float32 decode step reads every linear weight once (538 MB for SmolLM2-135M). This times the
products of one step at given row counts both ways: ``F.linear`` (Intel MKL's sgemm in torch's x86 wheels) on the
weight as ``nn.Linear`` keeps it, and the engine's float32 layers (``kernels/cpu/layers.py``): ``linear_f32.c``
(each output's inputs in MKL's runs, on the weight laid out once as blocks of 16 outputs) and, for up to three rows,
``linear_f32_lanes.c`` (MKL's lanes, on the weight as it is), by the plan the engine finds for each shape and row
count on its first product (``_f32_check``; where none gives ``F.linear``'s bits the layer runs ``F.linear`` itself,
and the line says so). The weights are the model's shapes (q, k and v, o, gate and up, down, for each of 30 layers,
and the 49,152 x 576 LM head), random, 30 distinct copies, so every product reads its weight from memory as in a
step. The two run in turns, ``--repeats`` rounds; medians are printed with the bytes per second.

    OMP_NUM_THREADS=1 python benchmarks/f32_linear.py --threads 1
    OMP_NUM_THREADS=2 python benchmarks/f32_linear.py --threads 2 --rows 1 2 3 5 16 48 128
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from kvpaging.kernels.cpu import layers as cpu_layers

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
    linears = []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        cpu_layers._give_f32_forward(linear)  # the engine's float32 forward (the C products where exact)
        linears.append(linear)
    total = sum(w.numel() * 4 for w in weights)
    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{len(weights)} products, {total / 1e6:.0f} MB of float32 weights a step")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}

        def mkl():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def c_product():
            for linear in linears:
                linear(xs[linear.in_features])

        with torch.no_grad():
            c_product()  # each shape's first product at this row count: checked, its plan kept
            plans = {(n, k): cpu_layers._f32_rows[(n, k, args.threads, rows)]
                     for n, k in {tuple(w.shape) for w in weights}}
            times = {"MKL (F.linear)": [], "C": []}
            mkl()
            for _ in range(args.repeats):
                for name, fn in (("MKL (F.linear)", mkl), ("C", c_product)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        exact = "every shape" if all(plans.values()) else "F.linear kept for " + ", ".join(
            f"{n} x {k}" for (n, k), plan in sorted(plans.items()) if not plan)
        kinds = sorted({"runs" if plan[1] == rows else "lanes" if not plan[1] else "runs + lanes"
                        for plan in plans.values() if plan})
        line = ", ".join(f"{name} {statistics.median(t) * 1e3:6.1f} ms ({total / statistics.median(t) / 1e9:4.1f} GB/s)"
                         for name, t in times.items())
        print(f"{rows:4d} rows (C where exact: {exact}; {'/'.join(kinds) or '-'}): {line}")


if __name__ == "__main__":
    main()
