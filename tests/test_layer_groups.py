"""Sliding-window layers among full-attention ones: a block table per layer group, over one pool.

Gemma 2 and gpt-oss alternate sliding and full layers, Gemma 3 has five sliding layers to one full, Cohere 2
three to one. The engine cuts the layers into groups of one kind (``kv_layout.layer_groups``) and keeps a table
per group (``core/layer_groups.py``): the sliding groups give their blocks back as the window passes them, the
full group keeps every block. The references are transformers' own ``generate()`` for the tokens, and exact
arithmetic for the blocks a sequence holds.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TIE_TOLERANCE, assert_pool_clean, forked_and_alone, greedy_params

from kvpaging import LLM, SamplingParams, blocks_held
from kvpaging.core.invariants import check_block_manager
from kvpaging.core.layer_groups import GroupedBlockManager
from kvpaging.errors import UnsupportedModelError
from kvpaging.models.architectures import reference_tokens, tiny_model
from kvpaging.teach.setup_check import greedy_agreement
from kvpaging.worker.kv_layout import config_layout, layer_groups

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 14
LENGTHS = (9, 14, 3, 23, 1, 30)
WINDOW = 6  # the tiny configs' window: shorter than most prompts, so it decides what a query sees
# (model type, config overrides): the interleavings of the families that have them
SHAPES = {
    "gemma2": ("gemma2", {"num_hidden_layers": 4}),  # sliding, full, sliding, full: two groups of two
    "gpt_oss": ("gpt_oss", {"num_hidden_layers": 4, "layer_types": None}),  # the same, with attention sinks
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "layer_types": None}),  # five sliding to one full
    "cohere2": ("cohere2", {"num_hidden_layers": 4, "layer_types": None}),  # three sliding to one full
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def interleaved(request, one_thread):
    model_type, overrides = SHAPES[request.param]
    model = tiny_model(model_type, **overrides)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    return request.param, model, prompts, [reference_tokens(model, p, NUM_TOKENS) for p in prompts]


def _assert_generates_tokens(model, prompts, outputs, expected, what):
    for prompt, out, want in zip(prompts, outputs, expected):
        got = out.outputs[0].token_ids
        verdict = greedy_agreement(model, prompt, got, want[: len(got)], tolerance=TIE_TOLERANCE)
        assert verdict.agrees, f"{what}: prompt of {len(prompt)}: {got} != generate()'s {want}"


def test_the_layers_fall_into_groups_of_one_kind():
    expected = {  # each layer's group and its place in it; each group's window
        "gemma2": ((1, 0, 1, 0), (0, 0, 1, 1), (0, WINDOW)),
        "gemma3": ((1, 2, 3, 4, 5, 0), (0,) * 6, (0,) + (WINDOW,) * 5),
        "cohere2": ((1, 2, 3, 0), (0,) * 4, (0, WINDOW, WINDOW, WINDOW)),
    }
    for name, (layer_group, layer_slot, windows) in expected.items():
        model_type, overrides = SHAPES[name]
        config = tiny_model(model_type, **overrides).config
        groups = layer_groups(config, config_layout(config, config.num_hidden_layers), 256)
        assert (groups.layer_group, groups.layer_slot, groups.windows) == (layer_group, layer_slot, windows), name
        assert layer_groups(config, config_layout(config, config.num_hidden_layers), WINDOW) is None, \
            "a window as long as max_model_len saves nothing: one table"
    mistral = tiny_model("mistral", sliding_window=WINDOW).config  # a window on every layer: no groups needed
    assert layer_groups(mistral, config_layout(mistral, mistral.num_hidden_layers), 256) is None


@pytest.mark.parametrize("mode", ["default", "chunked + preempted", "cpu backend"])
def test_interleaved_models_give_generates_tokens(interleaved, mode):
    name, model, prompts, expected = interleaved
    settings = {"block_size": 4, "max_model_len": 64, "attention_backend": "torch"}
    if mode == "chunked + preempted":  # 5-token chunks, and a pool too small for all six at once: a whole
        # sequence's 16 blocks in the full group, 4 in each sliding group (a chunk and the window), 8 more
        num_groups = len(layer_groups(model.config, config_layout(model.config, model.config.num_hidden_layers), 64).windows)
        settings |= {"max_num_batched_tokens": 5, "num_blocks": 16 + 4 * (num_groups - 1) + 8}
    if mode == "cpu backend":
        settings["attention_backend"] = "cpu"
        if not __import__("kvpaging.kernels.cpu_backend", fromlist=["available"]).available():
            pytest.skip("no C compiler for the CPU backend")
    llm = LLM(model, **settings)
    assert isinstance(llm.engine.block_manager, GroupedBlockManager)
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    _assert_generates_tokens(model, prompts, outputs, expected, f"{name} {mode}")
    stats = llm.engine.block_manager.stats()
    assert stats.num_passed_blocks > 0, "the sliding groups gave blocks back"
    if mode == "chunked + preempted":
        assert llm.engine.scheduler.num_preemptions > 0, "the tight pool preempted and recomputed someone"
    assert_pool_clean(llm)


def test_a_long_sequence_holds_the_full_groups_blocks_and_the_windows(interleaved):
    """After every step, the blocks in use are exactly what each group's table holds: every block in a full
    group, the window's in a sliding one (``blocks_held``), where one table for all layers would hold every
    block of every layer."""
    name, model, _, _ = interleaved
    llm = LLM(model, block_size=4, num_blocks=200, max_model_len=256, max_num_batched_tokens=32,
              attention_backend="torch")
    engine, bm = llm.engine, llm.engine.block_manager
    windows = bm.windows
    engine.add_request("long", list(range(5, 25)), SamplingParams(max_tokens=150, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        check_block_manager(bm)
        if engine.scheduler.running:
            held.append((engine.scheduler.running[0].blocks.num_tokens, bm.stats().num_used_blocks))
    assert held[0] == (20, len(windows) * 5), "the prompt's step: all 5 blocks of the 20 tokens in every group"
    for tokens, used in held[1:]:  # each decode: the blocks the window passed gave back before its slot was given
        assert used == sum(blocks_held(tokens, 4, window=w) for w in windows), (name, tokens, used)
    tokens, used = held[-1]
    one_table = len(windows) * blocks_held(tokens, 4)  # the same pages, none given back
    full = windows.count(0)
    assert tokens == 168 and used == full * 42 + (len(windows) - full) * 2 < one_table == len(windows) * 42


def test_forked_completions_and_prefix_hits(interleaved):
    """n = 3 forks share the prompt's blocks in every group (copy-on-write where a last block is shared) and
    equal separate seeded requests; the same prompt again is served from the prefix cache, every group's hit
    cut to the shortest, with generate()'s tokens."""
    name, model, prompts, expected = interleaved
    llm = LLM(model, block_size=4, max_model_len=64, attention_backend="torch")
    together, alone = forked_and_alone(llm, list(range(5, 23)), n=3, seed=5, max_tokens=10)
    assert together == alone
    assert llm.engine.block_manager.stats().num_cow_copies > 0
    long = prompts[5]
    first = llm.generate([long], greedy_params(NUM_TOKENS), use_tqdm=False)
    again = llm.generate([long], greedy_params(NUM_TOKENS), use_tqdm=False)
    assert again[0].num_cached_tokens > 0, "the second run is served from the prefix cache"
    _assert_generates_tokens(model, [long, long], first + again, [expected[5]] * 2, f"{name} prefix hit")
    assert_pool_clean(llm)


