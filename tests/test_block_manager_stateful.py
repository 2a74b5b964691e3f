"""A hypothesis state machine drives the block manager the way an engine would.

The model beside it is deliberately simple: every sequence is a plain list of
token ids, and every physical block is modelled by *what its KV data means* --
the tuple of all tokens from the start of the sequence up to the last token
written into it (the keys and values of a token depend on the whole prefix).
Writes, copy-on-write copies and prefix-cache hits are replayed on that model,
so any sharing bug (two sequences writing one block, a hit on the wrong data, a
copy forgotten) shows up as a model mismatch.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpaging.core.block_manager import BlockManager
from kvpaging.worker.model_runner import BlockTable
from kvpaging.core.invariants import check_block_manager

TOKENS = st.integers(0, 2)  # a tiny vocabulary, so prefixes repeat and the cache gets hits


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 24),
        caching=st.booleans(),
        colliding_hash=st.booleans(),
    )
    def setup(self, block_size, num_blocks, caching, colliding_hash):
        hash_fn = (lambda parent, toks: sum(toks) % 3) if colliding_hash else None
        kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, **kwargs)
        self.bs = block_size
        self.tokens: dict[int, list[int]] = {}  # live sequences
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its KV encodes
        self.next_id = 0
        self.colliding = colliding_hash
        self.runner_tables = BlockTable()  # what the model runner rebuilds from the manager's table updates

    # -- helpers replaying the engine's writes on the model ---------------------------
    def _apply_copies(self):
        copies, (updates,) = self.bm.take_step_changes()
        self.runner_tables.apply(updates)
        for src, dst in copies:
            assert self.bm.pool.blocks[dst].ref_cnt == 1
            self.content[dst] = self.content[src]
        self.bm.step_done()

    def _write(self, seq, start, end):
        """Positions [start, end) of ``seq`` are computed and stored in its blocks."""
        table = self.bm.get_block_table(seq)
        toks = self.tokens[seq]
        for pos in range(start, end):
            block_id = table[pos // self.bs]
            # a written block must be exclusively owned: anything else corrupts a sharer
            assert self.bm.pool.blocks[block_id].ref_cnt == 1, f"write into shared block {block_id}"
            if pos % self.bs:
                assert self.content[block_id] == tuple(toks[:pos]), "block does not hold this sequence's prefix"
            self.content[block_id] = tuple(toks[: pos + 1])

    # -- rules ------------------------------------------------------------------------
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=12), chunk=st.integers(1, 12))
    def admit(self, prompt, chunk):
        seq = self.next_id
        hit = self.bm.lookup_prefix(prompt)
        n_cached = hit.num_cached_tokens
        assert n_cached % self.bs == 0 and n_cached < len(prompt)
        for i, block in enumerate(hit.blocks):  # a hit must hold exactly this prefix
            assert self.content[block.block_id] == tuple(prompt[: (i + 1) * self.bs])
        n_new = min(chunk, len(prompt) - n_cached)
        try:
            ok = self.bm.allocate_sequence(seq, n_new, hit)
        except ValueError:
            assert self.bm.num_blocks_for(n_cached + n_new) > self.bm.num_blocks
            return
        if not ok:
            assert not self.bm.has_sequence(seq)
            return
        self.next_id += 1
        self.tokens[seq] = list(prompt)
        self._apply_copies()
        self._write(seq, n_cached, n_cached + n_new)
        self.bm.cache_full_blocks(seq, prompt, n_cached + n_new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=TOKENS, chunk=st.integers(1, 5))
    def step(self, data, token, chunk):
        """Either continue a chunked prefill or decode one token."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[seq]
        n = self.bm.get_num_tokens(seq)
        if n < len(toks):
            n_new = min(chunk, len(toks) - n)
        else:
            toks.append(token)
            n_new = 1
        try:
            ok = self.bm.append_slots(seq, n_new)
        except ValueError:
            ok = False
        if not ok:
            if n_new == 1 and n == len(toks) - 1:
                toks.pop()
            return
        self._apply_copies()
        self._write(seq, n, n + n_new)
        self.bm.cache_full_blocks(seq, toks, n + n_new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.get_num_tokens(seq) < len(self.tokens[seq]):
            return  # the engine forks only after the prompt is computed
        child = self.next_id
        self.next_id += 1
        self.bm.fork(seq, child)
        self.tokens[child] = list(self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        check_block_manager(bm)  # used + free = total; ref counts = tables; no block free and referenced
        s = bm.stats()
        held = {b for seq in self.tokens for b in bm.get_block_table(seq)}
        assert s.num_used_blocks == len(held)
        assert s.num_free_blocks == bm.num_blocks - len(held)
        assert s.num_tokens_stored == sum(bm.pool.blocks[b].num_filled for b in held)
        assert s.num_table_blocks == sum(len(bm.get_block_table(seq)) for seq in self.tokens)
        # the updates, applied in order, rebuild every live table: its row holds the table, then zeros
        self.runner_tables.apply(bm.take_step_changes()[1][0])
        for seq in self.tokens:
            st = bm.get_sequence_blocks(seq)
            row = self.runner_tables.array[st.row].tolist()
            assert row[: len(st.block_ids)] == st.block_ids and not any(row[len(st.block_ids):]), (seq, row)
        assert len({bm.get_sequence_blocks(seq).row for seq in self.tokens}) == len(self.tokens), "a row shared"
        for seq, toks in self.tokens.items():
            n = bm.get_num_tokens(seq)
            for i, block_id in enumerate(bm.get_block_table(seq)):
                end = min(n, (i + 1) * self.bs)
                assert self.content[block_id] == tuple(toks[:end]), f"seq {seq} block {i} holds the wrong prefix"
        # every cached hash points at a block whose tokens match what was written there
        for block in bm.pool.cached_blocks():
            assert self.content[block.block_id][-self.bs :] == block.token_ids
        if bm.enable_prefix_caching and not self.colliding:
            # a live sequence's computed full blocks are all findable
            for seq, toks in self.tokens.items():
                n_full = min(bm.get_num_tokens(seq), len(toks)) // self.bs
                hit = bm.lookup_prefix(toks)
                assert len(hit.blocks) >= min(n_full, (len(toks) - 1) // self.bs)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        s = self.bm.stats()
        assert s.num_used_blocks == 0 and s.num_free_blocks == self.bm.num_blocks and s.num_tokens_stored == 0
        check_block_manager(self.bm)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=180, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
