"""Block tables per layer group, over one pool: how a model that interleaves sliding-window and full-attention
layers gives back the blocks its sliding layers no longer read (vLLM's hybrid KV cache manager).

Gemma 2 and 3, gpt-oss and Cohere 2 mix layers that attend to every earlier token with layers that attend to
the last ``window`` tokens only. One block table for all layers must keep every block (a full layer reads it).
So the layers are cut into groups of one kind and equal size (``kvpaging.worker.kv_layout.layer_groups``), and
every sequence gets one table per group, each kept by a manager of its own: a :class:`BlockManager` for a full
group, a :class:`SlidingWindowBlockManager` for a sliding group, which gives blocks back as the window passes
them. All of them take blocks from one shared :class:`BlockPool`; a block is a page of one group's layers (the
``j``-th layer of every group stores in the same tensor), and belongs to one group at a time.

:class:`GroupedBlockManager` is what the scheduler sees: the block manager's methods, each done in every group.
What can fail is checked for all groups before any changes: a sequence gets its slots in every group or in none
(the free blocks all groups need together, against the pool's). The groups then hold their tables in step: the
same sequences, the same token counts, and the same rows in the model runner, which keeps one table array per
group (``SchedulerOutput.table_updates`` holds one list of changes per group). A prefix-cache hit is the
shortest of the groups' hits (each group caches its own blocks, its chains rooted at an identity of its own,
``root_cache_id``, so no lookup can find another group's block).

The saving: a sequence of ``L`` tokens holds ``L / block_size`` blocks in each full group and about
``window / block_size + 1`` in each sliding one, where one table for all layers would hold ``L / block_size``
pages of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Sequence

from kvpaging.core.block_manager import NO_HIT, BlockManager, PrefixHit, SequenceBlocks
from kvpaging.core.block_pool import BlockPool
from kvpaging.core.kv_stats import KVCacheStats, Peaks
from kvpaging.core.sliding_window import SlidingWindowBlockManager

__all__ = ["GroupedBlockManager", "GroupedPrefixHit"]


@dataclass(frozen=True)
class GroupedPrefixHit(PrefixHit):
    """A prefix hit in every group, all cut to the shortest: ``blocks`` are the first group's, ``per_group`` all."""

    per_group: tuple[PrefixHit, ...] = ()


