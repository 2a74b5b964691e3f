"""Small worked examples: step records written out by hand, with known answers.

Lessons use them to show one idea at a time without running a model, and the
tests check every view against them. ``hand_trace()`` is five steps of a pool
of 8 blocks of 4 slots, written out the way the engine would record them
(block ids follow the pool's free-queue order). What happens in it:

step 1  seq 0 (request a) prefills 6 tokens -> table (0, 1); block 0 full, so cached
step 2  seq 0 decodes (7 tokens); seq 1 (request b) is admitted with a 6-token prompt whose
        first block is a prefix-cache hit: it computes 2 tokens, table (0, 2)
step 3  seq 0 -> 8 tokens (block 1 full, cached), seq 1 -> 7; seq 2 (request c, n=2) prefills
        5 tokens -> table (3, 4), and is forked into seq 3 with the same table
step 4  seq 0 decodes its 9th token into a new block 5 and finishes (blocks 1, 5 freed; 1 stays
        cached); seq 1 -> 8 (block 2 full, cached); seq 2 writes into shared, partly filled
        block 4, so copy-on-write gives it block 6 (blocks_copied (4, 6)); seq 3 -> 6 in block 4
step 5  seq 1 decodes into a new block 7 and finishes; seqs 2 and 3 -> 7 tokens
"""

from __future__ import annotations

from kvpaging.engine.llm_engine import ScheduledEntry, StepRecord

__all__ = ["hand_trace", "chunked_prefill_trace", "BLOCK_SIZE", "NUM_BLOCKS"]

BLOCK_SIZE = 4
NUM_BLOCKS = 8


def _record(step, scheduled, tables, *, used, cached, stored, finished=(), copied=(), preempted=(), waiting=0):
    return StepRecord(
        step=step,
        start_time=float(step),
        wall_time=0.5,
        scheduled=tuple(ScheduledEntry(*e) for e in scheduled),
        num_batched_tokens=sum(e[3] for e in scheduled),
        preempted=tuple(preempted),
        finished=tuple(finished),
        blocks_copied=tuple(copied),
        num_free_blocks=NUM_BLOCKS - used,
        num_used_blocks=used,
        num_cached_blocks=cached,
        num_tokens_stored=stored,
        num_waiting=waiting,
        num_running=len(tables),
        block_tables=dict(tables),
    )


def hand_trace() -> list[StepRecord]:
    return [
        _record(1, [("a", 0, 0, 6, True)], {0: (0, 1)}, used=2, cached=1, stored=6, waiting=1),
        _record(2, [("a", 0, 0, 1, False), ("b", 1, 0, 2, True)], {0: (0, 1), 1: (0, 2)},
                used=3, cached=1, stored=9),
        _record(3, [("a", 0, 0, 1, False), ("b", 1, 0, 1, False), ("c", 2, 0, 5, True)],
                {0: (0, 1), 1: (0, 2), 2: (3, 4), 3: (3, 4)}, used=5, cached=3, stored=16),
        _record(4, [("a", 0, 0, 1, False), ("b", 1, 0, 1, False), ("c", 2, 0, 1, False), ("c", 3, 1, 1, False)],
                {1: (0, 2), 2: (3, 6), 3: (3, 4)}, used=5, cached=4, stored=16, finished=(0,), copied=[(4, 6)]),
        _record(5, [("b", 1, 0, 1, False), ("c", 2, 0, 1, False), ("c", 3, 1, 1, False)],
                {2: (3, 6), 3: (3, 4)}, used=3, cached=4, stored=10, finished=(1,)),
    ]


def chunked_prefill_trace() -> list[StepRecord]:
    """One request whose 10-token prompt is computed in chunks of 4, 4 and 2, then one decode."""
    return [
        _record(1, [("p", 0, 0, 4, True)], {0: (0,)}, used=1, cached=1, stored=4),
        _record(2, [("p", 0, 0, 4, True)], {0: (0, 1)}, used=2, cached=2, stored=8),
        _record(3, [("p", 0, 0, 2, True)], {0: (0, 1, 2)}, used=3, cached=2, stored=10),
        _record(4, [("p", 0, 0, 1, False)], {0: (0, 1, 2)}, used=3, cached=2, stored=11),
    ]
