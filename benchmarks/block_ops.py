"""Host cost of the block manager alone, driven with the pattern of a serving run.

No model: each running sequence gets a random next token every step, exactly the
calls an engine makes (admit with a prefix-cache lookup, one decode slot per step,
cache full blocks, free at the end). Prints microseconds per sequence-step.

    python benchmarks/block_ops.py                      # 512 requests, block size 16
    python benchmarks/block_ops.py --block-size 256 --requests 1024
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from kvpaging import BlockManager


def make_workload(num_requests: int, seed: int, shared_prefix: int):
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(shared_prefix)]
    reqs = []
    for _ in range(num_requests):
        prompt_len = rng.randint(100, 1024)
        own = [rng.randrange(32000) for _ in range(max(0, prompt_len - shared_prefix))]
        reqs.append((system[:prompt_len] + own, rng.randint(100, 1024)))
    return reqs


def run(reqs, block_size: int, max_running: int, caching: bool, seed: int) -> tuple[float, int, dict]:
    rng = random.Random(seed)
    # the "sampled" tokens are drawn before timing, so the loop times bookkeeping, not the RNG
    outputs = [[rng.randrange(32000) for _ in range(n)] for _, n in reqs]
    longest = max(len(p) + n for p, n in reqs)
    num_blocks = max_running * (-(-longest // block_size)) + 16  # never preempts: we time bookkeeping only
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    waiting = list(range(len(reqs)))
    waiting.reverse()
    running: list[int] = []
    tokens: dict[int, list[int]] = {}
    remaining: dict[int, int] = {}
    seq_steps = 0
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < max_running:  # admit: one whole-prompt prefill each
            rid = waiting.pop()
            prompt, max_tokens = reqs[rid]
            toks = list(prompt)
            hit = bm.lookup_prefix(toks)
            assert bm.allocate_sequence(rid, len(toks) - hit.num_cached_tokens, hit)
            bm.cache_full_blocks(rid, toks, len(toks))
            out = outputs[rid]
            toks.append(out[0])  # the token sampled from the prefill
            tokens[rid], remaining[rid] = toks, max_tokens - 1
            running.append(rid)
            seq_steps += 1
        still = []
        for rid in running:  # one decode step for every running sequence
            toks = tokens[rid]
            if remaining[rid] == 0:  # finished: blocks go back at once
                bm.free(rid)
                continue
            bm.append_slots(rid, 1)
            bm.cache_full_blocks(rid, toks, len(toks))
            left = remaining[rid]
            toks.append(outputs[rid][-left])
            remaining[rid] = left - 1
            seq_steps += 1
            still.append(rid)
        running = still
    elapsed = time.perf_counter() - t0
    s = bm.stats()
    assert s.num_used_blocks == 0, "leak"
    return elapsed, seq_steps, {"hit_rate": s.prefix_cache_hit_rate, "evictions": s.num_evictions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--shared-prefix", type=int, default=64, help="system-prompt tokens shared by every request")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = make_workload(args.requests, args.seed, args.shared_prefix)
    per_step = []
    for r in range(args.repeats + 1):
        elapsed, steps, extra = run(reqs, args.block_size, args.max_running, not args.no_prefix_caching, args.seed)
        if r:  # the first run warms up
            per_step.append(elapsed / steps * 1e6)
    print(f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(
        f"requests={args.requests} block_size={args.block_size} max_running={args.max_running} "
        f"prefix_caching={not args.no_prefix_caching} sequence-steps={steps} "
        f"prefix hit rate={extra['hit_rate']:.3f}"
    )
    print(
        f"block manager: {statistics.median(per_step):.3f} us per sequence-step "
        f"(median of {args.repeats}; min {min(per_step):.3f}, max {max(per_step):.3f})"
    )


if __name__ == "__main__":
    main()
