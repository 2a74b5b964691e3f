"""Blocks a sliding window has passed go back to the pool, and the tokens stay exactly generate()'s.

With a window of ``W`` on every layer, a query at position ``q`` reads only keys after ``q - W``. Once a
sequence's next query is at ``q``, every block whose tokens all lie at or before ``q - W`` is read by nobody
again: the block manager frees it (``SlidingWindowBlockManager``, which the engine sets from the model's
config when every layer slides). The accounting is checked against a count made here from positions alone (the
blocks holding a position some future query reads, or a slot already given); the tokens against the model's own
``generate()``, with the passed blocks taken over by other sequences in a tight pool, so that a kernel reading a
passed block would read someone else's keys.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import TIE_TOLERANCE, assert_pool_clean, forked_and_alone, greedy_params

from kvpaging import LLM, blocks_held
from kvpaging.core.block_manager import NO_HIT, BlockManager
from kvpaging.core.sliding_window import SlidingWindowBlockManager
from kvpaging.models.architectures import tiny_model
from kvpaging.teach.setup_check import greedy_agreement
from kvpaging.core.invariants import check_block_manager

pytestmark = pytest.mark.usefixtures("one_thread")


def blocks_needed(num_tokens: int, first_query: int, window: int, block_size: int) -> int:
    """Blocks a sequence must hold: those with a slot in ``[first_query - window + 1, num_tokens)`` (what a query
    from ``first_query`` on still reads, and the slots it was given), counted position by position."""
    return len({p // block_size for p in range(max(0, first_query - window + 1), num_tokens)})


class Seq:
    """What the block manager's decode call reads of a scheduler sequence."""

    def __init__(self, blocks, token_ids):
        self.blocks, self.token_ids = blocks, token_ids


@pytest.mark.parametrize("window, block_size", [(6, 4), (1, 4), (16, 16), (17, 16), (5, 8)])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_sequence_holds_what_its_window_reads(window, block_size, prefix_caching):
    """Prefill in chunks, then decode one token at a time: after every step the sequence holds exactly the blocks
    a position count says it needs, the rest are free, and every invariant holds."""
    bm = SlidingWindowBlockManager(64, block_size, window, enable_prefix_caching=prefix_caching)
    tokens = [random.Random(window).randrange(1000) for _ in range(40)]
    chunks = [13, 9, 18]  # a 40-token prompt in three chunks
    start = 0
    for n in chunks:
        bm.allocate_slots("s", tokens, n, NO_HIT if start == 0 else None)
        start += n
        assert bm.stats().num_used_blocks == blocks_needed(start, start - n, window, block_size)
        bm.step_done()
        check_block_manager(bm)
    st = bm.get_sequence_blocks("s")
    for _ in range(3 * block_size + 5):  # decodes
        tokens.append(len(tokens))
        assert bm.append_decode_slots([Seq(st, tokens)]) == 1
        assert bm.stats().num_used_blocks == blocks_needed(st.num_tokens, st.num_tokens - 1, window, block_size)
        assert bm.stats().num_used_blocks == blocks_held(st.num_tokens, block_size, window)  # the formula lessons use
        assert st.block_ids[: st.num_passed] == [-1] * st.num_passed
        bm.step_done()
        check_block_manager(bm)
    assert st.num_passed > 0
    bm.free("s")
    check_block_manager(bm)
    assert bm.stats().num_used_blocks == 0


def test_passed_blocks_stay_cached_and_the_chain_goes_on():
    """A passed block joins the free queue still cached: the same prompt again hits from its first block, and
    blocks filled after a passed one are cached after it (their parent's identity kept by the table)."""
    bm = SlidingWindowBlockManager(64, 4, 5, enable_prefix_caching=True)
    prompt = list(range(100, 124))  # 6 full blocks
    bm.allocate_slots("a", prompt, len(prompt), NO_HIT)
    bm.step_done()
    st = bm.get_sequence_blocks("a")
    assert st.num_passed == 0  # the prompt's own queries read from position 0
    tokens = list(prompt)
    for t in range(8):  # two more blocks filled while decoding, after passed ones
        tokens.append(500 + t)
        bm.append_decode_slots([Seq(st, tokens)])
        bm.step_done()
    check_block_manager(bm)
    assert st.num_passed == 6  # the next query, at 32, reads from position 28: block 7 only
    assert bm.pool.num_cached_blocks == 8  # the 6 prompt blocks (4 of them free) and the 2 filled while decoding
    hit = bm.lookup_prefix(tokens + [0])
    assert len(hit.blocks) == 8, "the whole chain, through the passed blocks, is findable"
    bm.free("a")
    check_block_manager(bm)


