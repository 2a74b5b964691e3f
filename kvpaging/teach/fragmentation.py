"""Lesson 03: a multi-tenant workload on the contiguous allocator, step by step.

Requests arrive over time; each asks for its worst case (prompt + max_tokens)
in one contiguous run, grows by one token per step while it decodes, and
leaves when its answer ends (usually well before max_tokens). A request that
finds no hole large enough waits in a first-come-first-served queue and asks
again at every step. The result is a list of :class:`kvpaging.ContiguousStep`,
which ``kvpaging.visualizers.ContiguousMemoryView`` draws.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpaging.core.contiguous import ContiguousAllocator, ContiguousStep, OutOfMemory, Reservation

__all__ = ["WorkloadRequest", "make_workload", "run_contiguous", "refusal_table", "paged_blocks_needed", "ServedStep",
           "contiguous_served", "serve_paged", "serve_paged_on_engine", "ServedSummary", "served_summary", "served_figure", "tokens_to_compute"]


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival: int  # step at which it arrives
    prompt_len: int
    max_tokens: int  # what it reserves room for
    output_len: int  # what it really generates (<= max_tokens)

    @property
    def worst_case(self) -> int:
        return self.prompt_len + self.max_tokens


def make_workload(num_requests: int = 24, seed: int = 0, prompt_range=(8, 96), max_tokens_choices=(64, 128, 256),
                  arrival_every: int = 2) -> list[WorkloadRequest]:
    """Seeded requests of mixed sizes; answers end somewhere between 10% and 100% of max_tokens."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        max_tokens = rng.choice(max_tokens_choices)
        requests.append(WorkloadRequest(
            request_id=f"r{i}", arrival=i * arrival_every + rng.randint(0, arrival_every - 1) if arrival_every > 1 else i,
            prompt_len=rng.randint(*prompt_range), max_tokens=max_tokens,
            output_len=rng.randint(max(1, max_tokens // 10), max_tokens)))
    return requests


def run_contiguous(num_slots: int, requests: list[WorkloadRequest], max_steps: int = 10_000) -> list[ContiguousStep]:
    """Serve ``requests`` on a contiguous allocator of ``num_slots`` token slots; one ContiguousStep per step.

    Each step: arrivals join the queue; the queue is served in order, and the
    first request that does not fit stops it (first come, first served);
    running requests add one token; finished ones release their run.
    """
    allocator = ContiguousAllocator(num_slots)
    by_arrival = sorted(requests, key=lambda r: r.arrival)
    queue: list[WorkloadRequest] = []
    running: dict[str, list] = {}  # id -> [request, tokens generated]
    steps: list[ContiguousStep] = []
    t = 0
    while (by_arrival or queue or running) and t < max_steps:
        actions, results = [], []
        while by_arrival and by_arrival[0].arrival <= t:
            queue.append(by_arrival.pop(0))
        while queue:
            req = queue[0]
            result = allocator.reserve(req.request_id, req.worst_case)
            actions.append(("reserve", req.request_id, req.worst_case))
            results.append(result)
            if isinstance(result, OutOfMemory):
                break
            queue.pop(0)
            running[req.request_id] = [req, 0]
            actions.append(("use", req.request_id, req.prompt_len))
            results.append(allocator.set_used(req.request_id, req.prompt_len))
        for rid, state in list(running.items()):
            req, generated = state
            if generated >= req.output_len:
                actions.append(("release", rid))
                results.append(allocator.release(rid))
                del running[rid]
                continue
            state[1] = generated + 1
            actions.append(("use", rid, req.prompt_len + state[1]))
            results.append(allocator.set_used(rid, req.prompt_len + state[1]))
        steps.append(ContiguousStep(t, tuple(actions), tuple(results), allocator.snapshot()))
        t += 1
    return steps


def refusal_table(steps: list[ContiguousStep]) -> list[dict]:
    """One row per refusal: when, who, how many slots it asked for, free in total, largest hole."""
    rows = []
    for step in steps:
        for result in step.results:
            if isinstance(result, OutOfMemory):
                rows.append({"step": step.index, "request": result.request_id, "asked": result.requested,
                             "free_total": result.total_free, "largest_hole": result.largest_hole,
                             "fragmentation": result.blocked_by_fragmentation})
    return rows


def paged_blocks_needed(tokens: int, block_size: int = 16) -> int:
    """Blocks a paged cache would give the same tokens: any free blocks will do, wherever they are."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class ServedStep:
    """One step of serving a workload: how many sequences ran, how many tokens came out, the memory in use."""

    index: int
    running: int  # sequences that hold memory and compute in this step
    tokens: int  # output tokens produced in this step
    used_slots: int  # token slots taken (contiguous: reserved; paged: in allocated blocks)
    waiting: int  # arrived requests not yet admitted
    preempted: int = 0  # paged only: sequences evicted this step to make room (recomputed later)
    computed: int = 0  # paged only: tokens the forward pass computes (prompt chunks, decodes, recomputation)


def contiguous_served(steps: list[ContiguousStep], requests: list[WorkloadRequest]) -> list[ServedStep]:
    """:func:`run_contiguous`'s steps as :class:`ServedStep` rows, to compare with :func:`serve_paged`."""
    prompt = {r.request_id: r.prompt_len for r in requests}
    arrived = sorted(r.arrival for r in requests)
    admitted, rows = 0, []
    for step in steps:
        admitted += sum(isinstance(res, Reservation) and act[0] == "reserve"
                        for act, res in zip(step.actions, step.results))
        tokens = sum(1 for act in step.actions if act[0] == "use" and act[2] > prompt[act[1]])
        waiting = sum(1 for a in arrived if a <= step.index) - admitted
        rows.append(ServedStep(step.index, len(step.snapshot.runs), tokens, step.snapshot.reserved_slots, waiting))
    return rows


def serve_paged(num_slots: int, requests: list[WorkloadRequest], block_size: int = 16,
                max_num_batched_tokens: int | None = None) -> list[ServedStep]:
    """Serve the same ``requests`` with the same ``num_slots`` through kvpaging's own scheduler and block manager.

    The pool holds ``num_slots // block_size`` blocks. No model runs: each step the
    :class:`kvpaging.core.scheduler.Scheduler` plans the batch exactly as the engine would
    (prompts admitted first come, first served while their blocks fit; one block more
    only when a sequence's last block is full; the newest sequence preempted and
    recomputed later when a decode finds the pool empty), and every sequence that
    reaches its end gets a placeholder token. Each request generates exactly its
    ``output_len`` tokens, as in :func:`run_contiguous`.

    ``max_num_batched_tokens`` is the step's token budget (default: the whole
    pool, so a prompt is computed in one step); a smaller one cuts prompts into
    chunks (chunked prefill, lesson 07).
    """
    from kvpaging.core.block_manager import BlockManager
    from kvpaging.core.scheduler import Scheduler
    from kvpaging.core.sequence import Request
    from kvpaging.sampling_params import SamplingParams

    num_blocks = num_slots // block_size
    longest = max(r.prompt_len + r.output_len for r in requests)
    if -(-longest // block_size) > num_blocks:
        raise ValueError(f"a request of {longest} tokens needs more than the pool's {num_blocks} blocks of {block_size}")
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    budget = num_slots if max_num_batched_tokens is None else max_num_batched_tokens
    sched = Scheduler(bm, max_num_seqs=len(requests), max_num_batched_tokens=budget, max_model_len=longest)

    def add(r: WorkloadRequest, t: int) -> None:
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        sched.add_request(Request(r.request_id, [7] * r.prompt_len, params, float(t)))

    def step(t: int) -> ServedStep:
        out = sched.schedule(now=float(t))
        used = (num_blocks - bm.num_free_blocks) * block_size
        row = ServedStep(t, out.num_seqs, len(out.samples), used, len(sched.waiting), len(out.preempted),
                         out.num_batched_tokens)
        sched.update(out, [7] * len(out.samples))
        return row

    return _serve_by_step(requests, add, step, sched.has_unfinished)


def serve_paged_on_engine(model, num_slots: int, requests: list[WorkloadRequest], block_size: int = 16) -> list[ServedStep]:
    """:func:`serve_paged`, through the whole engine on ``model``: the same requests arriving at the same steps,
    each generating its ``output_len`` tokens (greedy, ``ignore_eos``), in an ``LLM`` whose pool is the same
    ``num_slots`` cut into blocks of ``block_size``, with the same step budget and no prefix caching. The model
    runs every step; one row per step, as :func:`serve_paged` gives them (``used_slots`` and ``waiting`` are read
    after the step rather than after its planning)."""
    from kvpaging import LLM
    from kvpaging.sampling_params import SamplingParams

    longest = max(r.prompt_len + r.output_len for r in requests)
    llm = LLM(model, block_size=block_size, num_blocks=num_slots // block_size, max_model_len=longest,
              max_num_seqs=len(requests), max_num_batched_tokens=num_slots, enable_prefix_caching=False, seed=0)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []

    def add(r: WorkloadRequest, t: int) -> None:
        engine.add_request(r.request_id, [7] * r.prompt_len,
                           SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))

    def step(t: int) -> ServedStep:
        before = len(engine.trace)
        engine.step()
        if len(engine.trace) == before:  # nothing to run at this step (the next request has not arrived)
            return ServedStep(t, 0, 0, 0, 0)
        rec = engine.trace[-1]
        return ServedStep(t, len(rec.scheduled), len(rec.sampled), rec.num_used_blocks * block_size, rec.num_waiting,
                          len(rec.preempted), rec.num_batched_tokens)

    return _serve_by_step(requests, add, step, engine.has_unfinished_requests)


def _serve_by_step(requests: list[WorkloadRequest], add, step, busy) -> list[ServedStep]:
    """Step ``t`` = 0, 1, ...: first ``add(request, t)`` for each request arriving by then, then ``step(t)``'s row;
    until every request has arrived and ``busy()`` is false."""
    by_arrival = sorted(requests, key=lambda r: r.arrival)
    rows: list[ServedStep] = []
    t = 0
    while by_arrival or busy():
        while by_arrival and by_arrival[0].arrival <= t:
            add(by_arrival.pop(0), t)
        rows.append(step(t))
        t += 1
    return rows


@dataclass(frozen=True)
class ServedSummary:
    steps: int  # steps until the last request finished
    tokens: int  # output tokens in all
    tokens_per_step: float  # sustained throughput, in tokens per step
    mean_running: float  # concurrent streams, averaged over every step
    peak_running: int
    preemptions: int
    computed: int  # tokens the forward passes computed in all (paged runs; 0 for contiguous rows)
    largest_step: int  # the most tokens computed in one step (paged runs)


def served_summary(rows: list[ServedStep]) -> ServedSummary:
    tokens = sum(r.tokens for r in rows)
    return ServedSummary(len(rows), tokens, tokens / len(rows), sum(r.running for r in rows) / len(rows),
                         max(r.running for r in rows), sum(r.preempted for r in rows), sum(r.computed for r in rows),
                         max(r.computed for r in rows))


def tokens_to_compute(requests: list[WorkloadRequest]) -> int:
    """Tokens a forward pass must compute to serve ``requests`` once each: every prompt token, and every
    generated token but the last (it is sampled, never fed back). A paged run's ``computed`` beyond
    this is recomputation after preemption."""
    return sum(r.prompt_len + r.output_len - 1 for r in requests)


def served_figure(served: dict[str, list[ServedStep]], colours: dict[str, str] | None = None):
    """Streams running per step (top) and requests waiting (bottom), one line per allocator."""
    from plotly.subplots import make_subplots

    colours = colours or {"contiguous": "#fdb462", "paged": "#80b1d3"}
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=("streams running (one token each per step)", "requests waiting"))
    for name, rows in served.items():
        x = [r.index for r in rows]
        fig.add_scatter(x=x, y=[r.running for r in rows], mode="lines", name=name, line_color=colours.get(name),
                        row=1, col=1)
        fig.add_scatter(x=x, y=[r.waiting for r in rows], mode="lines", name=name, line_color=colours.get(name),
                        showlegend=False, row=2, col=1)
    fig.update_layout(height=420, title="The same workload on the same memory, step by step",
                      legend=dict(orientation="h", y=1.12))
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig
