"""What one all-reduce costs: the price tensor parallelism pays twice per layer.

N processes (the same fork server and gloo/NCCL process groups the engine uses) all-reduce a
``[tokens, hidden]`` tensor many times; rank 0 reports the median and 90th percentile, and
what that means per step of a model with ``--layers`` layers (2 all-reduces per layer + 1 for
the embedding). Compare it with the time a step computes to see when splitting a model pays.

    python benchmarks/tp_allreduce.py --ranks 2 --hidden 576 --tokens 1 16 256
    python benchmarks/tp_allreduce.py --ranks 2 --device cuda --hidden 4096 --tokens 1 256 2048   # 2 GPUs
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist


def measure(rank: int, ranks: int, port: int, device: str, hidden: int, tokens: list[int], iters: int,
            dtype: str) -> list[tuple[int, float, float]]:
    from kvpaging.distributed.tensor_parallel import _make_groups

    torch.set_num_threads(1)
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = _make_groups(dev, store, rank, ranks)[1]  # the group the model's all-reduces use
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, dtype=getattr(torch, dtype), device=dev)
        for _ in range(10):
            group.allreduce([x]).wait()
        times = []
        for _ in range(iters):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            group.allreduce([x]).wait()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        rows.append((n, statistics.median(times), times[int(0.9 * len(times))]))
    return rows


def worker(rank, ranks, port, device, hidden, tokens, iters, dtype):
    measure(rank, ranks, port, device, hidden, tokens, iters, dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=576, help="the model's hidden size (SmolLM2-135M: 576)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256], help="tokens in the step")
    ap.add_argument("--layers", type=int, default=30, help="to report the cost per step (SmolLM2-135M: 30)")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()

    from kvpaging.distributed.tensor_parallel import _worker_context

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = _worker_context()
    procs = [ctx.Process(target=worker, daemon=True, args=(r, args.ranks, store.port, args.device, args.hidden,
                                                             args.tokens, args.iters, args.dtype))
             for r in range(1, args.ranks)]
    for p in procs:
        p.start()
    rows = measure(0, args.ranks, store.port, args.device, args.hidden, args.tokens, args.iters, args.dtype)
    for p in procs:
        p.join()
    print(f"{args.ranks} ranks, {args.device}, {'nccl' if args.device == 'cuda' else 'gloo'}, "
          f"[tokens, {args.hidden}] {args.dtype}, {args.iters} all-reduces each")
    per_step = 2 * args.layers + 1
    for n, median, p90 in rows:
        print(f"tokens {n:5d}: median {median * 1e6:8.1f} us, p90 {p90 * 1e6:8.1f} us; "
              f"x{per_step} per step ({args.layers} layers) = {median * per_step * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