def test_fork_and_copy_on_write_after_blocks_were_passed():
    """n > 1: children share the live blocks only; each child's own decodes copy the shared last block."""
    bm = SlidingWindowBlockManager(32, 4, 6, enable_prefix_caching=True)
    prompt = list(range(1, 23))  # 22 tokens: a partly filled last block
    bm.allocate_slots("p", prompt, 10, NO_HIT)  # in two chunks: the second one's queries read from position 5
    bm.step_done()
    bm.allocate_slots("p", prompt, 12)
    bm.step_done()
    parent = bm.get_sequence_blocks("p")
    kids = [bm.fork("p", f"c{i}") for i in range(2)]
    check_block_manager(bm)
    assert all(k.block_ids == parent.block_ids and k.num_passed == parent.num_passed > 0 for k in kids)
    used = bm.stats().num_used_blocks
    assert used == blocks_needed(22, 10, 6, 4)  # shared, not copied
    for table, seq_tokens in [(parent, prompt + [7]), (kids[0], prompt + [8]), (kids[1], prompt + [9])]:
        bm.append_decode_slots([Seq(table, seq_tokens)])
    bm.step_done()
    check_block_manager(bm)
    assert bm.stats().num_cow_copies == 2
    for name in ("p", "c0", "c1"):
        bm.free(name)
    check_block_manager(bm)
    assert bm.stats().num_used_blocks == 0


# --- the engine, against generate() ---------------------------------------------------------------------------

NUM_TOKENS = 40


@pytest.fixture(scope="module")
def mistral(one_thread):
    model = tiny_model("mistral", sliding_window=6)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (3, 9, 14, 23, 30, 5)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return model, prompts, expected


