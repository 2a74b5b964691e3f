"""Unit tests of the block pool and block manager: exact block ids, reference counts and eviction order."""

import pytest

from kvpaging.core.block_manager import NO_HIT, BlockManager, default_block_hash
from kvpaging.core.block_pool import BlockPool
from kvpaging.errors import DuplicateSequenceError, SequenceNotFoundError, SequenceTooLongError
from kvpaging.core.invariants import check_free_queue, check_pool, check_block_manager


def free_order(bm):
    return [b.block_id for b in bm.pool.free_queue]


def refcounts(bm):
    return [b.ref_cnt for b in bm.pool.blocks]


def prefill(bm, seq_id, tokens):
    """Admit a sequence as the scheduler does: look up, allocate the rest, cache after 'computing'."""
    hit = bm.lookup_prefix(tokens)
    n_cached = hit.num_cached_tokens
    assert bm.allocate_sequence(seq_id, len(tokens) - n_cached, hit)
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return n_cached


def decode(bm, seq_id, tokens, token):
    """Append one token: slots for it, then (after the 'forward') cache full blocks."""
    assert bm.append_slots(seq_id, 1)
    tokens.append(token)
    bm.cache_full_blocks(seq_id, tokens, len(tokens))


# -- block pool ------------------------------------------------------------------


def test_pool_allocates_in_id_order_and_reuses_least_recently_freed():
    pool = BlockPool(num_blocks=4, block_size=16)
    a, b, c = pool.get_new_block(), pool.get_new_block(), pool.get_new_block()
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.free_block(b)
    pool.free_block(a)
    # free queue: 3 (never used), then 1, then 0 in the order freed
    assert [x.block_id for x in pool.free_queue] == [3, 1, 0]
    assert pool.get_new_block().block_id == 3
    assert pool.get_new_block().block_id == 1


def test_pool_touch_removes_a_free_block_from_the_middle():
    pool = BlockPool(num_blocks=5, block_size=4)
    blocks = [pool.get_new_block() for _ in range(5)]
    for blk in blocks:
        pool.free_block(blk)
    pool.touch(blocks[2])
    assert [x.block_id for x in pool.free_queue] == [0, 1, 3, 4]
    assert blocks[2].ref_cnt == 1
    check_pool(pool)


def test_pool_double_free_is_refused():
    pool = BlockPool(num_blocks=2, block_size=4)
    blk = pool.get_new_block()
    pool.free_block(blk)
    with pytest.raises(ValueError, match="block 0 is already free"):
        pool.free_block(blk)
    check_pool(pool)


@pytest.mark.parametrize("bad", [0, 3, 5, 12, 512, -16, 16.0, "16", True, None])
def test_block_size_must_be_power_of_two_up_to_256(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=8, block_size=bad)


@pytest.mark.parametrize("good", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_every_power_of_two_block_size_works(good):
    bm = BlockManager(num_blocks=4, block_size=good)
    tokens = list(range(2 * good + 1))
    assert bm.allocate_sequence("s", len(tokens))
    assert bm.get_block_table("s") == [0, 1, 2]
    bm.free("s")
    check_block_manager(bm)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", False, None])
def test_num_blocks_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=bad)


# -- block tables ------------------------------------------------------------------


def test_blocks_are_allocated_only_as_tokens_arrive():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_sequence("a", 5)  # 5 tokens -> 2 blocks, 3 slots of the 2nd empty
    assert bm.get_block_table("a") == [0, 1]
    assert [b.num_filled for b in bm.get_sequence_blocks("a").blocks] == [4, 1]
    for _ in range(3):
        assert bm.append_slots("a", 1)
    assert bm.get_block_table("a") == [0, 1]  # the last block filled up, no new block
    assert bm.append_slots("a", 1)
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.get_num_tokens("a") == 9
    assert bm.append_slots("a", 6)  # a prefill chunk: fills block 2, then block 3 partly
    assert bm.get_block_table("a") == [0, 1, 2, 3]
    assert [b.num_filled for b in bm.get_sequence_blocks("a").blocks] == [4, 4, 4, 3]
    check_block_manager(bm)


