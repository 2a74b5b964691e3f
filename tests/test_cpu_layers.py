"""Faster CPU layers inside engine steps (kvpaging/cpu_layers.py): oneDNN linears, one-pass RMSNorms.

The engine's tokens with these layers are checked against transformers'
``generate()`` by test_engine_vs_transformers.py (they are the default on a
CPU). Here: which modules get the step-gated forward, that it is the fast path
inside a step and exactly the layer's own code outside one, that RMSNorm
variants with other maths are left alone, and the switch that turns it off.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvpaging import LLM, cpu_layers
from kvpaging.kernels import cpu_backend
from kvpaging.models import tiny

needs_onednn = pytest.mark.skipif(not cpu_layers.onednn_usable(), reason="torch has no usable oneDNN linear here")
needs_c = pytest.mark.skipif(not cpu_backend.available(), reason="the C kernels cannot be built here")


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_onednn
@needs_c
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_engine_patches_every_float32_linear_and_rms_norm(arch):
    model = tiny(arch, seed=0)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    layers = model.config.num_hidden_layers
    # qwen3 normalizes queries and keys per head too: 4 norms a layer, llama 2; plus the final norm
    assert len(norms) == (4 if arch == "qwen3" else 2) * layers + 1
    llm = LLM(model, num_blocks=16, max_model_len=64)
    assert llm.engine.runner.cpu_layers == cpu_layers.CpuLayers(len(linears), len(norms))
    assert len(linears) == 7 * layers + 1
    assert all(getattr(m.forward, "kvpaging_fast_path", False) for m in linears + norms)
    # a second engine on the same model patches nothing twice
    assert LLM(model, num_blocks=16, max_model_len=64).engine.runner.cpu_layers == llm.engine.runner.cpu_layers


@needs_onednn
def test_onednn_inside_a_step_and_exactly_f_linear_outside():
    layer = torch.nn.Linear(256, 256)
    assert cpu_layers.enable_cpu_layers(layer).linears == 1
    rows = cpu_layers.MIN_MACS // (256 * 256)  # the smallest product that goes to oneDNN
    many, few = torch.randn(1, rows, 256), torch.randn(1, rows - 1, 256)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in ops_called(lambda: layer(many))
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
        with cpu_layers.engine_step():
            assert "mkldnn::_linear_pointwise" in ops_called(lambda: layer(many))
            torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert "mkldnn::_linear_pointwise" not in ops_called(lambda: layer(few)), "small products stay on F.linear"
            assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))


@needs_c
def test_rms_norm_is_one_c_pass_inside_a_step_and_its_own_code_outside():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64)
    reference = copy.deepcopy(norm)  # the layer's own code, untouched
    assert cpu_layers.enable_cpu_layers(norm).rms_norms == 1
    x = torch.randn(2, 9, 64) * 4
    with torch.inference_mode():
        outside = ops_called(lambda: norm(x))
        assert "aten::rsqrt" in outside
        assert torch.equal(norm(x), reference(x))
        with cpu_layers.engine_step():
            inside = ops_called(lambda: norm(x))
            assert "aten::rsqrt" not in inside and "aten::pow" not in inside
            torch.testing.assert_close(norm(x), reference(x), rtol=1e-5, atol=1e-6)
            strided = x.transpose(0, 1)  # not contiguous: the layer's own code
            assert torch.equal(norm(strided), reference(strided))


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
    assert cpu_layers.enable_cpu_layers(norm).rms_norms == 0
    assert "forward" not in vars(norm)


def test_generate_on_a_served_model_is_unchanged():
    model = tiny("qwen3", seed=0)
    twin = copy.deepcopy(model)
    LLM(model, num_blocks=16, max_model_len=64)  # patches model's layers, not twin's
    ids = torch.tensor([[5, 9, 2, 7] * 5])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)


@needs_onednn
def test_other_modules_and_dtypes_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyLinear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert cpu_layers.enable_cpu_layers(model).linears == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])


def test_the_environment_switch_turns_it_off():
    code = """
        from kvpaging import LLM
        from kvpaging.cpu_layers import CpuLayers
        from kvpaging.models import tiny
        llm = LLM(tiny("qwen3", seed=0), num_blocks=16, max_model_len=64)
        assert llm.engine.runner.cpu_layers == CpuLayers(), llm.engine.runner.cpu_layers
        assert not any("forward" in vars(m) for m in llm.engine.runner.model.modules())
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, cpu_layers.ENV_SWITCH: "0"}, timeout=120)
    assert done.returncode == 0, done.stderr


@needs_c
def test_c_rms_norm_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="float32 CPU tensors, got x torch.bfloat16"):
        cpu_backend.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"weight of shape \(8,\), got weight \(4,\)"):
        cpu_backend.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous x"):
        cpu_backend.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-6)


@needs_onednn
def test_an_engine_built_with_the_switch_off_runs_the_plain_layers(monkeypatch):
    """Even on a model another engine has patched: the switch is the engine's, not the model's."""
    from kvpaging import SamplingParams

    model = tiny("qwen3", seed=0)
    fast = LLM(model, num_blocks=16, max_model_len=64)
    monkeypatch.setenv(cpu_layers.ENV_SWITCH, "0")
    plain = LLM(model, num_blocks=16, max_model_len=64)
    assert plain.engine.runner.cpu_layers == cpu_layers.CpuLayers()
    prompts = [[5, 9, 2, 7] * 8] * 2
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert "mkldnn::_linear_pointwise" in ops_called(lambda: fast.generate(prompts, params, use_tqdm=False))
    assert "mkldnn::_linear_pointwise" not in ops_called(lambda: plain.generate(prompts, params, use_tqdm=False))
