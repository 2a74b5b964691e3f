"""Helpers for lesson 06 (continuous batching): a request stream and a fair static-vs-continuous run.

Two kinds of workload run through the same functions:

* real chats on the trained model, each answer ending at the model's own
  end-of-sequence token (``output_lengths=None`` and the ``params`` to sample
  with): the lengths, and so static batching's bubbles, come from real answers;
* token-id prompts with forced output lengths (``request_stream`` and
  ``output_lengths``, greedy with ``ignore_eos``), for any model, random weights included.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvpaging.sampling_params import SamplingParams
from kvpaging.teach.paging import timed
from kvpaging.teach.sharing import preview
from kvpaging.visualizers.batching import SlotTimeline, slot_timeline_from_trace

__all__ = ["request_stream", "PolicyRun", "run_policy", "compare_policies", "preview", "POLICY_COLOURS",
           "throughput_figure", "memory_figure", "blocks_freed", "mean_blocks_used"]


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
    useful_tokens: int  # generated tokens: each answer up to its own end (ignore_eos: exactly the requested lengths)
    outputs: list

    @property
    def lengths(self) -> list[int]:
        """Tokens each request generated (the end-of-sequence token included, when it ended there)."""
        return [len(o.outputs[0].token_ids) for o in self.outputs]

    @property
    def finish_reasons(self) -> list[str]:
        return [o.outputs[0].finish_reason for o in self.outputs]

    @property
    def texts(self) -> list[str]:
        return [o.outputs[0].text for o in self.outputs]

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.useful_tokens / self.steps


def _params(output_lengths, params, num_requests: int) -> list[SamplingParams]:
    """Each request's SamplingParams: forced lengths (greedy, ignore_eos), or ``params`` as given."""
    if output_lengths is not None:
        if params is not None:
            raise ValueError("give output_lengths (forced lengths) or params (natural stopping), not both")
        if len(output_lengths) != num_requests:
            raise ValueError(f"{len(output_lengths)} output lengths for {num_requests} prompts")
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lengths]
    if params is None:
        raise ValueError("give output_lengths (forced lengths) or params (natural stopping)")
    if isinstance(params, SamplingParams):
        return [params] * num_requests
    params = list(params)
    if len(params) != num_requests:
        raise ValueError(f"{len(params)} SamplingParams for {num_requests} prompts")
    return params


def run_policy(make_llm, scheduling: str, prompts, output_lengths=None, max_num_seqs: int = 4,
               use_tqdm: bool = True, params=None) -> PolicyRun:
    """One ``LLM.generate`` over the whole stream under ``scheduling`` ("static" or "continuous").

    ``output_lengths``: each request generates exactly that many tokens (greedy,
    ``ignore_eos``). Or ``params`` (one SamplingParams for all, or one each): the
    requests stop where the model ends its answer, or at ``max_tokens``.
    Prompts may be token-id lists, strings or ``{"prompt_token_ids": ...}`` dicts.
    """
    params = _params(output_lengths, params, len(prompts))
    llm = make_llm(scheduling=scheduling, max_num_seqs=max_num_seqs)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    with timed() as t:
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    trace = list(engine.trace)
    engine.keep_trace = False
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    return PolicyRun(scheduling, trace, slot_timeline_from_trace(trace, max_num_seqs), t.seconds,
                     len(trace), useful, outs)


def compare_policies(make_llm, prompts, output_lengths=None, max_num_seqs: int = 4, warmup: bool = True,
                     params=None, use_tqdm: bool = True):
    """Static then continuous on the same stream (after a short warm-up run); returns {policy: PolicyRun}.

    ``output_lengths`` forces each request's length; ``params`` instead lets each
    answer end naturally (see :func:`run_policy`). The warm-up runs two prompts for
    a few tokens on an engine of its own, so nothing it leaves (a prefix cache) helps the timed runs.
    """
    _params(output_lengths, params, len(prompts))  # refuse a bad combination before any work
    if warmup:
        llm = make_llm(scheduling="continuous", max_num_seqs=max_num_seqs)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return {p: run_policy(make_llm, p, prompts, output_lengths, max_num_seqs, use_tqdm=use_tqdm, params=params)
            for p in ("static", "continuous")}


POLICY_COLOURS = {"static": "#fdb462", "continuous": "#80b1d3"}  # one colour per policy, in every figure


def throughput_figure(runs: dict[str, PolicyRun], device: str = "cpu"):
    """Useful tokens per second (measured) and per step (counted) of each run, side by side."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("useful tokens per second", "useful tokens per step"))
    names = list(runs)
    colours = [POLICY_COLOURS.get(n, "#bbbbbb") for n in names]
    fig.add_bar(x=names, y=[runs[n].tokens_per_second for n in names], row=1, col=1, showlegend=False,
                marker_color=colours)
    fig.add_bar(x=names, y=[runs[n].tokens_per_step for n in names], row=1, col=2, showlegend=False,
                marker_color=colours)
    fig.update_layout(height=330, title=f"Throughput, same chats ({device})")
    return fig


def memory_figure(runs: dict[str, PolicyRun]):
    """KV blocks in use after each step of each run, with a cross at every step in which an answer ended."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, r in runs.items():
        colour = POLICY_COLOURS.get(name, "#bbbbbb")
        fig.add_scatter(x=[x.step for x in r.trace], y=[x.num_used_blocks for x in r.trace], mode="lines", name=name,
                        line_color=colour)
        ends = [x for x in r.trace if x.finished_block_tables]
        fig.add_scatter(x=[x.step for x in ends], y=[x.num_used_blocks for x in ends], mode="markers", showlegend=False,
                        marker=dict(color=colour, symbol="x", size=8), name=f"{name}: an answer ended")
    fig.update_layout(height=320, title="KV blocks in use after each step (x: an answer ended and freed its blocks)",
                      xaxis_title="step", yaxis_title="blocks")
    return fig


def blocks_freed(run: PolicyRun) -> int:
    """Blocks handed back to the pool by the answers that ended during the run."""
    return sum(len(t) for x in run.trace for t in x.finished_block_tables.values())


def mean_blocks_used(run: PolicyRun) -> float:
    """KV blocks in use after a step, averaged over the run's steps."""
    return sum(x.num_used_blocks for x in run.trace) / len(run.trace)
