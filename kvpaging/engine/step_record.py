"""Step records: what happened in one engine step, small and immutable, for observers.

Every view in ``kvpaging.visualizers``, the metrics and the saved traces are
built from these records alone; nothing outside the engine reads its internals.
A record is built only when someone listens (an observer, or ``keep_trace``),
so an engine nobody watches pays nothing for them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger("kvpaging")

__all__ = ["StepRecord", "ScheduledEntry", "StepObservers"]


@dataclass(frozen=True)
class ScheduledEntry:
    request_id: str
    seq_id: int
    index: int  # completion index within the request
    num_tokens: int
    is_prefill: bool  # a prompt (or recompute) chunk, not a decode token
    start: int = 0  # position of the first token computed; > 0 at admission means prefix-cache hit tokens


@dataclass(frozen=True)
class StepRecord:
    """What happened in one step: small, immutable, and enough to redraw every visualization."""

    step: int
    start_time: float
    wall_time: float
    scheduled: tuple[ScheduledEntry, ...]
    num_batched_tokens: int
    preempted: tuple[int, ...]  # seq ids
    finished: tuple[int, ...]  # seq ids
    blocks_copied: tuple[tuple[int, int], ...]
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_tokens_stored: int
    num_waiting: int
    num_running: int
    block_tables: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq id -> table, for running seqs
    seq_num_tokens: dict[int, int] = field(default_factory=dict)  # seq id -> token slots filled, running seqs
    forked: tuple[tuple[int, int], ...] = ()  # (parent seq id, child seq id) pairs made this step
    sampled: tuple[int, ...] = ()  # seq ids that got a new token this step
    arrivals: dict[str, float] = field(default_factory=dict)  # request id -> arrival time, first scheduled now
    # seq id -> block table of each sequence that finished normally this step, as it was just before
    # its blocks were released (a request can be admitted and finish within one step)
    finished_block_tables: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # the blocks all tables hold (a block in n tables counted n times), as the block manager counts them: with a
    # window, without the entries it has passed; with a table per layer group, every group's (``block_tables``
    # holds the first group's). None in records of older engines: the views then count ``block_tables``
    num_table_blocks: int | None = None


class StepObservers:
    """The engine's listeners: observer callbacks and the trace (the last records, or all of them)."""

    def __init__(self) -> None:
        self.observers: list[Callable[[StepRecord], None]] = []
        self.trace: deque[StepRecord] | list[StepRecord] = deque(maxlen=256)
        self.keep_trace = False

    @property
    def listening(self) -> bool:
        """Whether step records are wanted (an observer, or the trace): else none is built."""
        return bool(self.observers) or self.keep_trace

    def emit(self, out, start: float, scheduler, finished=(), sampled=(), released: dict | None = None) -> None:
        """Build the step's record from the scheduler's output and the books after the step, and hand it
        to the trace and every observer (an observer that raises is logged once and detached)."""
        if not self.listening:
            return
        record = _record(out, start, scheduler, finished, sampled, released)
        if self.keep_trace:
            self.trace.append(record)
        for fn in list(self.observers):
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - a broken observer must not stop serving
                logger.exception("observer %r raised; detaching it", fn)
                self.observers.remove(fn)


def _record(out, start: float, scheduler, finished, sampled, released: dict | None) -> StepRecord:
    bm = scheduler.bm
    stats = bm.stats()
    return StepRecord(
        step=out.step,
        start_time=start,
        wall_time=time.perf_counter() - start,
        scheduled=tuple(
            ScheduledEntry(s.seq.request.request_id, s.seq.seq_id, s.seq.index, s.num_new_tokens, s.is_prefill,
                           s.start)
            for s in out.scheduled
        ),
        num_batched_tokens=out.num_batched_tokens,
        preempted=tuple(s.seq_id for s in out.preempted),
        finished=tuple(s.seq_id for s in finished),
        blocks_copied=tuple(out.blocks_to_copy),
        num_free_blocks=stats.num_free_blocks,
        num_used_blocks=stats.num_used_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_tokens_stored=stats.num_tokens_stored,
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        block_tables={s.seq_id: tuple(s.blocks.block_ids) for s in scheduler.running},
        seq_num_tokens={s.seq_id: s.blocks.num_tokens for s in scheduler.running},
        forked=tuple(out.forked),
        sampled=tuple(s.seq_id for s in sampled),
        arrivals={s.seq.request.request_id: s.seq.request.arrival_time for s in out.scheduled
                  if s.seq.request.first_scheduled_time == start},
        finished_block_tables=released or {},
        num_table_blocks=stats.num_table_blocks,
    )
