"""Helpers for lesson 05 (copy-on-write, parallel sampling for GRPO, prefix caching)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpaging.engine.row_sampling import completion_seed
from kvpaging.sampling_params import SamplingParams

__all__ = [
    "ref_counts",
    "preview",
    "completion_seed",
    "PeakWatcher",
    "SharingRun",
    "rollouts",
    "PrefixRequest",
    "prefix_cache_run",
    "prefix_cache_demo",
    "GRPOStepMemory",
    "grpo_step_blocks",
    "grpo_step_memory",
    "peak_blocks_figure",
    "grpo_memory_figure",
    "ttft_figure",
]


def ref_counts(block_manager, seq_ids) -> dict[int, int]:
    """Physical block id -> reference count, for the blocks in these sequences' tables (read from the pool)."""
    pool = block_manager.pool
    ids = sorted({b for s in seq_ids for b in block_manager.get_block_table(s)})
    return {b: pool.blocks[b].ref_cnt for b in ids}


def preview(text: str, width: int = 80) -> str:
    """A generated text as one short line: its first non-empty line, cut to ``width`` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3].rstrip() + "..."




class PeakWatcher:
    """An engine observer that reports the block manager's exact peaks over the steps it watched.

    ``peak_used_blocks`` is the most blocks held at once, even when they were
    allocated and freed again within one step (say, a one-token request computed
    and finished in the same step): the block manager raises its high-water marks
    after every change, and the watcher only reads them (it resets them when it
    starts). ``table_blocks_at_peak`` is what the block tables pointed at at
    that same moment (a shared block counted once per table: the blocks the same
    sequences would hold without sharing), so ``savings_at_peak`` is an honest
    difference of two figures taken together. ``peak_table_blocks`` and
    ``peak_savings_blocks`` are the peaks of those two figures, each possibly
    reached at another moment. ``step_of_peak`` is the step in which use peaked.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        engine.block_manager.reset_peak_stats()
        self.peak_used_blocks = 0
        self.table_blocks_at_peak = 0
        self.step_of_peak = -1  # the first step in which use reached its peak
        self.peak_table_blocks = 0
        self.peak_savings_blocks = 0

    def __call__(self, record) -> None:
        st = self.engine.block_manager.stats()
        if st.peak_used_blocks > self.peak_used_blocks:
            self.step_of_peak = record.step
        self.peak_used_blocks = st.peak_used_blocks
        self.table_blocks_at_peak = st.table_blocks_at_peak
        self.peak_table_blocks = st.peak_table_blocks
        self.peak_savings_blocks = st.peak_savings_blocks

    @property
    def savings_at_peak(self) -> int:
        """Blocks the tables point at minus blocks held, at the moment of peak use."""
        return self.table_blocks_at_peak - self.peak_used_blocks


@dataclass
class SharingRun:
    n: int
    shared: bool
    peak_used_blocks: int  # the most blocks actually held at once
    table_blocks_at_peak: int  # blocks the tables pointed at at that same moment (a shared block once per table)
    peak_table_blocks: int  # the most blocks the tables pointed at, at any moment
    peak_savings_blocks: int  # the most blocks sharing saved at once (not necessarily at the peak)
    cow_copies: int
    outputs: list  # token id lists, one per completion
    trace: list
    texts: list | None = None  # the completions' text (empty strings without a tokenizer)
    finish_reasons: list | None = None  # "stop" (end of sequence) or "length" (max_tokens), one per completion
    prompt_len: int = 0
    step_of_peak: int = -1  # the first step in which use reached its peak
    prefix_hit_tokens: int = 0  # prompt tokens the prefix cache served over the run

    @property
    def savings_at_peak(self) -> int:
        """Blocks saved at the moment of peak use: ``table_blocks_at_peak - peak_used_blocks``."""
        return self.table_blocks_at_peak - self.peak_used_blocks

    @property
    def lengths(self) -> list[int]:
        return [len(o) for o in self.outputs]


