"""Tests of the helpers behind lessons 04-07 (kvpaging.teach.paging / sharing / batching / scheduling)."""

from functools import partial

import pytest

from kvpaging import LLM
from kvpaging.models import tiny
from kvpaging.teach.batching import compare_policies, request_stream
from kvpaging.teach.paging import concurrency_at_budget, fragmentation, fragmentation_by_block_size, random_workload
from kvpaging.teach.scheduling import long_prompt_arrives, run_with_pool
from kvpaging.teach.sharing import prefix_cache_demo, ref_counts, rollouts


@pytest.fixture(scope="module")
def model():
    return tiny("qwen3", num_hidden_layers=1)


def _make(model, **kw):
    cfg = dict(block_size=16, num_blocks=128, max_model_len=1024, seed=0)
    cfg.update(kw)
    return LLM(model, **cfg)


def test_fragmentation_matches_arithmetic():
    w = [(10, 5), (16, 16), (1, 1)]
    # lengths 15, 32, 2 -> blocks of 4: 4 + 8 + 1 = 13 blocks = 52 slots, 49 tokens
    assert fragmentation(w, 4) == pytest.approx(1 - 49 / 52)
    frag = fragmentation_by_block_size(random_workload(50, seed=0), (1, 16, 256))
    assert frag[1] == 0.0 and frag[16] < frag[256]


def test_concurrency_counts():
    w = [(100, 100)] * 50
    r = concurrency_at_budget(w, 4096, block_size=16, max_model_len=1024, max_tokens=300)
    assert r.reserve_max_model_len == 4
    assert r.reserve_prompt_plus_max_tokens == 4096 // 400
    assert r.paged == 256 // 13  # 200 tokens -> 13 blocks of 16
    assert r.paged_halfway >= r.paged


def test_rollouts_share_and_copy(model):
    make = lambda enable_prefix_caching=True: _make(model, enable_prefix_caching=enable_prefix_caching)  # noqa: E731
    prompt = list(range(100, 140))  # 2.5 blocks
    shared = rollouts(make, prompt, 4, True, max_tokens=6)
    alone = rollouts(make, prompt, 4, False, max_tokens=6)
    assert shared.cow_copies == 3 and alone.cow_copies == 0
    assert shared.peak_used_blocks < alone.peak_used_blocks
    assert len(shared.outputs) == 4 and all(len(o) == 6 for o in shared.outputs)


def test_ref_counts_after_fork(model):
    from kvpaging import SamplingParams

    llm = _make(model)
    llm.engine.add_request("r", list(range(20)), SamplingParams(n=3, max_tokens=4, seed=1))
    llm.engine.step()
    bm = llm.engine.block_manager
    seqs = [s for s in range(3) if bm.has_sequence(s)]
    assert set(ref_counts(bm, seqs).values()) == {3}


def test_prefix_cache_demo_hits(model):
    prompts, stats = prefix_cache_demo(_make(model), system_len=32, num_users=3, question_len=4, max_tokens=2)
    assert stats[0].prefix_hit_tokens == 0
    assert stats[-1].prefix_hit_tokens == 64


def test_static_vs_continuous(model):
    prompts, lengths = request_stream(6, seed=0, max_output=20)
    runs = compare_policies(lambda **kw: _make(model, **kw), prompts, lengths, max_num_seqs=2, warmup=False)
    s, c = runs["static"], runs["continuous"]
    assert s.useful_tokens == c.useful_tokens == sum(lengths)
    assert c.steps <= s.steps
    assert [o.outputs[0].token_ids for o in s.outputs] == [o.outputs[0].token_ids for o in c.outputs]


def test_long_prompt_chunking(model):
    make = lambda **kw: _make(model, **kw)  # noqa: E731
    whole = long_prompt_arrives(make, 512, num_running=2, decode_tokens=8, long_prompt_len=200, arrive_after=3)
    chunked = long_prompt_arrives(make, 32, num_running=2, decode_tokens=8, long_prompt_len=200, arrive_after=3)
    assert whole.prefill_steps == 1 and whole.max_step_tokens_for_running == 202
    assert chunked.prefill_steps > 1 and chunked.max_step_tokens_for_running <= 32
    assert chunked.long_ttft_steps > whole.long_ttft_steps
    assert whole.stalled_steps == chunked.stalled_steps == 0


def test_preemption_keeps_outputs(model):
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    big = run_with_pool(lambda **kw: _make(model, **kw), prompts, 30, 128, use_tqdm=False)
    small = run_with_pool(lambda **kw: _make(model, max_model_len=128, **kw), prompts, 30, 10, use_tqdm=False)
    assert big.num_preemptions == 0 and small.num_preemptions > 0
    assert small.preempted_steps
    assert small.outputs == big.outputs
