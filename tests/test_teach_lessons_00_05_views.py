"""Helpers that keep the cells of lessons 00-05 short (issue 14): tables, figures and runs moved out of the notebooks
into kvpaging.teach.roofline, .sharing and .kv_math."""

from __future__ import annotations

import pytest
import torch

from kvpaging import LLM
from kvpaging.models import load_config, tiny
from kvpaging.teach import roofline
from kvpaging.teach.kv_math import tensor_parallel_demo
from kvpaging.teach.sharing import (
    GRPOStepMemory,
    PrefixRequest,
    SharingRun,
    grpo_memory_figure,
    peak_blocks_figure,
    rollouts,
    ttft_figure,
)


def test_roofline_table_reads_the_roof():
    roof = roofline.DeviceRoof("cpu", torch.float32, peak_flops=100e9, bandwidth=10e9)  # ridge 10 FLOP/byte
    cfg = load_config("Qwen3-0.6B")
    pre, dec = roofline.prefill_cost(cfg, 128), roofline.decode_cost(cfg, 128)
    table = roofline.roofline_table(roof, [("prefill 128", pre, 2.0), ("decode x1", dec, 0.5)])
    header, row_pre, row_dec = table.splitlines()
    assert header.split()[:3] == ["step", "FLOP/byte", "bound"]
    assert len({len(line) for line in table.splitlines()}) == 1, "columns are aligned"
    assert row_pre.startswith("prefill 128") and " compute " in row_pre
    assert row_dec.startswith("decode x1") and " memory " in row_dec
    assert f"{dec.intensity:.2f}" in row_dec
    assert f"{roof.time_at_best(dec) * 1e3:.2f} ms" in row_dec and "500.00 ms" in row_dec
    assert row_dec.endswith(f"{dec.flops / 0.5 / 100e9:.1%} of peak")


def _run(n, used, tables):
    return SharingRun(n, True, used, tables, tables, tables - used, n - 1, [], [])


def test_peak_blocks_figure_has_both_bars_per_n():
    fig = peak_blocks_figure({8: _run(8, 33, 80), 16: _run(16, 58, 160)})
    unshared, shared = fig.data
    assert list(unshared.x) == list(shared.x) == ["n = 8", "n = 16"]
    assert list(unshared.y) == [80, 160] and list(shared.y) == [33, 58]
    assert fig.layout.barmode == "group"


def test_grpo_memory_figure_plots_the_measured_peaks():
    rows = [GRPOStepMemory(1, 26, 26, 26, 26), GRPOStepMemory(4, 56, 104, 56, 104)]
    fig = grpo_memory_figure(rows, num_prompts=2)
    assert [t.name for t in fig.data] == ["unshared", "shared"]
    assert list(fig.data[0].y) == [26, 104] and list(fig.data[1].y) == [26, 56]
    assert list(fig.data[0].x) == [1, 4] and fig.layout.xaxis.type == "log"
    assert "2 prompts" in fig.layout.title.text


def test_ttft_figure_in_milliseconds():
    def req(seconds):
        return PrefixRequest(10, 10, 0, 10, seconds, "", None)

    fig = ttft_figure([req(0.010), req(0.002)], [req(0.010), req(0.009)])
    off, on = fig.data
    assert (off.name, on.name) == ("prefix caching off", "prefix caching on")
    assert list(off.y) == pytest.approx([10.0, 9.0]) and list(on.y) == pytest.approx([10.0, 2.0])


def test_rollouts_as_separate_requests_with_the_prefix_cache_on():
    """Separate requests share through the prefix cache only once a prompt's blocks are computed: with a step
    budget of one prompt, every later request finds the prompt's full blocks, and samples what it did without."""
    model = tiny("qwen3", num_hidden_layers=1)

    def make(enable_prefix_caching=True):
        return LLM(model, block_size=16, num_blocks=64, max_model_len=256, max_num_batched_tokens=40, seed=0,
                   enable_prefix_caching=enable_prefix_caching)

    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks and a partly filled one
    plain = rollouts(make, prompt, 3, False, max_tokens=4)
    cached = rollouts(make, prompt, 3, False, max_tokens=4, prefix_caching=True)
    assert plain.prefix_hit_tokens == 0
    assert cached.prefix_hit_tokens == 2 * 32  # the two later requests reuse 2 full blocks each
    assert cached.outputs == plain.outputs
    assert cached.peak_used_blocks < plain.peak_used_blocks
    assert 0 <= cached.step_of_peak < len(cached.trace) and 0 <= plain.step_of_peak < len(plain.trace)


def test_tensor_parallel_demo_splits_the_heads_and_doubles_the_blocks():
    threads = torch.get_num_threads()
    budget = 1 << 20
    demo = tensor_parallel_demo(tiny("llama"), budget, [[5, 6, 7, 8, 9], list(range(20, 47))], max_tokens=4)
    assert torch.get_num_threads() == threads, "the caller's thread count is restored"
    assert demo.same_tokens and [len(o) for o in demo.outputs] == [4, 4]
    assert demo.kv_heads == (2, 1)  # tiny llama: 2 KV heads, one per rank
    assert demo.blocks[1] == 2 * demo.blocks[0]
    assert demo.key_cache_shapes[1][0] == demo.blocks[1]
    assert len(demo.rank_kv_cache_bytes) == 2 and all(b <= budget for b in demo.rank_kv_cache_bytes)
