"""The block manager: each sequence's block table, copy-on-write, and the prefix cache.

A sequence's *block table* maps its logical block ``i`` (tokens ``i*block_size``
to ``(i+1)*block_size - 1``) to a physical block id in the pool, the way a page
table maps virtual pages to physical frames. Blocks are allocated only as
tokens arrive -- a prefill chunk or one decode token at a time -- never for the
worst case, so a sequence wastes at most the unfilled part of its last block.

The life of a sequence, as the scheduler drives it::

    hit = bm.lookup_prefix(token_ids)                    # reuse cached leading blocks
    bm.allocate_slots(seq_id, token_ids, n_new, hit)     # waiting -> running: its first chunk's slots
    copies, updates = bm.take_step_changes()             # for the model runner
    ... forward pass ...
    bm.step_done()                                       # (or step_done(failed=True): forget what it cached)
    bm.allocate_slots(seq_id, token_ids, n)              # its next chunk, or one decode token
    bm.fork(seq_id, child_id)                            # n > 1: children share every block
    bm.free(seq_id)                                      # finished, aborted or preempted

``allocate_slots`` is the scheduler's one door (vLLM v1's name): it gives the slots and makes the
blocks that will be full once this step is computed findable in the prefix cache. Underneath are
the three steps it takes, which lesson 04 calls one by one: ``allocate_sequence`` (a sequence's
first slots), ``append_slots`` (more), ``cache_full_blocks``. Decodes, most of a busy step, come
through ``append_decode_slots``: one call for a whole run of them.

Only this class changes block tables; the pool alone changes reference and fill
counts. Tables only grow: a block, once in a table, stays at its place until the
sequence is freed (the one exception is copy-on-write, which gives a sequence its
own copy of a shared, partly filled last block). Every change is also written down
as a ``(row, column, block_ids)`` triple, which the model runner applies to its own copy of the
tables (``BlockTable`` in ``kvpaging/worker/model_runner.py``). Copy-on-write copies it decides on are queued as
``(src, dst)`` block-id pairs, which the runner makes before the forward. The scheduler hands both
over in its output (:meth:`take_step_changes`), and reports the step done after the forward
(:meth:`step_done`): until then a
source block whose last owner let go is held out of the free queue.

A block is findable in the prefix cache from the step that computes it, as in vLLM
v1: a request admitted later in the same step finds it, and attends to the keys
and values that step writes there (every layer stores the step's keys and values
before it attends). So requests that arrive together with one system prompt
compute it once. Should the step fail, ``step_done(failed=True)`` takes the blocks
cached for it out of the cache again: their data was never written.

A model whose every layer attends through one sliding window gets a :class:`SlidingWindowBlockManager`
(``sliding_window.py``), which gives blocks back to the pool as the window passes them; this class keeps every
block a sequence was given (``num_passed`` in a table record counts the entries such a subclass gave back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from kvpaging.checks import check_bool, check_int
from kvpaging.core.block_pool import BlockPool, KVBlock
from kvpaging.core.kv_stats import KVCacheStats, Peaks
from kvpaging.errors import DuplicateSequenceError, SequenceNotFoundError, SequenceTooLongError

__all__ = ["BlockManager", "PrefixHit", "KVCacheStats", "SequenceBlocks", "default_block_hash"]

# The hash of a block covers the hash of the block before it, so equal hashes
# mean equal whole prefixes (up to collisions, which token comparison catches).
_ROOT_HASH = 0x6B7670616769_6E67  # any fixed int; not None, whose hash varies between runs before Python 3.12


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of one full block: Python's tuple hash, deterministic for ints across runs."""
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, token_ids))


@dataclass(frozen=True)
class PrefixHit:
    """The result of a prefix-cache lookup: leading blocks whose KV is already computed."""

    blocks: tuple[KVBlock, ...] = ()
    block_hashes: tuple[int, ...] = ()
    num_prompt_tokens: int = 0  # tokens that were looked up

    @property
    def num_cached_tokens(self) -> int:
        return sum(b.num_filled for b in self.blocks)


