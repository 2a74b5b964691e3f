"""Hybrid models: linear-attention, state-space and convolution layers served beside the paged KV cache.

Qwen3-Next's gated delta net, LFM2's short convolution and Jamba's Mamba layers carry a state of fixed size
from token to token; kvpaging keeps one slot of it per live sequence, at the sequence's block-table row
(``kvpaging/worker/state_layers.py``). The reference is transformers' own ``generate()`` at batch 1; the engine
runs several sequences at once, cut into chunks, preempted and recomputed, forked, so a state read from the
wrong slot, not carried across a chunk, not copied to a fork or not started afresh changes the tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import TIE_TOLERANCE, assert_pool_clean, forked_and_alone, greedy_params

from kvpaging import LLM
from kvpaging.errors import UnsupportedModelError
from kvpaging.models.architectures import reference_tokens, tiny_model
from kvpaging.teach.setup_check import greedy_agreement
from kvpaging.worker.kv_layout import NO_KV
from kvpaging.sampling_params import SamplingParams
from kvpaging.worker.state_layers import (GroupCache, StateSlots, continues_chunks, find_state_layers,
                                        state_bytes_per_sequence)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 14
LENGTHS = (9, 14, 3, 23, 1, 30)  # the 1-token prompt starts its state inside a group of decodes


def _reference(model, prompts, num_tokens=NUM_TOKENS):
    return [reference_tokens(model, p, num_tokens) for p in prompts]


@pytest.fixture(scope="module", params=["qwen3_next", "lfm2", "jamba"])
def hybrid(request, one_thread):
    model = tiny_model(request.param)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    return request.param, model, prompts, _reference(model, prompts)


def _assert_generates_tokens(model, prompts, outputs, expected, what):
    for prompt, out, want in zip(prompts, outputs, expected):
        got = out.outputs[0].token_ids
        verdict = greedy_agreement(model, prompt, got, want[: len(got)], tolerance=TIE_TOLERANCE)
        assert verdict.agrees, f"{what}: prompt of {len(prompt)}: {got} != generate()'s {want}"


@pytest.mark.parametrize("mode", ["default", "chunked + preempted"])
def test_hybrid_models_give_generates_tokens(hybrid, mode):
    name, model, prompts, expected = hybrid
    settings = {"block_size": 4, "max_model_len": 64, "attention_backend": "torch"}
    if mode != "default":  # 7-token chunks, and a pool too small for all six at once
        settings |= {"max_num_batched_tokens": 7, "num_blocks": 16}
    llm = LLM(model, **settings)
    layout = llm.engine.runner.kv_layout
    assert NO_KV in layout and any(layer.num_kv_heads for layer in layout), f"{name}: hybrid layout {layout}"
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    _assert_generates_tokens(model, prompts, outputs, expected, f"{name} {mode}")
    if mode != "default":
        assert llm.engine.scheduler.num_preemptions > 0, "the tight pool preempted and recomputed someone"
    assert_pool_clean(llm)


def test_a_sequence_starting_among_running_decodes(hybrid, monkeypatch):
    """A one-token prompt is a decode in its first step: here it joins two running decodes in one batched call,
    its slot (the row of a sequence that has ended) read as zeros beside slots that go on."""
    name, model, prompts, expected = hybrid
    llm = LLM(model, block_size=4, max_model_len=64, attention_backend="torch")
    seen = []
    make = GroupCache.__init__

    def spy(self, slots, layer, rows, fresh):
        seen.append(list(fresh))
        make(self, slots, layer, rows, fresh)

    monkeypatch.setattr(GroupCache, "__init__", spy)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompts[1]}, greedy_params(NUM_TOKENS))
    engine.add_request("b", {"prompt_token_ids": prompts[0]}, greedy_params(NUM_TOKENS))
    # z ends after two tokens: c then takes its row, whose slot still holds z's state
    engine.add_request("z", {"prompt_token_ids": prompts[2]}, greedy_params(2))
    done = {}
    for step in range(200):
        if step == 3:
            assert "z" in done
            engine.add_request("c", {"prompt_token_ids": prompts[4]}, greedy_params(NUM_TOKENS))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert [False, False, True] in seen, "c started in a batch of decodes that go on"
    for rid, k in (("a", 1), ("b", 0), ("c", 4)):
        verdict = greedy_agreement(model, prompts[k], done[rid], expected[k], tolerance=TIE_TOLERANCE)
        assert verdict.agrees, f"{name}: request {rid}: {done[rid]} != generate()'s {expected[k]}"


def test_forked_completions_start_from_the_prompts_state():
    """n = 3: the completions fork after the prompt's step, each from a copy of the parent's state; seeded, they
    equal three separate requests (each computing the prompt itself)."""
    model = tiny_model("qwen3_next")
    llm = LLM(model, block_size=4, max_model_len=64, attention_backend="torch")
    together, alone = forked_and_alone(llm, list(range(5, 22)), n=3, seed=5, max_tokens=12)
    assert together == alone
    assert len(set(map(tuple, together))) > 1, "temperature 1 on random weights: the completions differ"
    assert_pool_clean(llm)


def test_prefix_caching_is_switched_off_and_said(caplog):
    model = tiny_model("qwen3_next")
    with caplog.at_level(logging.INFO, logger="kvpaging"):
        llm = LLM(model, block_size=4, max_model_len=64, enable_prefix_caching=True)
    assert "prefix caching is off for Qwen3NextForCausalLM" in caplog.text
    assert llm.engine.config.enable_prefix_caching is False
    prompt = list(range(5, 30))
    for _ in range(2):
        llm.generate([prompt], greedy_params(3), use_tqdm=False)
    assert llm.engine.block_manager.stats().prefix_hit_tokens == 0


def test_only_the_attention_layers_hold_keys_and_values():
    """The pool is sized by the full-attention layers alone: the article's own accounting (kv_cache_bytes)."""
    from kvpaging import kv_cache_bytes

    model = tiny_model("qwen3_next")
    llm = LLM(model, block_size=4, num_blocks=32, max_model_len=64)
    runner = llm.engine.runner
    kinds = model.config.layer_types
    assert [layer.num_kv_heads > 0 for layer in runner.kv_layout] == [t == "full_attention" for t in kinds]
    assert runner.kv_cache_bytes == kv_cache_bytes(model.config, 32 * 4, dtype=torch.float32)
    assert runner.state_slots.bytes_per_sequence > 0