def test_free_returns_blocks_last_first_and_stats_go_back_to_zero():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    assert bm.allocate_sequence("a", 9)  # blocks 0,1,2
    assert bm.allocate_sequence("b", 3)  # block 3
    bm.free("a")
    assert free_order(bm) == [4, 5, 2, 1, 0]
    bm.free("b")
    s = bm.stats()
    assert (s.num_used_blocks, s.num_free_blocks, s.num_tokens_stored, s.num_sequences) == (0, 6, 0, 0)
    check_block_manager(bm)


def test_not_enough_blocks_returns_false_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_sequence("a", 8)
    assert bm.allocate_sequence("z", 1)
    before = (bm.stats(), free_order(bm), refcounts(bm), list(bm.get_block_table("a")))
    assert not bm.allocate_sequence("b", 5)  # needs 2 blocks, 1 is free
    assert not bm.has_sequence("b")
    assert (bm.stats(), free_order(bm), refcounts(bm), bm.get_block_table("a")) == before
    assert bm.append_slots("a", 4)  # takes the last free block
    before = (bm.stats(), free_order(bm), refcounts(bm), list(bm.get_block_table("a")))
    assert not bm.append_slots("a", 1)
    assert (bm.stats(), free_order(bm), refcounts(bm), bm.get_block_table("a")) == before
    assert bm.get_num_tokens("a") == 12
    check_block_manager(bm)


def test_a_sequence_longer_than_the_pool_is_refused_with_a_clear_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(SequenceTooLongError, match="9 tokens.*only 2 blocks"):
        bm.allocate_sequence("a", 9)
    assert bm.allocate_sequence("a", 8)
    with pytest.raises(SequenceTooLongError):
        bm.append_slots("a", 1)
    assert bm.get_num_tokens("a") == 8
    check_block_manager(bm)


def test_unknown_and_finished_sequences_are_refused():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(SequenceNotFoundError, match="'ghost'"):
        bm.free("ghost")
    with pytest.raises(SequenceNotFoundError, match="'ghost'"):
        bm.fork("ghost", "child")
    assert bm.allocate_sequence("a", 3)
    bm.free("a")
    with pytest.raises(SequenceNotFoundError, match="already finished"):
        bm.append_slots("a", 1)
    with pytest.raises(SequenceNotFoundError):
        bm.free("a")
    assert bm.stats().num_used_blocks == 0


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2"])
def test_num_new_tokens_is_validated(bad):
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_sequence("a", bad)
    assert bm.allocate_sequence("a", 2)
    if bad != 1.0 and bad is not True:  # bad values that the decode fast path can't mistake for 1
        with pytest.raises(ValueError, match="num_new_tokens"):
            bm.append_slots("a", bad)
    assert bm.get_num_tokens("a") == 2
    check_block_manager(bm)


def test_duplicate_ids_are_refused():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_sequence("a", 3)
    assert bm.allocate_sequence("b", 3)
    with pytest.raises(DuplicateSequenceError, match="'a'"):
        bm.allocate_sequence("a", 1)
    with pytest.raises(DuplicateSequenceError, match="'b'"):
        bm.fork("a", "b")
    assert refcounts(bm) == [1, 1, 0, 0]


# -- fork and copy-on-write ------------------------------------------------------------


def test_fork_shares_every_block_and_cow_copies_only_the_partial_last_block():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    assert bm.allocate_sequence("p", 10)  # blocks 0,1 full; block 2 holds 2 tokens
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert refcounts(bm)[:3] == [3, 3, 3]
    assert bm.stats().shared_savings_blocks == 6

    assert bm.append_slots("c1", 1)  # writes into shared block 2 -> copy first
    assert bm.get_block_table("c1") == [0, 1, 3]
    assert take_copies(bm) == [(2, 3)]
    assert bm.append_slots("c2", 1)
    assert bm.get_block_table("c2") == [0, 1, 4]
    assert take_copies(bm) == [(2, 4)]
    assert bm.append_slots("p", 1)  # the last owner writes in place: no copy
    assert bm.get_block_table("p") == [0, 1, 2]
    assert take_copies(bm) == []
    assert refcounts(bm)[:5] == [3, 3, 1, 1, 1]
    assert bm.stats().num_cow_copies == 2
    check_block_manager(bm)


