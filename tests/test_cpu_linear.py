"""oneDNN linear layers inside engine steps (kvpaging/cpu_linear.py).

The engine's tokens with oneDNN linears are checked against transformers'
``generate()`` by test_engine_vs_transformers.py (it is the default on a CPU).
Here: which modules get the step-gated forward, that it is oneDNN's op inside
a step and exactly ``F.linear`` outside one, and the switches that turn it off.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvpaging import LLM, cpu_linear
from kvpaging.models import tiny

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_usable(), reason="torch has no usable oneDNN linear here")


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_the_engine_patches_every_float32_linear_of_the_model():
    model = tiny("qwen3", seed=0)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    llm = LLM(model, num_blocks=16, max_model_len=64)
    assert llm.engine.runner.onednn_linears == len(linears) == 7 * model.config.num_hidden_layers + 1
    assert all(getattr(m.forward, "kvpaging_onednn", False) for m in linears)
    # a second engine on the same model patches nothing twice
    assert LLM(model, num_blocks=16, max_model_len=64).engine.runner.onednn_linears == len(linears)


def test_onednn_inside_a_step_and_exactly_f_linear_outside():
    layer = torch.nn.Linear(256, 256)
    assert cpu_linear.enable_onednn_linears(layer) == 1
    rows = cpu_linear.MIN_MACS // (256 * 256)  # the smallest product that goes to oneDNN
    many, few = torch.randn(1, rows, 256), torch.randn(1, rows - 1, 256)
    with torch.inference_mode():
        outside = ops_called(lambda: layer(many))
        assert "mkldnn::_linear_pointwise" not in outside
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
        with cpu_linear.use_onednn():
            inside = ops_called(lambda: layer(many))
            assert "mkldnn::_linear_pointwise" in inside
            torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            assert "mkldnn::_linear_pointwise" not in ops_called(lambda: layer(few)), "small products stay on F.linear"
            assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))


def test_generate_on_a_served_model_is_unchanged():
    model = tiny("llama", seed=0)
    twin = copy.deepcopy(model)
    LLM(model, num_blocks=16, max_model_len=64)  # patches model's linears, not twin's
    ids = torch.tensor([[5, 9, 2, 7] * 5])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)


def test_other_modules_and_dtypes_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyLinear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert cpu_linear.enable_onednn_linears(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])


def test_the_environment_switch_turns_it_off():
    code = """
        from kvpaging import LLM
        from kvpaging.models import tiny
        llm = LLM(tiny("qwen3", seed=0), num_blocks=16, max_model_len=64)
        assert llm.engine.runner.onednn_linears == 0
        assert not any("forward" in vars(m) for m in llm.engine.runner.model.modules())
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**__import__("os").environ, cpu_linear.ENV_SWITCH: "0"}, timeout=120)
    assert done.returncode == 0, done.stderr
