"""The block manager of a model whose every layer attends through one sliding window (Mistral, Phi-3, Starcoder2).

With a sliding window on every layer (``sliding_window``: Mistral, Phi-3, Starcoder2), a query at
position ``p`` reads only the keys after ``p - sliding_window``, so a block whose last token lies at or
before ``q - sliding_window``, where ``q`` is the first position a sequence still has to compute, will
never be read by that sequence again: ``allocate_slots`` and ``append_decode_slots`` give such blocks
back to the pool as the window passes them. The table keeps its length; a passed
entry holds -1 (no block) here and block 0 in the model runner's copy, which the attention kernels never
read into a result (they start at the window, or mask it). A sequence then holds about
``sliding_window / block_size + 1`` blocks however long it grows. The passed blocks stay findable in the prefix cache until they are evicted, like any freed block.

vLLM keeps the same policy in its ``SlidingWindowManager``. Everything else (tables, copy-on-write, the prefix cache)
is :class:`BlockManager`'s: this class only gives passed blocks back before a sequence gets new slots, takes no
passed block of a prefix hit, and counts only the blocks a window holds when it asks whether a sequence can ever fit.
"""

from __future__ import annotations

import sys
from typing import Hashable, Sequence

from kvpaging.checks import check_int
from kvpaging.core.block_manager import BlockManager, PrefixHit, SequenceBlocks, _runner_row

__all__ = ["SlidingWindowBlockManager"]


class SlidingWindowBlockManager(BlockManager):
    """:class:`BlockManager` that gives each sequence's blocks back to the pool once its window has passed them."""

    def __init__(self, num_blocks: int, block_size: int = 16, sliding_window: int = 1, **kwargs) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self.sliding_window = check_int("sliding_window", sliding_window, 1)
        # about the window's blocks are all a decode holds, so any length fits once the pool holds those
        if num_blocks >= (sliding_window - 1) // self.block_size + 2:
            self.max_tokens_per_sequence = sys.maxsize

    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> SequenceBlocks | None:
        if prefix_hit is None:  # first, whatever follows: no query of this sequence reads them again
            st = self._state(seq_id)
            self._give_back_passed(st, st.num_tokens)
        return super().allocate_slots(seq_id, token_ids, num_new_tokens, prefix_hit)

    def append_decode_slots(self, seqs: list) -> int:
        for seq in seqs:  # first, whatever follows: no query of these sequences reads them again
            self._give_back_passed(seq.blocks, seq.blocks.num_tokens)
        return super().append_decode_slots(seqs)

    def _passed_in(self, num_hit_blocks: int) -> int:
        """How many leading blocks of a prefix hit this long the window has passed before its sequence computes
        anything: the first query, right after the hit, reads none of them."""
        return max(0, num_hit_blocks * self.block_size - self.sliding_window + 1) // self.block_size

    def _first_held_block(self, first_query: int) -> int:
        """The block holding ``first_query - sliding_window + 1``: the ones before it have gone back."""
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _give_back_passed(self, st: SequenceBlocks, first_query: int) -> None:
        """Free the blocks the sliding window has passed: every token of block ``j`` lies at or before
        ``first_query - sliding_window`` (no query from ``first_query`` on reads it), that is
        ``(j + 1) * block_size <= first_query - sliding_window + 1``. (A full last block goes too when the window
        is 1: the sequence's next token then opens a new one.)"""
        passed = (first_query - self.sliding_window + 1) // self.block_size  # at most len(st.blocks)
        if passed <= st.num_passed:
            return  # (most calls: the window crosses a block boundary once every block_size tokens)
        old = st.num_passed
        for j in range(old, passed):
            block = st.blocks[j]
            st.passed_cache_id = block.cache_id if block.block_hash is not None else None
            self.pool.free_block(block)  # one owner fewer: a forked sibling may still hold it
            st.blocks[j] = None
        self._num_table_blocks -= passed - st.num_passed
        self._num_passed_blocks += passed - st.num_passed
        st.num_passed = passed
        # the runner's copy reads block 0 there: the whole table the first time (a write from column 0 is one),
        # after that only the entries passed now
        self._table_updates.append((st.row, 0, _runner_row(st)) if not old else (st.row, old, [0] * (passed - old)))