def take_copies(bm):
    """What the scheduler and runner do with the pending copies: read them, copy, report them made."""
    pairs, _ = bm.take_step_changes()
    assert bm.take_step_changes()[0] == pairs, "the pending copies stay pending until step_done"
    bm.step_done()
    assert bm.take_step_changes()[0] == []
    return pairs


def test_full_shared_blocks_are_never_copied():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    assert bm.allocate_sequence("p", 8)  # two full blocks
    bm.fork("p", "c")
    assert bm.append_slots("c", 1)
    assert bm.append_slots("p", 1)
    assert take_copies(bm) == []
    assert bm.get_block_table("c") == [0, 1, 2]
    assert bm.get_block_table("p") == [0, 1, 3]
    bm.free("p")
    assert refcounts(bm)[:4] == [1, 1, 1, 0]
    bm.free("c")
    check_block_manager(bm)


def test_cow_needs_a_free_block_and_changes_nothing_without_one():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert bm.allocate_sequence("p", 6)
    bm.fork("p", "c")
    assert bm.allocate_sequence("x", 1)  # takes the last free block
    assert not bm.append_slots("c", 1)
    assert bm.get_block_table("c") == [0, 1]
    assert take_copies(bm) == []
    check_block_manager(bm)


def test_grpo_sixteen_rollouts_share_the_prompt():
    bm = BlockManager(num_blocks=64, block_size=16)
    prompt = list(range(100))  # 6 full blocks + 4 tokens
    prefill(bm, "r0", prompt)
    for i in range(1, 16):
        bm.fork("r0", f"r{i}")
    s = bm.stats()
    assert s.num_used_blocks == 7
    assert s.shared_savings_blocks == 7 * 16 - 7
    for i in range(16):
        assert bm.append_slots(f"r{i}", 1)
    # 15 copies of the partial block; the last writer keeps the original
    assert len(take_copies(bm)) == 15
    assert bm.stats().num_used_blocks == 6 + 16
    for i in range(16):
        bm.free(f"r{i}")
    assert bm.stats().num_used_blocks == 0
    check_block_manager(bm)


# -- prefix caching ----------------------------------------------------------------


def test_prefix_cache_reuses_full_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = [7, 7, 7, 7, 8, 8, 8, 8]
    a = system + [1, 2, 3]
    assert prefill(bm, "a", a) == 0
    assert prefill(bm, "b", system + [9]) == 8
    assert bm.get_block_table("b")[:2] == bm.get_block_table("a")[:2]
    assert refcounts(bm)[:2] == [2, 2]
    # a prompt that is exactly the cached blocks still computes its last token
    assert prefill(bm, "c", list(system)) == 4
    s = bm.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (11 + 9 + 8, 12)
    check_block_manager(bm)


def test_freed_cached_blocks_stay_findable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    prefill(bm, "a", [1, 2, 3, 4, 5])  # blocks 0,1 cached, block 2 partial
    bm.free("a")
    s = bm.stats()
    assert (s.num_free_blocks, s.num_cached_blocks, s.num_cached_free_blocks) == (4, 2, 2)
    assert free_order(bm) == [3, 2, 1, 0]
    assert prefill(bm, "b", [1, 2, 3, 4, 9]) == 4  # revives blocks 0 and 1
    assert bm.get_block_table("b") == [0, 1, 3]
    bm.free("b")
    # eviction takes the least recently freed first: block 2 (never cached), then the tail block 1
    assert free_order(bm) == [2, 3, 1, 0]
    assert bm.allocate_sequence("x", 6)
    assert bm.get_block_table("x") == [2, 3, 1]
    assert bm.stats().num_evictions == 1
    bm.free("x")
    # block 1 (tokens 3, 4) was evicted; block 0 (tokens 1, 2) is still cached
    assert prefill(bm, "y", [1, 2, 3, 4, 5]) == 2
    assert bm.get_block_table("y")[0] == 0
    check_block_manager(bm)


def test_prefix_caching_switch_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prefill(bm, "a", [1, 2, 3, 4, 5])
    assert prefill(bm, "b", [1, 2, 3, 4, 5]) == 0
    assert bm.stats().num_cached_blocks == 0


def test_decode_tokens_become_cacheable_when_their_block_fills():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3]
    prefill(bm, "a", tokens)
    assert bm.stats().num_cached_blocks == 1
    decode(bm, "a", tokens, 4)
    assert bm.stats().num_cached_blocks == 2
    assert prefill(bm, "b", [1, 2, 3, 4, 5]) == 4


