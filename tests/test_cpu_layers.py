"""Faster CPU layers (kernels/cpu/layers.py, ``cpu_fast_layers``): oneDNN linears, RMSNorms in C.

The engine's tokens with these layers are checked against transformers'
``generate()`` by test_engine_vs_transformers.py. Here: by default a model gets what changes no result (a bfloat16
one its packed linears, either dtype its RMSNorms in C, each the layer's own result to the bit), the rest only when
asked for (and nothing with ``cpu_fast_layers=False``); when on, the engine's private copy gets them and the user's model never
does; large products go to oneDNN and small ones stay on ``F.linear``; RMSNorm
variants with other maths are left alone; the patched copy still deep-copies
and pickles.
"""

from __future__ import annotations

import copy
import logging
import io

import pytest
import torch
import torch.nn.functional as F

from kvpaging import LLM, SamplingParams
from kvpaging.kernels import cpu
from kvpaging.kernels.cpu import layers
from kvpaging.models import tiny
from kvpaging.teach.scheduling import cpu_threads

needs_onednn = pytest.mark.skipif(not layers.onednn_usable(), reason="torch has no usable oneDNN linear here")
needs_c = pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")
needs_bf16_packing = pytest.mark.skipif(not layers.bf16_packing_usable(),
                                        reason="oneDNN cannot pack a bfloat16 weight on this CPU (no AVX-512 BW/VL/DQ)")
needs_amx = pytest.mark.skipif(not cpu.amx_ready(), reason="no AMX here (or the C kernels cannot be built)")


def amx_products(model: torch.nn.Module) -> int:
    """How many products a tiny model's fast layers should run on AMX tiles where the CPU has it: every fused group
    and every linear outside one (their shapes tile and they have no bias), none elsewhere."""
    if not cpu.amx_ready():
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    return len({id(vars(m)["_fused"]) if vars(m)["_fused"] is not None else id(m) for m in linears})


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_onednn
@needs_c
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_engine_copy_gets_every_float32_linear_and_rms_norm_and_the_user_model_none(arch):
    model = tiny(arch, seed=0)
    n_layers = model.config.num_hidden_layers
    llm = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=True)
    served = llm.engine.model
    linears = [m for m in served.modules() if type(m) is torch.nn.Linear]
    norms = [m for m in served.modules() if type(m).__name__.endswith("RMSNorm")]
    # qwen3 normalizes queries and keys per head too: 4 norms a layer, llama 2; plus the final norm
    assert len(norms) == (4 if arch == "qwen3" else 2) * n_layers + 1
    assert len(linears) == 7 * n_layers + 1
    assert llm.engine.runner.fast_layers == layers.FastLayers(len(linears), len(norms))
    assert all("forward" in vars(m) for m in linears + norms)
    assert not any("forward" in vars(m) for m in model.modules()), "the user's model was patched"
    assert served.lm_head.weight is model.lm_head.weight  # the copy shares the weights, no second copy


