"""The direct forward (kvpaging/worker/direct_forward.py): a Llama-structured model's forward pass with its layers'
``forward`` functions called straight, used only where it is the model's own forward pass to the bit."""

from __future__ import annotations

import contextlib

import types

import pytest
import torch

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.worker import direct_forward as direct_module
from kvpaging.worker.direct_forward import DirectForward, agrees_with_own_forward

PROMPTS = [[5, 9, 2, 7] * 8, [3, 1, 4, 1, 5, 9, 2, 6], list(range(3, 40))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_model_runs_the_direct_forward_and_gives_its_own_forwards_tokens(dtype):
    model = tiny("llama", seed=0).to(dtype)
    llm = LLM(model, num_blocks=32, max_model_len=64)
    assert isinstance(llm.engine.runner.direct, DirectForward)
    own = LLM(model, num_blocks=32, max_model_len=64, cpu_fast_layers=False)  # the model's own layers and forward
    assert own.engine.runner.direct is None
    assert tokens(llm) == tokens(own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c_rotary", [True, False])
def test_every_logit_of_a_mixed_step_is_the_models_own_forwards(c_rotary, dtype):
    """A step with decodes and prompt chunks together, every position's logits: the same bits both ways, with the
    rotary embedding in C and with transformers' own function (where the C kernels are not built), in float32 and
    in bfloat16 (where each MLP's SiLU and product are one C call)."""
    model = tiny("llama", seed=1).to(dtype)
    llm = LLM(model, num_blocks=32, max_model_len=64, max_num_batched_tokens=20)
    engine, runner = llm.engine, llm.engine.runner
    direct = runner.direct
    direct.c_rotary = c_rotary and direct.c_rotary
    assert agrees_with_own_forward(runner, direct)  # (which leaves the runner's direct forward None)
    runner.direct = direct
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, PARAMS)
    engine.step()
    engine.step()  # the first prompt decodes while the others' chunks are computed
    out = engine.scheduler.schedule()
    assert out.decodes and out.chunks
    inputs = runner.prepare_inputs(out)
    args = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
            inputs.prefill_cu_seqlens_q, inputs.num_decodes, 0, inputs.rows)
    with torch.inference_mode():
        straight = runner.forward(*args)
        runner.direct = None
        own = runner.forward(*args)
    assert torch.equal(straight, own)


def test_a_hook_a_replaced_forward_or_another_architecture_keeps_the_models_own_forward():
    hooked = tiny("llama", seed=0)
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)
    assert LLM(hooked, num_blocks=32, max_model_len=64).engine.runner.direct is None
    patched = tiny("llama", seed=0)
    attention = patched.model.layers[0].self_attn
    attention.forward = types.MethodType(lambda self, *a, **k: type(self).forward(self, *a, **k), attention)
    assert LLM(patched, num_blocks=32, max_model_len=64).engine.runner.direct is None
    assert LLM(tiny("qwen3", seed=0), num_blocks=32, max_model_len=64).engine.runner.direct is None
    assert isinstance(LLM(tiny("llama", seed=0), num_blocks=32, max_model_len=64).engine.runner.direct, DirectForward)


