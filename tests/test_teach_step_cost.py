"""The step-cost curve of lesson 06 (kvpaging/teach/step_cost.py): the GPU model against hand arithmetic, the
curve's reading, the CPU-flag check, and a measured curve on a tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from kvpaging.models import tiny
from kvpaging.teach.step_cost import (GPU, GPUS, StepCurve, bf16_matrix_units, gpu_step_curve, measure_step_curve,
                                      predicted_speedup, step_curve_figure, step_curve_table)

# A Llama-shaped config: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 1000.
CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False}


def _by_hand(batch: int, context: int, gpu: GPU) -> float:
    """The roofline's best case of one bf16 decode step, counted here from the config's shapes."""
    per_layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128  # q, k, v, o projections and a gated MLP
    lm_head = 64 * 1000
    weight_bytes = 2 * (2 * per_layer + lm_head)  # bf16; of the embedding only the batch's rows: left out
    kv_per_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 heads of 16, 2 bytes
    bytes_moved = weight_bytes + kv_per_token * (context + 1) * batch
    flops = 2 * (2 * per_layer) * batch + 2 * lm_head * batch + 4 * 4 * 16 * (context + 1) * 2 * batch
    return max(flops / gpu.peak_flops, bytes_moved / gpu.bandwidth)


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.name)
def test_gpu_model_is_the_roofline_best_case_counted_by_hand(gpu):
    curve = gpu_step_curve(CONFIG, gpu, batches=(1, 8, 64), context_len=16)
    assert not curve.measured and "model" in curve.label
    for batch, seconds in zip(curve.batches, curve.seconds):
        assert seconds == pytest.approx(_by_hand(batch, 16, gpu), rel=0.02)


def test_a_decode_step_of_the_trained_models_shape_is_flat_on_every_gpu():
    """SmolLM2-135M's shape: 64 sequences cost barely more than one on every GPU (bound by its weights' bytes),
    and the H200's step is the H100's times their bandwidth ratio."""
    smollm2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    curves = {g.name: gpu_step_curve(smollm2, g, batches=(1, 64)) for g in GPUS}
    assert all(c.regime() == "flat" for c in curves.values())
    h100, h200 = curves["H100 SXM"], curves["H200"]
    assert h100.seconds[0] / h200.seconds[0] == pytest.approx(4.8 / 3.35, rel=1e-6)


def test_reading_the_curve():
    curve = StepCurve("x", (1, 4, 16), (1.0, 2.0, 8.0), True)
    assert curve.at(1) == 1.0 and curve.at(0.5) == 1.0
    assert curve.at(2.5) == pytest.approx(1.5) and curve.at(10) == pytest.approx(5.0)
    assert curve.at(28) == pytest.approx(8.0 + 0.5 * 12)  # past the last batch, along the last segment's slope
    assert StepCurve("dip", (1, 2, 4), (1.0, 3.0, 2.0), True).at(8) == 2.0  # a falling last segment: flat
    assert curve.growth(16) == 8.0 and curve.regime() == "climbing"
    assert StepCurve("y", (1, 64), (1.0, 1.4), False).regime() == "flat"


def test_predicted_speedup_sums_the_curve_over_each_runs_steps():
    from types import SimpleNamespace

    def run(*steps):  # each step: the tokens its scheduled entries computed; every decode token is useful
        trace = [SimpleNamespace(scheduled=[SimpleNamespace(num_tokens=n) for n in step]) for step in steps]
        return SimpleNamespace(trace=trace, useful_tokens=sum(n for step in steps for n in step if n == 1))

    flat = StepCurve("flat", (1, 8), (1.0, 1.0), False)
    climbing = StepCurve("climbing", (1, 8), (1.0, 8.0), True)
    static = run([1, 1, 1, 1], [1], [1], [1])  # a batch of 4 draining to 1: 7 tokens in 4 steps
    continuous = run([1, 1, 1, 1], [1, 1, 1])  # the slot refilled: 7 tokens in 2 steps
    assert predicted_speedup(flat, static, continuous) == pytest.approx(2.0)  # a flat curve: the gain in steps
    # on the climbing curve a step costs its tokens: 7 tokens cost 7 either way, the gain in steps is eaten
    assert predicted_speedup(climbing, static, continuous) == pytest.approx(1.0)
    # a bent curve (flat to 2 sequences, then climbing): the static run's three steps of one sequence are cheap, and
    # reading the curve at each run's mean batch (1.75 and 3.5) would say 2 * 1.0 / 1.75, not this
    bent = StepCurve("bent", (1, 2, 4), (1.0, 1.0, 2.0), True)
    assert predicted_speedup(bent, static, continuous) == pytest.approx((2.0 + 3 * 1.0) / (2.0 + 1.5))
    # a prompt chunk costs what the curve says for its tokens
    assert predicted_speedup(climbing, run([12], [1]), run([1])) == pytest.approx((12.0 + 1.0) / 1.0)


def test_bf16_matrix_units_from_cpu_flags(tmp_path):
    def units(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        return bf16_matrix_units(str(path))

    assert units("fpu sse avx2 avx512f amx_bf16 amx_tile avx512_bf16") == "AMX"
    assert units("fpu sse avx2 avx512f avx512_bf16") == "AVX-512 BF16"
    assert units("fpu sse avx2") is None
    assert bf16_matrix_units(str(tmp_path / "missing")) is None


def test_measured_curve_on_a_tiny_model_leaves_the_model_alone():
    model = tiny("llama")
    before = copy.deepcopy(model.state_dict())
    curve = measure_step_curve(model, batches=(2, 1), context_len=8, decode_steps=3)
    assert curve.measured and curve.batches == (1, 2) and all(s > 0 for s in curve.seconds)
    assert "float32" in curve.label
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    table = step_curve_table([curve, gpu_step_curve(model.config, GPUS[0], batches=(1, 2))])
    assert "batch 1" in table and "H100 SXM (model)" in table
    fig = step_curve_figure([curve])
    assert fig.data[0].y[0] == 1.0
