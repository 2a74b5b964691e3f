"""What the block manager's ``stats()`` returns: a snapshot of the pool's figures, every one an exact count (or a
ratio of counts) kept up to date as blocks move, never sampled. The lessons' charts and the views read these.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVCacheStats"]


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
