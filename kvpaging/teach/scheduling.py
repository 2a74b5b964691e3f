"""Helpers for lesson 07 (the scheduler): a long prompt arriving mid-stream, and preemption."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ..sampling_params import SamplingParams

__all__ = ["LongPromptRun", "long_prompt_arrives", "PreemptionRun", "run_with_pool"]


@dataclass
class LongPromptRun:
    budget: int  # max_num_batched_tokens
    trace: list
    arrival_step: int  # the first step after the long prompt was added
    long_first_token_step: int  # the step that produced the long request's first token
    running_ids: list  # request ids of the requests already decoding
    itl_ms: dict  # request id -> inter-token gaps (ms) of tokens produced after the long prompt arrived
    stalled_steps: int  # steps after arrival in which some running (unfinished) request got no token
    max_step_tokens_for_running: int  # largest step (tokens computed) that a running request's token waited on
    prefill_steps: int  # steps that computed part of the long prompt

    @property
    def long_ttft_steps(self) -> int:
        return self.long_first_token_step - self.arrival_step + 1

    def median_itl_ms(self) -> float:
        return statistics.median(g for gaps in self.itl_ms.values() for g in gaps)

    def max_itl_ms(self) -> float:
        return max(g for gaps in self.itl_ms.values() for g in gaps)


def long_prompt_arrives(make_llm, budget: int, num_running: int = 4, decode_tokens: int = 40,
                        long_prompt_len: int = 1024, arrive_after: int = 10, seed: int = 0,
                        vocab: int = 4000) -> LongPromptRun:
    """``num_running`` short requests decode; after ``arrive_after`` steps a long prompt arrives.

    ``budget`` is ``max_num_batched_tokens``: at least ``long_prompt_len + num_running``
    lets the whole prompt go in one step (no chunking); smaller cuts it into chunks.
    """
    rng = random.Random(seed)
    llm = make_llm(max_num_batched_tokens=budget)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    ids = [f"run{i}" for i in range(num_running)]
    for rid in ids:
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True))
    outputs = {}
    for _ in range(arrive_after):
        for o in engine.step():
            outputs[o.request_id] = o
    long_prompt = [rng.randrange(3, vocab) for _ in range(long_prompt_len)]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    arrival_step = engine.num_steps + 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    trace = list(engine.trace)
    engine.keep_trace = False

    seq_of = {}
    long_first = None
    prefill_steps = 0
    for r in trace:
        for e in r.scheduled:
            seq_of.setdefault(e.request_id, e.seq_id)
            if e.request_id == "long" and e.is_prefill:
                prefill_steps += 1
        if long_first is None and seq_of.get("long") in r.sampled:
            long_first = r.step
    after = [r for r in trace if r.step >= arrival_step]
    running_seqs = {seq_of[i] for i in ids}
    stalled = 0
    biggest = 0
    for r in after:
        alive = running_seqs & (set(r.block_tables) | set(r.finished))
        got = alive & set(r.sampled)
        if alive - got:
            stalled += 1
        if got:
            biggest = max(biggest, r.num_batched_tokens)
    itl = {}
    for rid in ids:
        m = outputs[rid].metrics
        arrival_time = next(r.start_time for r in trace if r.step == arrival_step)
        times = m.token_times
        itl[rid] = [(b - a) * 1e3 for a, b in zip(times, times[1:]) if b >= arrival_time]
    return LongPromptRun(budget, trace, arrival_step, long_first, ids, itl, stalled, biggest, prefill_steps)


@dataclass
class PreemptionRun:
    num_blocks: int
    outputs: list  # token ids per request
    trace: list
    num_preemptions: int
    preempted_steps: list  # steps whose record lists preempted sequences
    metrics: dict  # request id -> RequestMetrics


def run_with_pool(make_llm, prompts, max_tokens: int, num_blocks: int, use_tqdm: bool = True) -> PreemptionRun:
    """Greedy generation of ``prompts`` with a pool of ``num_blocks`` blocks, tracing every step."""
    llm = make_llm(num_blocks=num_blocks)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=use_tqdm)
    trace = list(engine.trace)
    engine.keep_trace = False
    return PreemptionRun(num_blocks, [o.outputs[0].token_ids for o in outs], trace, engine.scheduler.num_preemptions,
                         [r.step for r in trace if r.preempted], {o.request_id: o.metrics for o in outs})