def rollouts(make_llm, prompt, n: int, shared: bool, max_tokens: int = 24, seed: int = 1,
             temperature: float = 0.8, use_tqdm: bool = False, ignore_eos: bool = True,
             top_p: float = 1.0, prefix_caching: bool | None = None) -> SharingRun:
    """``n`` sampled completions (rollouts) of one prompt, measured.

    ``shared=True``: one request with ``SamplingParams(n=n)``; its completions
    fork from the prompt's blocks. ``shared=False``: ``n`` separate requests on
    an engine with prefix caching off, so each computes and stores the prompt
    itself; request ``k`` gets ``completion_seed(seed, k)``, the seed completion
    ``k`` of the shared request uses, so both runs sample the same rollouts.
    ``make_llm(enable_prefix_caching=...)`` builds a fresh engine.

    ``ignore_eos=False`` lets each rollout end at the model's own end-of-sequence
    token (a trained model), so rollouts have different lengths; ``max_tokens``
    then only caps the longest, as a GRPO trainer's maximum completion length does.

    ``prefix_caching`` overrides the engine's prefix cache (by default on for
    ``shared=True``, off for separate requests): separate requests with the
    cache on show what the prefix cache alone shares.
    """
    llm = make_llm(enable_prefix_caching=shared if prefix_caching is None else prefix_caching)
    engine = llm.engine
    watcher = PeakWatcher(engine)
    engine.add_observer(watcher)
    engine.keep_trace, engine.trace = True, []
    if shared:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens,
                                ignore_eos=ignore_eos)
        outs = llm.generate([prompt], params, use_tqdm=use_tqdm)
        completions = outs[0].outputs
    else:
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=completion_seed(seed, k),
                                 max_tokens=max_tokens, ignore_eos=ignore_eos) for k in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=use_tqdm)
        completions = [o.outputs[0] for o in outs]
    engine.remove_observer(watcher)
    trace = list(engine.trace)
    engine.keep_trace = False
    return SharingRun(n, shared, watcher.peak_used_blocks, watcher.table_blocks_at_peak, watcher.peak_table_blocks,
                      watcher.peak_savings_blocks, engine.block_manager.stats().num_cow_copies,
                      [c.token_ids for c in completions], trace, [c.text for c in completions],
                      [c.finish_reason for c in completions], len(outs[0].prompt_token_ids), watcher.step_of_peak,
                      engine.block_manager.stats().prefix_hit_tokens)


@dataclass
class PrefixRequest:
    """One request of :func:`prefix_cache_run`: what the prefix cache served and what was computed."""

    prompt_len: int
    looked_up_tokens: int  # prompt tokens the cache was asked about (this request's share of prefix_query_tokens)
    hit_tokens: int  # prompt tokens served from the cache
    computed_tokens: int  # prompt tokens the model actually ran (prefill entries of the step records)
    ttft_seconds: float  # time to first token: from arrival to the first sampled token
    text: str  # what the model answered
    stats: object  # the cumulative KVCacheStats after this request

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


def prefix_cache_run(llm, prompts, params: SamplingParams | None = None) -> list[PrefixRequest]:
    """Send ``prompts`` one after another, as chats arriving at a server; one :class:`PrefixRequest` each.

    Each request runs to completion before the next arrives, so a later one can
    find the earlier ones' full prompt blocks in the prefix cache (if the engine
    has it on). Hits and lookups come from ``block_manager.stats()`` before and
    after each request; computed tokens from the step records (what the model
    ran); the time to first token from the request's own metrics. The default
    ``params`` generate one greedy token: the time to first token is then the
    prefill and nothing else.
    """
    params = SamplingParams(temperature=0.0, max_tokens=1) if params is None else params
    engine = llm.engine
    computed = []

    def count(record) -> None:
        computed.append(sum(e.num_tokens for e in record.scheduled if e.is_prefill))

    engine.add_observer(count)
    results = []
    try:
        before = engine.block_manager.stats()
        for prompt in prompts:
            computed.clear()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            after = engine.block_manager.stats()
            results.append(PrefixRequest(
                prompt_len=len(out.prompt_token_ids),
                looked_up_tokens=after.prefix_query_tokens - before.prefix_query_tokens,
                hit_tokens=after.prefix_hit_tokens - before.prefix_hit_tokens,
                computed_tokens=sum(computed),
                ttft_seconds=out.metrics.time_to_first_token,
                text=out.outputs[0].text,
                stats=after,
            ))
            before = after
    finally:
        engine.remove_observer(count)
    return results


