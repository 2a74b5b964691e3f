"""Per-step host overhead: scheduler + block manager + input preparation, with no model.

The engine's real Scheduler, BlockManager and input packing run exactly as in
serving; only the forward pass and sampler are replaced by random next tokens.
Prints microseconds per sequence-step, split into scheduling/bookkeeping and
input preparation.

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --block-size 256 --no-prefix-caching
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from kvpaging.block_manager import BlockManager
from kvpaging.model_runner import prepare_step_inputs
from kvpaging.sampling_params import SamplingParams
from kvpaging.scheduler import Scheduler
from kvpaging.sequence import Request


def run(args) -> dict:
    rng = random.Random(args.seed)
    longest = 2 * 1024 + 1
    num_blocks = args.max_num_seqs * (-(-longest // args.block_size)) + 16
    bm = BlockManager(num_blocks, args.block_size, enable_prefix_caching=not args.no_prefix_caching)
    sched = Scheduler(bm, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=longest + 1)
    system = [rng.randrange(32000) for _ in range(args.shared_prefix)]
    for i in range(args.requests):
        p = rng.randint(100, 1024)
        prompt = (system + [rng.randrange(32000) for _ in range(p)])[:p]
        params = SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0.0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params, arrival_time=0.0))
    tokens = [rng.randrange(32000) for _ in range(4096)]  # "sampled" tokens, drawn before timing
    t_sched = t_prep = 0.0
    seq_steps = steps = 0
    clock = time.perf_counter
    while sched.has_unfinished():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        prepare_step_inputs(out)
        t2 = clock()
        n, k = len(out.samples), steps % 2048
        sched.update(out, tokens[k : k + n] if k + n <= 4096 else tokens[:n])
        t3 = clock()
        t_sched += (t1 - t0) + (t3 - t2)
        t_prep += t2 - t1
        seq_steps += len(out.scheduled)
        steps += 1
    assert bm.stats().num_used_blocks == 0, "leak"
    return {"steps": steps, "seq_steps": seq_steps, "sched_us": t_sched / seq_steps * 1e6,
            "prep_us": t_prep / seq_steps * 1e6, "preemptions": sched.num_preemptions,
            "hit_rate": bm.stats().prefix_cache_hit_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=64)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs = [run(args) for _ in range(args.repeats + 1)][1:]  # the first run warms up
    r = runs[0]
    sched = statistics.median(x["sched_us"] for x in runs)
    prep = statistics.median(x["prep_us"] for x in runs)
    print(f"machine: {platform.machine()} python {platform.python_version()}")
    print(f"requests={args.requests} max_num_seqs={args.max_num_seqs} block_size={args.block_size} "
          f"prefix_caching={not args.no_prefix_caching} steps={r['steps']} sequence-steps={r['seq_steps']} "
          f"preemptions={r['preemptions']} prefix hit rate={r['hit_rate']:.3f}")
    print(f"scheduler + block manager: {sched:.3f} us per sequence-step")
    print(f"input preparation:         {prep:.3f} us per sequence-step")
    print(f"total host overhead:       {sched + prep:.3f} us per sequence-step (median of {args.repeats})")


if __name__ == "__main__":
    main()
