"""The engine's greedy tokens equal transformers' ``generate()``, whatever the engine does on the way.

The reference is ``model.generate(do_sample=False)`` from transformers, run per
prompt (batch 1, no padding, so it is unambiguous) on a second model built from
the same seed; kvpaging's code produces none of the expected tokens. The engine
runs all prompts together, packed into one batch with mixed lengths, and must give
the same tokens with every feature that changes *how* the KV is computed or
stored: block sizes, the prefix cache, chunked prefill, preemption and
recomputation, n > 1 with shared blocks and copy-on-write, static batching; and
on models with sliding-window attention, whose windows are shorter than the prompts.

Ties: where the best logits are within 1e-4 of each other, float32 rounding
in a differently ordered computation may legitimately pick another of them. At the
first position where engine and reference differ, the reference logits for the
common prefix are recomputed with one plain full forward pass; the divergence is
accepted only if both tokens' logits lie within 1e-4 of the best there, and the
rest of that sequence is then not compared
(``engine_helpers.Reference.assert_greedy``). Any other difference fails.

After every run the engine must hold no requests and every block must be free.
"""

from __future__ import annotations

import pytest
from engine_helpers import (
    ARCHS,
    Reference,
    assert_pool_clean,
    build_llm,
    greedy_params,
    random_prompt,
)

from kvpaging.worker.kv_layout import config_layout, layer_groups

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 16, 17, 40)


# Sliding-window attention, with windows shorter than the prompts (a query then sees only its last few
# tokens): Mistral's on every layer, Qwen2's on the layers above max_window_layers.
SLIDING = {
    "mistral, window 6": ("mistral", {"sliding_window": 6}),
    "qwen2, sliding layers": ("qwen2", {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 1}),
}
VARIANTS = {arch: (arch, {}) for arch in ARCHS} | SLIDING


def num_tables(model, max_model_len: int) -> int:
    """How many block tables each sequence keeps: one per layer group where sliding layers sit among full ones."""
    config = model.config
    groups = layer_groups(config, config_layout(config, config.num_hidden_layers), max_model_len)
    return 1 if groups is None else groups.num_groups


@pytest.fixture(scope="module", params=list(VARIANTS))
def ref(request, one_thread) -> Reference:
    arch, overrides = VARIANTS[request.param]
    return Reference(arch, **overrides)


def mixed_prompts() -> list[list[int]]:
    return [random_prompt(n, seed=100 + n) for n in PROMPT_LENGTHS]


def check_outputs(ref: Reference, prompts, outputs, num_tokens=NUM_TOKENS, n=1, what=""):
    assert [o.prompt_token_ids for o in outputs] == prompts, "outputs must come back in the order given"
    for prompt, out in zip(prompts, outputs):
        assert out.finished
        assert len(out.outputs) == n
        for completion in out.outputs:
            assert completion.finish_reason == "length"
            ref.assert_greedy(prompt, completion.token_ids, num_tokens, what=f"{what} prompt len {len(prompt)}")


