"""Helpers for lesson 05 (copy-on-write, parallel sampling for GRPO, prefix caching)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..sampling_params import SamplingParams

__all__ = ["ref_counts", "PeakWatcher", "SharingRun", "rollouts", "prefix_cache_demo"]


def ref_counts(block_manager, seq_ids) -> dict[int, int]:
    """Physical block id -> reference count, for the blocks in these sequences' tables (read from the pool)."""
    pool = block_manager.pool
    ids = sorted({b for s in seq_ids for b in block_manager.get_block_table(s)})
    return {b: pool.blocks[b].ref_cnt for b in ids}


class PeakWatcher:
    """An engine observer that keeps the largest figures seen in any step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.peak_used_blocks = 0
        self.peak_table_blocks = 0
        self.peak_savings_blocks = 0

    def __call__(self, record) -> None:
        st = self.engine.block_manager.stats()
        self.peak_used_blocks = max(self.peak_used_blocks, st.num_used_blocks)
        self.peak_table_blocks = max(self.peak_table_blocks, st.num_table_blocks)
        self.peak_savings_blocks = max(self.peak_savings_blocks, st.shared_savings_blocks)


@dataclass
class SharingRun:
    n: int
    shared: bool
    peak_used_blocks: int  # blocks actually held at the busiest step
    peak_table_blocks: int  # blocks the tables point at, counting a shared block once per table
    peak_savings_blocks: int  # max over steps of stats().shared_savings_blocks
    cow_copies: int
    outputs: list  # token id lists, one per completion
    trace: list


def rollouts(make_llm, prompt, n: int, shared: bool, max_tokens: int = 24, seed: int = 1,
             temperature: float = 0.8, use_tqdm: bool = False) -> SharingRun:
    """``n`` sampled completions of one prompt, measured.

    ``shared=True``: one request with ``SamplingParams(n=n)``; its completions
    fork from the prompt's blocks. ``shared=False``: ``n`` separate requests on
    an engine with prefix caching off, so each computes and stores the prompt
    itself. ``make_llm(enable_prefix_caching=...)`` builds a fresh engine.
    """
    llm = make_llm(enable_prefix_caching=shared)
    engine = llm.engine
    watcher = PeakWatcher(engine)
    engine.add_observer(watcher)
    engine.keep_trace, engine.trace = True, []
    if shared:
        params = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([prompt], params, use_tqdm=use_tqdm)
        completions = [c.token_ids for c in outs[0].outputs]
    else:
        params = [SamplingParams(temperature=temperature, seed=seed + k, max_tokens=max_tokens, ignore_eos=True)
                  for k in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=use_tqdm)
        completions = [o.outputs[0].token_ids for o in outs]
    engine.remove_observer(watcher)
    trace = list(engine.trace)
    engine.keep_trace = False
    return SharingRun(n, shared, watcher.peak_used_blocks, watcher.peak_table_blocks, watcher.peak_savings_blocks,
                      engine.block_manager.stats().num_cow_copies, completions, trace)


def prefix_cache_demo(llm, system_len: int = 96, num_users: int = 6, question_len: int = 12, max_tokens: int = 8,
                      seed: int = 0, vocab: int = 4000):
    """Requests sharing one system prompt, sent one after another; returns (prompts, stats after each).

    The first request computes the system prompt; each later one finds its
    full blocks in the prefix cache. ``stats`` is the cumulative
    ``KVCacheStats`` after each request, so the hit rate can be followed.
    """
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(num_users)]
    stats = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        llm.generate([p], params, use_tqdm=False)
        stats.append(llm.engine.block_manager.stats())
    return prompts, stats
