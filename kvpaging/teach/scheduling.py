"""Helpers for lesson 07 (the scheduler): a long prompt arriving mid-stream, and preemption.

Both runs (``long_prompt_arrives``, ``run_with_pool``) use whatever engine
``make_llm(**settings)`` builds: the tiny random-weight model where only the step
shapes matter (token counts per step, preemptions), the trained chat model where the
text or the time of a real forward pass matters. ``chunk_breakdown`` and
``step_wall_time_figure`` read a long-prompt run's trace for the lesson.
"""

from __future__ import annotations

import contextlib
import random
import statistics
from dataclasses import dataclass, field

import torch

from kvpaging.errors import RequestFailedError
from kvpaging.sampling_params import SamplingParams

__all__ = ["LongPromptRun", "long_prompt_arrives", "PreemptionRun", "run_with_pool", "cpu_threads",
           "document_chat", "ChunkBreakdown", "chunk_breakdown", "step_wall_time_figure"]


@contextlib.contextmanager
def cpu_threads(n: int):
    """Run the block with ``n`` torch CPU threads, then restore the number there was.

    A tiny model gains nothing from a second thread, and threads stall each other
    when other processes share the cores; a real model's prefill does gain from them.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def document_chat(tokenizer, doc_tokens: int,
                  question: str = "What is this text about? Answer in one sentence.") -> list[int]:
    """A chat prompt (token ids) whose user message is ``doc_tokens`` tokens of real prose, then ``question``.

    The prose is ``real_text()`` (Python's documentation), cut at exactly ``doc_tokens``
    tokens, so the prompt's length depends only on ``doc_tokens``, the chat template and
    the question, not on which Python's documentation was read.
    """
    from kvpaging.teach.text import chat_text, real_text

    marker = "@@DOCUMENT@@"
    head, tail = chat_text(tokenizer, f"{marker}\n\n{question}").split(marker)
    doc = tokenizer(real_text(8 * doc_tokens + 200), add_special_tokens=False)["input_ids"][:doc_tokens]
    if len(doc) < doc_tokens:
        raise ValueError(f"real_text() gave only {len(doc)} tokens, not {doc_tokens}")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(head) + doc + encode(tail)


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
    outputs: dict = field(default_factory=dict)  # request id -> RequestOutput ("long" is the long request)

    @property
    def long_ttft_steps(self) -> int:
        return self.long_first_token_step - self.arrival_step + 1

    def median_itl_ms(self) -> float:
        return statistics.median(g for gaps in self.itl_ms.values() for g in gaps)

    def max_itl_ms(self) -> float:
        return max(g for gaps in self.itl_ms.values() for g in gaps)


def long_prompt_arrives(make_llm, budget: int, num_running: int = 4, decode_tokens: int = 40,
                        long_prompt_len: int = 1024, arrive_after: int = 10, seed: int = 0,
                        vocab: int = 4000, running_prompts: list | None = None, long_prompt: list | None = None,
                        long_params: SamplingParams | None = None) -> LongPromptRun:
    """``num_running`` short requests decode; after ``arrive_after`` steps a long prompt arrives.

    ``budget`` is ``max_num_batched_tokens``: at least ``len(long prompt) + num_running``
    lets the whole prompt go in one step (no chunking); smaller cuts it into chunks.

    The prompts are random token ids (16 per running request, ``long_prompt_len`` for
    the long one) unless ``running_prompts`` / ``long_prompt`` (token-id lists) are given.
    The running requests decode exactly ``decode_tokens`` tokens each (EOS ignored), so
    the steps and their token counts depend only on the lengths and the budget. The long
    request runs with ``long_params`` (default: 4 greedy tokens, EOS ignored).
    """
    rng = random.Random(seed)
    if running_prompts is None:
        running_prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(num_running)]
    if long_prompt is None:
        long_prompt = [rng.randrange(3, vocab) for _ in range(long_prompt_len)]
    if long_params is None:
        long_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = make_llm(max_num_batched_tokens=budget)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    ids = [f"run{i}" for i in range(len(running_prompts))]
    for rid, prompt in zip(ids, running_prompts):
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        engine.add_request(rid, list(prompt), params)
    outputs = {}
    for _ in range(arrive_after):
        for o in engine.step():
            outputs[o.request_id] = o
    engine.add_request("long", list(long_prompt), long_params)
    arrival_step = engine.num_steps + 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    trace = list(engine.trace)
    engine.keep_trace = False
    failed = [o for o in outputs.values() if o.error is not None]
    if failed:  # as LLM.generate does: a failed request must never pass for a served one
        raise RequestFailedError(f"{len(failed)} request(s) failed, the first: {failed[0].error!r}",
                                 list(outputs.values()), failed) from failed[0].error

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
    arrival_time = next(r.start_time for r in trace if r.step == arrival_step)
    for rid in ids:
        times = outputs[rid].metrics.token_times
        itl[rid] = [(b - a) * 1e3 for a, b in zip(times, times[1:]) if b >= arrival_time]
    return LongPromptRun(budget, trace, arrival_step, long_first, ids, itl, stalled, biggest, prefill_steps, outputs)


@dataclass
class PreemptionRun:
    num_blocks: int
    outputs: list  # token ids per request, in prompt order
    trace: list
    num_preemptions: int
    preempted_steps: list  # steps whose record lists preempted sequences
    metrics: dict  # request id -> RequestMetrics
    request_ids: list = field(default_factory=list)  # in prompt order
    texts: list = field(default_factory=list)  # the detokenized outputs ("" without a tokenizer), in prompt order
    finish_reasons: list = field(default_factory=list)  # in prompt order
    preempted_requests: list = field(default_factory=list)  # request ids preempted at least once, first preempted first
    recomputed_tokens: int = 0  # tokens prefilled after a request's first preemption: its recomputation


def run_with_pool(make_llm, prompts, max_tokens: int, num_blocks: int, use_tqdm: bool = True,
                  ignore_eos: bool = True) -> PreemptionRun:
    """Greedy generation of ``prompts`` with a pool of ``num_blocks`` blocks, tracing every step.

    ``ignore_eos=True`` makes every request generate exactly ``max_tokens`` (step counts
    then depend only on lengths and settings); ``False`` lets a trained model stop where
    its answer ends. ``generate`` raises if any request failed.
    """
    llm = make_llm(num_blocks=num_blocks)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=use_tqdm)
    trace = list(engine.trace)
    engine.keep_trace = False
    request_of, preempted, recomputed = {}, [], 0
    for r in trace:
        for e in r.scheduled:
            request_of[e.seq_id] = e.request_id
            if e.is_prefill and e.request_id in preempted:
                recomputed += e.num_tokens
        for seq_id in r.preempted:
            rid = request_of[seq_id]
            if rid not in preempted:
                preempted.append(rid)
    return PreemptionRun(num_blocks, [o.outputs[0].token_ids for o in outs], trace, engine.scheduler.num_preemptions,
                         [r.step for r in trace if r.preempted], {o.request_id: o.metrics for o in outs},
                         [o.request_id for o in outs], [o.outputs[0].text or "" for o in outs],
                         [o.outputs[0].finish_reason for o in outs], preempted, recomputed)


@dataclass
class ChunkBreakdown:
    """How a run of :func:`long_prompt_arrives` computed the long prompt, and what its running requests saw."""

    chunks: list  # tokens of the long prompt computed in each of its prefill steps, in order
    cached_tokens: int  # tokens of the long prompt the prefix cache held (its first chunk starts there)
    decodes_beside: int  # most running decodes scheduled in one step beside a chunk of the long prompt
    gaps_per_request: int  # inter-token gaps of a running request after the long prompt arrived (mean over them)
    gaps_with_chunk: int  # steps that carried a chunk of the long prompt: the gaps it lengthened

    @property
    def median_is_chunk_step(self) -> bool:
        """More than half a running request's gaps carry a chunk, so their median is a chunk step."""
        return self.gaps_with_chunk > self.gaps_per_request / 2


def chunk_breakdown(run: LongPromptRun) -> ChunkBreakdown:
    """Read from ``run``'s trace how the long prompt was cut, and how many gaps of the running requests it hit.

    ``run`` comes from :func:`long_prompt_arrives`; its long request has the id ``"long"``.
    """
    long_chunks = [e for r in run.trace for e in r.scheduled if e.request_id == "long" and e.is_prefill]
    if not long_chunks:
        raise ValueError("the run's trace has no prefill step of the long request")
    beside = [sum(not e.is_prefill for e in r.scheduled) for r in run.trace
              if any(e.request_id == "long" and e.is_prefill for e in r.scheduled)]
    gaps = sum(len(g) for g in run.itl_ms.values()) // len(run.itl_ms)
    return ChunkBreakdown([e.num_tokens for e in long_chunks], long_chunks[0].start, max(beside), gaps,
                          run.prefill_steps)


def step_wall_time_figure(runs: dict):
    """Wall time of every step (log scale), one line per run of :func:`long_prompt_arrives`, keyed by budget.

    A step's wall time is the gap between two tokens of every request it decodes.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    for budget, r in runs.items():
        fig.add_scatter(x=[x.step for x in r.trace], y=[x.wall_time * 1e3 for x in r.trace], mode="lines+markers",
                        name=f"budget {budget}")
    fig.update_layout(title="Step wall time (the gap between two tokens of every running request)",
                      xaxis_title="step", yaxis_title="ms", height=340, yaxis_type="log")
    return fig