def test_a_float32_model_gets_its_c_norms_and_mkl_exact_linears_by_default_and_false_runs_the_models_own_layers():
    model = tiny("qwen3", seed=0)
    by_default = LLM(model, num_blocks=16, max_model_len=64)
    assert by_default.engine.config.cpu_fast_layers is None  # the exact fast layers
    served = list(by_default.engine.model.modules())
    norms = [m for m in served if type(m).__name__.endswith("RMSNorm")]
    linears = [m for m in served if type(m) is torch.nn.Linear]  # (no bias in qwen3's tiny model)
    # float32: the norms, and every linear on linear_f32.c where it is MKL's product to the bit (checked per size)
    expected = (layers.FastLayers(len(linears), len(norms), f32_linears=len(linears)) if cpu.available()
                else layers.FastLayers())
    assert by_default.engine.runner.fast_layers == expected
    plain = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=False)
    assert plain.engine.runner.fast_layers == layers.FastLayers()
    assert not any("forward" in vars(m) for m in plain.engine.model.modules())
    prompts = [[5, 9, 2, 7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in by_default.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    if layers.onednn_usable():
        fast = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=True)
        prompts = [[5, 9, 2, 7] * 8] * 2
        params = SamplingParams(max_tokens=2, temperature=0.0)
        assert "mkldnn::_linear_pointwise" in ops_called(lambda: fast.generate(prompts, params, use_tqdm=False))
        assert "mkldnn::_linear_pointwise" not in ops_called(lambda: plain.generate(prompts, params, use_tqdm=False))


@needs_bf16_packing
def test_a_bfloat16_model_gets_its_packed_linears_by_default_and_the_same_tokens_with_or_without():
    """The packed bfloat16 linears change no result (each layer's product is ``F.linear``'s to the bit, checked when
    it is turned on), so they are the default for a bfloat16 model on the CPU; False keeps the model's own."""
    model = tiny("llama", seed=0).to(torch.bfloat16)
    by_default = LLM(model, num_blocks=16, max_model_len=64)
    linears = [m for m in by_default.engine.model.modules() if type(m) is torch.nn.Linear]
    assert by_default.engine.config.cpu_fast_layers is None  # resolved: the exact fast layers (True asks for all)
    # its norms run in C (the layer's own results to the bit); no small batch goes to linear.c (not F.linear's
    # sums: only with True); its q/k/v and gate/up siblings run as one product each (two groups a layer)
    groups = 2 * model.config.num_hidden_layers
    norms = 2 * model.config.num_hidden_layers + 1 if cpu.available() else 0
    assert by_default.engine.runner.fast_layers == layers.FastLayers(len(linears), norms, 0, groups,
                                                                     amx_products(by_default.engine.model))
    assert not any(vars(m).get("_small_batch") for m in linears)
    assert all(isinstance(vars(m).get("_packed"), layers._Packed) for m in linears)
    assert not any("forward" in vars(m) for m in model.modules()), "the user's model was patched"
    own = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=False)
    assert own.engine.runner.fast_layers == layers.FastLayers()
    assert not any("forward" in vars(m) for m in own.engine.model.modules())
    prompts = [[5, 9, 2, 7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in by_default.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in own.generate(prompts, params, use_tqdm=False)]


@needs_onednn
def test_bf16_packing_usable_says_whether_a_bfloat16_weight_packs_here():
    """The verdict is the packing's own: a bfloat16 weight packs exactly where it says so (torch's oneDNN needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT for it)."""
    try:
        packs = layers._pack(torch.randn(64, 96).to(torch.bfloat16)) is not None
    except RuntimeError:
        packs = False
    assert layers.bf16_packing_usable() is packs


@pytest.mark.skipif(layers.bf16_packing_usable(), reason="oneDNN packs bfloat16 weights on this CPU")
def test_without_bf16_packing_a_bfloat16_models_linears_keep_f_linear_and_the_log_says_why(caplog):
    """On a CPU where oneDNN cannot pack a bfloat16 weight (AVX2 only) the engine's copy keeps every bfloat16
    linear's own forward, says why, and gives the tokens of the model's own layers."""
    model = tiny("llama", seed=0).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=layers.__name__):
        fast = LLM(model, num_blocks=16, max_model_len=64)
    assert "cannot pack a bfloat16 weight on this CPU" in caplog.text
    linears = [m for m in fast.engine.model.modules() if type(m) is torch.nn.Linear]
    assert linears and not any("forward" in vars(m) or "_packed" in vars(m) for m in linears)
    assert fast.engine.runner.fast_layers.linears == 0
    own = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=False)
    prompts = [[5, 9, 2, 7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in own.generate(prompts, params, use_tqdm=False)]


@needs_onednn
def test_float32_linears_run_on_packed_weights_within_rounding():
    """A float32 linear (opt-in) runs oneDNN on its weight packed once, at every row count (its small-batch
    products are where MKL is slowest): within float32 rounding of F.linear, not bit for bit; a weight written in
    place is packed again."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 384)
    plain = copy.deepcopy(layer)
    assert layers.enable_fast_layers(layer).linears == 1
    with torch.inference_mode():
        for rows in (1, 2, 3, 48, 300):
            x = torch.randn(1, rows, 256)
            assert "mkldnn::_linear_pointwise" in ops_called(lambda: layer(x)), rows
            torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-0.5)  # written in place: the next call packs the new weight
        plain.weight.mul_(-0.5)
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        vector = torch.randn(256)  # a 1-D input: F.linear's own path
        assert torch.equal(layer(vector), plain(vector))
    assert layers.enable_fast_layers(layer).linears == 1  # counted once, not patched twice


@needs_c
@pytest.mark.parametrize("mean", ["in C", "torch's"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_c_is_the_layers_own_result_to_the_bit_and_its_own_code_for_what_c_does_not_take(dtype, mean,
                                                                                                     monkeypatch):
    """The squares and the scaling run in C, rounded where torch rounds; the mean in C in torch's order of sums (where
    the load-time probe found that order here) or torch's own between two C passes: either way every element equals
    the layer's own forward, at every row count and scale."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    lanes = cpu._mean_lanes if cpu._mean_lanes is not None else cpu._find_mean_lanes()
    if mean == "in C" and not lanes:
        pytest.skip("rms_norm.c's sums are not torch's here")
    monkeypatch.setattr(cpu, "_mean_lanes", lanes if mean == "in C" else 0)

    g = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(576, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    reference = copy.deepcopy(norm)  # the layer's own code, untouched
    assert layers.enable_fast_layers(norm).rms_norms == 1
    with torch.inference_mode():
        for rows in (1, 2, 17, 48, 300, 2048):  # 2048 x 576: the C passes share the rows among threads
            for scale in (1e-4, 1.0, 300.0):
                x = (torch.randn(1, rows, 576, generator=g) * scale).to(dtype)
                assert torch.equal(norm(x), reference(x)), (rows, scale)
        assert "aten::rsqrt" in ops_called(lambda: reference(x))
        inside = ops_called(lambda: norm(x))
        assert "aten::rsqrt" not in inside and "aten::pow" not in inside
        assert ("aten::mean" in inside) is (mean == "torch's")
        strided = x.transpose(0, 1)  # not contiguous: the layer's own code
        assert torch.equal(norm(strided), reference(strided))
        other = x.to(torch.float16)  # a dtype it was not checked for: the layer's own code
        assert torch.equal(norm(other), reference(other))


@needs_c
def test_an_rms_norm_with_other_maths_keeps_its_own_forward():
    class GemmaLikeRMSNorm(torch.nn.Module):  # scales by (1 + weight), as Gemma's does
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(dim))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    norm = GemmaLikeRMSNorm(32)
    assert layers.enable_fast_layers(norm).rms_norms == 0
    assert "forward" not in vars(norm)

    class WideningRMSNorm(torch.nn.Module):  # Llama's maths, its result handed back in float32
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(dim).to(torch.bfloat16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight * h.to(x.dtype)).float()

    widening = WideningRMSNorm(32)  # its values are the C path's, its dtype is not
    assert layers.enable_fast_layers(widening).rms_norms == 0
    assert "forward" not in vars(widening)


@needs_onednn
def test_other_modules_and_dtypes_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyLinear(8, 8), torch.nn.Linear(8, 8).to(torch.float16))
    assert layers.enable_fast_layers(model).linears == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])