def test_a_prefix_computed_twice_keeps_both_tables_and_both_copies_findable():
    """Two requests admitted before either was computed: neither can hit, each computes its own copy. Tables
    only grow (no switching to the other's blocks), so the duplicate costs its blocks until b ends; both copies
    are cached, so a later request hits while either one survives."""
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    assert bm.allocate_sequence("a", 5, bm.lookup_prefix(tokens))
    assert bm.allocate_sequence("b", 5, bm.lookup_prefix(tokens))
    bm.cache_full_blocks("a", tokens, 5)
    bm.cache_full_blocks("b", tokens, 5)
    assert bm.get_block_table("a") == [0, 1, 2] and bm.get_block_table("b") == [3, 4, 5]
    s = bm.stats()
    assert (s.num_used_blocks, s.num_cached_blocks) == (6, 4)
    assert [b.block_id for b in bm.lookup_prefix(tokens).blocks] == [0, 1]  # the first copy cached
    bm.free("a")
    bm.reset_prefix_cache()  # a's copy is gone; b's, in use, stays findable
    assert [b.block_id for b in bm.lookup_prefix(tokens).blocks] == [3, 4]
    check_block_manager(bm)


def test_a_chain_passes_through_either_twin():
    """a computed [5, 6]; b, admitted beside it, computed [5, 6] again and then [7, 8] after its own copy. The
    two copies of [5, 6] hold the same content, so [7, 8] follows either: the lookup takes a's first block, then
    b's second, and hits both blocks (a block-by-block identity would stop after the first)."""
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.allocate_sequence("a", 2) and bm.allocate_sequence("b", 4)
    bm.cache_full_blocks("a", [5, 6], 2)
    bm.cache_full_blocks("b", [5, 6, 7, 8], 4)
    assert bm.get_block_table("a") == [0] and bm.get_block_table("b") == [1, 2]
    assert [b.block_id for b in bm.lookup_prefix([5, 6, 7, 8, 9]).blocks] == [0, 2]
    bm.free("a")
    bm.free("b")
    check_block_manager(bm)
    assert prefill(bm, "c", [5, 6, 7, 8, 9]) == 4  # the hit is taken out of the free queue and shared
    assert bm.get_block_table("c")[:2] == [0, 2]
    check_block_manager(bm)


def test_a_hash_collision_never_serves_another_requests_blocks():
    # every block hashes to the same value
    bm = BlockManager(num_blocks=16, block_size=2, hash_fn=lambda parent, toks: 42)
    prefill(bm, "a", [1, 2, 3, 4, 5])
    assert prefill(bm, "b", [9, 9, 3, 4, 5]) == 0  # same hash, other tokens: miss
    assert prefill(bm, "c", [1, 2, 9, 9, 5]) == 2  # first block genuinely equal: hit
    # same tokens in block 1 but after another block 0: its KV differs, so no hit
    bm2 = BlockManager(num_blocks=16, block_size=2, hash_fn=lambda parent, toks: hash(toks))
    prefill(bm2, "a", [1, 2, 3, 4, 5])
    assert prefill(bm2, "b", [7, 7, 3, 4, 5]) == 0
    check_block_manager(bm)
    check_block_manager(bm2)


def test_default_hash_is_a_chain():
    h0 = default_block_hash(None, (1, 2))
    assert default_block_hash(h0, (3, 4)) != default_block_hash(default_block_hash(None, (9, 9)), (3, 4))
    assert default_block_hash(None, (1, 2)) == h0


def test_stats_are_exact():
    bm = BlockManager(num_blocks=10, block_size=4)
    prefill(bm, "a", list(range(6)))  # 2 blocks, 6 tokens
    bm.fork("a", "b")
    s = bm.stats()
    assert s.num_used_blocks == 2
    assert s.num_tokens_stored == 6
    assert s.internal_fragmentation == pytest.approx(2 / 8)
    assert s.shared_savings_blocks == 2
    assert s.usage == pytest.approx(0.2)
    assert bm.append_slots("b", 1)  # copy of the partial block, then one more token
    s = bm.stats()
    assert (s.num_used_blocks, s.num_tokens_stored, s.shared_savings_blocks) == (3, 6 + 3, 1)


