"""The engine's step time by how many sequences run, under the serving benchmark's arrivals, in-process.

``benchmarks/serving.py`` measures a server from outside (TTFT, TPOT). This replays the same workload straight into
an ``LLMEngine`` in this process, no server, no HTTP: the same 48 chats of the trained model through its chat
template, the same Poisson arrivals (``random.Random(seed)``, exponential gaps at ``--request-rate``), greedy, at most
``--output-len`` tokens each, after the same warm-up requests. Each request is added once its arrival time has
passed, between steps; the engine steps while it has work. It prints each step's wall time grouped by how many
sequences were running after it, so a step cost that depends on the batch size (a product kernel that is slow at
some row counts, say) shows where a server at that rate spends its time.

    OMP_NUM_THREADS=2 python benchmarks/serving_steps.py --dtype float32 --request-rate 1
"""

from __future__ import annotations

import argparse
import collections
import platform
import random
import statistics
import time

import torch

from serving import chat_requests  # benchmarks/serving.py: the same chats

from kvpaging import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True)
               for r in chat_requests(args.num_prompts, args.output_len)]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    for i in range(args.warmup):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": prompts[i]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    rng = random.Random(args.seed)
    gaps = [rng.expovariate(args.request_rate) for _ in prompts]
    steps = collections.defaultdict(list)  # sequences running after the step -> its seconds
    start, arrival, added = time.perf_counter(), 0.0, 0
    while added < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while added < len(prompts) and arrival <= now:
            engine.add_request(f"r{added}", {"prompt_token_ids": prompts[added]}, params)
            arrival += gaps[added]
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrival - now))
            continue
        t0 = time.perf_counter()
        engine.step()
        steps[len(engine.scheduler.running)].append(time.perf_counter() - t0)
    total = sum(len(v) for v in steps.values())
    print(f"machine: {platform.machine()} | torch {torch.__version__} | {torch.get_num_threads()} thread(s) | "
          f"{args.dtype} | {args.num_prompts} chats at {args.request_rate}/s: {time.perf_counter() - start:.1f} s, "
          f"{total} steps")
    for running in sorted(steps):
        times = steps[running]
        print(f"  {running:3d} running: {len(times):5d} steps, median {statistics.median(times) * 1e3:6.1f} ms, "
              f"mean {statistics.fmean(times) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