@needs_bf16_packing
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (576, 1536)])
def test_bfloat16_products_of_any_size_are_f_linears_to_the_bit(threads, n, k):
    """Every row count a packed product takes (1 to ``PACKED_MAX_ROWS_BF16``: decode batches) and larger ones up to
    520 (prefill chunks), the trained model's layer shapes: F.linear's product to the bit. oneDNN may split a large
    product on a packed weight otherwise than on the plain one (an AMX Xeon at two threads did, at 96 rows for
    192 x 576 and from 289 for 576 x 576), so such products must not take the packed weight: the row counts past the
    bound are those, the bound's neighbours and a spread up to 520 (each is ``F.linear`` itself when routed right)."""
    g = torch.Generator().manual_seed(n + k)
    layer = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer = layer.to(torch.bfloat16)
    plain = copy.deepcopy(layer)
    bound = layers.PACKED_MAX_ROWS_BF16
    past_it = (bound + 1, bound + 2, 96, 97, 128, 200, 288, 289, 300, 400, 511, 520)
    with cpu_threads(threads), torch.no_grad():
        assert layers.enable_fast_layers(layer, exact=True).linears == 1
        for rows in (*range(1, bound + 1), *past_it):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(layer(x), plain(x)), rows


@needs_bf16_packing
def test_bfloat16_linears_run_on_packed_weights_to_the_bit():
    """A bfloat16 linear's product on its packed weight is F.linear's, bit for bit, at decode and prefill sizes;
    a weight written in place is packed again; a copy computes with its own weights, and the layer saves."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    plain = copy.deepcopy(layer)
    assert layers.enable_fast_layers(layer).linears == 1 and "forward" in vars(layer)
    with torch.no_grad():
        for rows in (1, 7, 48, 300):
            x = torch.randn(1, rows, 576).to(torch.bfloat16)
            assert torch.equal(layer(x), plain(x)), rows
        layer.weight.mul_(-0.5)  # written in place: the next call packs the new weight (and its AMX tiles)
        plain.weight.mul_(-0.5)
        assert torch.equal(layer(x[:, :7]), plain(x[:, :7])) and torch.equal(layer(x), plain(x))
        twin = copy.deepcopy(layer)
        twin.weight.zero_()
        assert torch.equal(twin(x), torch.zeros(1, 300, 1536, dtype=torch.bfloat16)) and torch.equal(layer(x), plain(x))
    torch.save(layer, io.BytesIO())  # the packed copy is left out


def _siblings(bias: bool, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An attention-like module with q/k/v projections of one input (bfloat16), and an untouched copy of it."""
    g = torch.Generator().manual_seed(seed)
    parent = torch.nn.Module()
    for name, n in (("q_proj", 96), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
        layer = torch.nn.Linear(64, n, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, 64, generator=g) * 0.1)
            if bias:
                layer.bias.copy_(torch.randn(n, generator=g))
        setattr(parent, name, layer.to(torch.bfloat16))
    return parent, copy.deepcopy(parent)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_sibling_linears_run_as_one_product_and_each_gets_its_own_bits(bias, monkeypatch):
    """q/k/v called one after another on one input: one oneDNN product, and each member's output its own
    ``F.linear`` to the bit (every row count to the packing's bound); o_proj, no sibling, runs alone."""
    parent, plain = _siblings(bias)
    fast = layers.enable_fast_layers(parent, exact=True)
    assert fast == layers.FastLayers(4, 0, 0, 1, 2 if cpu.amx_ready() and not bias else 0)  # the group's, o_proj's
    group = vars(parent.q_proj)["_fused"]
    assert group is vars(parent.k_proj)["_fused"] is vars(parent.v_proj)["_fused"] and parent.o_proj._fused is None
    products = []
    real = layers._product  # oneDNN's or, for up to AMX_ROWS rows where the group has tiles, linear_amx.c's
    monkeypatch.setattr(layers, "_product", lambda *a: products.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in range(1, layers.PACKED_MAX_ROWS_BF16 + 1):
            x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
            for name in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(getattr(parent, name)(x), getattr(plain, name)(x)), (rows, name)
            assert group.input is None and group.output is None  # nothing held once every member took its slice
    assert len(products) == layers.PACKED_MAX_ROWS_BF16  # one product a row count, not three


@needs_bf16_packing
def test_the_warm_up_makes_each_products_kernels_once_per_row_count_and_changes_nothing(monkeypatch):
    """``warm_packed_products`` runs each distinct packed product (the q/k/v group's, o_proj's) once for every row
    count up to its bound, on zeros, and never again for what it did; the group is left as it was (no slices held,
    no misses counted) and every product is still the layer's own ``F.linear`` to the bit."""
    parent, plain = _siblings(True, seed=5)
    layers.enable_fast_layers(parent, exact=True)
    group = vars(parent.q_proj)["_fused"]
    products = []
    real = layers._onednn_product
    monkeypatch.setattr(layers, "_onednn_product", lambda *a: products.append(tuple(a[0].shape)) or real(*a))
    monkeypatch.setattr(layers, "_warmed", set())
    layers.warm_packed_products(parent, 5)
    assert sorted(products) == sorted([(rows, 64) for rows in range(1, 6)] * 2)  # the group's and o_proj's
    layers.warm_packed_products(parent, 200)  # past the bound: up to PACKED_MAX_ROWS_BF16, the first five not again
    assert len(products) == 2 * layers.PACKED_MAX_ROWS_BF16
    assert group.input is None and group.output is None and group.misses == 0
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        assert all(torch.equal(getattr(parent, n)(x), getattr(plain, n)(x)) for n in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj"))


@needs_bf16_packing
def test_the_warm_up_leaves_out_the_row_counts_that_run_on_amx_tiles(monkeypatch):
    """Products without a bias on a CPU with AMX take up to AMX_ROWS rows on their tiles, so oneDNN never sees those
    row counts and the warm-up makes no kernels for them; elsewhere it makes them from one row."""
    parent, _ = _siblings(False, seed=7)
    layers.enable_fast_layers(parent, exact=True)
    products = []
    real = layers._onednn_product
    monkeypatch.setattr(layers, "_onednn_product", lambda *a: products.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(layers, "_warmed", set())
    layers.warm_packed_products(parent, 40)
    first = layers.AMX_ROWS + 1 if cpu.amx_ready() else 1
    assert sorted(products) == sorted(list(range(first, 41)) * 2)  # the q/k/v group's and o_proj's


@needs_bf16_packing
def test_siblings_called_out_of_step_get_their_own_products_and_the_group_is_undone():
    """A model that calls a member on another input while the others' slices wait (cross-attention's keys, say)
    still gets each member's own product, computed again; after MAX_MISSES such calls the group is undone and each
    member runs on its own packed weight, with the same bits. A weight written in place is packed again."""
    parent, plain = _siblings(False, seed=2)
    layers.enable_fast_layers(parent, exact=True)
    group = vars(parent.q_proj)["_fused"]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for k in range(group.MAX_MISSES + 2):
            x, other = (torch.randn(2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
            assert torch.equal(parent.q_proj(x), plain.q_proj(x))
            assert torch.equal(parent.k_proj(other), plain.k_proj(other)), k  # not q's input: its own product
            assert torch.equal(parent.v_proj(x), plain.v_proj(x)), k
        assert all(vars(m)["_fused"] is None for m in (parent.q_proj, parent.k_proj, parent.v_proj))
        assert torch.equal(parent.k_proj(x), plain.k_proj(x))
        fresh, twin = _siblings(True, seed=4)
        layers.enable_fast_layers(fresh, exact=True)
        for module in (fresh, twin):
            module.v_proj.weight.mul_(-2)
        assert all(torch.equal(getattr(fresh, n)(x), getattr(twin, n)(x)) for n in ("q_proj", "k_proj", "v_proj"))
        for module in (fresh, twin):
            module.k_proj.bias.add_(3)  # a bias written in place: the group's bias is made again too
        assert all(torch.equal(getattr(fresh, n)(x), getattr(twin, n)(x)) for n in ("q_proj", "k_proj", "v_proj"))


@needs_bf16_packing
def test_a_copy_of_fused_siblings_runs_each_alone_with_its_own_weights():
    parent, plain = _siblings(True, seed=5)
    layers.enable_fast_layers(parent, exact=True)
    twin = copy.deepcopy(parent)
    assert all(vars(getattr(twin, n))["_fused"] is None for n in ("q_proj", "k_proj", "v_proj"))
    with torch.no_grad():
        twin.k_proj.weight.zero_()
        twin.k_proj.bias.zero_()
        x = torch.randn(3, 64).to(torch.bfloat16)
        assert torch.equal(twin.k_proj(x), torch.zeros(3, 32, dtype=torch.bfloat16))
        assert all(torch.equal(getattr(parent, n)(x), getattr(plain, n)(x)) for n in ("q_proj", "k_proj", "v_proj"))
    torch.save(parent, io.BytesIO())


@needs_bf16_packing
def test_a_member_running_alone_is_checked_first_and_keeps_f_linear_where_its_packed_product_differs(monkeypatch):
    """A fused group's members are checked as a group, not alone: the first time one runs alone (its group undone,
    or a copy of it) its own packed product is checked against F.linear, and where that check fails the member
    runs F.linear from then on."""
    parent, plain = _siblings(False, seed=6)
    layers.enable_fast_layers(parent, exact=True)
    twin = copy.deepcopy(parent)
    checked = []
    monkeypatch.setattr(layers, "_packed_if_it_agrees", lambda members, probed: checked.append(members) or None)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(twin.k_proj(x), plain.k_proj(x)) and torch.equal(twin.k_proj(x), plain.k_proj(x))
    assert checked == [[twin.k_proj]]  # once, at its first call alone
    assert vars(twin.k_proj)["_packed"].weight is None  # no packed weight: F.linear


@needs_onednn
def test_a_patched_copy_still_deep_copies_and_pickles_with_its_own_weights():
    model = tiny("qwen3", seed=0, num_hidden_layers=1)
    served = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=True).engine.model
    twin = copy.deepcopy(served)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(1, 64, 256)
    layer = twin.model.layers[0].mlp.up_proj
    assert "forward" in vars(layer)
    assert torch.equal(layer(x), torch.zeros(1, 64, layer.out_features)), "the copy computes with its own weights"
    torch.save(served, io.BytesIO())


@needs_c
def test_c_rms_norm_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="bfloat16 CPU tensors of one dtype, got x torch.bfloat16 on cpu, weight "
                                         "torch.float32"):
        cpu.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="got x torch.float16"):
        cpu.rms_norm(torch.randn(2, 8).half(), torch.randn(8).half(), 1e-6)
    with pytest.raises(ValueError, match=r"weight of shape \(8,\), got weight \(4,\)"):
        cpu.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous x"):
        cpu.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-6)


def test_the_default_resolves_by_device_dtype_and_processes():
    """``cpu_fast_layers=None`` stays None (the exact fast layers) only where they run: a bfloat16 or float32 model
    on the CPU, served by one process (a tensor-parallel rank's layers are not split for the fast path)."""
    from kvpaging.config import EngineConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig()._fast_layers(cpu, torch.bfloat16) is None  # None: the fast layers that change no result
    assert EngineConfig()._fast_layers(cpu, torch.float32) is None
    assert EngineConfig()._fast_layers(cpu, torch.float16) is False
    assert EngineConfig()._fast_layers(cuda, torch.bfloat16) is False
    assert EngineConfig(tensor_parallel_size=2)._fast_layers(cpu, torch.bfloat16) is False
    assert EngineConfig(cpu_fast_layers=False)._fast_layers(cpu, torch.bfloat16) is False
    assert EngineConfig(cpu_fast_layers=True)._fast_layers(cpu, torch.float32) is True
    with pytest.raises(ValueError, match="cpu_fast_layers=True serves models on the CPU, but device='cuda'"):
        EngineConfig(cpu_fast_layers=True)._fast_layers(cuda, torch.float32)


# -- one or two rows of bfloat16 through linear.c (cpu_fast_layers=True) -------------------------------------------
@needs_c
@pytest.mark.parametrize(("n", "k", "with_bias"), [(96, 64, True), (576, 576, False), (37, 53, True), (5, 16, False)])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_small_batch_bfloat16_product_is_the_float64_sum_rounded_once(n, k, with_bias, rows):
    """linear.c sums in float32 and rounds to bfloat16 once: within one bfloat16 rounding of the exact (float64) sum
    of the same bfloat16 inputs, at any width (16-lane blocks and a tail), with and without a bias; and a row's
    result is the one it gets alone."""
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, 1, k, generator=g).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = cpu.linear_bf16(x, weight, bias)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
    # one rounding to bfloat16 (8 bits) of a float32 sum: at most one bfloat16 step from the exact value's
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3 * k ** 0.5)
    assert torch.equal(torch.cat([cpu.linear_bf16(x[r], weight, bias) for r in range(rows)]).view_as(got), got)


