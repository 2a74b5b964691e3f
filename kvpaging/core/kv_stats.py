"""What the block manager's ``stats()`` returns: a snapshot of the pool's figures, every one an exact count (or a
ratio of counts) kept up to date as blocks move, never sampled. The lessons' charts and the views read these.
Also the high-water marks (``Peaks``) the block managers keep for it, and the snapshot's making (``KVCacheStats.of``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVCacheStats", "Peaks"]


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the pool's figures, all exact integers or ratios of them."""

    num_blocks: int
    block_size: int
    num_sequences: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # blocks findable by the prefix cache (in use or free)
    num_cached_free_blocks: int  # free, but still holding reusable KV
    num_tokens_stored: int  # slots holding a token, over blocks in use
    num_table_blocks: int  # sum of all block-table lengths: blocks needed without sharing
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_cow_copies: int
    num_evictions: int
    # High-water marks since the block manager's last reset_peak_stats(), exact: taken after every
    # change that can raise them, so a peak reached and undone within one engine step still counts.
    peak_used_blocks: int = 0  # the most blocks in use at once
    table_blocks_at_peak: int = 0  # what the tables pointed at, at that same moment
    peak_table_blocks: int = 0  # the most blocks the tables pointed at (possibly at another moment)
    peak_savings_blocks: int = 0  # the most blocks sharing saved at once (table blocks minus used blocks)
    num_passed_blocks: int = 0  # table entries given back as a sliding window passed them (all sequences, ever)

    @classmethod
    def of(cls, bm) -> KVCacheStats:
        """The figures of a ``BlockManager`` (or a sliding-window one) and its pool, now."""
        pool, peaks = bm.pool, bm.peaks
        return cls(
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            num_sequences=len(bm._seqs),
            num_used_blocks=pool.num_used_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_tokens_stored=pool.num_filled_slots,
            num_table_blocks=bm._num_table_blocks,
            prefix_query_tokens=bm._prefix_query_tokens,
            prefix_hit_tokens=bm._prefix_hit_tokens,
            num_cow_copies=bm._num_cow_copies,
            num_evictions=pool.num_evictions,
            peak_used_blocks=peaks.used_blocks,
            table_blocks_at_peak=peaks.table_blocks_at_peak,
            peak_table_blocks=peaks.table_blocks,
            peak_savings_blocks=peaks.savings_blocks,
            num_passed_blocks=bm._num_passed_blocks,
        )

    @property
    def internal_fragmentation(self) -> float:
        """Allocated slots holding no token, as a fraction of allocated slots."""
        allocated = self.num_used_blocks * self.block_size
        return 0.0 if allocated == 0 else 1.0 - self.num_tokens_stored / allocated

    @property
    def shared_savings_blocks(self) -> int:
        """Blocks that would exist without sharing minus blocks that do."""
        return self.num_table_blocks - self.num_used_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache, as a fraction of prompt tokens looked up."""
        return 0.0 if self.prefix_query_tokens == 0 else self.prefix_hit_tokens / self.prefix_query_tokens

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's "KV cache usage")."""
        return self.num_used_blocks / self.num_blocks


class Peaks:
    """The high-water marks of ``KVCacheStats``: blocks in use, table entries, and what sharing saved. A block
    manager calls :meth:`note` at the end of every method that can add a used block or a table entry (allocate,
    append, fork); the others only lower both, so the marks are exact peaks, not samples."""

    __slots__ = ("used_blocks", "table_blocks_at_peak", "table_blocks", "savings_blocks")

    def __init__(self) -> None:
        self.used_blocks = self.table_blocks_at_peak = self.table_blocks = self.savings_blocks = 0

    def note(self, used_blocks: int, table_blocks: int) -> None:
        """Raise the marks to the present: ``used_blocks`` in use, ``table_blocks`` entries in the tables."""
        if used_blocks > self.used_blocks:
            self.used_blocks, self.table_blocks_at_peak = used_blocks, table_blocks
        self.table_blocks = max(self.table_blocks, table_blocks)
        self.savings_blocks = max(self.savings_blocks, table_blocks - used_blocks)