class GroupedBlockManager:
    """One block table per layer group for each sequence, over one shared pool; the block manager's methods."""

    sliding_window = 0  # not a window on every layer: the full groups keep every block (``windows``: each group's)

    def __init__(self, windows: Sequence[int], num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, **kwargs) -> None:
        """``windows``: each group's (0: full attention); ``kwargs`` go to every group's manager (``hash_fn``)."""
        self.pool = BlockPool(num_blocks, block_size)
        self.groups: list[BlockManager] = [
            SlidingWindowBlockManager(num_blocks, block_size, window, enable_prefix_caching=enable_prefix_caching,
                                      pool=self.pool, root_cache_id=-1 - g, **kwargs) if window else
            BlockManager(num_blocks, block_size, enable_prefix_caching, pool=self.pool, root_cache_id=-1 - g, **kwargs)
            for g, window in enumerate(windows)]
        self.windows = tuple(windows)
        self.block_size = self.pool.block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.reset_peak_stats()

    # -- queries: the first group's table stands for the sequence -----------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free_blocks

    def has_sequence(self, seq_id: Hashable) -> bool:
        return self.groups[0].has_sequence(seq_id)

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        """The first group's table (``get_block_tables`` gives every group's)."""
        return self.groups[0].get_block_table(seq_id)

    def get_block_tables(self, seq_id: Hashable) -> list[list[int]]:
        return [group.get_block_table(seq_id) for group in self.groups]

    def get_sequence_blocks(self, seq_id: Hashable) -> SequenceBlocks:
        return self.groups[0].get_sequence_blocks(seq_id)

    def get_num_tokens(self, seq_id: Hashable) -> int:
        return self.groups[0].get_num_tokens(seq_id)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_step_changes(self) -> tuple[list[tuple[int, int]], list[list[tuple[int, int, list[int]]]]]:
        """Every group's copy-on-write pairs, and each group's table changes as a list of its own."""
        copies, updates = [], []
        for group in self.groups:
            group_copies, (group_updates,) = group.take_step_changes()
            copies += group_copies
            updates.append(group_updates)
        return copies, updates

    # -- the prefix cache ---------------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Each group's hit, all cut to the shortest (a position is served from the cache only if every
        layer's keys and values for it are)."""
        hits = [group.lookup_prefix(token_ids) for group in self.groups]
        k = min(len(hit.blocks) for hit in hits)
        hits = [replace(hit, blocks=hit.blocks[:k], block_hashes=hit.block_hashes[:k]) for hit in hits]
        return GroupedPrefixHit(hits[0].blocks, hits[0].block_hashes, hits[0].num_prompt_tokens, tuple(hits))

    # -- slots: every group or none -------------------------------------------------------------------
    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> SequenceBlocks | None:
        """``BlockManager.allocate_slots`` in every group, or None, changing nothing, when the pool lacks the
        blocks all groups need together (a sliding group first gives back the blocks its window has passed)."""
        if prefix_hit is None:
            tables = [group._state(seq_id) for group in self.groups]
            for group, st in zip(self.groups, tables):
                if group.sliding_window:
                    group._give_back_passed(st, st.num_tokens)
            need = sum(group.blocks_to_append(st, num_new_tokens) for group, st in zip(self.groups, tables))
            hits = [None] * len(self.groups)
        else:
            hits = prefix_hit.per_group if isinstance(prefix_hit, GroupedPrefixHit) else [NO_HIT] * len(self.groups)
            need = sum(group.blocks_to_allocate(seq_id, num_new_tokens, hit) for group, hit in zip(self.groups, hits))
            # the hit blocks a window has passed are not taken, but are held below too
            need += sum(1 for group, hit in zip(self.groups, hits)
                        for block in hit.blocks[: group._passed_in(len(hit.blocks))] if block.ref_cnt == 0)
        if need > self.pool.free_queue.num_free_blocks:
            return None
        # every group's hit blocks get an owner first, so that no group's new blocks evict another group's hit
        hit_blocks = [block for hit in hits if hit is not None for block in hit.blocks]
        for block in hit_blocks:
            self.pool.touch(block)
        tables = [group.allocate_slots(seq_id, token_ids, num_new_tokens, hit) for group, hit in zip(self.groups, hits)]
        for block in hit_blocks:
            self.pool.free_block(block)
        if any(table is None for table in tables):  # the check above counts every block the groups take
            raise RuntimeError(f"the layer groups fell out of step giving sequence {seq_id!r} its slots")
        self._note_peak()
        return tables[0]

    def append_decode_slots(self, seqs: list) -> int:
        """``BlockManager.append_decode_slots``: one more slot for each of ``seqs`` in every group, in order, until
        the pool has no blocks for one; how many got theirs."""
        bs, caching, groups = self.block_size, self.enable_prefix_caching, self.groups
        free_queue = self.pool.free_queue
        tables_of = [group._seqs for group in groups]
        sliding = [(group, group._seqs) for group in groups if group.sliding_window]
        max_tokens = min(group.max_tokens_per_sequence for group in groups)
        filling = []  # unshared last blocks with room, one more slot each: filled by the pool at the end
        grew = False  # whether a decode took new blocks
        served = 0
        for seq in seqs:
            seq_id, tokens = seq.seq_id, seq.token_ids
            for group, tables in sliding:  # first, the blocks each window has passed go back
                st = tables[seq_id]
                group._give_back_passed(st, st.num_tokens)
            tables = [of[seq_id] for of in tables_of]
            n = tables[0].num_tokens
            lasts = [st.blocks[-1] for st in tables] if n % bs else None
            if lasts is not None and all(last.ref_cnt == 1 for last in lasts):  # room in every group's last block
                filling += lasts
                for st in tables:
                    st.num_tokens = n + 1
            elif lasts is None and n < max_tokens and len(groups) <= free_queue.num_free_blocks:
                for group, st in zip(groups, tables):  # a full last block everywhere: a new one in every group
                    group._grow(st, 1)
                grew = True
            elif self.allocate_slots(seq_id, tokens, 1) is None:  # a copy on write, or the pool short: in every
                break  # group or none (the general path also raises for a sequence the pool could never hold)
            if caching and (n + 1) % bs == 0:  # the decode fills the last blocks: findable from this step on
                for group, st in zip(groups, tables):
                    group._cache_blocks(st, tokens, n + 1)
            served += 1
        self.pool.fill_one_each(filling)
        if grew:
            self._note_peak()
        return served

    def fork(self, parent_id: Hashable, child_id: Hashable) -> SequenceBlocks:
        tables = [group.fork(parent_id, child_id) for group in self.groups]
        self._note_peak()
        return tables[0]

    def free(self, seq_id: Hashable) -> None:
        for group in self.groups:
            group.free(seq_id)

    def step_done(self, failed: bool = False) -> None:
        for group in self.groups:
            group.step_done(failed)
        self._note_peak()

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # -- figures ----------------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        """The pool's figures (its blocks are pages of one group's layers), and the tables' summed over the groups:
        pages in tables, pages passed by a window, pages copied on write (a copy in every group's table). A
        sequence counts once, and its prefix hits as the first group's, which every group's equal."""
        parts = [group.stats() for group in self.groups]
        first = parts[0]
        return replace(
            first,
            num_table_blocks=sum(p.num_table_blocks for p in parts),
            num_cow_copies=sum(p.num_cow_copies for p in parts),
            num_passed_blocks=sum(p.num_passed_blocks for p in parts),
            peak_used_blocks=self.peaks.used_blocks,
            table_blocks_at_peak=self.peaks.table_blocks_at_peak,
            peak_table_blocks=self.peaks.table_blocks,
            peak_savings_blocks=self.peaks.savings_blocks,
        )

    def reset_peak_stats(self) -> None:
        self.peaks = Peaks()
        self._note_peak()

    def _note_peak(self) -> None:
        """The high-water marks of the whole pool and of all groups' tables, after each change that adds to
        them (the groups' own marks see the pool between two groups' changes)."""
        self.peaks.note(self.num_blocks - self.pool.free_queue.num_free_blocks,
                        sum(group._num_table_blocks for group in self.groups))