@needs_c
def test_the_small_batch_product_refuses_what_it_cannot_compute():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 CPU tensors, got torch.float32"):
        cpu.linear_bf16(torch.zeros(1, 16), w)
    with pytest.raises(ValueError, match=r"rows of 16 features .* got x \(2, 15\)"):
        cpu.linear_bf16(torch.zeros(2, 15, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"bias of \(8,\), got .* bias \(4,\)"):
        cpu.linear_bf16(torch.zeros(1, 16, dtype=torch.bfloat16), w, torch.zeros(4, dtype=torch.bfloat16))


@needs_bf16_packing
@needs_c
def test_true_sends_one_or_two_sequences_to_linear_c_and_larger_batches_to_onednn():
    """With ``cpu_fast_layers=True`` a bfloat16 model's linears take products of one or two rows (one or two
    sequences decoding) to linear.c and larger ones to oneDNN's packed weight; the default keeps oneDNN for all
    (F.linear's products to the bit); the user's model is untouched."""
    model = tiny("llama", seed=0).to(torch.bfloat16)
    fast = LLM(model, num_blocks=16, max_model_len=64, cpu_fast_layers=True)
    linears = [m for m in fast.engine.model.modules() if type(m) is torch.nn.Linear]
    assert fast.engine.config.cpu_fast_layers is True
    groups = 2 * model.config.num_hidden_layers  # q/k/v and gate/up: one product each beyond two rows
    norms = 2 * model.config.num_hidden_layers + 1
    assert fast.engine.runner.fast_layers == layers.FastLayers(len(linears), norms, len(linears), groups,
                                                               amx_products(fast.engine.model))
    assert not any(vars(m).get("_small_batch") or "forward" in vars(m) for m in model.modules())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    two = [[5, 9, 2, 7], [3, 1, 4, 1]]
    assert cpu.LINEAR_PROFILER_NAME in ops_called(lambda: fast.generate(two, params, use_tqdm=False))
    three = two + [[2, 7, 1, 8]]
    assert cpu.LINEAR_PROFILER_NAME not in ops_called(lambda: fast.generate(three, params, use_tqdm=False))
    by_default = LLM(model, num_blocks=16, max_model_len=64)
    assert cpu.LINEAR_PROFILER_NAME not in ops_called(lambda: by_default.generate(two, params, use_tqdm=False))


@needs_c
def test_the_small_batch_product_is_the_same_on_any_number_of_threads():
    """Each output is one thread's dot product: sharing the weight rows among threads changes no bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200, generator=g).to(torch.bfloat16)
    weight = torch.randn(1001, 200, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.linear_bf16(x, weight)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu.linear_bf16(x, weight), one)
    finally:
        torch.set_num_threads(before)


@needs_c
def test_the_amx_layout_is_the_weights_tiles():
    """``amx_pack`` moves elements, nothing else: block of 16 outputs, tile of 32 inputs, pair of inputs, output,
    input of the pair (the layout TDPBF16PS reads); it runs on any CPU, and refuses a shape that does not tile."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 96, generator=g).to(torch.bfloat16)
    expected = weight.view(3, 16, 3, 16, 2).permute(0, 2, 3, 1, 4).reshape(48, 96)
    assert torch.equal(cpu.amx_pack(weight), expected)
    with pytest.raises(ValueError, match=r"shape \(40, 96\)"):
        cpu.amx_pack(weight[:40])
    with pytest.raises(ValueError, match="float32"):
        cpu.amx_pack(weight.float())


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (208, 576)])
def test_amx_products_of_up_to_32_rows_are_f_linears_to_the_bit(threads, n, k):
    """The trained model's product shapes (q/k/v and gate/up side by side, o, down, the LM head) and one with an odd
    number of 16-output blocks (the last one without a pair), every row count a tiled product takes: ``F.linear``'s
    bits, on one thread or two (each block of outputs is one thread's)."""
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    tiles = cpu.amx_pack(weight)
    with cpu_threads(threads):
        for rows in range(1, layers.AMX_ROWS + 1):
            x = torch.randn(1, rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(cpu.amx_linear(x, tiles), F.linear(x, weight)), rows


@needs_amx
def test_amx_linear_refuses_what_it_cannot_compute():
    tiles = cpu.amx_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got x \(33, 64\)"):
        cpu.amx_linear(torch.zeros(33, 64, dtype=torch.bfloat16), tiles)  # more rows than two tiles
    with pytest.raises(ValueError, match=r"got x \(2, 32\)"):
        cpu.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16), tiles)  # not the weight's inputs
    with pytest.raises(ValueError, match="float32"):
        cpu.amx_linear(torch.zeros(2, 64), tiles)


