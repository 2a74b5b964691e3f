"""Rebuild what the block pool looked like after every step, from step records alone.

A :class:`~kvpaging.engine.llm_engine.StepRecord` says which sequences ran, with how many
tokens, and every running sequence's block table. It does not say how many
token slots each block holds, how many tables share a block, or which free
blocks still hold reusable KV for the prefix cache. The visualizers need all
three, and they may not reach into the engine (the design guide's rule:
visualizers read step records, nothing else). So this module *replays* the
records, the way a debugger replays a log. (Where a record carries
``seq_num_tokens`` and ``forked``, as newer engines write them, the replay takes
lengths and fork parents from there instead of working them out.)

- **Sequence lengths.** A sequence admitted in this step brought ``n`` prompt
  tokens and got ``len(table)`` blocks. The blocks beyond ``ceil(n /
  block_size)`` can only be prefix-cache hits, so ``hits = len(table) -
  ceil(n / block_size)`` and its length is ``hits * block_size + n``. After
  that, every scheduled chunk adds its ``num_tokens``. A child forked for
  ``n > 1`` sampling appears with no scheduled entry and the very same table
  as its parent, so it takes the parent's length.
- **Block fill.** Logical block ``i`` of a sequence of length ``L`` holds
  ``min(block_size, L - i * block_size)`` tokens.
- **Reference counts.** A block's reference count is the number of running
  block tables that hold it (the block manager keeps exactly that invariant).
- **Cached free blocks.** A full block of a computed sequence is offered to the
  prefix cache; it stays findable after its sequence ends until the pool hands
  it out again. The replay keeps that set. A request can start and finish
  within one step, so its table is never among the running ones: records carry
  the tables of the sequences that finished or were preempted
  (``finished_block_tables``). With a record from an older engine, which lacks
  them, the set is exact only until the first sequence that takes a block in
  the step it leaves in (such a one-step request, or a sequence whose last
  token opens a new block).

Everything is kept compactly (a few small numpy arrays per step), so a dashboard
can scrub back and forth through thousands of steps. The per-step *pictures*
(which block belongs to whom) are computed on demand by :func:`pool_arrays`.

What the records would need for this file to shrink to nothing is listed in the
package docstring (``kvpaging.visualizers``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpaging.engine.llm_engine import StepRecord

__all__ = ["TraceReplay", "DerivedStep", "PoolArrays", "pool_arrays", "infer_block_size", "table_blocks_of"]

_INT = np.int64


def table_blocks_of(record) -> int:
    """The blocks a step's tables hold, each once per table: the engine's own count where the record has it (a
    window's passed entries left out, every layer group's tables in), else the recorded tables' entries."""
    counted = getattr(record, "num_table_blocks", None)
    return counted if counted is not None else sum(len(t) for t in record.block_tables.values())


@dataclass(frozen=True)
class DerivedStep:
    """What the replay learned from one record; arrays are aligned with ``seq_ids``.

    ``seq_ids`` lists the running sequences after the step (the record's
    ``block_tables`` keys, sorted). ``num_tokens[i]`` is how many token slots
    sequence ``seq_ids[i]`` fills, ``hit_blocks[i]`` how many of its leading
    blocks came from the prefix cache when it was (re)admitted, and ``exact[i]``
    is False when the replay joined too late to know the length (it then
    assumes full blocks).
    """

    position: int
    seq_ids: np.ndarray
    num_tokens: np.ndarray
    hit_blocks: np.ndarray
    exact: np.ndarray
    admitted: tuple[int, ...]  # seq ids admitted (or re-admitted after preemption) in this step
    forked: tuple[int, ...]  # seq ids that appeared by forking in this step
    ended: tuple[int, ...]  # seq ids that left the running set without being preempted
    cached_free: np.ndarray  # sorted ids of free blocks that still hold prefix-cache entries
    num_cached_derived: int  # the replay's count of cached blocks (record.num_cached_blocks is the truth)


@dataclass(frozen=True)
class PoolArrays:
    """The physical pool after one step, one entry per block id."""

    ref_count: np.ndarray  # running tables holding the block
    fill: np.ndarray  # token slots holding a token (0 for free blocks)
    owner: np.ndarray  # seq id of the only holder; -1 free; -2 shared by several
    cached_free: np.ndarray  # bool: free, but still findable by the prefix cache