NO_HIT = PrefixHit()


@dataclass(eq=False, slots=True)
class SequenceBlocks:
    """One sequence's block table, as the block manager keeps it. Read it; never change it."""

    blocks: list[KVBlock]
    num_tokens: int  # token slots assigned
    block_hashes: list[int] = field(default_factory=list)  # of leading full blocks already offered to the cache
    row: int = -1  # this table's row in the model runner's BlockTable (kvpaging/worker/model_runner.py)
    seq_id: Hashable = None  # whose table it is
    # with a sliding window: the leading entries given back to the pool (None in ``blocks``, -1 in ``block_ids``),
    # and the identity of the last of them as the prefix cache knew it (its cache_id; None: it was not cached)
    num_passed: int = 0
    passed_cache_id: int | None = -1

    @property
    def block_ids(self) -> list[int]:
        """The physical block id of each logical block, -1 where a window has passed it (a new list)."""
        return [-1 if block is None else block.block_id for block in self.blocks]


class BlockManager:
    """Block tables over a :class:`BlockPool`, with copy-on-write and automatic prefix caching."""

    sliding_window = 0  # every block kept (SlidingWindowBlockManager: the window, in tokens)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: Callable[[int | None, tuple[int, ...]], int] = default_block_hash,
        pool: BlockPool | None = None,
        root_cache_id: int = -1,
    ) -> None:
        """``pool``: a pool shared with other layer groups' managers (``layer_groups.py``), each with its own
        ``root_cache_id``, the parent identity of its tables' first blocks (so no group's prefix-cache lookup
        can find another group's block); None: a pool of its own."""
        check_bool("enable_prefix_caching", enable_prefix_caching)
        self.pool = BlockPool(num_blocks, block_size) if pool is None else pool
        self.root_cache_id = root_cache_id
        self.block_size = self.pool.block_size
        self.num_blocks = num_blocks
        self.max_tokens_per_sequence = num_blocks * self.block_size  # the most one sequence can ever hold
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self._seqs: dict[Hashable, SequenceBlocks] = {}
        self._free_rows: list[int] = []  # rows of sequences that ended, taken again first
        self._num_rows = 0  # rows ever given
        self._table_updates: list[tuple[int, int, list[int]]] = []  # (row, column, block ids) since the last take
        self._blocks_to_copy: list[tuple[int, int]] = []
        self._cached_in_step: list[KVBlock] = []  # made findable for the step under way (see step_done)
        self._num_table_blocks = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_cow_copies = 0
        self._num_passed_blocks = 0
        self.reset_peak_stats()

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free_blocks

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of the sequence's logical blocks (a new list)."""
        return self._state(seq_id).block_ids

    def get_sequence_blocks(self, seq_id: Hashable) -> SequenceBlocks:
        """The sequence's live table record (block ids, token count, row in the runner's block table): read only."""
        return self._state(seq_id)

    def take_step_changes(self) -> tuple[list[tuple[int, int]], list[list[tuple[int, int, list[int]]]]]:
        """What the model runner must do before the step's forward: the copy-on-write ``(src, dst)`` pairs decided
        since the last :meth:`step_done` (they stay pending until it), and every change to the tables since the
        last call, in order, as ``(row, column, block_ids)``: ``block_ids`` go into ``row`` from ``column`` on;
        written from column 0 they are the whole table (the runner's ``BlockTable.apply``). The changes come as one
        list per layer group (``layer_groups.py``); this manager's tables are one group."""
        updates, self._table_updates = self._table_updates, []
        return list(self._blocks_to_copy), [updates]

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        self._num_rows += 1
        return self._num_rows - 1

    def get_num_tokens(self, seq_id: Hashable) -> int:
        """How many token slots the sequence has been given."""
        return self._state(seq_id).num_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        return KVCacheStats.of(self)

    def reset_peak_stats(self) -> None:
        """Start the high-water marks in ``stats()`` afresh, from the present state
        (as ``torch.cuda.reset_peak_memory_stats`` does for GPU memory)."""
        self.peaks = Peaks()
        self._note_peak()

    def _note_peak(self) -> None:
        """Raise the high-water marks (``kv_stats.Peaks``) to the present state."""
        self.peaks.note(self.num_blocks - self.pool.free_queue.num_free_blocks, self._num_table_blocks)

    # -- prefix cache --------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Find the longest run of leading full blocks already in the cache. Changes nothing.

        The last prompt token is never served from the cache: the model must
        compute at least one position to produce the next token's logits.
        """
        if not self.enable_prefix_caching:
            return PrefixHit(num_prompt_tokens=len(token_ids))
        bs = self.block_size
        blocks: list[KVBlock] = []
        hashes: list[int] = []
        parent: KVBlock | None = None
        parent_hash: int | None = None
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent_hash, toks)
            block = self.pool.lookup(h, toks, parent, self.root_cache_id)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent, parent_hash = block, h
        return PrefixHit(tuple(blocks), tuple(hashes), len(token_ids))

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Offer the sequence's blocks that are full once its first ``num_tokens`` tokens are computed.

        Call it in the step that computes them, once their slots are given (see the module docstring): a later
        admission in the same step may hit them. When another block already holds the very same tokens after
        the very same prefix (two requests computed one prefix in different steps' chunks), both stay cached
        and the table keeps its own block.
        """
        if not self.enable_prefix_caching:
            return
        st = self._state(seq_id)
        if num_tokens // self.block_size <= len(st.block_hashes):
            return  # no block became full: most decode steps end here
        if num_tokens > st.num_tokens or num_tokens > len(token_ids):
            raise ValueError(
                f"num_tokens={num_tokens} exceeds the sequence's {st.num_tokens} slots or its {len(token_ids)} tokens"
            )
        self._cache_blocks(st, token_ids, num_tokens)

    def _cache_blocks(self, st: SequenceBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the full blocks of ``st`` up to ``num_tokens`` and offer the uncached ones."""
        bs = self.block_size
        hashes = st.block_hashes
        blocks = st.blocks
        parent_id = self._parent_cache_id(st, len(hashes))
        for i in range(len(hashes), num_tokens // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(hashes[-1] if i else None, toks)
            hashes.append(h)
            block = blocks[i]
            # a prefix hit, or a block shared with a parent that cached it, is cached already
            if block.block_hash is None and self.pool.cache_block(block, h, toks, parent_id):
                self._cached_in_step.append(block)
            parent_id = block.cache_id if block.block_hash is not None else None

    def _parent_cache_id(self, st: SequenceBlocks, i: int) -> int | None:
        """The prefix-cache identity of block ``i - 1`` of ``st`` (``root_cache_id`` before block 0; None if not
        cached). A block the window passed is gone from the table: it is the last one passed (blocks are offered
        to the cache in the step that fills them, before the window can pass the next one), whose identity the
        table kept."""
        if i == 0:
            return self.root_cache_id
        parent = st.blocks[i - 1]
        if parent is None:
            return st.passed_cache_id
        return parent.cache_id if parent.block_hash is not None else None

    # -- allocation ------------------------------------------------------------
    def allocate_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> SequenceBlocks | None:
        """Slots for ``num_new_tokens`` more tokens of ``seq_id`` (``token_ids`` are all its tokens), then its blocks
        that are full once those are computed made findable in the prefix cache. With ``prefix_hit`` (``NO_HIT``
        for none) it is a new sequence, starting with the hit's cached blocks (:meth:`allocate_sequence`);
        without, a sequence that holds blocks already (:meth:`append_slots`): either is an error otherwise.
        Returns its table record, or None, changing nothing, when the pool lacks free blocks right now (the
        scheduler then preempts someone, or waits)."""
        if prefix_hit is None:
            if not self.append_slots(seq_id, num_new_tokens):
                return None
        elif not self.allocate_sequence(seq_id, num_new_tokens, prefix_hit):
            return None
        st = self._seqs[seq_id]
        self.cache_full_blocks(seq_id, token_ids, st.num_tokens)
        return st

    def allocate_sequence(self, seq_id: Hashable, num_new_tokens: int, prefix_hit: PrefixHit = NO_HIT) -> bool:
        """Give a sequence with no blocks its cached prefix plus slots for ``num_new_tokens``.

        Returns False, changing nothing, when the pool lacks free blocks right
        now; raises SequenceTooLongError when the pool could never hold it.
        """
        if self.blocks_to_allocate(seq_id, num_new_tokens, prefix_hit) > self.pool.free_queue.num_free_blocks:
            return False
        pool = self.pool
        hit = prefix_hit.blocks
        skip = self._passed_in(len(hit))  # with a window, hit blocks it has passed already are not taken at all
        live = hit[skip:]
        for block in live:
            pool.touch(block)
        st = self._hit_table(prefix_hit, skip)
        st.row = self._take_row()
        st.seq_id = seq_id
        self._table_updates.append((st.row, 0, _runner_row(st)))
        self._seqs[seq_id] = st
        self._num_table_blocks += len(live)
        self._prefix_query_tokens += prefix_hit.num_prompt_tokens
        self._prefix_hit_tokens += st.num_tokens
        self._grow(st, num_new_tokens)
        self._note_peak()
        return True

    def blocks_to_allocate(self, seq_id: Hashable, num_new_tokens: int, prefix_hit: PrefixHit = NO_HIT) -> int:
        """The free blocks ``allocate_sequence`` would use (changing nothing); raises for a sequence that holds
        blocks already, a stale hit, or one the pool could never hold."""
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already holds blocks")
        check_int("num_new_tokens", num_new_tokens, 1)
        hit = prefix_hit.blocks
        for block, h in zip(hit, prefix_hit.block_hashes):
            if block.block_hash != h:
                raise ValueError(
                    f"stale prefix hit: block {block.block_id} was evicted since lookup_prefix; "
                    "look up and allocate in the same scheduling step"
                )
        total = len(hit) * self.block_size + num_new_tokens
        self._check_fits(seq_id, total, len(hit) * self.block_size)
        # Cached blocks with no owner sit in the free queue: reviving them uses up free blocks too.
        revived = sum(1 for b in hit[self._passed_in(len(hit)):] if b.ref_cnt == 0)
        return self.num_blocks_for(total) - len(hit) + revived

    def _passed_in(self, num_hit_blocks: int) -> int:
        """How many leading blocks of a prefix hit this long its sequence will never read (none here)."""
        return 0

    def _hit_table(self, prefix_hit: PrefixHit, skip: int) -> SequenceBlocks:
        """A new table holding a prefix hit, its first ``skip`` blocks already passed (-1, not taken)."""
        hit = prefix_hit.blocks
        st = SequenceBlocks([None] * skip + list(hit[skip:]), len(hit) * self.block_size, list(prefix_hit.block_hashes))
        if skip:
            st.num_passed, st.passed_cache_id = skip, hit[skip - 1].cache_id
        return st

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Give a running sequence slots for ``num_new_tokens`` more tokens (a decode token or a prefill chunk).

        If the last block is partly filled and shared with a forked sequence,
        it is first copied (copy-on-write). Returns False, changing nothing,
        when the pool lacks free blocks: the scheduler then preempts someone.
        """
        st = self._state(seq_id)
        if self.blocks_to_append(st, num_new_tokens) > self.pool.free_queue.num_free_blocks:
            return False
        if self._shared_partly_filled(st):
            self._copy_on_write(st, st.blocks[-1])
        self._grow(st, num_new_tokens)
        self._note_peak()
        return True

    def blocks_to_append(self, st: SequenceBlocks, num_new_tokens: int) -> int:
        """The free blocks ``append_slots`` would use for the sequence of table ``st`` (changing nothing): new
        blocks, and a copy of a shared, partly filled last block; raises for one the pool could never hold."""
        check_int("num_new_tokens", num_new_tokens, 1)
        n = st.num_tokens
        self._check_fits(st.seq_id, n + num_new_tokens, n)
        cow = 1 if self._shared_partly_filled(st) else 0
        return self.num_blocks_for(n + num_new_tokens) - len(st.blocks) + cow

    def _shared_partly_filled(self, st: SequenceBlocks) -> bool:
        """Whether the last block of ``st`` is partly filled and shared (a fork's): the next token goes to a copy."""
        return bool(st.num_tokens % self.block_size) and st.blocks[-1].ref_cnt > 1

    def append_decode_slots(self, seqs: list) -> int:
        """One more slot for each of ``seqs``, decodes the scheduler found (each has one token to compute, its
        last), in order, as ``append_slots(seq_id, 1)`` would give it; returns how many got theirs.

        The scheduler's every-step call for its decoding sequences: one call per step, not one per sequence.
        ``seqs`` holds scheduler sequences, read through two attributes: ``blocks`` (the table record this
        manager gave them) and ``token_ids``. The run stops at the first one the pool has no block for. A
        decode that fills its last block makes that block findable in the prefix cache, as
        :meth:`allocate_slots` does.

        Most decodes land in an unshared, unfilled last block and cost a few attribute updates; a full or
        shared last block takes the general path (a new block, or a copy-on-write).
        """
        bs = self.block_size
        pool = self.pool
        free_queue = pool.free_queue
        max_tokens = self.max_tokens_per_sequence
        served = 0
        slow = False  # whether a decode took the general path
        filling = []  # unshared last blocks with room: one more slot each, filled by the pool below
        full = []  # decodes that fill their last block: cached once filled
        caching = self.enable_prefix_caching
        for seq in seqs:
            st = seq.blocks
            n = st.num_tokens
            last = st.blocks[-1] if n % bs else None  # partly filled: the token goes there, unless it is shared
            if last is not None and last.ref_cnt == 1:  # room in an unshared last block: the common case
                filling.append(last)
                st.num_tokens = n + 1
            else:  # a full last block (or none) needs a new block; a shared, partly filled one its copy
                if n >= max_tokens:  # _check_fits's test, without the call on every new block
                    self._check_fits(st.seq_id, n + 1, n)  # raises: the pool could never hold it
                if not free_queue.num_free_blocks:
                    break
                if last is not None:
                    self._copy_on_write(st, last)
                self._grow(st, 1)
                slow = True
            served += 1
            if caching and (n + 1) % bs == 0:
                full.append(seq)
        pool.fill_one_each(filling)
        for seq in full:
            self._cache_blocks(seq.blocks, seq.token_ids, seq.blocks.num_tokens)
        if slow:
            self._note_peak()
        return served

    def _copy_on_write(self, st: SequenceBlocks, shared: KVBlock) -> None:
        pool = self.pool
        copy = pool.get_new_block(shared.num_filled)
        pool.free_block(shared)  # one owner fewer; it stays with the others
        pool.hold_until_copied(shared)  # until copied, it must not be handed out again
        st.blocks[-1] = copy
        self._table_updates.append((st.row, len(st.blocks) - 1, [copy.block_id]))
        self._blocks_to_copy.append((shared.block_id, copy.block_id))
        self._num_cow_copies += 1

    def _grow(self, st: SequenceBlocks, num_new_tokens: int) -> None:
        """Fill the last block's free slots, then take new blocks (feasibility already checked)."""
        pool = self.pool
        bs = self.block_size
        remaining = num_new_tokens
        if st.num_tokens % bs:
            last = st.blocks[-1]
            room = min(bs - last.num_filled, remaining)
            pool.fill(last, room)
            remaining -= room
        if remaining > 0:
            count = -(-remaining // bs)
            first = len(st.blocks)
            if count == 1:  # one new block (every decode that crosses into a new block): no lists made
                block = pool.get_new_block(remaining)
                st.blocks.append(block)
                self._table_updates.append((st.row, first, [block.block_id]))
            else:
                blocks = [pool.get_new_block(bs) for _ in range(count - 1)]
                blocks.append(pool.get_new_block(remaining - (count - 1) * bs))
                st.blocks += blocks
                self._table_updates.append((st.row, first, [block.block_id for block in blocks]))
            self._num_table_blocks += count
        st.num_tokens += num_new_tokens

    def fork(self, parent_id: Hashable, child_id: Hashable) -> SequenceBlocks:
        """Give ``child_id`` the parent's whole block table, sharing every block (no data is copied); returns the
        child's table record."""
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"cannot fork into sequence {child_id!r}: it already holds blocks")
        for block in parent.blocks[parent.num_passed:]:
            self.pool.touch(block)
        child = SequenceBlocks(list(parent.blocks), parent.num_tokens, list(parent.block_hashes))
        child.row = self._take_row()
        child.seq_id = child_id
        child.num_passed, child.passed_cache_id = parent.num_passed, parent.passed_cache_id
        self._table_updates.append((child.row, 0, _runner_row(child)))
        self._seqs[child_id] = child
        self._num_table_blocks += len(parent.blocks) - parent.num_passed
        self._note_peak()
        return child

    def free(self, seq_id: Hashable) -> None:
        """Return a finished, aborted or preempted sequence's blocks to the pool.

        Blocks are freed last-first, so that the tail of a cached prefix is
        evicted before its head (a later request more likely shares the head).
        """
        st = self._seqs.pop(seq_id, None)
        if st is None:
            raise SequenceNotFoundError(
                f"cannot free sequence {seq_id!r}: it holds no blocks (never allocated, or already freed)"
            )
        self.pool.free_blocks(reversed(st.blocks[st.num_passed:]))
        self._num_table_blocks -= len(st.blocks) - st.num_passed
        self._free_rows.append(st.row)  # the next owner's first update rewrites the whole row

    def step_done(self, failed: bool = False) -> None:
        """The step's forward is over: its copies are made, so the sources held back for them go to the free
        queue. ``failed``: it raised, so the blocks cached for it hold no keys and values; they leave the cache
        (every sequence that holds one was in that step, and is failed with it)."""
        if failed:
            for block in self._cached_in_step:
                self.pool.uncache(block)
        self._cached_in_step.clear()
        if not self._blocks_to_copy:  # no copy pending (most steps): no block is held back either
            return
        self._blocks_to_copy.clear()
        self.pool.release_held()
        self._note_peak()  # the sources held back are free now: fewer used blocks, as many in the tables

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # -- helpers -----------------------------------------------------------------
    def _state(self, seq_id: Hashable) -> SequenceBlocks:
        st = self._seqs.get(seq_id)
        if st is None:
            raise SequenceNotFoundError(
                f"sequence {seq_id!r} holds no blocks (never allocated, or already finished and freed)"
            )
        return st

    def _check_fits(self, seq_id: Hashable, total_tokens: int, first_query: int) -> None:
        """Raise SequenceTooLongError when the pool could never hold the blocks a sequence needs at once to give
        slots up to ``total_tokens`` to queries from ``first_query`` on: all of them (with a window, only those
        the window has not passed: ``_first_held_block``)."""
        bs = self.block_size
        needed = self.num_blocks_for(total_tokens) - self._first_held_block(first_query)
        if needed > self.num_blocks:
            window = f" (the {self.sliding_window}-token window included)" if self.sliding_window else ""
            raise SequenceTooLongError(
                f"sequence {seq_id!r} would need {needed} blocks at once for its {total_tokens} tokens{window}, "
                f"but the pool has only {self.num_blocks} blocks of {bs} slots"
            )


    def _first_held_block(self, first_query: int) -> int:
        """The first block a sequence must hold for queries from ``first_query`` on: its first, here."""
        return 0


def _runner_row(st: SequenceBlocks) -> list[int]:
    """``st``'s table as the model runner gets it, a copy: an entry the window has passed (-1 here) reads as block 0
    there, which its window masks (the Triton kernels start at the window and never reach it; the torch ones mask
    it), so the kernels index no block outside the cache."""
    return [0 if block is None else block.block_id for block in st.blocks]
