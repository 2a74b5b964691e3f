"""Helpers for lesson 06 (continuous batching): a request stream and a fair static-vs-continuous run."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from ..visualizers.batching import SlotTimeline, slot_timeline_from_trace
from .paging import timed

__all__ = ["request_stream", "PolicyRun", "run_policy", "compare_policies"]


def request_stream(num_requests: int, seed: int = 0, prompt_range=(8, 48), median_output: int = 24,
                   max_output: int = 160, vocab: int = 4000):
    """Prompts (token ids) and output lengths; outputs are long-tailed (log-normal), as in real traffic.

    Most answers are short and a few are long: exactly what leaves static
    batching's slots idle while the longest member of a batch finishes.
    """
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))])
        lengths.append(max(2, min(max_output, int(round(median_output * math.exp(rng.gauss(0.0, 0.9)))))))
    return prompts, lengths


@dataclass
class PolicyRun:
    policy: str
    trace: list
    timeline: SlotTimeline
    seconds: float  # wall time of the whole generate call
    steps: int
    useful_tokens: int  # generated tokens that were asked for (ignore_eos: exactly the requested lengths)
    outputs: list

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.useful_tokens / self.steps


def run_policy(make_llm, scheduling: str, prompts, output_lengths, max_num_seqs: int,
               use_tqdm: bool = True) -> PolicyRun:
    """One ``LLM.generate`` over the whole stream under ``scheduling`` ("static" or "continuous")."""
    llm = make_llm(scheduling=scheduling, max_num_seqs=max_num_seqs)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lengths]
    with timed() as t:
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    trace = list(engine.trace)
    engine.keep_trace = False
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    return PolicyRun(scheduling, trace, slot_timeline_from_trace(trace, max_num_seqs), t.seconds,
                     len(trace), useful, outs)


def compare_policies(make_llm, prompts, output_lengths, max_num_seqs: int, warmup: bool = True):
    """Static then continuous on the same stream (after a short warm-up run); returns {policy: PolicyRun}."""
    if warmup:
        llm = make_llm(scheduling="continuous", max_num_seqs=max_num_seqs)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return {p: run_policy(make_llm, p, prompts, output_lengths, max_num_seqs) for p in ("static", "continuous")}
