"""The books of the memory core, checked from scratch: every count the pool, the block manager and the
scheduler keep up to date as they go is recomputed here by a full scan and compared (tests and the soak
benchmark call these after every change; the engine never does: each is O(num_blocks) or worse).

A check reads private fields on purpose: it is the one place that looks at how the books are kept
rather than at what they answer. Each raises ``InvariantError`` naming what disagrees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpaging.core.scheduler import seats_of
from kvpaging.core.sequence import SequenceStatus
from kvpaging.errors import InvariantError

if TYPE_CHECKING:
    from kvpaging.core.block_manager import BlockManager
    from kvpaging.core.block_pool import BlockPool, FreeBlockQueue
    from kvpaging.core.scheduler import Scheduler

__all__ = ["check_free_queue", "check_pool", "check_block_manager", "check_scheduler"]


def check_free_queue(queue: FreeBlockQueue) -> None:
    """Walk the list both ways: every link has its reverse, and the count is right (tests only)."""
    before, block, count = queue._head, queue._head.next_free, 0
    while block is not queue._tail:
        _check(block is not None and block.prev_free is before,
               f"free queue: the block after {before.block_id} does not link back to it")
        before, block, count = block, block.next_free, count + 1
    _check(queue._tail.prev_free is before, "free queue: the tail does not link back to the last block")
    _check(count == queue.num_free_blocks, f"free queue holds {count} blocks, counted {queue.num_free_blocks}")


def check_pool(pool: BlockPool) -> None:
    """Scan everything and raise InvariantError on any inconsistency (tests only: O(num_blocks))."""
    free_ids = [b.block_id for b in pool.free_queue]
    _check(len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free queue corrupt")
    check_free_queue(pool.free_queue)
    free = set(free_ids) | {b.block_id for b in pool._held}
    for block in pool.blocks:
        _check(block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}")
        _check((block.ref_cnt == 0) == (block.block_id in free),
               f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block.block_id in free}")
        _check(0 <= block.num_filled <= pool.block_size, f"block {block.block_id} holds {block.num_filled}")
        if block.block_hash is not None:
            _check(block.token_ids is not None and len(block.token_ids) == pool.block_size,
                   f"cached block {block.block_id} does not hold a full block of tokens")
            _check(block.num_filled == pool.block_size, f"cached block {block.block_id} is not full")
        else:
            _check(block.next_same_hash is None, f"uncached block {block.block_id} still chained to a cached one")
    indexed = list(pool.cached_blocks())  # every chain, from the first block under each hash
    for h, first in pool._cached.items():
        _check(first.block_hash == h, f"block {first.block_id} indexed under another hash")
    _check(len(indexed) == len({b.block_id for b in indexed}), "a block chained twice")
    _check({b.block_id for b in indexed} == {b.block_id for b in pool.blocks if b.block_hash is not None},
           "the cached blocks and the index disagree")
    _check(all(b.next_same_hash is None or b.next_same_hash.block_hash == b.block_hash for b in indexed),
           "a block chained under another hash")
    _check(pool.num_cached_blocks == len(indexed), "num_cached_blocks out of step")
    _check(pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks, "used + free != all blocks")
    _check(all(b.ref_cnt == 0 and b.block_id in pool._hold_on_free for b in pool._held), "held block not held")
    _check(pool.num_cached_free_blocks == sum(1 for b in pool.free_queue if b.block_hash is not None),
           "num_cached_free_blocks out of step")
    _check(pool.num_filled_slots == sum(b.num_filled for b in pool.blocks if b.ref_cnt > 0),
           "num_filled_slots out of step")


def check_block_manager(bm: BlockManager) -> None:
    """Check every table against the pool; raise InvariantError on any inconsistency (tests only). A
    ``GroupedBlockManager`` (layer_groups.py): each group's tables, all against the one pool, in step."""
    pool = bm.pool
    check_pool(pool)
    members = getattr(bm, "groups", None) or [bm]
    owners: dict[int, int] = {}
    for member in members:
        _check(member.pool is pool, "a layer group keeps a pool of its own")
        _check_tables(member, owners)
    for block in pool.blocks:
        _check(block.ref_cnt == owners.get(block.block_id, 0),
               f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {owners.get(block.block_id, 0)} tables")
    first = members[0]._seqs
    for member in members[1:]:  # the groups' tables in step: the same sequences, lengths and runner rows
        _check(member._seqs.keys() == first.keys(), "the layer groups hold tables of different sequences")
        for seq_id, st in member._seqs.items():
            _check((st.num_tokens, st.row) == (first[seq_id].num_tokens, first[seq_id].row),
                   f"{seq_id!r}: the layer groups' tables differ in length or row")
    used = bm.pool.num_used_blocks
    tables = sum(member._num_table_blocks for member in members)
    peaks = bm.peaks
    _check(peaks.used_blocks >= used, "high-water mark of used blocks below the present")
    _check(peaks.table_blocks >= tables, "high-water mark of table blocks below the present")
    _check(peaks.savings_blocks >= tables - used, "high-water mark of savings below the present")
    _check(peaks.table_blocks_at_peak <= peaks.table_blocks, "tables at the peak above the tables' peak")


def _check_tables(bm: BlockManager, owners: dict[int, int]) -> None:
    """One manager's tables against the pool; counts each block's owners into ``owners``."""
    pool = bm.pool
    for seq_id, st in bm._seqs.items():
        _check(all(b is None for b in st.blocks[:st.num_passed]) and None not in st.blocks[st.num_passed:],
               f"{seq_id!r}: the entries passed by the window are not the leading {st.num_passed}")
        _check(len(st.blocks) == bm.num_blocks_for(st.num_tokens), f"{seq_id!r}: wrong number of blocks")
        _check(len(st.block_hashes) <= st.num_tokens // bm.block_size, f"{seq_id!r}: hashes of unfilled blocks")
        for i, block in enumerate(st.blocks[st.num_passed:], st.num_passed):
            _check(pool.blocks[block.block_id] is block, f"{seq_id!r} block {i} is not the pool's")
            owners[block.block_id] = owners.get(block.block_id, 0) + 1
            expected_fill = min(bm.block_size, st.num_tokens - i * bm.block_size)
            _check(block.num_filled == expected_fill,
                   f"{seq_id!r} block {i} (id {block.block_id}) holds {block.num_filled}, expected {expected_fill}")
        if bm.enable_prefix_caching:
            for i, h in enumerate(st.block_hashes):
                b = st.blocks[i]
                _check(b is None or b.block_hash is None or b.block_hash == h, f"{seq_id!r} block {i}: hash mismatch")
    _check(bm._num_table_blocks == sum(len(st.blocks) - st.num_passed for st in bm._seqs.values()),
           "table block count")


def check_scheduler(sched: Scheduler) -> None:
    """Scan the queues against the block manager; raise InvariantError on any inconsistency (tests)."""
    running_ids = {id(s) for s in sched.running}
    _check(len(running_ids) == len(sched.running), "a sequence is running twice")
    _check(not running_ids & {id(s) for s in sched.waiting}, "a sequence is both waiting and running")
    extra = sum(seats_of(s) - 1 for s in sched.running)
    _check(extra == sched._unforked_extra_seats, f"seat count {sched._unforked_extra_seats} != {extra}")
    _check(len(sched.running) + extra <= sched.max_num_seqs, "more sequences than max_num_seqs")
    for seq in sched.running:
        _check(seq.status is SequenceStatus.RUNNING, f"running sequence {seq.seq_id} is {seq.status}")
        _check(sched.bm.has_sequence(seq.seq_id), f"running sequence {seq.seq_id} holds no blocks")
        _check(sched.bm.get_num_tokens(seq.seq_id) >= seq.num_computed_tokens,
               f"sequence {seq.seq_id} has fewer slots than computed tokens")
    for seq in sched.waiting:
        _check(seq.status is SequenceStatus.WAITING, f"waiting sequence {seq.seq_id} is {seq.status}")
        _check(not sched.bm.has_sequence(seq.seq_id), f"waiting sequence {seq.seq_id} holds blocks")



def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)