def test_stale_prefix_hit_is_refused():
    bm = BlockManager(num_blocks=3, block_size=2)
    prefill(bm, "a", [1, 2, 3])
    bm.free("a")
    hit = bm.lookup_prefix([1, 2, 3])
    assert hit.num_cached_tokens == 2
    assert bm.allocate_sequence("x", 6)  # evicts everything
    bm.free("x")
    with pytest.raises(ValueError, match="stale prefix hit"):
        bm.allocate_sequence("b", 1, hit)
    assert not bm.has_sequence("b")
    check_block_manager(bm)


def test_invariant_checks_still_check_under_python_O():
    """The scans the tests rely on raise InvariantError themselves, so `python -O` (which strips
    `assert` statements) cannot turn them into no-ops."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        from kvpaging.core.block_manager import BlockManager
        from kvpaging.core.invariants import check_block_manager, check_pool, check_scheduler
        from kvpaging.errors import InvariantError
        from kvpaging.core.scheduler import Scheduler
        assert False, "this assert is stripped under -O"
        bm = BlockManager(8, 4)
        if not bm.allocate_sequence("a", 6):
            raise SystemExit("no room")
        check_block_manager(bm)
        for obj, name, check in ((bm.pool.blocks[0], "ref_cnt", lambda: check_block_manager(bm)),
                                 (bm.pool, "num_filled_slots", lambda: check_pool(bm.pool))):
            setattr(obj, name, getattr(obj, name) + 1)  # corrupt the books
            try:
                check()
            except InvariantError as error:
                print("caught:", error)
            else:
                raise SystemExit("not caught")
            setattr(obj, name, getattr(obj, name) - 1)
        sched = Scheduler(bm)
        sched._unforked_extra_seats = 3
        try:
            check_scheduler(sched)
        except InvariantError as error:
            print("caught:", error)
        else:
            raise SystemExit("not caught")
    """)
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("caught:") == 3, done.stdout


# -- the scheduler's one-call-per-step paths ----------------------------------------------------------------------


class _Seq:
    """What append_decode_slots reads of a scheduler sequence: its table record and tokens."""

    def __init__(self, bm, seq_id, tokens):
        self.seq_id, self.token_ids, self.blocks = seq_id, tokens, bm.get_sequence_blocks(seq_id)


def _tables(bm):
    return {s: list(bm.get_block_table(s)) for s in bm._seqs}


def _books(bm):
    s = bm.stats()
    return (_tables(bm), refcounts(bm), free_order(bm), [b.num_filled for b in bm.pool.blocks], s.num_tokens_stored,
            s.num_table_blocks, s.num_cow_copies, s.peak_used_blocks, s.peak_table_blocks, s.peak_savings_blocks,
            bm.take_step_changes())


def _twin_managers(block_size, num_blocks):
    """Two managers driven through the same history: sequences at every kind of last block (partly filled,
    full, shared partly filled after a fork), and one in the middle of its prompt."""
    made = []
    for _ in range(2):
        bm = BlockManager(num_blocks, block_size)
        seqs = {}
        for name, length in (("a", 5), ("b", 8), ("c", 6), ("p", 9)):
            tokens = [10 + ord(name)] * length
            assert bm.allocate_sequence(name, length - (name == "p") * 3, bm.lookup_prefix(tokens))
            seqs[name] = tokens + [1]  # a sampled token: every sequence but p decodes next
        bm.fork("c", "c2")  # c and c2 share c's partly filled last block
        seqs["c2"] = list(seqs["c"])
        seqs["p"] = seqs["p"][:-1]  # p still has 3 prompt tokens to compute: not a decode
        made.append((bm, {k: _Seq(bm, k, v) for k, v in seqs.items()}))
    return made