@pytest.mark.parametrize("mode", ["default", "chunked, prefix cache, preemption"])
def test_engine_frees_passed_blocks_and_gives_generates_tokens(mistral, mode):
    model, prompts, expected = mistral
    settings = {"block_size": 4, "num_blocks": 20, "max_model_len": 72, "attention_backend": "torch"}
    if mode != "default":
        settings |= {"max_num_batched_tokens": 7}
    llm = LLM(model, **settings)
    bm = llm.engine.block_manager
    assert bm.sliding_window == 6
    for run in range(2 if mode != "default" else 1):  # the second run starts from the prefix cache
        bm.reset_peak_stats()
        outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
        for prompt, out, want in zip(prompts, outputs, expected):
            got = out.outputs[0].token_ids
            verdict = greedy_agreement(model, prompt, got, want, tolerance=TIE_TOLERANCE)
            assert verdict.agrees, f"{mode} run {run}: prompt of {len(prompt)}: {got} != generate()'s {want}"
        assert_pool_clean(llm)
        stats = bm.stats()
        # 6 sequences of up to 70 tokens would need up to 18 blocks each without the window; the pool has 20
        assert stats.peak_used_blocks <= 20
        assert stats.peak_table_blocks < sum(-(-(len(p) + NUM_TOKENS) // 4) for p in prompts)
    assert stats.num_evictions > 0, "passed blocks were handed to other sequences"
    assert llm.engine.runner.block_table.array.min() >= 0, "the runner's tables index no block outside the cache"
    assert stats.num_passed_blocks > 0


def test_n_completions_on_a_sliding_window_model(mistral):
    """Forked completions after the window passed prompt blocks: seeded samples equal separate requests'."""
    model, prompts, _ = mistral
    llm = LLM(model, block_size=4, num_blocks=40, max_model_len=72, attention_backend="torch")
    together, alone = forked_and_alone(llm, prompts[4], n=3, seed=5, max_tokens=12)
    assert together == alone
    assert_pool_clean(llm)


def test_models_with_a_full_attention_layer_pass_nothing_in_one_table():
    """Gemma 2's global layers read every key: no window passes a block of a table all layers share (its
    sliding layers give blocks back from a table of their own instead: tests/test_layer_groups.py)."""
    from kvpaging.worker.kv_layout import passing_window

    assert passing_window(tiny_model("gemma2", sliding_window=6).config) == 0
    assert passing_window(tiny_model("mistral", sliding_window=6).config) == 6
    assert passing_window(tiny_model("llama").config) == 0


@pytest.mark.interpreter
def test_triton_kernels_start_at_the_window(mistral):
    """The Triton kernels (under the interpreter here) begin each query's keys at its window, so a passed
    entry (-1) is never read: the same tokens, fewer prompts and tokens for the interpreter's sake."""
    model, prompts, expected = mistral
    served = model
    if torch.cuda.is_available():  # compiled kernels take CUDA tensors only
        import copy

        served = copy.deepcopy(model).to("cuda")
    llm = LLM(served, block_size=4, num_blocks=24, max_model_len=72, attention_backend="triton")
    outputs = llm.generate(prompts[1:4], greedy_params(14), use_tqdm=False)
    for prompt, out, want in zip(prompts[1:4], outputs, expected[1:4]):
        verdict = greedy_agreement(model, prompt, out.outputs[0].token_ids, want[:14], tolerance=TIE_TOLERANCE)
        assert verdict.agrees
    assert llm.engine.block_manager.stats().peak_table_blocks < sum(-(-(len(p) + 14) // 4) for p in prompts[1:4])
    assert_pool_clean(llm)


def test_blocks_held_refuses_what_is_not_a_count():
    assert blocks_held(33, 16) == 3 and blocks_held(33, 16, window=0) == 3
    for bad in ({"num_tokens": -1}, {"block_size": 0}, {"window": -2}, {"window": True}, {"num_tokens": 2.0}):
        args = {"num_tokens": 10, "block_size": 4, "window": 3} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            blocks_held(**args)


# --- sequences longer than the pool ---------------------------------------------------------------------------

def test_a_windowed_sequence_may_outgrow_the_pool():
    """With a window, a sequence holds only the window's blocks: 4 blocks of 4 serve one of 60 tokens (prefilled in
    chunks of 4), where without the window the 17th token is refused as too long for the pool."""
    from kvpaging.errors import SequenceTooLongError

    tokens = list(range(100, 160))
    for window in (6, 0):
        bm = SlidingWindowBlockManager(4, 4, window, enable_prefix_caching=True) if window else BlockManager(4, 4)
        try:
            for start in range(0, 20, 4):  # a 20-token prompt in chunks of 4
                assert bm.allocate_slots("s", tokens, 4, NO_HIT if start == 0 else None) is not None
                bm.step_done()
            st = bm.get_sequence_blocks("s")
            seq = Seq(st, tokens[:20])
            for n in range(20, 60):
                seq.token_ids = tokens[: n + 1]
                assert bm.append_decode_slots([seq]) == 1
                bm.step_done()
                check_block_manager(bm)
        except SequenceTooLongError as error:
            assert window == 0 and "only 4 blocks" in str(error)
        else:
            assert window == 6 and st.num_tokens == 60 and bm.stats().num_used_blocks <= 3
    bm = SlidingWindowBlockManager(4, 4, 6)
    with pytest.raises(SequenceTooLongError, match="window"):  # a chunk longer than the pool, window or not
        bm.allocate_slots("t", tokens, 20, NO_HIT)


def test_a_long_prefix_hit_takes_only_the_blocks_the_window_still_reads():
    """A second request with the same 40-token prompt hits 9 blocks, but its first query (at position 36) reads
    only the last 6 positions: it takes 2 of them (and a new block), the 7 before are passed from the start (and stay
    findable)."""
    bm = SlidingWindowBlockManager(16, 4, 6, enable_prefix_caching=True)
    prompt = list(range(1, 41))
    for start in range(0, 40, 8):
        bm.allocate_slots("a", prompt, 8, NO_HIT if start == 0 else None)
        bm.step_done()
    bm.free("a")
    hit = bm.lookup_prefix(prompt)
    assert len(hit.blocks) == 9
    st = bm.allocate_slots("b", prompt, 4, hit)
    bm.step_done()
    check_block_manager(bm)
    assert st.num_passed == 7 and st.block_ids[:7] == [-1] * 7
    assert bm.stats().num_used_blocks == blocks_needed(40, 36, 6, 4) == 3  # 2 hit blocks and 1 new
    bm.free("b")
    assert len(bm.lookup_prefix(prompt).blocks) == 9


def test_the_engine_serves_a_windowed_model_longer_than_its_pool(mistral):
    """8 blocks of 4 (32 slots) serve prompts and answers of up to 70 tokens on a tiny Mistral with a 6-token
    window, in steps of at most 6 tokens: generate()'s tokens. A model without a window is refused that pool."""
    model, prompts, expected = mistral
    llm = LLM(model, block_size=4, num_blocks=8, max_model_len=72, max_num_batched_tokens=6,
              attention_backend="torch")
    outputs = llm.generate(prompts[3:5], greedy_params(NUM_TOKENS), use_tqdm=False)  # prompts of 23 and 30 tokens
    for prompt, out, want in zip(prompts[3:5], outputs, expected[3:5]):
        assert greedy_agreement(model, prompt, out.outputs[0].token_ids, want, tolerance=TIE_TOLERANCE).agrees
    assert_pool_clean(llm)
    with pytest.raises(ValueError, match="cannot hold"):
        LLM(tiny_model("llama"), block_size=4, num_blocks=8, max_model_len=72, max_num_batched_tokens=6)