def test_continuing_a_chunk_is_measured_per_layer_class():
    """Qwen3-Next's gated delta net starts a chunk from the state it is given; Jamba's selective scan does not
    (its chunks then go a token at a time)."""
    for name, continues in (("qwen3_next", True), ("lfm2", True), ("jamba", False)):
        model = tiny_model(name)
        layer = find_state_layers(model)[0]
        assert continues_chunks(layer, model.config.hidden_size) is continues, name
        assert "forward" not in vars(layer), "measuring changes nothing on the model"


def test_a_lost_state_is_caught_by_the_self_check(monkeypatch):
    """The check can fail: states never written back mean every chunk starts afresh, and the load-time
    self-check refuses the model, naming the logits that differ."""
    monkeypatch.setattr(GroupCache, "write_back", lambda self: None)
    with pytest.raises(UnsupportedModelError) as info:
        LLM(tiny_model("qwen3_next"), block_size=4, max_model_len=64)
    assert info.value.cause == "logits"


def test_group_cache_follows_transformers_rules():
    """The slots' object against transformers' own rule for a convolution window: a first call pads to the
    window and keeps its last ``width`` columns; a later one convolves the kept window with the new columns."""
    slots = StateSlots(num_rows=2)
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)  # [batch, channels, tokens]
    first = GroupCache(slots, 0, [1, 0], [True, True])
    assert first.get_conv_state(0) is None
    full = first.update_conv_state(x, 0, conv_kernel_size=4)
    assert torch.equal(full, torch.nn.functional.pad(x, (2, 0)))
    first.write_back()
    later = GroupCache(slots, 0, [0, 1], [True, False])  # row 0 starts afresh, row 1 goes on
    state = later.get_conv_state(0)
    assert torch.equal(state[0], torch.zeros(3, 4)) and torch.equal(state[1], full[0])
    y = torch.ones(2, 3, 1)
    assert torch.equal(later.update_conv_state(y, 0, conv_kernel_size=4), torch.cat([state, y], dim=-1))
    later.write_back()
    assert torch.equal(slots.tensors[(0, "conv", 0)][1], torch.cat([full[0], torch.ones(3, 1)], dim=-1)[:, -4:])
    slots.copy_rows([(1, 5)])  # a fork into a row past the first ones: the slots grow
    assert slots.num_rows == 8 and torch.equal(slots.tensors[(0, "conv", 0)][5], slots.tensors[(0, "conv", 0)][1])


def test_the_users_model_is_not_changed():
    model = tiny_model("qwen3_next")
    prompt = list(range(5, 17))
    before = _reference(model, [prompt], 6)
    llm = LLM(model, block_size=4, max_model_len=64)
    llm.generate([prompt], greedy_params(6), use_tqdm=False)
    assert all("forward" not in vars(m) for m in model.modules()), "the engine wraps its own copy's layers"
    assert _reference(model, [prompt], 6) == before


def test_tensor_parallelism_refuses_state_layers():
    with pytest.raises(UnsupportedModelError) as info:
        LLM(tiny_model("qwen3_next"), tensor_parallel_size=2, block_size=4, max_model_len=64)
    assert info.value.cause == "state_layers" and "tensor_parallel_size=1" in str(info.value)