@needs_amx
@needs_onednn
def test_the_default_takes_decode_batches_of_up_to_32_to_amx_and_larger_ones_to_onednn():
    """By default a bfloat16 layer without a bias runs 1 to 32 rows on its AMX tiles and 33 to 64 on oneDNN's packed
    weight (which sums them in parts there), each ``F.linear``'s to the bit; a layer with a bias keeps oneDNN."""
    g = torch.Generator().manual_seed(11)
    for bias in (False, True):
        layer = torch.nn.Linear(576, 192, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(192, 576, generator=g) * 0.05)
        layer = layer.to(torch.bfloat16)
        plain = copy.deepcopy(layer)
        assert layers.enable_fast_layers(layer, exact=True).amx_products == (0 if bias else 1)
        for rows, on_amx in ((1, not bias), (32, not bias), (33, False), (64, False)):
            x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(layer(x), plain(x)), (bias, rows)
                assert (cpu.AMX_PROFILER_NAME in ops_called(lambda: layer(x))) == on_amx, (bias, rows)


@needs_bf16_packing
def test_a_fused_groups_tiles_follow_a_weight_written_in_place_and_a_shape_that_does_not_tile_has_none():
    """A group's weights written in place are laid out again (tiles too) before its next product: every member's
    output is still its own ``F.linear``'s, on tiles and off; a layer whose outputs are not a multiple of 16 gets no
    tiles and runs on oneDNN, to the same bits."""
    parent, plain = _siblings(False, seed=9)
    layers.enable_fast_layers(parent, exact=True)
    group = vars(parent.q_proj)["_fused"]
    assert (group.amx is not None) == cpu.amx_ready()
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for layer in (parent.k_proj, plain.k_proj):
            layer.weight.mul_(-0.5)
        for rows in (7, 40):
            x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
            for name in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(getattr(parent, name)(x), getattr(plain, name)(x)), (rows, name)
        odd = torch.nn.Linear(64, 100, bias=False).to(torch.bfloat16)
        odd_plain = copy.deepcopy(odd)
        layers.enable_fast_layers(odd, exact=True)
        assert odd._packed.amx is None
        x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
        assert torch.equal(odd(x), odd_plain(x))