def test_a_forward_that_is_off_by_one_bit_is_refused_and_the_probe_leaves_the_cache_as_it_found_it():
    llm = LLM(tiny("llama", seed=0), num_blocks=32, max_model_len=64)
    runner = llm.engine.runner
    direct = runner.direct

    class Nudged(DirectForward):
        def __call__(self, *args):
            logits = super().__call__(*args)
            return torch.nextafter(logits, torch.full_like(logits, float("inf")))  # every logit one bit up

    assert agrees_with_own_forward(runner, direct)
    assert not agrees_with_own_forward(runner, Nudged(runner.model))
    assert runner.direct is None  # the probe leaves nothing in place
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_a_hook_added_after_the_engine_was_built_runs_the_models_own_forward_for_as_long_as_it_is_there():
    model = tiny("llama", seed=2)
    llm = LLM(model, num_blocks=32, max_model_len=64)
    want = tokens(LLM(model, num_blocks=32, max_model_len=64, cpu_fast_layers=False))
    direct = llm.engine.runner.direct
    calls = []
    handle = llm.engine.model.model.layers[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    assert not direct.still_exact()
    assert tokens(llm) == want and calls  # the hook ran: the model's own forward did
    handle.remove()
    assert direct.still_exact()
    calls.clear()
    assert tokens(llm) == want and not calls
    from transformers import AttentionInterface

    from kvpaging.worker.attention import ATTN_NAME, paged_attention_forward

    seen = []
    AttentionInterface.register(ATTN_NAME, lambda *a, **k: seen.append(1) or paged_attention_forward(*a, **k))
    try:
        assert not direct.still_exact()
        assert tokens(llm) == want and seen  # another function under the name: the model's own forward calls it
    finally:
        AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    assert direct.still_exact()
    mlp = llm.engine.model.model.layers[0].mlp
    llm.engine.model.model.layers[0].mlp = torch.nn.Identity()  # a module swapped: its own forward again
    assert not direct.still_exact()
    llm.engine.model.model.layers[0].mlp = mlp
    assert direct.still_exact()


def test_the_refusal_names_what_it_found():
    from kvpaging.worker.attention import ATTN_NAME, register_attention

    model = tiny("llama", seed=0)
    assert "attention" in direct_module.direct_forward_refusal(model, set())  # transformers' own attention yet
    register_attention()
    model.set_attn_implementation(ATTN_NAME)
    assert direct_module.direct_forward_refusal(model, set()) is None
    model.model.norm.register_forward_pre_hook(lambda module, args: None)
    assert direct_module.direct_forward_refusal(model, set()) == "model.norm has a hook"
    other = tiny("qwen3", seed=0)
    other.set_attn_implementation(ATTN_NAME)
    assert "Qwen3ForCausalLM" in direct_module.direct_forward_refusal(other, set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_the_c_rotary_embedding_is_transformers_to_the_bit(dtype, tokens):
    """``kernels/cpu/rotary.c`` against transformers' own ``apply_rotary_pos_emb``: every element equal, for queries
    and keys read from slices of one fused projection (as the packed q/k/v group hands them out), at several
    scales and with the model's own cos and sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kvpaging.kernels import cpu

    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    model = tiny("llama", seed=0)
    config, heads, kv_heads, dim = model.config, 4, 2, 16
    g = torch.Generator().manual_seed(tokens)
    for scale in (1e-3, 1.0, 30.0):
        fused = (torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=g) * scale).to(dtype)
        q = fused[..., : heads * dim].view(1, tokens, heads, dim)
        k = fused[..., heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
        positions = torch.randint(0, 4000, (1, tokens), generator=g)
        config.head_dim = dim
        cos, sin = LlamaRotaryEmbedding(config).forward(fused, positions)
        want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        got_q = cpu.rotary(q, cos.unsqueeze(2), sin.unsqueeze(2))
        got_k = cpu.rotary(k, cos.unsqueeze(2), sin.unsqueeze(2))
        assert got_q.dtype == dtype and torch.equal(got_q, want_q.transpose(1, 2))
        assert torch.equal(got_k, want_k.transpose(1, 2))
        # both in one call (k's heads follow q's in the fused rows), and each alone (separate tensors): the same bits
        for pair in ((q, k), (q.clone(), k.clone())):
            with count_calls(cpu, "_rotary_fn") as calls:
                got_q, got_k = cpu.rotary_pair_unchecked(*pair, cos.unsqueeze(2), sin.unsqueeze(2))
            assert torch.equal(got_q, want_q.transpose(1, 2)) and torch.equal(got_k, want_k.transpose(1, 2))
            assert len(calls) == (1 if pair[0] is q else 2)


@contextlib.contextmanager
def count_calls(module, name: str):
    """Every call of ``module.name`` (a C function) while in the block, in a list the block gets."""
    fn, calls = getattr(module, name), []

    def counted(*args):
        calls.append(args)
        return fn(*args)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, fn)


def test_the_c_rotary_embedding_refuses_what_it_cannot_compute():
    from kvpaging.kernels import cpu

    if not cpu.available():
        pytest.skip(cpu.unavailable_reason())
    x, cos = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    with pytest.raises(ValueError, match="one dtype"):
        cpu.rotary(x, cos.to(torch.bfloat16), cos)
    with pytest.raises(ValueError, match=r"cos \(1, 3, 1, 6\)"):
        cpu.rotary(x, cos[..., :6].contiguous(), cos[..., :6].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_mlps_silu_and_product_are_one_c_call_in_bfloat16_with_the_same_bits(dtype, monkeypatch):
    """Where the activation is SiLU and the tensors bfloat16, ``act_fn(gate) * up`` is one ``silu_mul`` call; in float32,
    or with another activation (GELU), the activation's own forward, then the product. Every bit the same."""
    from transformers.activations import ACT2FN

    from kvpaging.kernels import cpu

    if not cpu.available():
        pytest.skip("the C kernels cannot be built here")
    calls = []
    real = direct_module.silu_mul_unchecked
    monkeypatch.setattr(direct_module, "silu_mul_unchecked", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    both = (torch.randn(1, 7, 2 * 40, generator=g) * 4).to(dtype)
    gate, up = both[..., :40], both[..., 40:]  # the two halves of one fused product, as the fast layers give them
    for name, c_calls in (("silu", 1 if dtype == torch.bfloat16 else 0), ("gelu", 0)):
        act = ACT2FN[name]
        calls.clear()
        got = direct_module._act_then_mul(act, cpu.silu_table())(gate, up)
        assert len(calls) == c_calls, name
        assert torch.equal(got, act(gate) * up), name
    calls.clear()
    assert torch.equal(direct_module._act_then_mul(ACT2FN["silu"], None)(gate, up), ACT2FN["silu"](gate) * up)
    assert not calls  # no table (torch's loops disagree, or no C kernels): the activation's own forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_residual_connection_and_the_norm_after_it_are_one_c_call_with_the_same_bits(dtype, monkeypatch):
    """Where a norm is the engine's C RMSNorm, the sum before it and the norm are one ``add_rms_norm`` call; a norm that
    is not (here: a plain transformers RMSNorm) gets the sum, then its own forward. Both give ``residual + y`` and
    the norm of it, every bit."""
    from kvpaging.kernels import cpu
    from kvpaging.kernels.cpu import layers

    if not cpu.available():
        pytest.skip("the C kernels cannot be built here")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(4)
    plain = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(96, generator=g))
    fast = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    fast.load_state_dict(plain.state_dict())
    assert layers.enable_fast_layers(fast).rms_norms == 1 and layers.is_c_rms_norm(fast)
    calls = []
    real = direct_module.add_rms_norm_unchecked
    monkeypatch.setattr(direct_module, "add_rms_norm_unchecked", lambda *a: calls.append(1) or real(*a))
    residual = torch.randn(1, 5, 96, generator=g).to(dtype)
    y = torch.randn(1, 5, 96, generator=g).to(dtype)
    with torch.inference_mode():
        want_hidden, want = residual + y, plain(residual + y)
        for norm, c_calls in ((plain, 0), (fast, 1)):
            calls.clear()
            hidden, normed = direct_module._add_then_norm(norm)(residual, y)
            assert len(calls) == c_calls
            assert torch.equal(hidden, want_hidden) and torch.equal(normed, want)
