"""The C kernels that a decode step's norms, gated MLPs and greedy pick run on (``kernels/cpu/rms_norm.c``,
``silu_mul.c``, ``argmax.c``), against the torch code they stand in for: every element, every index, to the bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpaging import SamplingParams
from kvpaging.kernels import cpu
from kvpaging.worker import sampler as sampler_module
from kvpaging.worker.sampler import Sampler

needs_c = pytest.mark.skipif(not cpu.available(), reason="the C kernels cannot be built here")


def found_lanes() -> int:
    return cpu._mean_lanes if cpu._mean_lanes is not None else cpu._find_mean_lanes()


@needs_c
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="only x86 vector widths are known to match")
def test_the_c_mean_finds_torchs_order_here_and_no_other_width_passes_the_probe():
    """On an x86 CPU torch sums float32 rows in 8 or 16 lanes; the probe finds which, and the others fail it (so the
    probe can tell orders apart: a width it accepts is not a guess)."""
    lanes = found_lanes()
    assert lanes in (8, 16)
    for other in (16, 8, 4):
        if other != lanes:
            assert not cpu._same_norms(other), other


@needs_c
@pytest.mark.parametrize("mean", ["in C", "torch's"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_sum_and_norm_in_one_call_are_torchs_to_the_bit(dtype, mean, monkeypatch):
    """``add_rms_norm(residual, y, ...)`` is ``h = residual + y`` and transformers' RMSNorm of ``h``: both outputs, every
    element, over widths that cross the cascade of torch's sums (16 and 256 groups of vectors) and odd tails."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    lanes = found_lanes()
    if mean == "in C" and not lanes:
        pytest.skip("rms_norm.c's sums are not torch's here")
    monkeypatch.setattr(cpu, "_mean_lanes", lanes if mean == "in C" else 0)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for dim, rows in itertools.product((16, 33, 576, 1088, 4099, 16448, 70001), (1, 3)):
            norm = LlamaRMSNorm(dim, eps=1e-5).to(dtype)
            norm.weight.copy_(torch.randn(dim, generator=g))
            residual = (torch.randn(1, rows, dim, generator=g) * 3).to(dtype)
            y = torch.randn(1, rows, dim, generator=g).to(dtype)
            hidden, normed = cpu.add_rms_norm(residual, y, norm.weight, norm.variance_epsilon)
            assert torch.equal(hidden, residual + y), (dim, rows)
            assert torch.equal(normed, norm(residual + y)), (dim, rows)
            assert torch.equal(cpu.rms_norm(residual, norm.weight, norm.variance_epsilon), norm(residual)), (dim, rows)


@needs_c
def test_add_rms_norm_refuses_what_it_cannot_serve():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="y torch.bfloat16"):
        cpu.add_rms_norm(x, x.bfloat16(), w, 1e-6)
    with pytest.raises(ValueError, match=r"one shape .* got residual \(2, 8\), y \(1, 8\)"):
        cpu.add_rms_norm(x, x[:1], w, 1e-6)
    with pytest.raises(ValueError, match=r"weight of shape \(8,\), got .* weight \(4,\)"):
        cpu.add_rms_norm(x, x, torch.randn(4), 1e-6)