def prefix_cache_demo(llm, system_len: int = 96, num_users: int = 6, question_len: int = 12, max_tokens: int = 8,
                      seed: int = 0, vocab: int = 4000):
    """Random-token requests sharing one system prompt, sent one after another; returns (prompts, stats after each).

    The first request computes the system prompt; each later one finds its
    full blocks in the prefix cache. ``stats`` is the cumulative
    ``KVCacheStats`` after each request, so the hit rate can be followed.
    (Any model: the prompts are token ids. :func:`prefix_cache_run` takes real prompts.)
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


@dataclass
class GRPOStepMemory:
    """One GRPO sampling step (``len(prompt_lens)`` prompts, ``group_size`` rollouts each): its peak KV blocks,
    measured on the engine with the rollouts sharing their prompt and as separate requests, and counted."""

    group_size: int
    shared_peak: int  # measured: one request per prompt with SamplingParams(n=group_size)
    unshared_peak: int  # measured: group_size separate requests per prompt, prefix caching off
    shared_blocks: int  # counted by grpo_step_blocks(..., shared=True)
    unshared_blocks: int  # counted by grpo_step_blocks(..., shared=False)

    @property
    def ratio(self) -> float:
        return self.unshared_peak / self.shared_peak


def grpo_step_blocks(prompt_lens, group_size: int, rollout_len: int, block_size: int, shared: bool) -> int:
    """KV blocks a GRPO sampling step holds when every rollout has written its last token, counted by hand.

    A rollout of ``rollout_len`` tokens stores ``prompt_len + rollout_len - 1`` tokens: its last sampled
    token is never fed back. Unshared, each rollout holds all its blocks. Shared, the prompt's full blocks
    are stored once per prompt, and each rollout holds the rest: its own copy of the prompt's partly
    filled last block (copy-on-write), then its own blocks.
    """
    total = 0
    for p in prompt_lens:
        per_rollout = -(-(p + rollout_len - 1) // block_size)
        if shared:
            full = p // block_size
            total += full + group_size * (per_rollout - full)
        else:
            total += group_size * per_rollout
    return total


def grpo_step_memory(make_llm, prompts, group_sizes, rollout_len: int = 64, seed: int = 0) -> list[GRPOStepMemory]:
    """Run one GRPO sampling step per group size, shared and unshared, and measure each one's peak blocks.

    ``make_llm(enable_prefix_caching=...)`` builds a fresh engine; its token budget must hold every prompt of
    the step at once, so that all rollouts run side by side (as a trainer's sampling step does). Rollouts have
    a fixed length (``ignore_eos``) so that the two runs, and the count, describe the same work.
    """
    rows = []
    block_size = None
    lens = [len(p) for p in prompts]
    for g in group_sizes:
        peaks = {}
        for shared in (True, False):
            llm = make_llm(enable_prefix_caching=shared)
            block_size = llm.engine.config.block_size
            watcher = PeakWatcher(llm.engine)
            llm.engine.add_observer(watcher)
            if shared:
                params = SamplingParams(n=g, temperature=1.0, seed=seed, max_tokens=rollout_len, ignore_eos=True)
                llm.generate(list(prompts), params, use_tqdm=False)
            else:
                params = [SamplingParams(temperature=1.0, seed=completion_seed(seed, k), max_tokens=rollout_len,
                                         ignore_eos=True) for _ in prompts for k in range(g)]
                llm.generate([p for p in prompts for _ in range(g)], params, use_tqdm=False)
            peaks[shared] = watcher.peak_used_blocks
        rows.append(GRPOStepMemory(g, peaks[True], peaks[False],
                                   grpo_step_blocks(lens, g, rollout_len, block_size, True),
                                   grpo_step_blocks(lens, g, rollout_len, block_size, False)))
    return rows


# --------------------------------------------------------------------------- the lesson's figures


def peak_blocks_figure(runs: dict):
    """Bars of the peak KV blocks of rollouts with and without sharing, one group per ``n``.

    ``runs`` maps ``n`` to a :class:`SharingRun` or a :class:`PeakWatcher` of a
    shared run: "without sharing" is the most blocks its tables pointed at
    (``peak_table_blocks``), "shared" the most blocks it held (``peak_used_blocks``).
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    x = [f"n = {n}" for n in runs]
    fig.add_bar(name="without sharing (block tables)", x=x, y=[r.peak_table_blocks for r in runs.values()])
    fig.add_bar(name="shared (blocks in use)", x=x, y=[r.peak_used_blocks for r in runs.values()])
    fig.update_layout(title="Peak KV blocks, same rollouts", yaxis_title="blocks", height=340, barmode="group")
    return fig


def grpo_memory_figure(rows: list[GRPOStepMemory], num_prompts: int):
    """The measured peaks of :func:`grpo_step_memory`, unshared and shared, against the group size (log x axis)."""
    import plotly.graph_objects as go

    x = [r.group_size for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[r.unshared_peak for r in rows], mode="lines+markers", name="unshared")
    fig.add_scatter(x=x, y=[r.shared_peak for r in rows], mode="lines+markers", name="shared")
    fig.update_layout(title=f"Peak KV blocks of one GRPO sampling step ({num_prompts} prompts)", height=320,
                      xaxis_title="group size (rollouts per prompt)", yaxis_title="blocks", xaxis_type="log")
    return fig


def ttft_figure(cached: list[PrefixRequest], plain: list[PrefixRequest]):
    """Time to first token (ms) of each chat of two :func:`prefix_cache_run` runs: prefix caching off and on."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_scatter(name="prefix caching off", y=[p.ttft_seconds * 1e3 for p in plain], mode="lines+markers")
    fig.add_scatter(name="prefix caching on", y=[c.ttft_seconds * 1e3 for c in cached], mode="lines+markers")
    fig.update_layout(title="Time to first token of each chat (prefill only)", xaxis_title="chat", yaxis_title="ms",
                      height=320)
    return fig
