"""Where kvpaging's time goes on the throughput workload, and what bounds its ratio to static generate().

Runs the workload of ``throughput.py`` through kvpaging twice after a warm-up,
once plain, for the wall time, and once under ``torch.profiler``
(``kvpaging.teach.serving.time_breakdown``), which splits the time into the
model's linear layers (the matrix products every engine runs), paged attention,
other tensor ops, and Python/dispatch. It then measures the fixed cost of one
step (one request decoding alone, minus its linear layers), counts the token
positions each approach pushes through the model, and with ``--static`` times
transformers' static ``generate()`` on the same workload and prints the time a
given ratio would leave for everything but the linear layers and the fixed
per-step cost.

    python benchmarks/throughput_breakdown.py --threads 1 --static
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from throughput import TINY, build

from kvpaging.kernels.cpu.layers import onednn_linear, onednn_usable
from kvpaging.teach import serving


def make_llm(model, work, args):
    """A fresh engine for the workload; ``serving.time_breakdown`` warms it up on other prompts."""
    return serving.kvpaging_llm(model, work, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--static", action="store_true", help="also time transformers' static generate()")
    ap.add_argument("--repeats", type=int, default=3, help="plain runs of each engine; the median is used")
    ap.add_argument("--ratio", type=float, default=3.0, help="the ratio to static generate() to budget for")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    build_args = argparse.Namespace(model="tiny", layers=None, dtype="float32", device="cpu")
    model = build(build_args)
    work = serving.make_workload(args.requests, TINY["vocab_size"], (16, 256), (16, 128), seed=0)
    useful = work.num_output_tokens

    bd = serving.time_breakdown(make_llm(model, work, args), work, repeats=args.repeats)
    wall = bd.wall_s
    print(f"machine: {platform.machine()} | torch {torch.__version__} | {torch.get_num_threads()} torch threads")
    print(f"kvpaging: {useful} useful tokens in {wall:.3f} s = {useful / wall:,.0f} tok/s, {bd.steps} steps")
    for name, seconds in bd.rows():
        print(f"  {name:56s} {seconds:7.3f} s  {seconds / wall:6.1%}")

    # how fast the linear layers ran, against this core's matrix-product peak on a layer-sized product
    layer_weights = sum(m.weight.numel() for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    head = model.get_output_embeddings().weight
    cont, static = serving.token_positions(work, args.hf_batch_size)
    flops = 2 * layer_weights * cont + 2 * head.numel() * useful
    x, w = torch.randn(2048, head.shape[1]), torch.randn(4 * head.shape[1], head.shape[1])
    products = {"F.linear": lambda: torch.nn.functional.linear(x, w)}
    if onednn_usable():
        products["oneDNN"] = lambda: onednn_linear()(x, w, None, "none", [], "")
    peaks = []
    for name, product in products.items():
        product()
        t0 = time.perf_counter()
        for _ in range(10):
            product()
        peaks.append(f"{name} {10 * 2 * x.shape[0] * w.numel() / (time.perf_counter() - t0) / 1e9:.0f}")
    print(f"linear layers: {flops / 1e9:.1f} GFLOP at {flops / bd.linear_s / 1e9:.0f} GFLOP/s; one "
          f"[2048 x {head.shape[1]}] @ [{head.shape[1]} x {w.shape[0]}] product runs at "
          f"{', '.join(peaks)} GFLOP/s here")

    # the fixed cost of a step: one request decoding alone, without its (tiny) linear layers
    one = serving.time_breakdown(make_llm(model, work, args), serving.Workload([([7] * 16, 128)]))
    fixed = (one.wall_s - one.linear_s) / one.steps
    floor = bd.linear_s + fixed * bd.steps
    print(f"fixed cost of a step (1 request decoding alone, without its linear layers): {fixed * 1e3:.2f} ms "
          f"x {bd.steps} steps = {fixed * bd.steps:.3f} s")
    print(f"linear layers + fixed step cost: {floor:.3f} s, i.e. at most {useful / floor:,.0f} tok/s "
          "with free attention and no per-sequence work")
    print(f"token positions through the model: kvpaging {cont:,}, static generate() in batches of "
          f"{args.hf_batch_size}: {static:,} ({static / cont:.2f}x)")
    if args.static:
        static_model = build(build_args)
        static_s = statistics.median(serving.run_static_generate(static_model, work, batch_size=args.hf_batch_size).seconds
                                     for _ in range(args.repeats))
        rate = useful / static_s
        budget = useful / (args.ratio * rate)
        print(f"static generate(): {rate:,.0f} tok/s, so kvpaging ran at {useful / wall / rate:.2f}x; "
              f"{args.ratio:g}x would be {args.ratio * rate:,.0f} tok/s = {budget:.3f} s for the workload")
        print(f"time {args.ratio:g}x leaves for attention and per-sequence work after the linear layers and the "
              f"fixed step cost: {budget - floor:+.3f} s (this run spent {wall - floor:.3f} s on them)")


if __name__ == "__main__":
    main()
