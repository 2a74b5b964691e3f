"""CPython 3.11's frame data stack, seen from Python: the cost of a call at each recursion depth, as the interpreter
does it and with the frame chunks kept (``kvpaging/worker/host_memory.py``'s ``keep_frame_chunks``).

A thread's frames live in chunks of a data stack; a chunk is freed as soon as the calls return below it, so a loop of
calls that each cross a chunk's end allocates and frees a chunk at every call (CPython issue gh-142183). By default
this calls a small function 200,000 times at every depth from 0 to 399 (and one frame deeper) and prints the depths
where it took over twice the median time (``tests/conftest.py`` keeps the chunks for the whole test session).
``--engine`` runs the engine's host path instead (the real ``Scheduler``, ``BlockManager`` and
``prepare_step_inputs`` over 200 decoding sequences, ``--steps`` steps, as
``benchmarks/host_overhead.py`` does with random tokens) at each depth from 0 to ``--deepest``, the fastest of
``--repeats`` runs at each (a shared machine only ever adds time), and prints its median time per sequence-step and
the depths over 1.2 times that.

Each depth runs as the interpreter does it and then with the chunks kept, one after the other (the process switches
its arena allocator between the two), so that a slow minute of a shared machine touches both alike.

    python benchmarks/frame_chunks.py
    python benchmarks/frame_chunks.py --engine
    python benchmarks/frame_chunks.py --trained 8 --shallowest 80 --deepest 140 --every 2
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import random
import statistics
import time

from kvpaging.worker import host_memory


def leaf(a, b, c, d, e, f, g, h):
    return a


def calls() -> float:
    start = time.perf_counter()
    for _ in range(200_000):
        leaf(1, 2, 3, 4, 5, 6, 7, 8)
    return time.perf_counter() - start


def host_path(steps: int):
    """A function timing ``steps`` steps of 200 decoding sequences through the scheduler, block manager and input
    preparation; it returns seconds of CPU time per sequence-step (the sequences made before it runs)."""
    from kvpaging.core.block_manager import BlockManager
    from kvpaging.core.scheduler import Scheduler
    from kvpaging.core.sequence import Request
    from kvpaging.sampling_params import SamplingParams
    from kvpaging.worker.model_runner import BlockTable, prepare_step_inputs

    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(100, 1000))] for _ in range(200)]
    tokens = [rng.randrange(32000) for _ in range(1000)]

    def run() -> float:
        bm = BlockManager(200 * 256, 16)
        sched = Scheduler(bm, max_num_seqs=256, max_num_batched_tokens=1 << 20, max_model_len=1 << 20)
        params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            sched.add_request(Request(f"r{i}", prompt, params, arrival_time=0.0))
        table = BlockTable()
        out = sched.schedule()  # the prompts, untimed
        table.apply(out.table_updates[0])
        sched.update(out, tokens[: len(out.samples)])
        start = time.process_time()
        for k in range(steps):
            out = sched.schedule()
            table.apply(out.table_updates[0])
            prepare_step_inputs(out, [table.array])
            sched.update(out, tokens[k % 800 : k % 800 + len(out.samples)])
        return (time.process_time() - start) / (steps * len(prompts))

    return run


def trained_model(num_requests: int, max_tokens: int):
    """A function timing ``LLM.generate`` over ``num_requests`` chat requests to the trained model (wall-clock
    seconds, one torch thread); the engine made and warmed up before it runs."""
    import torch
    from transformers import AutoTokenizer

    from kvpaging import SamplingParams
    from kvpaging.models import load_trained_model
    from kvpaging.models.trained_model import trained_path
    from kvpaging.teach import serving

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(trained_path("smollm2"))
    work = serving.make_chat_workload(tokenizer, num_requests, max_tokens=max_tokens)
    llm = serving.kvpaging_llm(load_trained_model("smollm2"), work, tokenizer=tokenizer, cpu_fast_layers=None)
    prompts = [{"prompt_token_ids": p} for p, _ in work.requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for _, n in work.requests]

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return run


def at(depth: int, pad: int, work) -> float:
    if depth:
        return at(depth - 1, pad, work)
    if pad:  # one small frame more: the leaf's frame lands elsewhere in the chunk
        return at(0, pad - 1, work)
    return work()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="store_true", help="the engine's host path instead of a plain call")
    ap.add_argument("--steps", type=int, default=60, help="with --engine: steps timed at each depth")
    ap.add_argument("--trained", type=int, default=0, metavar="N", help="N chat requests to the trained model instead")
    ap.add_argument("--max-tokens", type=int, default=32, help="with --trained: the most tokens each answer gets")
    ap.add_argument("--shallowest", type=int, default=0, help="with --engine or --trained: the shallowest depth")
    ap.add_argument("--deepest", type=int, default=160, help="with --engine or --trained: the deepest depth")
    ap.add_argument("--every", type=int, default=1, help="with --engine or --trained: the step between depths")
    ap.add_argument("--repeats", type=int, default=3,
                    help="with --engine or --trained: runs at each depth (the fastest counts)")
    args = ap.parse_args()
    get, put = ctypes.pythonapi.PyObject_GetArenaAllocator, ctypes.pythonapi.PyObject_SetArenaAllocator
    interpreters = host_memory._ArenaAllocator()
    get(ctypes.byref(interpreters))
    if not host_memory.keep_frame_chunks():
        raise SystemExit("the frame chunks cannot be kept here (see host_memory.keep_frame_chunks)")
    keeping = host_memory._ArenaAllocator()
    get(ctypes.byref(keeping))
    if args.engine or args.trained:
        run = trained_model(args.trained, args.max_tokens) if args.trained else host_path(args.steps)
        work, pads, limit = lambda: min(run() for _ in range(args.repeats)), (0,), 1.2
        depths = range(args.shallowest, args.deepest + 1, args.every)
        at(0, 0, work)  # warm up
    else:
        work, depths, pads, limit = calls, range(400), (0, 1), 2.0
    times: dict[str, list[tuple[str, float]]] = {"as the interpreter does it": [], "frame chunks kept": []}
    before = host_memory.frame_chunks_reused()
    for depth in depths:
        for pad in pads:
            for allocator, name in ((interpreters, "as the interpreter does it"), (keeping, "frame chunks kept")):
                put(ctypes.byref(allocator))
                times[name].append((f"{depth}+{pad}" if len(pads) > 1 else str(depth), at(depth, pad, work)))
    put(ctypes.byref(keeping))
    print(f"Python {platform.python_version()}, {platform.machine()}; frame chunks served again by the kept ones: "
          f"{host_memory.frame_chunks_reused() - before:,}")
    for name, measured in times.items():
        median = statistics.median(t for _, t in measured)
        what = (f"{median:.3f} s per generate" if args.trained else f"{median * 1e6:.3f} us per sequence-step"
                if args.engine else f"200,000 calls take {median * 1e3:.1f} ms")
        print(f"{name}: {what} at the median depth; depths over {limit} times that (depth, times the median):")
        print(f"  {[(depth, round(t / median, 2)) for depth, t in measured if t > limit * median]}")


if __name__ == "__main__":
    main()
