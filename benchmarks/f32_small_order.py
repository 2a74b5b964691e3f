"""How MKL sums a float32 product of a few rows: ``F.linear``'s bits against two candidate orders, row count by row count.

A float32 ``F.linear`` on the CPU is MKL's sgemm. ``kernels/cpu/linear_f32.c`` reproduces its products of 16 rows and
more (each output's inputs in equal runs, each run a chain of fused multiply-adds; ``f32_run_length`` finds the runs),
and the engine uses it only for sizes where it gave ``F.linear``'s bits. Below 16 rows MKL runs other code. For each
float32 linear shape of the trained model (outputs x inputs), at each row count from 1 to 16, on random inputs,
this prints whether every element of ``F.linear(x, w)`` equals

* ``runs``: ``linear_f32.c`` with the run length found at 16 rows (the order the engine uses today), and
* ``lanes``: the inputs in 16 lanes (input ``k`` in lane ``k mod 16``), each lane a chain of fused multiply-adds
  from zero in input order, then the lanes added as ``s_i = ((l_i + l_{i+4}) + l_{i+8}) + l_{i+12}`` for ``i`` = 0..3
  and the result ``(s_0 + s_1) + (s_2 + s_3)``: what a kernel that runs one output's inputs along an AVX-512
  register computes when it folds the register's four 128-bit quarters onto the first, then adds that quarter's
  pairs. Emulated here in numpy (each fused multiply-add in float64, where the product is exact, then rounded to
  float32: a double rounding could differ in a rare case, and would show as a mismatch);
* ``4 lanes``: ``linear_f32_lanes.c`` (each product rounded, then added in four lanes of inputs, folded as
  ``(l_0 + l_2) + (l_1 + l_3)``, after a head that reaches the inputs' 16-byte alignment, for one row the weights'),
  for every row below four, else for the rows past the last group of four, the others in ``runs`` (what MKL does at
  two threads on an AVX2-only AMD EPYC; the order that machine's probes found, benchmarks/RESULTS.md).

    python benchmarks/f32_small_order.py --threads 1
    python benchmarks/f32_small_order.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from kvpaging.kernels import cpu
from kvpaging.kernels.cpu.layers import f32_run_length

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # q/o, k/v, gate/up, down (outputs, inputs)


def lanes_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The ``lanes`` candidate for one row ``x`` [k] and a weight ``w`` [n, k]: [n] float32."""
    k = x.shape[0]
    wide = w.astype(np.float64)
    lanes = []
    for lane in range(16):
        acc = np.zeros(w.shape[0], np.float32)
        for i in range(lane, k, 16):
            acc = (acc.astype(np.float64) + wide[:, i] * np.float64(x[i])).astype(np.float32)  # a fused multiply-add
        lanes.append(acc)
    quarters = []
    for i in range(4):
        s = lanes[i]
        for j in (4, 8, 12):
            s = s + lanes[i + j]  # float32 + float32: one rounding
        quarters.append(s)
    return (quarters[0] + quarters[1]) + (quarters[2] + quarters[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit(f"the C kernels cannot be built here: {cpu.unavailable_reason()}")
    g = torch.Generator().manual_seed(args.seed)
    print(f"machine: {platform.machine()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("rows | " + " | ".join(f"{n} x {k}: runs, lanes, 4 lanes" for n, k in SHAPES))
    weights = [torch.randn(n, k, generator=g) for n, k in SHAPES]
    packed = [cpu.f32_pack(w) for w in weights]
    runs = []
    for w, p in zip(weights, packed):
        x16 = torch.randn(16, w.shape[1], generator=g)
        runs.append(f32_run_length(x16, p, F.linear(x16, w)))
    for rows in range(1, args.max_rows + 1):
        cells = []
        for w, p, kc in zip(weights, packed, runs):
            x = torch.randn(rows, w.shape[1], generator=g)
            own = F.linear(x, w)
            by_runs = bool(kc) and torch.equal(cpu.f32_linear_unchecked(x, p, w.shape[0], kc), own)
            by_lanes = all(np.array_equal(lanes_order(x[r].numpy(), w.numpy()), own[r].numpy()) for r in range(rows))
            split = rows - rows % 4
            by_four = False
            if rows % 4 and (not split or kc):  # the first rows in runs (any), the rest in four lanes
                four = (cpu.f32_lanes_unchecked(x, w, -1 if rows == 1 else -2) if not split  # the engine's two paths
                        else cpu.f32_linear_unchecked(x, p, w.shape[0], kc, rows - split, -2))
                by_four = torch.equal(four, own)
            cells.append(", ".join(f"{'yes' if v else 'no':>3}" for v in (by_runs, by_lanes, by_four)))
        print(f"{rows:4d} | " + " | ".join(f"{c:>31}" for c in cells))
    print("(runs found at 16 rows: " + ", ".join(f"{n} x {k}: {kc or 'none'}" for (n, k), kc in zip(SHAPES, runs)) + ")")


if __name__ == "__main__":
    main()
