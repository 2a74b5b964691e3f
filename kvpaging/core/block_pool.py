"""The block pool: a fixed set of physical KV blocks, managed like pages of memory.

The KV cache of every layer is one big tensor cut into ``num_blocks`` blocks of
``block_size`` token slots each. This module decides nothing about *which*
sequence owns which block (that is the block manager's job); it only keeps the
state of each physical block:

* ``ref_cnt`` -- how many block tables point at the block. Forked sequences
  (``n > 1`` sampling, GRPO rollouts) share blocks, so a block can have several
  owners. A block with ``ref_cnt == 0`` is free.
* ``block_hash`` -- set when the block holds a *full* block of tokens that the
  prefix cache may hand to another request with the same prefix. Two blocks can
  hold the same tokens after the same prefix (a request that computes its whole
  prompt for its log-probabilities; two requests that reached one block in
  chunks of the same step): both are cached under the hash with one
  ``cache_id`` (the identity of their content), so a later block's parent may be
  either of them, and a lookup takes the first. A block table never changes to
  point at such a twin: tables only grow (vLLM v1 makes the same choice), and
  the duplicate costs one block until its sequence ends.

Free blocks wait in a :class:`FreeBlockQueue`, a doubly linked list threaded
through the blocks themselves. Freed blocks join the tail; allocation takes the
head. A freed block that still has a hash keeps its data and stays findable in
the prefix cache until allocation reaches it at the head, so the cached block
that was used least recently is the first to be overwritten (LRU eviction). When
a prefix-cache hit revives a free cached block, it leaves the *middle* of the
queue, which a linked list does in O(1) -- the reason for the list instead of a
``deque``.

Every operation on the hot path is O(1). Two scan: :meth:`BlockPool.reset_prefix_cache`
(every cached block, on request) and the checks of ``invariants.py`` (tests only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from kvpaging.checks import check_block_size, check_int

__all__ = ["KVBlock", "FreeBlockQueue", "BlockPool"]


@dataclass(eq=False, slots=True)
class KVBlock:
    """Metadata of one physical block. The K/V data itself lives in the model runner's tensors."""

    block_id: int
    ref_cnt: int = 0
    # How many of the block's slots hold a token (for fragmentation figures).
    num_filled: int = 0
    # Prefix-cache identity, set only while the block is in the cache.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens: compared on every hit
    cache_id: int = -1  # what it holds: these tokens after its parent's content (twins share it)
    parent_cache_id: int = -1  # cache_id of the block before it in its sequence (-1: first block)
    next_same_hash: KVBlock | None = field(default=None, repr=False)  # the next block cached under its hash
    # Links of the free queue (None when the block is not in it).
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Free blocks, oldest first, as a doubly linked list through the blocks.

    Two sentinel blocks (id -1) sit at both ends so that append, pop and remove
    never test for an empty list. All three are O(1).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        """Put a freed block at the tail: it will be reused last."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """``append`` each of ``blocks``, in order (a whole freed table at once)."""
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Take the block that has been free the longest."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Take a block out of the middle of the queue (a prefix-cache hit on a free block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __len__(self) -> int:
        return self.num_free_blocks


    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All physical blocks, their reference counts, and the prefix-cache index.

    The pool hands out blocks and takes them back; it never decides which
    sequence gets one. Counters are kept up to date on every change, so reading
    any statistic is O(1).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        check_int("num_blocks", num_blocks, 1)
        self.block_size = check_block_size(block_size)
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> the first block cached under it; the others under the same hash (twins, collisions: rare)
        # follow it through next_same_hash, in the order they were cached. A block is cached only while it is
        # in here; eviction takes it out. (No container per block: nothing for the garbage collector to scan.)
        self._cached: dict[int, KVBlock] = {}
        self.num_cached_blocks = 0
        self._next_cache_id = 0
        self.num_cached_free_blocks = 0  # cached blocks sitting in the free queue
        self.num_filled_slots = 0  # slots holding a token, over blocks in use
        self.num_evictions = 0
        # Copy sources the runner has not copied yet: if their last owner lets go before the
        # copy is made (a preemption in the same step), they must not be handed out again
        # before they are read. They wait in _held until release_held().
        self._hold_on_free: set[int] = set()
        self._held: list[KVBlock] = []

    # -- figures -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    def cached_blocks(self) -> Iterator[KVBlock]:
        """Every block the prefix cache can find, in use or free."""
        for block in self._cached.values():
            while block is not None:
                yield block
                block = block.next_same_hash

    # -- allocation --------------------------------------------------------
    def get_new_block(self, num_filled: int = 0) -> KVBlock:
        """Take the least recently freed block, evicting its cached contents if any; ``num_filled`` of its
        slots are about to hold tokens."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._uncache(block)
            self.num_cached_free_blocks -= 1
            self.num_evictions += 1
        block.ref_cnt = 1
        block.num_filled = num_filled
        self.num_filled_slots += num_filled
        return block

    def fill(self, block: KVBlock, num_slots: int) -> None:
        """``num_slots`` more of an owned block's slots now hold a token (the pool's fill counter follows)."""
        block.num_filled += num_slots
        self.num_filled_slots += num_slots

    def fill_one_each(self, blocks: list[KVBlock]) -> None:
        """``fill(block, 1)`` for each of ``blocks``: a step's decodes, in one call."""
        for block in blocks:
            block.num_filled += 1
        self.num_filled_slots += len(blocks)

    def hold_until_copied(self, block: KVBlock) -> None:
        """``block`` is the source of a pending copy: should its last owner free it before the copy is
        made, it waits outside the free queue until ``release_held()``."""
        self._hold_on_free.add(block.block_id)

    def touch(self, block: KVBlock) -> None:
        """Add one owner to ``block``; a free (cached) block leaves the free queue."""
        if block.ref_cnt == 0:
            if block.prev_free is None:  # held back for a pending copy (see hold_until_copied)
                self._held.remove(block)
            else:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            self.num_filled_slots += block.num_filled
        block.ref_cnt += 1

    def free_block(self, block: KVBlock) -> None:
        """Drop one owner. At zero the block joins the free queue's tail, still cached."""
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block.block_id} is already free")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.num_filled_slots -= block.num_filled
            if block.block_id in self._hold_on_free:
                self._held.append(block)
            else:
                self._enqueue_free(block)

    def free_blocks(self, blocks) -> None:
        """``free_block`` for each of ``blocks``, in order: one call for a whole table."""
        freed = []
        held = self._hold_on_free
        filled = cached = 0
        for block in blocks:
            if block.ref_cnt == 1 and block.block_id not in held:
                block.ref_cnt = 0
                filled += block.num_filled
                if block.block_hash is not None:
                    cached += 1
                freed.append(block)
            else:
                self.free_block(block)  # shared, held for a copy, or already free (the error)
        if freed:
            self.num_filled_slots -= filled
            self.num_cached_free_blocks += cached
            self.free_queue.extend(freed)

    def _enqueue_free(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.num_cached_free_blocks += 1
        self.free_queue.append(block)

    def release_held(self) -> None:
        """The pending copies are made: blocks held back for them become free for real."""
        held, self._held = self._held, []
        self._hold_on_free.clear()
        for block in held:
            self._enqueue_free(block)

    # -- prefix cache --------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: KVBlock | None,
               root_cache_id: int = -1) -> KVBlock | None:
        """A cached block holding ``token_ids`` right after ``parent`` (None: first in a table whose first blocks
        have the parent identity ``root_cache_id``), or None.

        A hash match alone is not trusted: the tokens must be equal and the
        candidate must have been computed after ``parent``'s very content
        (compared by ``cache_id``, which only equal tokens after an equal parent
        share), so a hash collision can never hand one request another request's
        keys and values.
        """
        if parent is not None and parent.block_hash is None:
            return None  # an uncached parent has no identity to match against
        parent_cache_id = root_cache_id if parent is None else parent.cache_id
        return _same_content(self._cached.get(block_hash), token_ids, parent_cache_id)  # (most lookups miss)

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...],
                    parent_cache_id: int | None = -1) -> bool:
        """Make a full, computed block findable under ``block_hash``; False when it stays uncached.

        ``parent_cache_id`` is the identity (``cache_id``) of the block before it in its sequence, -1 for a
        sequence's first block, None when that block is not cached: a block is cached only after a cached
        parent, so a chain is cached from its start. Blocks already cached under the same hash stay (see the
        module docstring on twins).
        """
        if parent_cache_id is None:
            return False
        first = self._cached.get(block_hash)
        twin = _same_content(first, token_ids, parent_cache_id)
        if twin is not None:  # the same content: one identity, so a chain may pass through either copy
            block.cache_id = twin.cache_id
        else:
            block.cache_id = self._next_cache_id
            self._next_cache_id += 1
        if first is None:  # most blocks: the first under their hash
            self._cached[block_hash] = block
        else:  # after the others, so a lookup still finds the first one cached
            while first.next_same_hash is not None:
                first = first.next_same_hash
            first.next_same_hash = block
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_cache_id = parent_cache_id
        self.num_cached_blocks += 1
        return True

    def uncache(self, block: KVBlock) -> None:
        """Take ``block`` out of the prefix cache (if it is in it): its data is not what its hash says."""
        if block.block_hash is None:
            return
        self._uncache(block)
        if block.ref_cnt == 0 and block.prev_free is not None:  # free, in the queue: counted as cached there
            self.num_cached_free_blocks -= 1

    def _uncache(self, block: KVBlock) -> None:
        first = self._cached[block.block_hash]
        if first is block:
            if block.next_same_hash is None:
                del self._cached[block.block_hash]
            else:
                self._cached[block.block_hash] = block.next_same_hash
        else:  # unlink it from behind the block before it
            while first.next_same_hash is not block:
                first = first.next_same_hash
            first.next_same_hash = block.next_same_hash
        block.next_same_hash = None
        self.num_cached_blocks -= 1
        block.block_hash = None
        block.token_ids = None
        block.cache_id = -1
        block.parent_cache_id = -1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence uses (vLLM: reset_prefix_cache). Returns how many."""
        stale = [b for b in self.cached_blocks() if b.ref_cnt == 0]
        for block in stale:
            self._uncache(block)
        self.num_cached_free_blocks -= len(stale)
        return len(stale)


def _same_content(block: KVBlock | None, token_ids: tuple[int, ...], parent_cache_id: int) -> KVBlock | None:
    """Of ``block`` and the blocks cached under the same hash after it, the first holding ``token_ids`` after the
    parent identity ``parent_cache_id``, or None."""
    while block is not None:
        if block.token_ids == token_ids and block.parent_cache_id == parent_cache_id:
            return block
        block = block.next_same_hash
    return None
