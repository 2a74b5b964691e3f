"""Keys and values of the shapes the model gives them, not the ones its config names (kvpaging/worker/kv_layout.py).

Multi-head latent attention (DeepSeek-V2, GLM-4-MoE-Lite) gives every head keys of
``qk_nope_head_dim + qk_rope_head_dim`` numbers and values of ``v_head_dim``;
JetMoE has more key/value heads than ``num_key_value_heads``. The engine reads each
layer's shapes off one forward pass, sizes the pool by them, and stores the narrower
of keys and values with zeros after it. Greedy tokens must then be transformers'
own on every backend, with chunked prefill, the prefix cache and preemption, and the
pool must hold exactly the bytes the layout says.
"""

import copy

import pytest
import torch
from engine_helpers import TIE_TOLERANCE, assert_pool_clean, greedy_params

from kvpaging import LLM, EngineConfig, UnsupportedModelError
from kvpaging.models.architectures import tiny_model
from kvpaging.worker.kv_layout import LayerKV, config_layout, layout_bytes_per_token
from kvpaging.worker.self_check import measure_kv_layout
from kvpaging.teach.setup_check import greedy_agreement

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_TOKENS = 8

# model type, its config changes, and each layer's (KV heads, key width, value width) as its attention sees them
CASES = {
    "glm4_moe_lite": ({}, (4, 24, 16)),  # keys wider than values: values padded
    "deepseek_v2": ({"v_head_dim": 32}, (4, 16, 32)),  # values wider than keys: queries and keys padded
    "jetmoe": ({}, (4, 16, 16)),  # 4 KV heads where the config says 2
}


def reference_tokens(model, prompt):
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                             min_new_tokens=NUM_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, one_thread):
    change, shape = CASES[request.param]
    model = tiny_model(request.param, **change)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 14, 23)]
    return request.param, model, shape, prompts, [reference_tokens(model, p) for p in prompts]


def test_the_layout_is_read_off_the_attention_calls(case):
    name, model, shape, _, _ = case
    layers = model.config.num_hidden_layers
    layout = measure_kv_layout(model, layers)
    assert layout == [LayerKV(*shape)] * layers
    assert layout != config_layout(model.config, layers)  # so the config alone would size the cache wrong
    assert all(layer.width == max(shape[1:]) for layer in layout)


def test_the_pool_holds_the_bytes_the_layout_says(case):
    name, model, shape, _, _ = case
    llm = LLM(model, block_size=4, kv_cache_memory_bytes=1 << 20, max_model_len=64)
    layout = llm.engine.runner.kv_layout
    per_block = layout_bytes_per_token(layout, torch.float32) * 4
    assert llm.engine.config.num_blocks == (1 << 20) // per_block
    heads, _, _ = shape
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        assert tuple(k_cache.shape) == tuple(v_cache.shape) == (llm.engine.config.num_blocks, 4, heads, max(shape[1:]))
    assert sum(k.numel() * k.element_size() + v.numel() * v.element_size()
               for k, v in llm.engine.runner.kv_caches) == llm.engine.config.num_blocks * per_block


CHUNKED = "chunked, prefix cache, preemption"


# (the Triton interpreter is slow: one mode for it)
@pytest.mark.parametrize("backend, mode", [("torch", "default"), ("torch", CHUNKED),
                                           ("cpu", CHUNKED),
                                           pytest.param("triton", "default", marks=pytest.mark.interpreter)])
