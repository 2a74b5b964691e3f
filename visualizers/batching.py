"""Batch slots over iterations: where static batching leaves bubbles and continuous batching does not.

A GPU running a batch of ``num_slots`` sequences does one *iteration* (one
forward pass, one new token per sequence) at a time. Picture a grid: one row
per batch slot, one column per iteration, each cell either the request that
occupies the slot or idle. Idle cells are paid-for compute that produced
nothing: the "bubbles".

- **Static batching** takes ``num_slots`` requests, runs them until the
  *longest* one is done, and only then admits the next batch. A request that
  finishes early leaves its slot idle for the rest of the batch.
- **Continuous batching** (iteration-level scheduling, Orca / vLLM) refills a
  slot on the very iteration its request finishes, from the waiting queue.

The functions here simulate both from nothing but output lengths (one token
per iteration; prefill is ignored), so the textbook example needs no model::

    >>> t = simulate_static_batching([50, 120, 240, 1024], num_slots=4)
    >>> t.busy, t.capacity          # 1,434 of 4,096 slot-iterations do work
    (1434, 4096)

With only four requests for four slots, continuous batching has nothing to
refill the slots with, and ends up with the very same grid. Its advantage shows
as soon as requests queue up: see :func:`article_example`.

:class:`EngineSlots` reads the same picture from a real engine trace.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpaging.engine.llm_engine import StepRecord

__all__ = [
    "SlotTimeline",
    "simulate_static_batching",
    "simulate_continuous_batching",
    "simulate_batching",
    "article_example",
    "EngineSlots",
    "slot_timeline_from_trace",
    "ARTICLE_OUTPUT_LENGTHS",
]

#: The four requests of the continuous-batching article's example: tokens each generates.
ARTICLE_OUTPUT_LENGTHS = (50, 120, 240, 1024)

IDLE = -1


@dataclass(frozen=True)
class SlotTimeline:
    """Who occupied which batch slot at every iteration.

    ``occupancy[slot, iteration]`` is the index of the request in that slot
    (into ``labels``), or ``-1`` when the slot was idle. ``prefill`` marks cells
    that computed a prompt chunk (engine traces only; all False in
    simulations). ``steps`` gives each column's engine step number.
    """

    occupancy: np.ndarray
    labels: tuple[str, ...]
    policy: str
    prefill: np.ndarray | None = None
    steps: np.ndarray | None = None
    notes: dict = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        return self.occupancy.shape[0]

    @property
    def num_iterations(self) -> int:
        return self.occupancy.shape[1]

    @property
    def busy(self) -> int:
        """Slot-iterations that did work."""
        return int((self.occupancy != IDLE).sum())

    @property
    def capacity(self) -> int:
        """Slot-iterations paid for: slots x iterations."""
        return int(self.occupancy.size)

    @property
    def utilisation(self) -> float:
        return self.busy / self.capacity if self.capacity else 0.0

    def utilisation_until(self, iteration: int) -> tuple[int, int]:
        """(busy, capacity) over iterations ``0..iteration``, for an animation's running figure."""
        upto = self.occupancy[:, : iteration + 1]
        return int((upto != IDLE).sum()), int(upto.size)

    def summary(self) -> str:
        return (
            f"{self.policy} batching: {self.num_slots} slots x {self.num_iterations} iterations, "
            f"utilisation {self.utilisation:.1%} ({self.busy:,} / {self.capacity:,} slot-iterations)"
        )


def _check_inputs(output_lengths: Iterable[int], num_slots: int) -> list[int]:
    lengths = list(output_lengths)
    for length in lengths:
        if not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1:
            raise ValueError(f"output lengths must be positive integers, got {length!r}")
    if not isinstance(num_slots, numbers.Integral) or isinstance(num_slots, bool) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
    return [int(x) for x in lengths]


def _labels(lengths: Sequence[int], labels: Sequence[str] | None) -> tuple[str, ...]:
    if labels is None:
        return tuple(f"r{i} ({n} tok)" for i, n in enumerate(lengths))
    if len(labels) != len(lengths):
        raise ValueError(f"{len(labels)} labels for {len(lengths)} requests")
    return tuple(str(x) for x in labels)


def simulate_static_batching(
    output_lengths: Iterable[int], num_slots: int, labels: Sequence[str] | None = None
) -> SlotTimeline:
    """Requests in arrival order, ``num_slots`` at a time; each batch lasts as long as its longest member."""
    lengths = _check_inputs(output_lengths, num_slots)
    batches = [lengths[i : i + num_slots] for i in range(0, len(lengths), num_slots)]
    total = sum(max(batch) for batch in batches)
    occupancy = np.full((num_slots, total), IDLE, dtype=np.int32)
    start, request = 0, 0
    for batch in batches:
        for slot, length in enumerate(batch):
            occupancy[slot, start : start + length] = request
            request += 1
        start += max(batch)
    return SlotTimeline(occupancy, _labels(lengths, labels), "static")