@pytest.mark.parametrize(("num_blocks", "served"), [(10, 4), (9, 2), (8, 1)])
def test_append_decode_slots_gives_what_append_slots_gives_one_by_one(num_blocks, served):
    """One call for a run of decodes against append_slots(seq, 1) for each: the same tables, fills, copies,
    counters and high-water marks, over the run of decodes the scheduler would find (up to p, mid-prompt); with
    fewer free blocks it stops at the first one the pool has no block for."""
    (fast, fseqs), (slow, _) = _twin_managers(4, num_blocks)
    order = ["a", "b", "c", "c2", "p", "a"]
    decodes = order[: order.index("p")]  # the scheduler's run of decodes ends where p, mid-prompt, is
    done = fast.append_decode_slots([fseqs[k] for k in decodes])
    expected = 0
    for name in decodes:
        if not slow.append_slots(name, 1):
            break
        expected += 1
    assert done == expected == served  # 10 blocks: b takes a new block and c a copy; fewer: it stops short
    assert _books(fast) == _books(slow)
    assert fast.stats().num_cow_copies == (served == 4)
    check_block_manager(fast)


def test_a_decode_that_fills_its_block_caches_it_as_cache_full_blocks_does():
    """A decode that fills its block: offered to the cache by the step's one append_decode_slots call, or by
    append_slots and cache_full_blocks sequence by sequence. Two sequences that computed the same blocks keep
    their own (tables only grow), and both copies are findable."""
    made = []
    for one_call in (True, False):
        bm = BlockManager(12, 4)
        seqs = []
        for name in ("x", "y"):
            tokens = [7, 7, 7, 7, 8, 8, 8]
            assert bm.allocate_sequence(name, len(tokens))
            bm.cache_full_blocks(name, tokens, len(tokens))
            tokens.append(9)  # the decode's input: position 7, the last slot of block 1
            seqs.append(_Seq(bm, name, tokens))
        if one_call:
            assert bm.append_decode_slots(seqs) == 2
        else:
            for seq in seqs:
                assert bm.append_slots(seq.seq_id, 1)
                bm.cache_full_blocks(seq.seq_id, seq.token_ids, len(seq.token_ids))
        check_block_manager(bm)
        made.append(bm)
    assert _books(made[0]) == _books(made[1])
    bm = made[0]
    tables = _tables(bm)
    assert not set(tables["x"]) & set(tables["y"])  # each kept its own blocks
    pool = bm.pool
    assert all(pool.blocks[b].block_hash is not None for b in tables["x"] + tables["y"])
    assert [pool.blocks[b].block_hash for b in tables["x"]] == [pool.blocks[b].block_hash for b in tables["y"]]
    assert bm.stats().num_cached_blocks == 4
    hit = bm.lookup_prefix([7, 7, 7, 7, 8, 8, 8, 9, 1])  # the first cached twin is found: x's
    assert [b.block_id for b in hit.blocks] == tables["x"]
    bm.free("x")
    bm.reset_prefix_cache()  # x's blocks leave the cache; y's, in use, stay and are found
    assert [b.block_id for b in bm.lookup_prefix([7, 7, 7, 7, 8, 8, 8, 9, 1]).blocks] == tables["y"]
    check_block_manager(bm)


def test_free_blocks_is_free_block_in_order():
    """The pool's one-call free of a whole table: shared blocks lose an owner, a block held for a pending copy waits,
    the rest join the free queue in order, and every counter ends where free_block one by one leaves it."""
    made = []
    for one_call in (True, False):
        pool = BlockPool(num_blocks=8, block_size=4)
        blocks = [pool.get_new_block() for _ in range(6)]
        for b in blocks:
            pool.fill(b, 4)
        pool.cache_block(blocks[0], 123, (1, 2, 3, 4))
        pool.touch(blocks[1])  # shared
        pool.hold_until_copied(blocks[2])  # a pending copy's source
        table = [blocks[k] for k in (5, 4, 2, 1, 0)]
        if one_call:
            pool.free_blocks(table)
        else:
            for b in table:
                pool.free_block(b)
        pool.release_held()
        check_pool(pool)
        made.append(([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks], pool.num_filled_slots,
                     pool.num_cached_free_blocks))
    assert made[0] == made[1]
    assert made[0][0] == [6, 7, 5, 4, 0, 2]