def test_a_layer_reading_another_groups_tables_is_caught(monkeypatch):
    """The check can fail: with every layer sent to the full group's tables, the sliding layers overwrite the
    full layers' keys in the tensors the groups share, and the load-time self-check refuses the model."""
    import kvpaging.worker.model_runner as model_runner

    real = model_runner.layer_groups

    def one_group_for_all(*args, **kwargs):
        groups = real(*args, **kwargs)
        return None if groups is None else type(groups)(groups.group_size, groups.windows,
                                                         (0,) * len(groups.layer_group), groups.layer_slot)

    monkeypatch.setattr(model_runner, "layer_groups", one_group_for_all)
    with pytest.raises(UnsupportedModelError) as info:
        LLM(tiny_model("gemma2", num_hidden_layers=4), block_size=4, max_model_len=64, attention_backend="torch")
    assert info.value.cause == "logits"


def test_the_pool_is_sized_in_pages_of_one_group():
    """A block is a page of one group's layers: from a byte budget, as many as fit, each the size of
    group_size layers' keys and values for block_size tokens."""
    model = tiny_model("gemma2", num_hidden_layers=4)
    budget = 1 << 20
    llm = LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=budget, attention_backend="torch")
    runner = llm.engine.runner
    layer = runner.kv_layout[0]
    page = 2 * 2 * layer.num_kv_heads * layer.width * 4 * 4  # K and V, 2 layers, heads x width, 4 slots, float32
    assert llm.engine.config.num_blocks == budget // page
    assert runner.kv_cache_bytes == budget // page * page <= budget
    assert len({id(k) for k, _ in runner.kv_caches}) == 2, "layer j of each group shares tensors"
    with pytest.raises(ValueError, match="in the tables of its 2 layer groups"):
        LLM(model, block_size=4, max_model_len=64, num_blocks=16, attention_backend="torch")