@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_a_float32_linear_is_mkls_product_to_the_bit_at_every_row_count_and_on_inputs_after_the_checked_one(threads):
    """The float32 layers' C product (linear_f32.c) is used for a row count only once it gave ``F.linear``'s bits on
    the first real product of that size: every later product of that size, on other inputs, must still be
    ``F.linear``'s to the bit (how MKL adds the terms depends on the shape and the rows, not on the values)."""
    g = torch.Generator().manual_seed(0)
    with cpu_threads(threads):
        for n, k in ((192, 576), (200, 96), (48, 1536)):
            layer = torch.nn.Linear(k, n, bias=False)
            layers._give_f32_forward(layer)
            with torch.no_grad():
                for rows in (1, 5, 16, 17, 24, 33, 48, 64, 16, 5, 1, 24):  # each size twice, on new inputs
                    x = torch.randn(rows, k, generator=g)
                    assert torch.equal(layer(x), F.linear(x, layer.weight)), (n, k, rows)
                x = torch.randn(2, 3, k, generator=g)  # rows in any leading shape
                assert torch.equal(layer(x), F.linear(x, layer.weight))
                x = torch.randn(300, k, generator=g)  # a prompt chunk: F.linear's own
                assert torch.equal(layer(x), F.linear(x, layer.weight))
                x = torch.randn(0, k)  # no rows at all (a step of no tokens for this layer)
                assert layer(x).shape == (0, n)


@needs_c
def test_a_float32_linear_runs_the_c_product_where_it_agrees_and_f_linear_where_it_does_not(monkeypatch):
    """Where the C product gives MKL's bits (found on the machines this was written on for 16 rows and more) it runs
    in F.linear's place, with the run length found; a row count whose check failed runs F.linear, and so does a row
    count for which no run length is found (the next row count of that shape is searched again, until one is: then
    a new row count tries that one alone)."""
    layer = torch.nn.Linear(576, 192, bias=False)
    layers._give_f32_forward(layer)
    monkeypatch.setattr(layers, "_f32_runs", {})
    monkeypatch.setattr(layers, "_f32_rows", {})
    x = torch.randn(24, 576)
    with torch.no_grad(), cpu_threads(1):
        layer(x)
        key = (192, 576, 1)
        if not layers._f32_rows[(*key, 24)]:
            pytest.skip("MKL does not sum 24-row float32 products in runs here: the layers keep F.linear")
        assert layers._f32_rows[(*key, 24)] == (layers._f32_runs[key], 24, 0) and layers._f32_runs[key] > 0
        assert "kvpaging::cpu_linear_f32" in ops_called(lambda: layer(x))
        layers._f32_rows[(*key, 24)] = ()  # as if the check had failed: F.linear from then on
        assert "kvpaging::cpu_linear_f32" not in ops_called(lambda: layer(x))
        monkeypatch.setattr(layers, "f32_linear_unchecked", lambda x, packed, n, kc, *a: torch.zeros(x.shape[0], n))
        monkeypatch.setattr(layers, "f32_lanes_unchecked", lambda x, w, head, out, first: out.zero_())
        layers._f32_rows.pop((*key, 24))  # a check whose C product differs: refused, and F.linear's product served
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and layers._f32_rows[(*key, 24)] == ()
        layers._f32_runs.clear()  # a shape whose run length is not found: refused at that row count, searched at the next
        layers._f32_rows.clear()
        searched = []
        monkeypatch.setattr(layers, "f32_run_length", lambda *a: searched.append(a[0].shape[0]) or 0)
        for rows in (30, 31):
            y = torch.randn(rows, 576)
            assert torch.equal(layer(y), F.linear(y, layer.weight))
            assert layers._f32_rows[(*key, rows)] == () and key not in layers._f32_runs
        assert searched == [30, 28, 31, 28]  # all rows in runs, then the first 28 (their last rows in lanes)
        layers._f32_runs[key] = 288  # once a run length is known, a new row count tries it alone: no search
        z = torch.randn(40, 576)
        assert torch.equal(layer(z), F.linear(z, layer.weight)) and layers._f32_rows[(*key, 40)] == ()
        assert searched == [30, 28, 31, 28]


