"""Which thread steps the engine: one decode step of the trained model, stepped on the thread that built it or on
another one (what ``AsyncLLM`` does with an engine built elsewhere).

Each way runs in a fresh process, so no OpenMP thread team is left over from another:

* ``main``: built and stepped on the main thread (``LLM.generate``'s case);
* ``other``: built on the main thread, stepped on a second thread (``AsyncLLM(llm)``);
* ``same``: built and stepped on a second thread (``AsyncLLM(function)``, what ``kvpaging serve`` does).

At more than one torch thread libgomp keeps a team of worker threads per thread that ran a parallel operator; two
teams hold more OpenMP threads than a small machine has cores, and libgomp then lets idle workers spin only briefly,
so each small operator pays a wake-up. Prints the mean step (ms) of one greedy sequence, after two warm-up steps.

    OMP_NUM_THREADS=2 python benchmarks/engine_thread.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time


def steps(engine, tokens: int) -> float:
    """Mean seconds per step of one greedy request of ``tokens`` tokens, without its first two steps."""
    from kvpaging import SamplingParams

    engine.add_request("one", "Explain why the sky is blue in a few sentences.",
                       SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sum(times[2:]) / len(times[2:])


def one_way(way: str, dtype: str, tokens: int) -> float:
    from kvpaging import LLM

    def build():
        return LLM("smollm2", dtype=dtype, max_model_len=512).engine

    if way == "main":
        engine = build()
        steps(engine, tokens)  # a first request warms the caches
        return steps(engine, tokens)
    box = {}
    engine = build() if way == "other" else None

    def run():
        stepped = engine if engine is not None else build()
        steps(stepped, tokens)
        box["s"] = steps(stepped, tokens)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--way", choices=("main", "other", "same"), help=argparse.SUPPRESS)  # one way, in this process
    args = ap.parse_args()
    if args.way:
        print(f"{one_way(args.way, args.dtype, args.tokens) * 1e3:.2f}")
        return
    import torch

    print(f"trained model, {args.dtype}, {torch.get_num_threads()} torch thread(s); ms per decode step of one sequence")
    for way, what in (("main", "built and stepped on the main thread"),
                      ("other", "built on the main thread, stepped on another"),
                      ("same", "built and stepped on another thread")):
        out = subprocess.run([sys.executable, __file__, "--way", way, "--dtype", args.dtype,
                              "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        print(f"  {what:<48} {out.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