@pytest.mark.interpreter
def test_triton_kernels_and_an_fp8_cache():
    """The Triton kernels (under the interpreter here, compiled on a GPU) with each group's tables, and an FP8
    cache whose scales are calibrated per layer over the shared tensors."""
    model = tiny_model("gemma2", num_hidden_layers=4)
    prompts = [list(range(5, 16)), list(range(40, 49))]
    expected = [reference_tokens(model, p, 5) for p in prompts]
    served = model
    if torch.cuda.is_available():  # compiled kernels take CUDA tensors only (benchmarks/gpu_check.sh runs this)
        import copy

        served = copy.deepcopy(model).to("cuda")
    llm = LLM(served, block_size=4, max_model_len=64, attention_backend="triton")
    assert isinstance(llm.engine.block_manager, GroupedBlockManager)
    _assert_generates_tokens(model, prompts, llm.generate(prompts, greedy_params(5), use_tqdm=False), expected,
                             "triton")
    fp8 = LLM(model, block_size=4, max_model_len=64, kv_cache_dtype="fp8", attention_backend="torch")
    assert isinstance(fp8.engine.block_manager, GroupedBlockManager)
    assert fp8.engine.self_check is not None and fp8.engine.self_check.error <= fp8.engine.self_check.tolerance
    assert all(len(o.outputs[0].token_ids) == 5 for o in fp8.generate(prompts, greedy_params(5), use_tqdm=False))


def test_step_records_count_every_groups_tables():
    """The views count the blocks the tables hold from the step records: every group's, not only the first group's
    (whose tables the records keep), so unshared tables hold exactly the blocks in use (the memory map showed
    "sharing saves" a negative number of blocks before)."""
    from kvpaging.visualizers.replay import table_blocks_of

    llm = LLM(tiny_model("gemma2", num_hidden_layers=4), block_size=4, max_model_len=64, attention_backend="torch")
    llm.engine.keep_trace = True
    llm.generate([list(range(5, 30)), list(range(40, 50))], greedy_params(20), use_tqdm=False)
    records = list(llm.engine.trace)
    assert records and all(table_blocks_of(r) == r.num_used_blocks for r in records)
    assert any(sum(len(t) for t in r.block_tables.values()) < r.num_used_blocks for r in records), \
        "the first group's tables alone hold fewer blocks than are in use"
