"""Lesson 12's pieces and engine: the checks catch the mistakes a learner makes, and the engine the pieces make
gives transformers' generate() tokens (its own run of the model, which kvpaging's code does not touch)."""

from __future__ import annotations

import pytest
import torch

from kvpaging.models import tiny
from kvpaging.teach import mini_engine as me
from kvpaging.teach.mini_engine import MiniEngine, use

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_references_pass_their_own_checks():
    for name, piece in me.REFERENCES.items():
        choice = use(name, piece)
        assert choice.mine and choice.piece is piece, choice


def _stub(*args, **kwargs):
    raise NotImplementedError


class _LeakyAllocator(me.ReferenceAllocator):
    def free(self, seq_id):  # forgets to give the blocks back
        del self.tables[seq_id], self.lengths[seq_id]


WRONG = {
    "slot_mapping": lambda t, s, n, bs: [t[p // bs] * bs + p % bs + 1 for p in range(s, s + n)],  # one slot too far
    "store_kv": lambda kc, vc, k, v, slots: me.store_kv(kc, vc, v, k, slots),  # keys and values swapped
    "attend": lambda q, kc, vc, t, n, sc: me.attend(q, kc, vc, t, n, sc * 2),  # the wrong scale
    "sample": lambda logits: int(logits.argmin()),
    "allocator": _LeakyAllocator,
    "paged_attention": lambda q, kc, vc, bt, lens, sc: me.reference_paged_attention(q, kc, vc, bt, lens - 1, sc),
    "plan": lambda running, waiting, budget, cap: me.reference_plan_step(running, waiting, budget, cap + 1),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_piece_is_caught_and_the_reference_taken(name):
    choice = use(name, WRONG[name])
    assert not choice.mine and choice.piece is me.REFERENCES[name]
    assert "differs" in choice.reason


def test_a_start_aligned_mask_is_caught():
    """The mistake lesson 04b warns about: SDPA's is_causal aligns the mask to the start, right only for a prompt."""
    def start_aligned(q, k_cache, v_cache, table, seq_len, scale):
        k = k_cache[table[: -(-seq_len // k_cache.shape[1])]].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)
        v = v_cache[table[: -(-seq_len // v_cache.shape[1])]].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                               v.transpose(0, 1), is_causal=True, scale=scale)
        return out.transpose(0, 1)

    assert not use("attend", start_aligned).mine


def test_stubs_and_crashes_say_why():
    choice = use("attend", _stub)
    assert not choice.mine and "not written yet" in repr(choice)
    choice = use("slot_mapping", lambda *a: 1 / 0)
    assert not choice.mine and "ZeroDivisionError" in choice.reason


def _generate(model, prompts, max_tokens):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            o = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, pad_token_id=0)
        out.append(o[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def model_and_reference(one_thread):
    model = tiny("llama", num_key_value_heads=2)
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 7, 16, 17, 30)]
    return model, prompts, _generate(model, prompts, 12)


def test_the_engine_gives_generates_tokens(model_and_reference):
    model, prompts, expected = model_and_reference
    before = model.config._attn_implementation
    engine = MiniEngine(model, num_blocks=40, block_size=4, max_num_seqs=3)  # 3 at a time: later ones wait
    assert engine.generate(prompts, 12) == expected
    assert engine.allocator.num_free_blocks == 40
    assert model.config._attn_implementation == before, "the user's model keeps its own attention"


def test_an_off_by_one_slot_shows_in_the_tokens(model_and_reference):
    """The lesson's claim: a slot one too far (within the pool) changes the answers."""
    model, prompts, expected = model_and_reference
    shifted = lambda t, s, n, bs: [(t[p // bs] * bs + p % bs + 1) % (40 * bs) for p in range(s, s + n)]  # noqa: E731
    engine = MiniEngine(model, {"slot_mapping": shifted}, num_blocks=40, block_size=4, max_num_seqs=3)
    assert engine.generate(prompts, 12) != expected


def test_decodes_go_through_the_paged_attention_piece_together(model_and_reference):
    """After its prompt, each sequence's token is attended by lesson 04b's paged attention, every decode of a step
    in one call; a piece that forgets the newest key shows in the tokens."""
    model, prompts, expected = model_and_reference
    batches = []

    def counting(query, *args):
        batches.append(query.shape[0])
        return me.reference_paged_attention(query, *args)

    engine = MiniEngine(model, {"paged_attention": counting}, num_blocks=40, block_size=4, max_num_seqs=3)
    assert engine.generate(prompts, 12) == expected
    layers = model.config.num_hidden_layers
    # every token but each answer's first (its prompt's step) is a decode; 3 sequences run at a time
    assert sum(batches) == layers * sum(len(answer) - 1 for answer in expected) and max(batches) == 3
    short = MiniEngine(model, {"paged_attention": WRONG["paged_attention"]}, num_blocks=40, block_size=4,
                       max_num_seqs=3)
    assert short.generate(prompts, 12) != expected


@pytest.mark.parametrize("budget", [1, 5, 8, 13])
def test_chunked_prefill_under_a_token_budget_gives_generates_tokens(model_and_reference, budget):
    """Lesson 07's planner in the engine: prompts of up to 30 tokens in chunks of at most ``budget`` tokens, a
    step's decodes first, and never more tokens in a step than the budget."""
    model, prompts, expected = model_and_reference
    sizes = []

    def planner(running, waiting, step_budget, cap):
        plan = me.reference_plan_step(running, waiting, step_budget, cap)
        sizes.append(sum(plan.values()))
        return plan

    engine = MiniEngine(model, {"plan": planner}, num_blocks=40, block_size=4, max_num_seqs=3,
                        max_num_batched_tokens=budget)
    assert engine.generate(prompts, 12) == expected
    assert max(sizes) == budget and engine.allocator.num_free_blocks == 40
    unchunked = MiniEngine(model, num_blocks=40, block_size=4, max_num_seqs=3)
    unchunked.generate(prompts, 12)
    assert engine.num_steps > unchunked.num_steps  # the prompts took several steps each


def test_a_full_pool_is_an_error_that_says_so(model_and_reference):
    model, prompts, _ = model_and_reference
    engine = MiniEngine(model, num_blocks=8, block_size=4, max_num_seqs=5)
    with pytest.raises(RuntimeError, match="no preemption"):
        engine.generate(prompts, 12)


def test_the_model_cannot_be_called_outside_a_step(model_and_reference):
    engine = MiniEngine(model_and_reference[0], num_blocks=8, block_size=4)
    with pytest.raises(RuntimeError, match="outside MiniEngine.step"):
        engine.model(torch.tensor([[5, 6, 7]]))


def test_forked_answers_are_those_of_separate_requests(model_and_reference):
    """n = 3 answers a prompt fork after the prompt's step, sharing its blocks (lesson 05's allocator); drawn with
    their seeds they equal three separate requests. Without the engine's copy of a shared block, they do not."""
    from kvpaging.teach.build import ReferenceSharingAllocator

    model, prompts, expected = model_and_reference
    parts = {"allocator": ReferenceSharingAllocator}
    chosen = [prompts[1], prompts[3]]  # 7 and 17 tokens: each prompt's last block partly filled, so shared and copied
    engine = MiniEngine(model, parts, num_blocks=40, block_size=4, max_num_batched_tokens=9)
    together = engine.generate(chosen, 10, n=3, temperature=1.0, seed=5)
    assert engine.num_copies == 4, "each prompt's shared last block copied for two of its three answers"
    used, listed = engine.peak_blocks
    assert listed > used, "the tables listed shared blocks more than once"
    alone = [[engine.generate([p], 10, temperature=1.0, seed=5 + i)[0] for i in range(3)] for p in chosen]
    assert together == alone and engine.allocator.num_free_blocks == 40
    assert all(len({tuple(a) for a in answers}) > 1 for answers in together), "temperature 1: the answers differ"
    greedy = MiniEngine(model, parts, num_blocks=40, block_size=4).generate(chosen, 12, n=2)
    assert greedy == [[expected[1]] * 2, [expected[3]] * 2]

    class Copying(ReferenceSharingAllocator):  # a learner's table() may hand out a copy, not the live list
        def table(self, seq_id):
            return list(self.tables[seq_id])
    copying = MiniEngine(model, {"allocator": Copying}, num_blocks=40, block_size=4, max_num_batched_tokens=9)
    assert copying.generate(chosen, 10, n=3, temperature=1.0, seed=5) == alone and copying.num_copies == 4
    lost = MiniEngine(model, parts, num_blocks=40, block_size=4, max_num_batched_tokens=9)
    lost.copy_block = lambda src, dst: None  # the allocator swaps the block, but its keys and values are not copied
    assert lost.generate(chosen, 10, n=3, temperature=1.0, seed=5) != alone


def test_an_fp8_cache_is_calibrated_and_stored_as_kvpaging_does(model_and_reference):
    """Lesson 09's quantizer calibrates the engine's FP8 cache as kvpaging calibrates its own: the same random
    calibration pass, so the very same scales; codes are stored as kvpaging's quantize_fp8 makes them, byte for
    byte. A quantizer whose scales are a quarter of that (the largest keys and values then saturate at 448) gives
    other answers. (Token for token the two FP8 engines may part: their attention sums in another order, and a
    difference in the last float bit of a key changes its e4m3 code now and then.)"""
    from kvpaging import LLM
    from kvpaging.kernels.fp8 import quantize_fp8
    from kvpaging.teach.build import ReferenceAllocator, reference_quantize_fp8

    class Remembering(ReferenceAllocator):  # keeps each finished sequence's table, to find its slots afterwards
        last_tables: dict = {}

        def free(self, seq_id):
            self.last_tables[seq_id] = list(self.tables[seq_id])
            super().free(seq_id)

    model, prompts, expected = model_and_reference
    engine = MiniEngine(model, {"allocator": Remembering}, num_blocks=40, block_size=4, max_num_seqs=3,
                        kv_cache_dtype="fp8")
    assert all(k.dtype == torch.float8_e4m3fn for k, _ in engine.caches)
    llm = LLM(model, num_blocks=40, block_size=4, max_model_len=64, kv_cache_dtype="fp8", attention_backend="torch")
    for (k, v), (mine_k, mine_v) in zip(llm.engine.runner.kv_scales, engine.scales):
        assert torch.equal(k.flatten(), mine_k) and torch.equal(v.flatten(), mine_v)
    mine = engine.generate(prompts, 12)
    assert all(len(a) == 12 for a in mine)
    # the last prompt's layer-0 keys (computed from its embeddings alone, paged or not) stored where its table says,
    # as kvpaging's quantize_fp8 makes them, byte for byte
    tokens = prompts[-1] + mine[-1][:-1]  # every token whose keys were stored (the last sampled one was not)
    engine.calibrating = {}
    with torch.no_grad():
        engine.model(input_ids=torch.tensor([tokens]), use_cache=False, logits_to_keep=1, mini_engine=engine)
    keys = engine.calibrating[0][0][0]
    engine.calibrating = None
    table = Remembering.last_tables[len(prompts) - 1]
    stored = torch.stack([engine.caches[0][0][table[p // 4], p % 4] for p in range(len(tokens))])
    assert torch.equal(stored.view(torch.uint8), quantize_fp8(keys, engine.scales[0][0]).view(torch.uint8))

    def quartered(x):
        codes, scales = reference_quantize_fp8(x)
        return codes, scales / 4
    assert MiniEngine(model, {"quantize": quartered}, num_blocks=40, block_size=4, max_num_seqs=3,
                      kv_cache_dtype="fp8").generate(prompts, 12) != mine


def test_a_prefix_cache_on_the_learners_hashes(model_and_reference):
    """MiniEngine(prefix_caching=True): a prompt computed once leaves its full blocks findable by lesson 05's chained
    hashes; a later prompt that starts alike skips computing them (kvpaging's hits, token for token the answers
    without the cache). Holders are freed when the pool runs short. A hash of a block's own tokens alone hands a
    prompt keys computed after another prefix, and the answers change."""
    from kvpaging import LLM, SamplingParams
    from kvpaging.teach.build import ReferenceSharingAllocator

    model, prompts, expected = model_and_reference
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 500, (10,), generator=g).tolist()
    chats = [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 6, 1, 9)]
    parts = {"allocator": ReferenceSharingAllocator}
    plain = MiniEngine(model, parts, num_blocks=40, block_size=4).generate(chats, 8)
    engine = MiniEngine(model, parts, num_blocks=40, block_size=4, prefix_caching=True)
    answers, hits = [], []
    for group in (chats[:1], chats[1:]):
        answers += engine.generate(group, 8)
        hits += engine.hit_tokens
    assert answers == plain
    llm = LLM(model, num_blocks=40, block_size=4, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [o for group in (chats[:1], chats[1:]) for o in llm.generate(group, params, use_tqdm=False)]
    assert hits == [o.num_cached_tokens for o in outs] == [0, 8, 8, 8]  # 10 shared tokens: two whole blocks of 4
    assert engine.holders and engine.allocator.num_free_blocks < 40  # the cache holds the blocks it can find

    tight = MiniEngine(model, parts, num_blocks=12, block_size=4, prefix_caching=True)
    assert [tight.generate([c], 8)[0] for c in chats] == plain  # holders freed as the pool runs short
    assert len(tight.holders) < len(chats)

    own_only = lambda t, b: [hash(tuple(t[i:i + b])) for i in range(0, len(t) - b + 1, b)]  # noqa: E731
    twisted = [[7, 7, 7, 7] + shared[:4] + [9], shared[:4] + [1, 2, 3]]  # block 1 of the first = block 0 of the second
    fooled = MiniEngine(model, {**parts, "block_hashes": own_only}, num_blocks=40, block_size=4, prefix_caching=True)
    first = fooled.generate(twisted[:1], 8)
    assert first + fooled.generate(twisted[1:], 8) != MiniEngine(model, parts, num_blocks=40,
                                                                  block_size=4).generate(twisted, 8)