@needs_c
def test_the_run_length_search_finds_the_one_run_length_a_product_was_summed_with(monkeypatch):
    """A product that only one run length reproduces is found, whichever candidate it is; one that none reproduces
    gives 0 after trying every candidate once."""
    tried = []
    real = layers.f32_linear_unchecked

    def spy(x, packed, n, kc):
        tried.append(kc)
        return real(x, packed, n, kc)

    monkeypatch.setattr(layers, "f32_linear_unchecked", spy)
    w = torch.randn(48, 576)
    packed = cpu.f32_pack(w)
    x = torch.randn(5, 576)
    for kc in (576, 288, 192, 144, 96, 72):
        own = real(x, packed, 48, kc)  # a product summed in runs of kc: only kc gives its bits (random inputs)
        tried.clear()
        assert layers.f32_run_length(x, packed, own) == kc and tried[-1] == kc
    tried.clear()
    assert layers.f32_run_length(x, packed, torch.zeros(5, 48)) == 0 and len(tried) == 6


@needs_c
def test_a_float32_linear_lays_its_weight_out_only_when_a_product_needs_it(monkeypatch):
    """Products of one row are checked against the lanes order alone, which reads the weight as it is: an engine that
    serves one sequence at a time pays no memory for the C products. The first product of four rows is checked in
    runs first, which needs the weight laid out."""
    monkeypatch.setattr(layers, "_f32_runs", {})
    monkeypatch.setattr(layers, "_f32_rows", {})
    layer = torch.nn.Linear(96, 64, bias=False)
    layers._give_f32_forward(layer)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 96)
            assert torch.equal(layer(x), F.linear(x, layer.weight))
        assert layer._f32.weight is None and (64, 96, torch.get_num_threads(), 1) in layers._f32_rows
        layer(torch.randn(4, 96))  # the first product of four rows: laid out, and checked
        assert layer._f32.weight is not None and (64, 96, torch.get_num_threads(), 4) in layers._f32_rows


