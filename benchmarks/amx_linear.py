"""A decode step's linear products on an AMX CPU: oneDNN's packed product against ``linear_amx.c``, weights from memory.

The trained model's decode step reads every linear weight once (269 MB in bfloat16 for SmolLM2-135M), so its
products take the weights' bytes over what one core reads. This times the products of one decode step at a given
number of rows, each engine's way: oneDNN on the weight packed once (``_reorder_linear_weight``, what the engine's
fast layers did before) and ``kernels/cpu/linear_amx.c`` on the weight laid out as the tile unit's tiles, in 2 MiB
pages where the system gives them (what they do now for up to 32 rows where the results are the same bits, which it
checks here too). The weights are the
model's shapes (its q/k/v and gate/up side by side, o, down, for each of 30 layers, and the 49,152 x 576 LM head),
random (only the shapes and the bytes matter), 30 distinct copies, so every product reads its weight from memory
as in a step. The two run in turns, ``--repeats`` rounds; the medians are printed, with each one's bytes per second
and the read bandwidth of one thread (``decode_step.py``'s sum over 1 GiB) beside them.

With ``--pages``, the tiles alone, twice: in torch's own memory (4 KiB pages) and copied into 2 MiB pages
(``kernels/cpu/huge_pages.py``, where the engine keeps them), in turns in one process; the copies are checked to give
the same bits.

    OMP_NUM_THREADS=1 python benchmarks/amx_linear.py --threads 1
    OMP_NUM_THREADS=2 python benchmarks/amx_linear.py --threads 2 --rows 1 16 32
    OMP_NUM_THREADS=1 python benchmarks/amx_linear.py --threads 1 --pages
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from decode_step import read_bandwidth

from kvpaging.kernels import cpu
from kvpaging.kernels.cpu.huge_pages import huge_pages_allowed, into_huge_pages
from kvpaging.kernels.cpu.layers import _onednn_product, _pack, onednn_usable

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # q/k/v side by side, o, gate/up side by side, down
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pages", action="store_true",
                    help="the tiles in 4 KiB pages against the same tiles in 2 MiB pages, instead of oneDNN against them")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (cpu.amx_ready() and onednn_usable()):
        raise SystemExit(f"needs a CPU with AMX and the C kernels (amx_ready: {cpu.amx_ready()}) and oneDNN "
                         f"(usable: {onednn_usable()})")
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append((torch.randn(*HEAD, generator=g) * 0.02).to(torch.bfloat16))
    tiles = [cpu.amx_pack(w) for w in weights]
    if args.pages:  # the engine's tiles (into_huge_pages) against the same in torch's memory
        if not huge_pages_allowed():
            raise SystemExit("this system gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage)")
        products = {"tiles, 4 KiB pages": tiles, "tiles, 2 MiB pages": into_huge_pages(tiles)}
    else:
        products = {"oneDNN (packed)": [_pack(w) for w in weights],
                    "linear_amx.c": into_huge_pages(tiles) if huge_pages_allowed() else tiles}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = read_bandwidth()
    print(f"machine: {platform.machine()} {platform.node()} | torch {torch.__version__} | {args.threads} thread(s) | "
          f"{len(weights)} products, {nbytes / 1e6:.0f} MB of bfloat16 weights a step | {args.threads} thread(s) read "
          f"{bandwidth / 1e9:.1f} GB/s (bytes floor {nbytes / bandwidth * 1e3:.1f} ms)")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        for w, t in zip(weights[:len(SHAPES)] + weights[-1:], tiles[:len(SHAPES)] + tiles[-1:]):
            x = xs[w.shape[1]]
            assert torch.equal(cpu.amx_linear(x, t), F.linear(x, w)), (rows, tuple(w.shape))

        def run(name):
            if name == "oneDNN (packed)":
                for w, packed in zip(weights, products[name]):
                    _onednn_product(xs[w.shape[1]], packed, None)
            else:
                for w, t in zip(weights, products[name]):
                    cpu.amx_linear_unchecked(xs[w.shape[1]], t)

        if args.pages:
            for w, a, b in zip(weights, *products.values()):
                assert torch.equal(cpu.amx_linear(xs[w.shape[1]], a), cpu.amx_linear(xs[w.shape[1]], b))
        times = {name: [] for name in products}
        for _ in range(args.repeats):
            for name in products:
                t0 = time.perf_counter()
                run(name)
                times[name].append(time.perf_counter() - t0)
        cells = [f"{name} {statistics.median(t) * 1e3:5.1f} ms ({nbytes / statistics.median(t) / 1e9:4.1f} GB/s)"
                 for name, t in times.items()]
        print(f"{rows:2d} rows (F.linear's bits: yes): " + ", ".join(cells))


if __name__ == "__main__":
    main()