# "auto" is the C decode kernel on a CPU with a compiler (tests/test_kernels_cpu.py); "torch" the torch backend.
# "fast layers": with the opt-in oneDNN linears of kernels/cpu/layers.py (and its C RMSNorms, which the default has too).
@pytest.mark.parametrize("backend", ["auto", "torch", "auto, fast layers"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_equals_generate(ref, block_size, backend):
    fast = backend.endswith("fast layers")
    backend = backend.split(",")[0]
    prompts = mixed_prompts()
    llm = build_llm(ref.engine_model(), block_size=block_size, num_blocks=64, max_model_len=64,
                    enable_prefix_caching=False, attention_backend=backend, cpu_fast_layers=fast)
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    check_outputs(ref, prompts, outputs, what=f"block_size={block_size} backend={backend} fast layers={fast}")
    assert_pool_clean(llm)


def test_prefix_cache_hits_give_the_same_tokens(ref):
    base = mixed_prompts()
    p17, p40 = base[3], base[4]
    shared = random_prompt(24, seed=7)
    second = [
        p40,  # the whole prompt again: every block but the one holding the last token is a hit
        p40[:30] + random_prompt(6, seed=8),  # a long shared prefix, then a new tail
        p17 + ref.greedy(p17, NUM_TOKENS)[:7],  # hits blocks whose KV was computed while decoding
        shared + random_prompt(3, seed=9),  # these two share a prefix new to the cache and
        shared + random_prompt(5, seed=10),  # are computed in the same step
    ]
    llm = build_llm(ref.engine_model(), block_size=4, num_blocks=96, max_model_len=64, enable_prefix_caching=True)
    check_outputs(ref, base, llm.generate(base, greedy_params(NUM_TOKENS), use_tqdm=False), what="first pass")
    assert_pool_clean(llm)
    hits_before = llm.engine.block_manager.stats().prefix_hit_tokens

    check_outputs(ref, second, llm.generate(second, greedy_params(NUM_TOKENS), use_tqdm=False), what="cached")
    assert llm.engine.block_manager.stats().prefix_hit_tokens - hits_before >= 36 + 28 + 20
    assert_pool_clean(llm)

    # and a third pass over the second batch, now served mostly from the cache
    check_outputs(ref, second, llm.generate(second, greedy_params(NUM_TOKENS), use_tqdm=False), what="again")
    assert_pool_clean(llm)


def test_chunked_prefill_gives_the_same_tokens(ref):
    prompts = mixed_prompts()
    budget = 7
    llm = build_llm(ref.engine_model(), block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=False)
    llm.engine.keep_trace = True
    llm.engine.trace = []
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    check_outputs(ref, prompts, outputs, what="chunked")
    assert_pool_clean(llm)

    trace = llm.engine.trace
    assert all(0 < r.num_batched_tokens <= budget for r in trace)
    prefill_chunks: dict[str, list[int]] = {}
    for record in trace:
        assert sum(e.num_tokens for e in record.scheduled) == record.num_batched_tokens
        for entry in record.scheduled:
            if entry.is_prefill:
                prefill_chunks.setdefault(entry.request_id, []).append(entry.num_tokens)
    # every prompt is computed once, in chunks that add up to it (a 1-token remainder is still prefill)
    for out in outputs:
        assert sum(prefill_chunks[out.request_id]) == len(out.prompt_token_ids)
    # the 40-token prompt cannot go in fewer than 6 chunks of at most 7 tokens
    assert len(prefill_chunks[outputs[-1].request_id]) >= 6
    # some step mixes decode tokens with a prefill chunk
    assert any(
        any(e.is_prefill for e in r.scheduled) and any(not e.is_prefill for e in r.scheduled) for r in trace
    )


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_gives_the_same_tokens(ref, prefix_caching):
    prompts = mixed_prompts()
    # 13 blocks of 4 hold one 40-token prompt plus its 12 tokens, nowhere near the whole batch (in each table of a
    # model with sliding layers among full ones, which keeps one per layer group: tests/test_layer_groups.py)
    llm = build_llm(ref.engine_model(), block_size=4, num_blocks=13 * num_tables(ref.engine_model(), 40 + NUM_TOKENS),
                    max_model_len=40 + NUM_TOKENS, enable_prefix_caching=prefix_caching)
    if llm.engine.block_manager.sliding_window:
        # a window on every layer: the blocks it passes go back to the pool, so a sequence holds at most 3 blocks
        # once it decodes; eight more short prompts, admitted with a block or two each, run out as they grow
        prompts += [random_prompt(n, seed=200 + i) for i, n in enumerate((1, 2, 3, 5) * 2)]
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    check_outputs(ref, prompts, outputs, what="preempted")
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


def test_n_greedy_completions_all_equal_the_reference(ref):
    prompts = mixed_prompts()
    n = 3
    llm = build_llm(ref.engine_model(), block_size=4, num_blocks=128, enable_prefix_caching=False)
    llm.engine.keep_trace = True
    llm.engine.trace = []
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS, n=n), use_tqdm=False)
    check_outputs(ref, prompts, outputs, n=n, what="n=3")
    for out in outputs:
        assert [c.index for c in out.outputs] == list(range(n))
    assert llm.engine.scheduler.num_preemptions == 0
    # The n completions share the prompt's blocks. A partly filled last block is copied when a
    # completion first writes into it, by all but the last completion to do so; full blocks never (in every
    # table of a model with a table per layer group).
    partly_filled = sum(1 for p in prompts if len(p) % 4) * len(getattr(llm.engine.block_manager, "groups", [0]))
    assert llm.engine.block_manager.stats().num_cow_copies == partly_filled * (n - 1)
    assert sum(len(r.blocks_copied) for r in llm.engine.trace) == partly_filled * (n - 1)
    assert_pool_clean(llm)


def test_static_scheduling_gives_the_same_tokens(ref):
    prompts = mixed_prompts()
    llm = build_llm(ref.engine_model(), block_size=4, scheduling="static", max_num_seqs=3)
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    check_outputs(ref, prompts, outputs, what="static")
    assert_pool_clean(llm)


def test_different_lengths_per_request_in_one_batch(ref):
    prompts = mixed_prompts()
    lengths = [3, 12, 1, 7, 5]
    llm = build_llm(ref.engine_model(), block_size=16, num_blocks=16, max_model_len=64)
    outputs = llm.generate(prompts, [greedy_params(k) for k in lengths], use_tqdm=False)
    for prompt, out, k in zip(prompts, outputs, lengths):
        assert out.outputs[0].finish_reason == "length"
        ref.assert_greedy(prompt, out.outputs[0].token_ids, k, what=f"max_tokens={k}")
    assert_pool_clean(llm)