class TraceReplay:
    """Step records plus what can be derived from them, growing one record at a time.

    ``TraceReplay(records, block_size=16)`` replays a whole trace; a live view
    calls :meth:`append` for each new record. Besides the records and their
    :class:`DerivedStep`, it keeps per-step number columns (tokens, blocks,
    queue lengths) for the time-series plots, as numpy arrays via :meth:`column`.
    """

    #: Numeric columns kept for every step (see :meth:`column`).
    COLUMNS = (
        "step",
        "start_time",
        "wall_time",
        "prefill_tokens",
        "decode_tokens",
        "num_batched_tokens",
        "num_free_blocks",
        "num_used_blocks",
        "num_cached_blocks",
        "num_tokens_stored",
        "num_waiting",
        "num_running",
        "num_preempted",
        "num_table_blocks",
    )

    def __init__(
        self,
        records: Iterable[StepRecord] = (),
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        meta = getattr(records, "meta", None) or {}  # a trace from load_trace() remembers its sizes
        records = list(records)
        if block_size is None:
            block_size = meta.get("block_size") or (infer_block_size(records) if records else None)
        if num_blocks is None:
            num_blocks = meta.get("num_blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.records: list[StepRecord] = []
        self.steps: list[DerivedStep] = []
        self.seq_request: dict[int, str] = {}  # seq id -> request id (fork children included)
        self.seq_index: dict[int, int] = {}  # seq id -> completion index within its request
        self.request_order: dict[str, int] = {}  # request id -> order of first appearance (for colours)
        self._columns: dict[str, list] = {name: [] for name in self.COLUMNS}
        self._column_cache: dict[str, np.ndarray] = {}
        self._lengths: dict[int, int] = {}
        self._exact: dict[int, bool] = {}
        self._hits: dict[int, int] = {}
        self._tables: dict[int, tuple[int, ...]] = {}
        self._cached: set[int] = set()
        self._cached_free = np.zeros(0, dtype=_INT)
        self.extend(records)

    def __len__(self) -> int:
        return len(self.records)

    def extend(self, records: Iterable[StepRecord]) -> None:
        for record in records:
            self.append(record)

    # -- replaying one record ------------------------------------------------------------------
    def append(self, record: StepRecord) -> DerivedStep:
        """Take the next record; returns what was derived from it."""
        if self.block_size is None:
            raise ValueError("block_size is unknown: pass TraceReplay(..., block_size=...) before appending records")
        bs = self.block_size
        if self.num_blocks is None:
            self.num_blocks = record.num_free_blocks + record.num_used_blocks
        tables = record.block_tables
        # Sequences that finished in this step are gone from the running tables; newer records
        # keep their last tables, so their lengths are worked out like everyone else's (for the
        # prefix cache), while the step's picture shows the running ones only.
        finished_tables = getattr(record, "finished_block_tables", None) or {}
        all_tables = {**tables, **finished_tables} if finished_tables else tables
        entries = {}
        for entry in record.scheduled:
            entries[entry.seq_id] = entry
            self.seq_request.setdefault(entry.seq_id, entry.request_id)
            self.seq_index[entry.seq_id] = entry.index
            self.request_order.setdefault(entry.request_id, len(self.request_order))

        lengths: dict[int, int] = {}
        exact: dict[int, bool] = {}
        hits: dict[int, int] = {}
        admitted, forked, later = [], [], []
        # The first record of a bounded trace (engine.trace keeps the last 256 steps) may be the
        # middle of a run: a prefill entry there can be a prompt's second chunk, not an admission.
        joined_late = not self.records and record.step > 1
        for sid, table in all_tables.items():
            entry = entries.get(sid)
            if sid in self._lengths:  # running before this step
                length = self._lengths[sid] + (entry.num_tokens if entry else 0)
                is_exact = self._exact[sid]
                if not is_exact:
                    grew = len(table) > len(self._tables.get(sid, ()))
                    if grew and entry is not None and entry.num_tokens == 1:
                        length, is_exact = (len(table) - 1) * bs + 1, True  # a decode token opened a new block
                    else:
                        length = min(max(length, (len(table) - 1) * bs + 1), len(table) * bs)
                lengths[sid], exact[sid], hits[sid] = length, is_exact, self._hits[sid]
            elif entry is not None and entry.is_prefill and not joined_late:  # admitted (or re-admitted) now
                num_hit = max(0, len(table) - math.ceil(entry.num_tokens / bs))
                lengths[sid], exact[sid], hits[sid] = num_hit * bs + entry.num_tokens, True, num_hit
                admitted.append(sid)
            else:
                later.append(sid)
        parents = {child: parent for parent, child in getattr(record, "forked", ())}
        for sid in later:  # fork children: recorded as such, or found by their parent's identical table
            table = all_tables[sid]
            parent = parents.get(sid)
            if parent not in lengths:
                parent = next((p for p in entries if p in lengths and all_tables.get(p) == table), None)
            if parent is not None:
                lengths[sid], exact[sid], hits[sid] = lengths[parent], exact[parent], hits[parent]
                self.seq_request.setdefault(sid, self.seq_request[parent])
                self.seq_index.setdefault(sid, -1)  # unknown until it is scheduled
                forked.append(sid)
            else:  # joined a bounded trace late: assume full blocks until a decode step tells
                lengths[sid], exact[sid], hits[sid] = len(table) * bs, False, 0
        # Newer engines record every running sequence's length: then nothing is guessed.
        for sid, num_tokens in (getattr(record, "seq_num_tokens", None) or {}).items():
            if sid in lengths:
                lengths[sid], exact[sid] = num_tokens, True

        preempted = set(record.preempted)
        ended = tuple(sid for sid in self._tables if sid not in tables and sid not in preempted)
        self._update_cache(record, all_tables, lengths, exact, hits, admitted)
        if finished_tables:  # what the next record needs is the running sequences' state
            admitted = [sid for sid in admitted if sid in tables]
            forked = [sid for sid in forked if sid in tables]
            for sid in finished_tables:
                del lengths[sid], exact[sid], hits[sid]

        seq_ids = np.array(sorted(tables), dtype=_INT)
        derived = DerivedStep(
            position=len(self.records),
            seq_ids=seq_ids,
            num_tokens=np.array([lengths[s] for s in seq_ids.tolist()], dtype=_INT),
            hit_blocks=np.array([hits[s] for s in seq_ids.tolist()], dtype=_INT),
            exact=np.array([exact[s] for s in seq_ids.tolist()], dtype=bool),
            admitted=tuple(admitted),
            forked=tuple(forked),
            ended=ended,
            cached_free=self._cached_free,
            num_cached_derived=len(self._cached),
        )
        self._lengths, self._exact, self._hits, self._tables = lengths, exact, hits, dict(tables)
        self.records.append(record)
        self.steps.append(derived)
        self._add_columns(record)
        return derived

    def _update_cache(self, record, all_tables, lengths, exact, hits, admitted) -> None:
        """Track which blocks hold prefix-cache entries (see the module docstring).

        ``all_tables`` are the running sequences' tables plus, from newer engines, the
        last tables of the sequences that finished in this step. First every block that
        a table holds *fresh* (newly taken from the free queue) loses its old cache
        entry, if it had one: the pool evicted it to hand it out. Then every full block
        of a sequence with a known length is in the cache (the engine offers full blocks
        right after computing them, before a finished sequence lets go of them).
        """
        if record.num_cached_blocks == 0:  # caching is off, or the cache was just reset
            self._cached.clear()
        else:
            admitted = set(admitted)
            for sid, table in all_tables.items():
                old = self._tables.get(sid)
                if old is not None:
                    fresh = [b for i, b in enumerate(table) if i >= len(old) or old[i] != b]
                elif sid in admitted:
                    fresh = table[hits[sid] :]
                else:
                    fresh = ()  # a fork child shares all its blocks with its parent
                self._cached.difference_update(fresh)
            for sid, table in all_tables.items():
                if exact[sid]:
                    self._cached.update(table[: lengths[sid] // self.block_size])
            if all_tables is record.block_tables:
                # An older engine's record does not carry the tables of finished sequences. One
                # that was running computed its last tokens first: the blocks they filled were
                # cached before the sequence let go of them.
                scheduled = {e.seq_id: e.num_tokens for e in record.scheduled}
                for sid in record.finished:
                    old = self._tables.get(sid)
                    if old is not None and self._exact.get(sid, False) and sid in scheduled:
                        self._cached.update(old[: (self._lengths[sid] + scheduled[sid]) // self.block_size])
        in_use = {b for table in record.block_tables.values() for b in table}
        cached_free = np.array(sorted(self._cached - in_use), dtype=_INT)
        if not np.array_equal(cached_free, self._cached_free):
            self._cached_free = cached_free  # else share the previous array: most steps change nothing

    def _add_columns(self, record: StepRecord) -> None:
        prefill = sum(e.num_tokens for e in record.scheduled if e.is_prefill)
        decode = sum(e.num_tokens for e in record.scheduled if not e.is_prefill)
        values = {
            "step": record.step,
            "start_time": record.start_time,
            "wall_time": record.wall_time,
            "prefill_tokens": prefill,
            "decode_tokens": decode,
            "num_batched_tokens": record.num_batched_tokens,
            "num_free_blocks": record.num_free_blocks,
            "num_used_blocks": record.num_used_blocks,
            "num_cached_blocks": record.num_cached_blocks,
            "num_tokens_stored": record.num_tokens_stored,
            "num_waiting": record.num_waiting,
            "num_running": record.num_running,
            "num_preempted": len(record.preempted),
            "num_table_blocks": table_blocks_of(record),
        }
        for name, value in values.items():
            self._columns[name].append(value)
        self._column_cache.clear()

    # -- reading ---------------------------------------------------------------------------------
    def column(self, name: str) -> np.ndarray:
        """One per-step number as an array (cached until the next record arrives)."""
        if name not in self._column_cache:
            self._column_cache[name] = np.asarray(self._columns[name])
        return self._column_cache[name]

    def seq_lengths(self, position: int) -> dict[int, int]:
        d = self.steps[position]
        return dict(zip(d.seq_ids.tolist(), d.num_tokens.tolist()))

    def request_of(self, seq_id: int) -> str:
        return self.seq_request.get(seq_id, f"seq {seq_id}")


def pool_arrays(replay: TraceReplay, position: int) -> PoolArrays:
    """Reference count, fill and owner of every physical block after step ``position``.

    Cost: one pass over the running block tables, vectorised with numpy.
    """
    record = replay.records[position]
    derived = replay.steps[position]
    num_blocks = replay.num_blocks
    bs = replay.block_size
    tables = record.block_tables
    ref_count = np.zeros(num_blocks, dtype=_INT)
    fill = np.zeros(num_blocks, dtype=_INT)
    owner = np.full(num_blocks, -1, dtype=_INT)
    if tables:
        sizes = np.array([len(tables[s]) for s in derived.seq_ids.tolist()], dtype=_INT)
        ids = np.fromiter((b for s in derived.seq_ids.tolist() for b in tables[s]), dtype=_INT, count=int(sizes.sum()))
        seq_of_entry = np.repeat(derived.seq_ids, sizes)
        # logical index of each entry within its own table: 0, 1, ..., len-1 for every table
        starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
        logical = np.arange(ids.size, dtype=_INT) - starts
        entry_fill = np.clip(np.repeat(derived.num_tokens, sizes) - logical * bs, 0, bs)
        np.add.at(ref_count, ids, 1)
        fill[ids] = entry_fill  # holders of a shared block agree on its fill
        owner[ids] = seq_of_entry
        owner[ref_count > 1] = -2
    cached_free = np.zeros(num_blocks, dtype=bool)
    cached_free[derived.cached_free] = True
    return PoolArrays(ref_count, fill, owner, cached_free)


def infer_block_size(records: Sequence[StepRecord], max_records: int = 200) -> int:
    """Find the block size of a trace that was saved without it.

    The engine allows powers of two from 1 to 256. For each, replay the first
    records and add up the tokens the replay believes each used block holds:
    only the true block size reproduces the ``num_tokens_stored`` that the
    engine recorded at every step. (With a wrong size, sequences get the wrong
    number of blocks for their tokens, so the sums drift.) The size with the
    fewest mismatching steps wins; ties go to the smaller size.
    """
    records = list(records)[:max_records]
    best, best_misses = 16, None
    for bs in (1 << p for p in range(9)):
        replay = TraceReplay(block_size=bs)
        misses = 0
        try:
            for record in records:
                replay.append(record)
                arrays = pool_arrays(replay, len(replay) - 1)
                misses += int(arrays.fill.sum()) != record.num_tokens_stored
        except (IndexError, ValueError):
            continue  # block ids out of range or negative counts: not this size
        if best_misses is None or misses < best_misses:
            best, best_misses = bs, misses
    return best