def test_blocks_under_one_hash_stay_findable_in_the_order_they_were_cached():
    """Blocks cached under one hash (collisions here: other tokens) are chained behind the first: a lookup finds
    each by its tokens, the first cached first, and taking any of them out of the cache, first, middle or last,
    leaves the others findable."""
    for gone in range(3):
        pool = BlockPool(num_blocks=4, block_size=2)
        blocks = [pool.get_new_block(2) for _ in range(3)]
        for k, block in enumerate(blocks):
            assert pool.cache_block(block, 7, (k, k))
        pool.cache_block(pool.get_new_block(2), 7, (0, 0))  # a twin of the first: found after it
        assert [pool.lookup(7, (k, k), None) for k in range(3)] == blocks
        pool.uncache(blocks[gone])
        check_pool(pool)
        assert pool.lookup(7, (gone, gone), None) is (pool.blocks[3] if gone == 0 else None)
        assert all(pool.lookup(7, (k, k), None) is blocks[k] for k in range(3) if k != gone)
        assert pool.num_cached_blocks == 3


def test_free_queue_against_a_plain_list():
    """The linked free queue against a Python list doing the same appends, pops from the front, removals from
    the middle and whole-table extends: same order at every step, and every link has its reverse."""
    import random

    from kvpaging.core.block_pool import FreeBlockQueue, KVBlock
    from kvpaging.errors import InvariantError

    rng = random.Random(7)
    blocks = [KVBlock(i) for i in range(12)]
    queue = FreeBlockQueue(blocks)
    model = list(blocks)
    taken = []
    for _ in range(400):
        op = rng.randrange(4)
        if op == 0 and model:
            block = queue.popleft()
            assert block is model.pop(0)
            assert block.prev_free is None and block.next_free is None
            taken.append(block)
        elif op == 1 and model:
            block = rng.choice(model)
            queue.remove(block)
            model.remove(block)
            taken.append(block)
        elif op == 2 and taken:
            block = taken.pop(rng.randrange(len(taken)))
            queue.append(block)
            model.append(block)
        elif op == 3 and taken:
            rng.shuffle(taken)
            some, taken = taken[:3], taken[3:]
            queue.extend(some)
            model += some
        assert [b.block_id for b in queue] == [b.block_id for b in model]
        assert len(queue) == len(model)
        check_free_queue(queue)
    while model:
        assert queue.popleft() is model.pop(0)
    with pytest.raises(IndexError):
        queue.popleft()
    check_free_queue(queue)
    queue.append(blocks[0])
    blocks[0].prev_free = blocks[5]  # a broken back link is caught
    with pytest.raises(InvariantError):
        check_free_queue(queue)


@pytest.mark.parametrize("caching", [True, False])
def test_allocate_slots_is_allocate_or_append_then_cache_full_blocks(caching):
    """The scheduler's one door against the three steps lesson 04 takes one by one: the same tables, fills,
    cache and counters after a first chunk with a prefix hit, a second chunk and a decode that fills a block;
    with no room it returns None and changes nothing."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    made = []
    for door in (True, False):
        bm = BlockManager(8, 4, enable_prefix_caching=caching)
        assert bm.allocate_sequence("warm", 9)
        bm.cache_full_blocks("warm", prompt, 9)  # blocks 0 and 1 cached
        hit = bm.lookup_prefix(prompt)
        assert len(hit.blocks) == (2 if caching else 0)
        start = len(hit.blocks) * 4
        tokens = list(prompt)
        for n, extra in ((10 - start, None), (1, None), (1, 12)):  # to 10 tokens, to 11, then a decode
            if extra is not None:
                tokens.append(extra)
            if door:
                st = bm.allocate_slots("s", tokens, n, None if bm.has_sequence("s") else hit)
                assert st is bm.get_sequence_blocks("s")
            else:
                if bm.has_sequence("s"):
                    assert bm.append_slots("s", n)
                else:
                    assert bm.allocate_sequence("s", n, hit)
                bm.cache_full_blocks("s", tokens, bm.get_num_tokens("s"))
        check_block_manager(bm)
        made.append(bm)
    assert _books(made[0]) == _books(made[1])
    bm = made[0]
    assert bm.get_num_tokens("s") == 12
    before = _books(bm)
    assert bm.allocate_slots("big", list(range(100, 130)), 30, NO_HIT) is None  # 8 blocks needed, fewer free
    assert _books(bm) == before and not bm.has_sequence("big")
    with pytest.raises(DuplicateSequenceError):  # a hit means a new sequence
        bm.allocate_slots("s", tokens, 1, NO_HIT)
    bm.free("warm")
    with pytest.raises(SequenceNotFoundError):  # no hit means one that holds blocks: not a finished one
        bm.allocate_slots("warm", prompt, 1)
