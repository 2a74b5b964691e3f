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

from ..contiguous import ContiguousAllocator, ContiguousStep, OutOfMemory, Reservation

__all__ = ["WorkloadRequest", "make_workload", "run_contiguous", "refusal_table"]


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