def same_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element the same bits, but where both are NaN (torch's own loops give a NaN different payloads)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_then_product_in_one_pass_is_torchs_to_the_bit(threads, monkeypatch):
    """``silu_mul(gate, up)`` is ``silu(gate) * up`` in bfloat16: every element, as halves of one fused product's
    output and as tensors of their own, over row counts a decode step and a prompt chunk have, with infinities,
    NaNs, signed zeros, subnormals and the largest numbers among the inputs (NaN results: NaN both ways)."""
    assert cpu.silu_table() is not None  # torch's vectorized and scalar SiLU agree on every bfloat16 number here
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the kernel is told to share rows among
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 1e-40, -1e-40, 3.3e38, -3.3e38,
                            88.0, -88.0, 1e-3]).bfloat16()
    for rows, cols in ((1, 1536), (3, 96), (48, 1536), (300, 1536), (7, 33)):
        both = (torch.randn(1, rows, 2 * cols, generator=g) * 6).bfloat16()
        flat = both.view(-1)
        flat[torch.randint(0, flat.numel(), (40,), generator=g)] = special[torch.randint(0, len(special), (40,),
                                                                                         generator=g)]
        gate, up = both[..., :cols], both[..., cols:]
        want = torch.nn.functional.silu(gate) * up
        assert same_or_both_nan(cpu.silu_mul(gate, up), want), (rows, cols)
        assert same_or_both_nan(cpu.silu_mul(gate.contiguous(), up.contiguous()), want), (rows, cols)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)  # each number once
    assert same_or_both_nan(cpu.silu_mul(every, torch.ones_like(every)), torch.nn.functional.silu(every))


@needs_c
def test_silu_mul_refuses_what_it_cannot_compute():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="bfloat16 CPU tensors, got gate torch.float32"):
        cpu.silu_mul(x, x)
    x = x.bfloat16()
    with pytest.raises(ValueError, match=r"one shape \[..., cols\].* got gate \(2, 8\) .* up \(1, 8\)"):
        cpu.silu_mul(x, x[:1])
    with pytest.raises(ValueError, match="each row contiguous"):
        cpu.silu_mul(x.t(), x.t())


def logits_with_ties_nans_and_infinities(g: torch.Generator, rows: int, cols: int, case: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g)
    if case % 3 == 0:
        x = x.round()  # many ties for the maximum
    if case % 5 == 0:
        x[torch.rand(rows, cols, generator=g) < 0.05] = float("nan")
    if case % 7 == 0:
        x[torch.rand(rows, cols, generator=g) < 0.3] = float("-inf")
    if case % 11 == 0:  # zeros of both signs as the maximum
        x = torch.where(torch.rand(rows, cols, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0)) - (x > 0).float()
    return x


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_greedy_pick_is_torch_max_indices_ties_nans_and_signed_zeros_alike(dtype):
    g = torch.Generator().manual_seed(2)
    for case in range(120):
        rows, cols = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(1, 300, (), generator=g))
        x = logits_with_ties_nans_and_infinities(g, rows, cols, case).to(dtype)
        assert torch.equal(cpu.argmax_rows(x), x.float().max(dim=-1).indices), case
    wide = torch.randn(48, 49152, generator=g).to(dtype)  # the trained model's vocabulary: rows split among threads
    assert torch.equal(cpu.argmax_rows(wide), wide.float().max(dim=-1).indices)
    assert torch.equal(cpu.argmax_rows(wide[:, :1000]), wide[:, :1000].float().max(dim=-1).indices)  # rows apart


@needs_c
def test_the_c_greedy_pick_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="got torch.int64"):
        cpu.argmax_rows(torch.arange(6).view(2, 3))
    with pytest.raises(ValueError, match=r"got shape \(6,\)"):
        cpu.argmax_rows(torch.randn(6))
    with pytest.raises(ValueError, match=r"shape \(4, 3\) with strides \(1, 4\)"):
        cpu.argmax_rows(torch.randn(3, 4).t())


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_picks_greedy_rows_in_c_only_when_nothing_else_is_asked(dtype, monkeypatch):
    calls = []
    real = sampler_module.argmax_rows
    monkeypatch.setattr(sampler_module, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    g = torch.Generator().manual_seed(3)
    logits = logits_with_ties_nans_and_infinities(g, 6, 500, 3).to(dtype)
    greedy = [SamplingParams(temperature=0.0)] * 6
    out = Sampler()(logits, greedy)
    assert calls == [(6, 500)]
    assert out.token_ids == logits.float().max(dim=-1).indices.tolist()
    for other in (SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
                  SamplingParams(temperature=0.8, seed=1)):
        calls.clear()
        Sampler()(logits, greedy[:5] + [other])
        assert calls == [], other