def _lanes_reference(x: torch.Tensor, w: torch.Tensor, head: int) -> torch.Tensor:
    """The order ``linear_f32_lanes.c`` documents, one float32 operation at a time in torch (every output at once):
    each product rounded; the first ``head`` inputs added in order; lane ``l`` the inputs ``head + l``, ``head + l +
    4``, ... in order, lane 0 after the head; ``(lane 0 + lane 2) + (lane 1 + lane 3)``; then the inputs past the
    lanes' last group of four, in order."""
    k = x.shape[-1]
    end = head + (k - head) // 4 * 4
    products = x[:, None, :] * w[None, :, :]  # [rows, n, k], each rounded to float32
    lanes = [None, None, None, None]
    if head:
        lanes[0] = products[..., 0]
        for i in range(1, head):
            lanes[0] = lanes[0] + products[..., i]
    for i in range(head, end):
        lane = (i - head) % 4
        lanes[lane] = products[..., i] if lanes[lane] is None else lanes[lane] + products[..., i]
    if end == head:
        total = lanes[0] if head else torch.zeros(products.shape[:2])
    else:
        total = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
    for i in range(end, k):
        total = total + products[..., i]
    return total


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_the_lanes_kernel_sums_in_the_order_it_documents(threads):
    """``linear_f32_lanes.c`` against a torch emulation of its documented order (not MKL: that is the engine's check),
    for one to three rows, fixed heads of 0 to 5 and the two heads taken from the addresses, inputs past the lanes'
    last group of four, outputs past the last group, misaligned inputs and weights, and rows after a ``first``."""
    g = torch.Generator().manual_seed(3)
    with cpu_threads(threads):
        for n, k in ((37, 64), (16, 23), (9, 8), (3, 5)):
            for w_off in (0, 1, 2):
                w = torch.randn(n * k + 3, generator=g)[w_off:w_off + n * k].view(n, k)
                for rows in (1, 2, 3):
                    for x_off in (0, 1, 3):
                        x = torch.randn(rows * k + 3, generator=g)[x_off:x_off + rows * k].view(rows, k)
                        for head in (0, 1, 2, 3, 4, 5, -1, -2):
                            if head == -1:  # up to the first weight past the first at a 16-byte boundary: 1 to 4
                                fixed = 4 - (w.data_ptr() // 4) % 4
                            elif head == -2:  # up to the first input at a 16-byte boundary: 0 to 3
                                fixed = -(x.data_ptr() // 4) % 4
                            else:
                                fixed = head
                            if head < 0 and k % 4:
                                continue  # rows of x or of w aligned differently: not what the kernel is used for
                            got = cpu.f32_lanes_unchecked(x, w, head)
                            assert torch.equal(got, _lanes_reference(x, w, min(fixed, k))), (n, k, rows, head)
                # rows after `first`: the ones before are left alone
                x = torch.randn(5, k, generator=g)
                out = torch.full((5, n), 7.0)
                cpu.f32_lanes_unchecked(x, w, 2, out, 3)
                assert torch.equal(out[:3], torch.full((3, n), 7.0))
                assert torch.equal(out[3:], _lanes_reference(x[3:], w, 2))
        with pytest.raises(ValueError, match="4 rows"):
            cpu.f32_lanes_unchecked(torch.randn(4, 8), torch.randn(9, 8))
        # the same order for a product's last rows beside runs, on the weight laid out for linear_f32.c
        for n, k in ((37, 64), (16, 23), (40, 576)):
            w = torch.randn(n, k, generator=g)
            packed = cpu.f32_pack(w)
            for rows in (1, 4, 5, 6, 7, 9):
                for lanes in range(0, min(3, rows) + 1):
                    x_off = 1 if rows % 2 else 0
                    x = torch.randn(rows * k + 1, generator=g)[x_off:x_off + rows * k].view(rows, k)
                    runs = rows - lanes
                    for head in (0, 3, 4, -2):
                        got = cpu.f32_linear_unchecked(x, packed, n, 64, lanes, head)
                        if runs:
                            assert torch.equal(got[:runs], cpu.f32_linear_unchecked(x[:runs], packed, n, 64))
                        fixed = -(x[runs:].data_ptr() // 4) % 4 if head == -2 else head
                        assert torch.equal(got[runs:], _lanes_reference(x[runs:], w, min(fixed, k))), (n, k, rows)
            with pytest.raises(ValueError, match="4 rows in lanes"):  # refused in C, nothing written
                cpu.f32_linear_unchecked(torch.randn(5, k), packed, n, 64, 4)
            with pytest.raises(ValueError, match="head -1"):  # the weights' own alignment: not in the laid-out one
                cpu.f32_linear_unchecked(torch.randn(5, k), packed, n, 64, 1, -1)


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_a_float32_linear_stays_mkls_product_on_inputs_and_weights_at_any_alignment(threads, monkeypatch):
    """MKL's kernels for a few rows start their lanes where the inputs' or the weights' addresses say (found on an
    AVX2-only AMD EPYC): a row count checked on one alignment must still give ``F.linear``'s bits on inputs and
    weights at every other alignment of a float."""
    monkeypatch.setattr(layers, "_f32_runs", {})
    monkeypatch.setattr(layers, "_f32_rows", {})
    g = torch.Generator().manual_seed(4)
    with torch.no_grad(), cpu_threads(threads):
        for n, k in ((192, 576), (64, 96)):
            for w_off in (0, 1, 2, 3):
                layer = torch.nn.Linear(k, n, bias=False)
                weight = torch.randn(n * k + 4, generator=g)[w_off:w_off + n * k].view(n, k)
                layer.weight = torch.nn.Parameter(weight, requires_grad=False)
                layers._give_f32_forward(layer)
                for rows in range(1, 12):
                    for x_off in (0, 1, 2, 3):
                        x = torch.randn(rows * k + 4, generator=g)[x_off:x_off + rows * k].view(rows, k)
                        assert torch.equal(layer(x), F.linear(x, weight)), (n, k, w_off, rows, x_off)


@needs_c
def test_float32_products_of_a_few_rows_run_in_lanes_where_mkl_sums_so(monkeypatch):
    """On a CPU where MKL sums products of one to three rows in four lanes (an AVX2-only AMD EPYC), the engine's
    float32 layers run them in C: a server decoding one to three sequences reads its weights at the C product's
    speed, not MKL's small-product kernels'. Where MKL sums otherwise, they stay F.linear's."""
    monkeypatch.setattr(layers, "_f32_rows", {})
    g = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(576, 192, bias=False)
    layers._give_f32_forward(layer)
    in_lanes = []
    with torch.no_grad(), cpu_threads(1):
        for rows in (1, 2, 3):
            y = torch.randn(rows, 576, generator=g)
            mkl_lanes = any(torch.equal(cpu.f32_lanes_unchecked(y, layer.weight, head), F.linear(y, layer.weight))
                            for head in ((-2, -1) if rows == 1 else (-2,)))
            layer(y)  # checked
            plan = layers._f32_rows[(192, 576, 1, rows)]
            assert (plan != () and plan[1] == 0) == mkl_lanes, rows  # every row in lanes exactly where MKL's are
            assert ("kvpaging::cpu_linear_f32" in ops_called(lambda: layer(y))) == mkl_lanes, rows
            in_lanes.append(mkl_lanes)
        if not any(in_lanes):
            pytest.skip("MKL does not sum float32 products of one to three rows in four lanes here")
    assert layer._f32.weight is None  # no layout: the lanes read the weight as it is


@needs_c
def test_float32_linears_on_one_weight_share_its_layout_and_a_weight_written_in_place_is_laid_out_again():
    """Engines made on one model share its weight tensors, and so the C product's layout of each; a weight written
    in place since gets a new one, and the layers' products stay F.linear's either way."""
    weight = torch.nn.Parameter(torch.randn(64, 96))
    first, second = torch.nn.Linear(96, 64, bias=False), torch.nn.Linear(96, 64, bias=False)
    first.weight = second.weight = weight
    for layer in (first, second):
        layers._give_f32_forward(layer)
    x = torch.randn(16, 96)
    with torch.no_grad():
        layout = layers._f32_layout(weight)
        assert layers._f32_layout(weight) is layout  # one layout of one weight tensor, while someone holds it
        assert torch.equal(layout.view(4, 96, 16)[1, :, 3], weight[16 + 3])  # block 1, output 3, input by input
        assert torch.equal(first(x), F.linear(x, weight)) and torch.equal(second(x), F.linear(x, weight))
        weight.mul_(2)
        assert layers._f32_layout(weight) is not layout  # written in place: laid out again
        assert torch.equal(first(x), F.linear(x, weight)) and torch.equal(second(x), F.linear(x, weight))