def simulate_continuous_batching(
    output_lengths: Iterable[int], num_slots: int, labels: Sequence[str] | None = None
) -> SlotTimeline:
    """Requests in arrival order; each takes the slot that frees first (the lowest slot on a tie)."""
    lengths = _check_inputs(output_lengths, num_slots)
    free_at = [(0, slot) for slot in range(num_slots)]  # (iteration the slot frees, slot): a min-heap
    placed = []
    for request, length in enumerate(lengths):
        start, slot = heapq.heappop(free_at)
        placed.append((slot, start, length, request))
        heapq.heappush(free_at, (start + length, slot))
    total = max((start + length for _, start, length, _ in placed), default=0)
    occupancy = np.full((num_slots, total), IDLE, dtype=np.int32)
    for slot, start, length, request in placed:
        occupancy[slot, start : start + length] = request
    return SlotTimeline(occupancy, _labels(lengths, labels), "continuous")


def simulate_batching(output_lengths: Iterable[int], num_slots: int, policy: str = "static") -> SlotTimeline:
    if policy == "static":
        return simulate_static_batching(output_lengths, num_slots)
    if policy == "continuous":
        return simulate_continuous_batching(output_lengths, num_slots)
    raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")


def article_example(num_batches: int = 1, num_slots: int = 4) -> tuple[SlotTimeline, SlotTimeline]:
    """(static, continuous) timelines for the article's four requests, queued ``num_batches`` times over.

    With ``num_batches=1`` both grids are the same (nothing waits, so nothing
    can fill the bubbles); with more, continuous batching packs the queue into
    the bubbles that static batching leaves idle.
    """
    lengths = list(ARTICLE_OUTPUT_LENGTHS) * num_batches
    return simulate_static_batching(lengths, num_slots), simulate_continuous_batching(lengths, num_slots)


class EngineSlots:
    """Slot occupancy read from an engine trace, one record at a time.

    Each sequence keeps one slot from the step it is first scheduled until it
    leaves the running set (finished, preempted or aborted). A slot counts as
    busy in a step only when its sequence computed tokens in that step; a
    running sequence left out for lack of token budget is idle for that step.
    New sequences take the lowest free slot, so the picture stays stable.
    """

    def __init__(self, num_slots: int | None = None) -> None:
        self.min_slots = num_slots or 0
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = []  # a min-heap of released slots
        self._num_slots = 0
        self.columns: list[np.ndarray] = []  # request index per slot, for each step
        self.prefill_columns: list[np.ndarray] = []
        self.steps: list[int] = []
        self.request_order: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.columns)

    def _take_slot(self, seq_id: int) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._num_slots
            self._num_slots += 1
        self._slot_of[seq_id] = slot
        return slot

    def append(self, record: StepRecord) -> None:
        column = {}
        prefill = {}
        for entry in record.scheduled:
            request = self.request_order.setdefault(entry.request_id, len(self.request_order))
            slot = self._slot_of.get(entry.seq_id)
            if slot is None:
                slot = self._take_slot(entry.seq_id)
            column[slot] = request
            prefill[slot] = entry.is_prefill
        size = max(self._num_slots, self.min_slots)
        col = np.full(size, IDLE, dtype=np.int32)
        pre = np.zeros(size, dtype=bool)
        for slot, request in column.items():
            col[slot] = request
            pre[slot] = prefill[slot]
        self.columns.append(col)
        self.prefill_columns.append(pre)
        self.steps.append(record.step)
        # after the step: leavers give their slot back, fork children take one
        for seq_id in [s for s in self._slot_of if s not in record.block_tables]:
            heapq.heappush(self._free, self._slot_of.pop(seq_id))
        for seq_id in sorted(record.block_tables):
            if seq_id not in self._slot_of:
                self._take_slot(seq_id)

    def timeline(self, upto: int | None = None) -> SlotTimeline:
        """The occupancy grid of steps ``0..upto`` (all by default)."""
        cols = self.columns if upto is None else self.columns[: upto + 1]
        pres = self.prefill_columns if upto is None else self.prefill_columns[: upto + 1]
        size = max([len(c) for c in cols] + [self.min_slots, 1])
        occupancy = np.full((size, len(cols)), IDLE, dtype=np.int32)
        prefill = np.zeros((size, len(cols)), dtype=bool)
        for i, (c, p) in enumerate(zip(cols, pres)):
            occupancy[: len(c), i] = c
            prefill[: len(p), i] = p
        labels = tuple(self.request_order)
        steps = np.asarray(self.steps[: len(cols)], dtype=np.int64)
        return SlotTimeline(occupancy, labels, "engine", prefill, steps)


def slot_timeline_from_trace(records: Iterable[StepRecord], num_slots: int | None = None) -> SlotTimeline:
    """The slot grid of a real engine run (``engine.trace``); ``num_slots`` pads to e.g. max_num_seqs."""
    slots = EngineSlots(num_slots)
    for record in records:
        slots.append(record)
    return slots.timeline()