@pytest.mark.interpreter
def test_triton_kernels_and_an_fp8_cache_on_a_hybrid_model():
    """The Triton kernels (under the interpreter here) on the attention layers, and an FP8 cache (calibrated on
    the attention layers alone)."""
    model = tiny_model("qwen3_next")
    prompts = [list(range(5, 14)), list(range(40, 51))]
    expected = _reference(model, prompts, 5)
    served = model
    if torch.cuda.is_available():  # compiled kernels take CUDA tensors only (benchmarks/gpu_check.sh runs this)
        import copy

        served = copy.deepcopy(model).to("cuda")
    llm = LLM(served, block_size=4, max_model_len=64, attention_backend="triton")
    outputs = llm.generate(prompts, greedy_params(5), use_tqdm=False)
    _assert_generates_tokens(model, prompts, outputs, expected, "triton")
    fp8 = LLM(model, block_size=4, max_model_len=64, kv_cache_dtype="fp8", attention_backend="torch")
    assert fp8.engine.self_check is not None and fp8.engine.self_check.error <= fp8.engine.self_check.tolerance
    assert len(fp8.generate(prompts, greedy_params(5), use_tqdm=False)[1].outputs[0].token_ids) == 5


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba"])
def test_a_state_space_model_without_attention(name):
    """Every layer a Mamba mixer: no keys and values at all (blocks only count tokens), a state per sequence;
    chunked and preempted, still generate()'s tokens."""
    model = tiny_model(name)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    expected = _reference(model, prompts)
    llm = LLM(model, block_size=4, max_model_len=64, max_num_batched_tokens=7, num_blocks=16)
    runner = llm.engine.runner
    assert runner.kv_cache_bytes == 0 and all(layer == NO_KV for layer in runner.kv_layout)
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    _assert_generates_tokens(model, prompts, outputs, expected, name)
    assert llm.engine.scheduler.num_preemptions > 0
    assert LLM(model, max_model_len=64, max_num_seqs=3).engine.config.num_blocks == 3 * 4, \
        "blocks that cost nothing: enough for max_num_seqs sequences of max_model_len"


def test_state_slots_come_out_of_the_memory_budget():
    """The slots of max_num_seqs sequences are reserved before the pool is sized, so serving never needs memory
    the budget did not count: the pool gets exactly what the states leave, and the states measured before sizing
    are the ones the engine keeps."""
    model = tiny_model("qwen3_next")
    state = state_bytes_per_sequence(model)
    budget = 100_000_000
    llm = LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=budget, max_num_seqs=8)
    runner = llm.engine.runner
    per_block = runner.kv_cache_bytes // llm.engine.config.num_blocks
    assert llm.engine.config.num_blocks == (budget - 8 * state) // per_block
    assert runner.kv_cache_bytes + runner.state_slots.reserved_bytes <= budget
    assert runner.state_slots.bytes_per_sequence == state and runner.state_slots.num_rows == 8
    with pytest.raises(ValueError, match=r"max_num_seqs=20 sequences \(6,684,672 bytes each\)") as info:
        LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=budget, max_num_seqs=20)
    assert "lower max_num_seqs" in str(info.value)
    with pytest.raises(ValueError, match="no memory left"):
        LLM(tiny_model("mamba"), max_model_len=64, kv_cache_memory_bytes=1000, max_num_seqs=4)


def test_max_num_seqs_left_unset_fits_the_states_in_half_the_budget(caplog):
    model = tiny_model("qwen3_next")
    state = state_bytes_per_sequence(model)
    with caplog.at_level(logging.INFO, logger="kvpaging"):
        llm = LLM(model, block_size=4, max_model_len=64, kv_cache_memory_bytes=200_000_000)
    assert llm.engine.config.max_num_seqs == 100_000_000 // state < 256
    assert f"max_num_seqs={100_000_000 // state}: the state slots of 256 sequences" in caplog.text
    dense = LLM(tiny_model("llama"), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert dense.engine.config.max_num_seqs == 256, "a model without states keeps vLLM's default"


def test_the_slots_never_outgrow_max_num_seqs():
    """A block-table row (a state slot) belongs to a sequence that holds blocks, and at most max_num_seqs do at
    once: n = 2 forks, a pool that preempts and sequences that end and give their rows to others never need a
    row past max_num_seqs, so the reserved slots are all the engine ever makes."""
    model = tiny_model("qwen3_next")
    llm = LLM(model, block_size=4, max_model_len=64, max_num_seqs=5, num_blocks=16, max_num_batched_tokens=9,
              attention_backend="torch")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 2, 11, 23, 8, 3)]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(c.token_ids) == 10 for out in outputs for c in out.outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager._num_rows <= 5 and llm.engine.runner.state_slots.num_rows == 5
    assert_pool_clean(llm)