def test_equals_generate(case, backend, mode):
    if backend == "cpu":
        from kvpaging.kernels import cpu_backend

        if not cpu_backend.available():
            pytest.skip(cpu_backend.unavailable_reason())
    name, model, _, prompts, expected = case
    if backend == "triton" and name != "glm4_moe_lite":
        pytest.skip("the Triton interpreter is slow: one case, with rows 24 wide (not a power of two), is enough")
    settings = {"block_size": 16, "num_blocks": 32, "max_model_len": 64}
    if mode != "default":  # 5-token chunks; 12 blocks of 4 hold the longest sequence, not all three
        settings = {"block_size": 4, "num_blocks": 12, "max_model_len": 40, "max_num_batched_tokens": 5}
    served = model
    if backend == "triton" and torch.cuda.is_available():  # compiled kernels take CUDA tensors only
        served = copy.deepcopy(model).to("cuda")
    llm = LLM(served, attention_backend=backend, **settings)
    runs = 2 if mode != "default" else 1  # the second run starts from the prefix cache
    for _ in range(runs):
        outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
        for prompt, out, want in zip(prompts, outputs, expected):
            got = out.outputs[0].token_ids
            verdict = greedy_agreement(model, prompt, got, want, tolerance=TIE_TOLERANCE)
            assert verdict.agrees, f"{name} {backend} {mode}: prompt of {len(prompt)}: {got} != generate()'s {want}"
        assert_pool_clean(llm)
    if mode != "default":
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.stats().prefix_hit_tokens > 0


def test_fp8_cache_with_padded_rows(case):
    """FP8 scales are per KV head, computed over the padded rows' real numbers; the zeros stay zeros."""
    name, model, _, prompts, _ = case
    llm = LLM(model, kv_cache_dtype="fp8", block_size=16, num_blocks=32, max_model_len=64)
    outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == NUM_TOKENS for out in outputs)
    assert llm.engine.self_check is not None and llm.engine.self_check.error <= llm.engine.self_check.tolerance
    assert_pool_clean(llm)


def test_tensor_parallelism_refuses_shapes_the_config_does_not_name():
    model = tiny_model("jetmoe")
    layout = measure_kv_layout(model, model.config.num_hidden_layers)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=2: JetMoeForCausalLM's keys and values"):
        EngineConfig(tensor_parallel_size=2, num_blocks=64, max_model_len=64).resolve(model, layout)


def test_the_users_model_is_not_touched():
    model = tiny_model("glm4_moe_lite")
    before = model.config._attn_implementation
    measure_kv_layout(model, model.config.num_hidden_layers)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("mode", ["default", "chunked, prefix cache, preemption"])
def test_two_attention_calls_per_layer_get_a_cache_each(mode):
    """Differential attention (DiffLlama) calls attention twice per layer, with the same keys and the two halves
    of its values: each call gets a cache of its own, listed after the layers' (``LayerKV.of_layer``)."""
    model = tiny_model("diffllama")
    layers = model.config.num_hidden_layers
    layout = measure_kv_layout(model, layers)
    assert len(layout) == 2 * layers and [kv.of_layer for kv in layout[layers:]] == list(range(layers))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 13, 22, 9)]
    settings = {"block_size": 4, "max_model_len": 48, "attention_backend": "torch"}
    if mode != "default":
        settings |= {"max_num_batched_tokens": 7, "num_blocks": 12}
    llm = LLM(model, **settings)
    assert llm.engine.runner.kv_cache_bytes == llm.engine.config.num_blocks * 4 * layout_bytes_per_token(
        layout, torch.float32)
    for run in range(2 if mode != "default" else 1):  # the second run from the prefix cache
        outputs = llm.generate(prompts, greedy_params(NUM_TOKENS), use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            want = reference_tokens(model, prompt)
            verdict = greedy_agreement(model, prompt, out.outputs[0].token_ids, want, tolerance=TIE_TOLERANCE)
            assert verdict.agrees, f"{mode} run {run}: {out.outputs[0].token_ids} != generate()'s {want}"
    if mode != "default":
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.stats().prefix_hit_tokens > 0
    assert_pool_clean(llm)


def test_one_cache_for_two_calls_is_caught(monkeypatch):
    """The check can fail: with both calls sent to the layer's first cache, the second call's values overwrite
    the first's, and the self-check refuses the model by its logits."""
    import kvpaging.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "cache_indexes", lambda layout, n: [[i, i] for i in range(n)])
    with pytest.raises(UnsupportedModelError) as info:
        LLM(tiny_model("diffllama"), block_size=4, max_model_len=48)
    assert info.value.cause == "logits"
