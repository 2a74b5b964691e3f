"""What the scheduler hands the rest of the engine: one step's plan (``SchedulerOutput``, with a
``ScheduledSeq`` per prefill chunk) and what it did with the step's sampled tokens (``UpdateResult``).

These types live apart from the scheduler so that the worker, which reads a plan, never imports the
scheduler that makes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpaging.core.sequence import Sequence

__all__ = ["ScheduledSeq", "SchedulerOutput", "UpdateResult"]


@dataclass(eq=False, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens ``[start, start + num_new_tokens)``.

    ``table_row`` says where its whole context lives: its block table's row in the model runner's ``BlockTable``.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool  # the chunk reaches the end of the sequence, so its last position yields a token
    is_prefill: bool  # prompt tokens (or recomputed ones) rather than one decode token: decided here only
    table_row: int = -1


@dataclass(eq=False)
class SchedulerOutput:
    """Everything one step needs, handed from the scheduler to the model runner and the sampler.

    A step's sequences come in two groups, and are packed into the forward pass in this order:

    * ``decodes``: sequences computing exactly one token, their last one (a decode, or a prompt
      whose last chunk is one token). Each samples. They are most of every busy step, so they are
      kept as plain lists and arrays (no object per sequence), and their block tables are rows of
      the runner's own block table: it builds their inputs with a few numpy operations.
    * ``chunks``: everything else (prefill chunks, recomputation after preemption), one
      ``ScheduledSeq`` each.

    ``scheduled`` lists both groups, decodes first, as ``ScheduledSeq``s (built on demand).
    """

    step: int
    decodes: list[Sequence] = field(default_factory=list)
    decode_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their block-table rows
    decode_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the token computed
    decode_token_ids: list[int] = field(default_factory=list)  # and its id (the sequence's last)
    chunks: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    # the sequences that get a token this step, in order: the decodes, then the chunks that reach their end,
    # then completions forked this step; each samples with its request's SamplingParams and its own seed
    # (row_sampling.completion_seed of its request's seed, a number; no seed: the engine's shared generator)
    samples: list[Sequence] = field(default_factory=list)
    # the logits row each of ``samples`` reads (the runner returns one row per sequence whose chunk reached its
    # end, decodes first); None when that is simply row k for sample k, i.e. when no request forked this step
    sample_rows: list[int] | None = None
    # which of ``chunks`` (indices) belong to requests that want their prompt's log-probabilities: the runner
    # returns one more logits row per token of each, after the sampling rows, in this order
    prompt_logprob_chunks: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    forked: list[tuple[int, int]] = field(default_factory=list)  # (parent, child) seq ids, made this step
    children: list[Sequence] = field(default_factory=list)  # the completions forked this step
    # every change to the block tables since the last step's output, in order: (row, column, block ids), which the
    # runner applies to its own copy of the tables before it reads them (BlockTable, kvpaging/worker/model_runner.py);
    # one list per layer group (most models: one group, one list)
    table_updates: list[list[tuple[int, int, list[int]]]] = field(default_factory=lambda: [[]])
    block_size: int = 16

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.chunks)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Every sequence of the step, decodes first (made on each call: for records and tests, not the hot path)."""
        decodes = [ScheduledSeq(seq, start, 1, True, start < seq.prompt_len, row) for seq, start, row in
                   zip(self.decodes, self.decode_positions.tolist(), self.decode_rows.tolist())]
        return decodes + self.chunks


@dataclass(eq=False)
class UpdateResult:
    """What ``Scheduler.update`` did with a step's sampled tokens."""

    sampled: list[Sequence]  # sequences that got a token, in sampling order (the step's ``samples``)
    finished: list[Sequence]  # of those, the ones that are done (their blocks are freed)
    released_tables: dict[int, tuple[int, ...]] = field(default_factory=dict)  # finished seq id -> its last table
    # sequences of requests that failed on their own this step (their row could not be sampled, their stop
    # check raised): finished with the error, blocks freed, out of the queues; not in ``sampled`` or ``finished``
    failed: list[Sequence] = field(default_factory=list)
