"""The helpers behind lessons 08-10 (kvpaging.teach.graphs / fp8 / serving), and the saved notebooks' size."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from kvpaging import LLM, SamplingParams, kv_bytes_per_token
from kvpaging.kernels.fp8 import FP8_MAX
from kvpaging.models import tiny
from kvpaging.teach import fp8, graphs, serving

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(num_hidden_layers=2, vocab_size=512)


@pytest.fixture(scope="module")
def llm():
    # the model's own layers, as lesson 08 counts them: a C product (a float32 linear's, on the CPU) is no operator
    return LLM(tiny("qwen3", **SMALL), max_model_len=128, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 20,
               cpu_fast_layers=False)


# ------------------------------------------------------------------ graphs


def test_decode_step_launches_do_not_depend_on_batch(llm):
    counts = [graphs.count_decode_step_ops(llm, b, prompt_len=8) for b in (1, 4)]
    assert counts[0].launches == counts[1].launches > 50
    assert counts[0].total >= counts[0].launches
    assert sum(counts[0].by_name.values()) == counts[0].launches
    assert "linear" in counts[0].by_name or "mm" in counts[0].by_name or "addmm" in counts[0].by_name
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.stats().num_used_blocks == 0


def test_more_layers_more_launches():
    a, b = (LLM(tiny("qwen3", num_hidden_layers=n, vocab_size=512), max_model_len=64, kv_cache_memory_bytes=1 << 20,
                cpu_fast_layers=False) for n in (1, 3))  # the model's own layers (the fixture's note)
    la, lb = (graphs.count_decode_step_ops(x, 2, prompt_len=4).launches for x in (a, b))
    assert lb > la and (lb - la) % 2 == 0  # each layer adds the same number


def test_decode_step_ms_and_dispatch(llm):
    assert graphs.decode_step_ms(llm, 2, prompt_len=8, tokens=4, repeats=1) > 0
    assert 0 < graphs.dispatch_overhead_us(repeats=50) < 1e4
    assert not llm.engine.keep_trace


def test_read_results_table_markers(tmp_path):
    p = tmp_path / "RESULTS.md"
    assert graphs.read_results_table(p) is None  # no file: nothing measured
    p.write_text("# Results\n\n## Throughput\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert graphs.read_results_table(p) is None  # no CUDA graphs table
    p.write_text(
        "# Results\n<!-- results:cuda_graphs -->\n- device: NVIDIA H200\n- date: 2025-01-31\n"
        "- command: `python benchmarks/cuda_graphs.py --batches 1 8`\n\n"
        "| batch | eager ms/step | graphs ms/step | speedup |\n|---|---|---|---|\n| 1 | 9.0 | 3.0 | 3.00x |\n"
        "| 8 | 10.0 | 4.0 | 2.50x |\n\n| other | table |\n|---|---|\n| x | y |\n<!-- /results:cuda_graphs -->\n")
    t = graphs.read_results_table(p)
    assert t.device == "NVIDIA H200" and t.date == "2025-01-31"
    assert t.command == "python benchmarks/cuda_graphs.py --batches 1 8"
    assert t.column("batch") == ["1", "8"] and t.column("speedup") == ["3.00x", "2.50x"]
    assert t.to_markdown().splitlines()[0] == "| batch | eager ms/step | graphs ms/step | speedup |"


def test_read_results_table_heading_fallback(tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("## CUDA graphs (enforce_eager)\ndevice: H100\n\n| batch | eager ms | graphs ms |\n|---|---|---|\n"
                 "| 1 | 5 | 2 |\n\n## FP8\n| x | y |\n|---|---|\n| 1 | 2 |\n")
    t = graphs.read_results_table(p)
    assert t.device == "H100" and t.date is None and t.rows == [["1", "5", "2"]]


def test_step_time_figure():
    fig = graphs.step_time_figure({"eager": {1: 2.0, 8: 4.0}})
    assert len(fig.data) == 2 and list(fig.data[1].y) == [2.0, 0.5]


# ------------------------------------------------------------------ fp8


@pytest.mark.parametrize("value,bits,stored", [
    (1.0, "0.0111.000", 1.0), (448.0, "0.1111.110", 448.0), (500.0, "0.1111.110", 448.0),
    (-2.0, "1.1000.000", -2.0), (0.1, "0.0011.101", 0.1015625),
])
def test_e4m3_fields(value, bits, stored):
    f = fp8.e4m3_fields(value)
    assert f["bits"] == bits and f["stored"] == stored


def test_e4m3_grid():
    v = fp8.e4m3_positive_values()
    assert v[0] == 0 and v[-1] == FP8_MAX and len(v) == 127
    assert bool((v[1:] > v[:-1]).all())
    gaps = (v[2:] - v[1:-1]) / v[1:-1]
    normal = v[1:-1] >= 2 ** -6
    assert float(gaps[normal].max()) == pytest.approx(1 / 8) and float(gaps[normal].min()) == pytest.approx(1 / 15)
    assert len(fp8.grid_figure().data) == 2


def test_round_trip_table():
    rows = fp8.round_trip_table([1.0, 3.3, 500.0], scale=1.0)
    assert [r["stored e4m3"] for r in rows] == [1.0, 3.25, 448.0]
    assert [r["saturated"] for r in rows] == [False, False, True]
    rows = fp8.round_trip_table([0.5], scale=0.5 / FP8_MAX)
    assert rows[0]["rel error"] < 1e-6  # amax lands exactly on 448


def test_pool_capacity_fp8_quarter_of_float32():
    model = tiny("qwen3", **SMALL)
    budget = kv_bytes_per_token(model.config, torch.float32) * 32 * 3
    a = fp8.measure_pool_capacity(model, budget, 32, "auto")
    q = fp8.measure_pool_capacity(model, budget, 32, "fp8")
    assert (a.num_blocks, a.capacity, a.peak_running, a.num_preemptions) == (6, 3, 3, 0)
    assert (q.num_blocks, q.capacity, q.peak_running, q.num_preemptions) == (24, 12, 12, 0)
    assert a.bytes_per_element == 4 and q.bytes_per_element == 1 and q.element_dtype == "float8_e4m3fn"
    assert a.pool_bytes == q.pool_bytes == budget


def test_pool_capacity_of_a_bf16_copy_is_real_and_leaves_the_model_alone():
    model = tiny("qwen3", **SMALL)
    budget = kv_bytes_per_token(model.config, torch.float32) * 32 * 3
    b = fp8.measure_pool_capacity(model, budget, 32, "auto", dtype=torch.bfloat16)
    assert b.element_dtype == "bfloat16" and b.bytes_per_element == 2
    assert (b.num_blocks, b.capacity, b.peak_running, b.num_preemptions) == (12, 6, 6, 0)
    assert next(model.parameters()).dtype == torch.float32  # the engine served its own converted copy


def test_scale_spread_reads_ratios_of_amax():
    k = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 3.0])]
    v = [torch.tensor([0.5, 0.5]), torch.tensor([8.0, 2.0])]
    scales = [(kk / FP8_MAX, vv / FP8_MAX) for kk, vv in zip(k, v)]
    s = fp8.scale_spread(scales)
    assert (s["layers"], s["kv_heads"]) == (2, 2)
    assert s["k_within_layer"] == pytest.approx(2.0) and s["k_within_layer_layer"] == 0
    assert s["v_within_layer"] == pytest.approx(4.0) and s["v_within_layer_layer"] == 1
    assert s["k_across_layers"] == pytest.approx(3.0) and s["v_across_layers"] == pytest.approx(16.0)
    assert s["v_amax"] == pytest.approx((0.5, 8.0))
    fig = fp8.scales_figure(scales, "t")
    assert len(fig.data) == 2 and fig.data[0].customdata[1][0] == pytest.approx(2.0)  # head 1 of layer 0, keys


def _attention_model(q_norm_gain: float):
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(q_norm_gain)
    return model


def test_attention_entropy_uniform_peaked_and_model_untouched():
    tokens = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    uniform = fp8.attention_entropy(_attention_model(0.0), tokens)  # q = 0: every score is 0, attention is uniform
    assert uniform.shape == (2,)
    torch.testing.assert_close(uniform, torch.ones(2), atol=1e-4, rtol=0)
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)
    plain = fp8.attention_entropy(model, tokens)
    peaked = fp8.attention_entropy(_attention_model(30.0), tokens)  # large scores: attention on a few tokens
    assert bool((plain > 0).all() and (plain < 1).all())
    assert bool((peaked < plain - 0.2).all())
    assert model.config._attn_implementation != "eager"  # the helper ran a private copy
    with pytest.raises(ValueError):
        fp8.attention_entropy(model, tokens[:10])
    assert len(fp8.attention_entropy_figure({"a": plain, "b": peaked}).data) == 2


def test_compare_engines_keeps_per_position_figures():
    from kvpaging.worker.kv_accuracy import compare_engines

    model = tiny("qwen3", **SMALL)
    seqs = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(3)).tolist()
    seqs[1] = seqs[1][:40]
    kw = dict(max_model_len=64, num_blocks=8)
    ref, q8 = LLM(model, **kw), LLM(model, kv_cache_dtype="fp8", **kw)
    acc = compare_engines(ref, q8, seqs, chunk_size=16, rows_at_once=7)  # rows_at_once cuts across chunks
    assert acc.positions == 88
    assert [k.numel() for k in acc.kl_per_sequence] == [48, 40]
    assert [t.dtype for t in acc.same_top1_per_sequence] == [torch.bool, torch.bool]
    assert 0.0 < acc.mean_kl < 1.0 and 0.0 < acc.reference_top1_prob <= 1.0
    rows = acc.by_position([0, 16, 40, 100])
    assert [(r["start"], r["stop"], r["positions"]) for r in rows] == [(0, 16, 32), (16, 40, 48), (40, 100, 8)]
    # the ranges pool every sequence: their weighted means give back the totals
    assert sum(r["mean_kl"] * r["positions"] for r in rows) / 88 == pytest.approx(acc.mean_kl, rel=1e-5)
    assert sum(r["top1_agreement"] * r["positions"] for r in rows) / 88 == pytest.approx(acc.top1_agreement)
    assert max(r["max_kl"] for r in rows) == pytest.approx(acc.max_kl)
    assert sum(r["reference_top1_prob"] * r["positions"] for r in rows) / 88 == pytest.approx(acc.reference_top1_prob,
                                                                                             rel=1e-5)
    assert [p.numel() for p in acc.reference_top1_prob_per_sequence] == [48, 40]
    assert [(r["start"], r["positions"]) for r in acc.by_position([40, 48, 60])] == [(40, 8)]  # empty ranges left out
    with pytest.raises(ValueError):
        acc.by_position([16, 0])
    same = compare_engines(ref, LLM(model, **kw), seqs[:1], chunk_size=16)
    assert same.top1_agreement == 1.0 and same.mean_kl == pytest.approx(0.0, abs=1e-6)
    assert ref.engine.block_manager.stats().num_used_blocks == 0


# ------------------------------------------------------------------ serving


def test_workload_is_deterministic():
    a = serving.make_workload(5, 100, (4, 8), (2, 3), seed=3)
    b = serving.make_workload(5, 100, (4, 8), (2, 3), seed=3)
    assert a == b and all(4 <= len(p) <= 8 and 2 <= n <= 3 for p, n in a.requests)
    assert all(3 <= t < 100 for p, _ in a.requests for t in p)
    assert a.num_output_tokens == sum(n for _, n in a.requests)


def test_compare_engines_counts_useful_tokens():
    work = serving.make_workload(4, 512, (4, 12), (2, 6), seed=0)
    build = lambda: tiny("qwen3", **SMALL)  # noqa: E731
    results = serving.compare_engines(build, work, progress=False,
                                      options={"transformers generate() (static)": {"batch_size": 2}})
    assert [r.name for r in results] == list(serving.ENGINES)
    assert [r.useful_tokens for r in results] == [work.num_output_tokens] * 3
    # each request's own count, in workload order (transformers' continuous batching finishes them out of order)
    assert [r.output_lengths for r in results] == [tuple(n for _, n in work.requests)] * 3
    assert all(r.tokens_per_s > 0 for r in results)
    table = serving.results_table(results)
    assert "1.00x" in [line for line in table.splitlines() if "(static)" in line][0]
    assert len(serving.throughput_figure(results).data) == 1


def test_token_positions_count_what_each_approach_computes():
    work = serving.Workload([([5] * 3, 2), ([6] * 5, 4), ([7] * 2, 1)])
    # continuous: 10 prompt tokens + each output token but the last fed back (1 + 3 + 0)
    # static, batches of 2: 2 rows x (5 padded prompt + 4 - 1 steps) + 1 row x (2 + 1 - 1)
    assert serving.token_positions(work, batch_size=2) == (14, 16 + 2)
    # ... and the continuous count is what the engine's steps really computed
    llm = LLM(tiny("qwen3", **SMALL), max_model_len=64, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 20)
    llm.engine.keep_trace, llm.engine.trace = True, []
    llm.generate([p for p, _ in work.requests], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in work.requests],
                 use_tqdm=False)
    assert sum(r.num_batched_tokens for r in llm.engine.trace) == 14
    # with natural stopping, the counts follow what each request really produced
    assert serving.token_positions(work, batch_size=2, output_lengths=[1, 2, 1]) == (10 + 0 + 1 + 0, 2 * 6 + 2)
    with pytest.raises(ValueError, match="2 output lengths for 3 requests"):
        serving.token_positions(work, batch_size=2, output_lengths=[1, 2])


def test_every_c_kernel_of_the_cpu_counts_where_its_work_belongs_in_the_time_breakdown():
    """Each C kernel's profiler name is counted as a product, attention, or the elementwise work it replaces: a kernel
    left out would have its time counted as Python and dispatch in lesson 10's breakdown."""
    from kvpaging.kernels import cpu

    names = {getattr(cpu, n) for n in dir(cpu) if n.endswith("PROFILER_NAME")}
    assert len(names) >= 8
    counted = serving._LINEAR_OPS | serving._ATTENTION_OPS | serving._C_LAYER_OPS
    assert names <= counted, sorted(names - counted)


def test_time_breakdown_profiles_a_full_recomputation():
    work = serving.make_workload(4, 512, (4, 12), (2, 6), seed=0)
    llm = LLM(tiny("qwen3", **SMALL), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    bd = serving.time_breakdown(llm, work)
    fresh = LLM(tiny("qwen3", **SMALL), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    fresh.generate([p for p, _ in work.requests], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in work.requests],
                   use_tqdm=False)
    assert bd.steps == fresh.engine.num_steps  # the prefix cache was reset: the profiled run recomputed every prompt
    assert bd.wall_s > 0 and bd.linear_s > 0 and bd.attention_s > 0 and bd.other_ops_s > 0 and bd.python_s >= 0
    assert len(bd.markdown().splitlines()) == 2 + len(bd.rows()) == 6


def test_static_breakdown_and_where_the_positions_come_from():
    """generate()'s profiled run split the same four ways, and each engine's positions traced to their causes: the
    rows add up to static's padded count and to what kvpaging's step records say it computed."""
    shared = list(range(40, 56))  # one 16-token prefix, then each request's own tokens
    work = serving.Workload([(shared + [60 + i] * (2 + i), n) for i, n in enumerate((2, 5, 3))], stop_at_eos=False)
    paged = serving.time_breakdown(LLM(tiny("qwen3", **SMALL), max_model_len=64, block_size=4,
                                       kv_cache_memory_bytes=1 << 20), work)
    static = serving.time_breakdown_static(tiny("qwen3", **SMALL), work, batch_size=2)
    assert static.output_lengths == paged.output_lengths == (2, 5, 3)
    assert static.positions == serving.token_positions(work, 2, static.output_lengths)[1]
    assert static.steps == 5 + 3 and static.linear_s > 0 and static.attention_s > 0 and static.python_s > 0
    assert static.profiled_wall_s >= static.linear_s + static.attention_s + static.other_ops_s
    causes = serving.position_causes(work, 2, paged.output_lengths, paged.positions)
    assert causes[-1] == ("token positions through the layers", static.positions, paged.positions)
    assert sum(a for _, a, _ in causes[:-1]) == static.positions and sum(b for _, _, b in causes[:-1]) == paged.positions
    # by hand: prompts 18, 19, 20 (57 tokens); batch 1 pads 18 -> 19, batch 2 alone; decodes 1 + 4 + 2; the first
    # batch's short row idles 3 steps; kvpaging finds 4 full blocks of the shared prefix for each later request
    assert causes[:5] == [("prompt tokens", 57, 57), ("padding: each prompt to its batch's longest", 1, 0),
                          ("decode positions: each answer's tokens but its last", 7, 7),
                          ("rows kept running after their answer ended", 3, 0),
                          ("prompt tokens found in the prefix cache", 0, -32)]
    table = serving.breakdown_comparison_markdown(static, paged)
    assert f"| {static.positions:,} | {paged.positions:,} |" in table and "forward passes" in table
    # a race's wall times given: no plain runs, the same profiled split (lesson 10 reuses its race's runs)
    again = serving.time_breakdown_static(tiny("qwen3", **SMALL), work, batch_size=2, wall_s=1.25)
    assert again.wall_s == 1.25 and again.output_lengths == static.output_lengths and again.python_s > 0
    assert again.profiled_wall_s >= again.linear_s + again.attention_s + again.other_ops_s
    paged_again = serving.time_breakdown(LLM(tiny("qwen3", **SMALL), max_model_len=64, block_size=4,
                                             kv_cache_memory_bytes=1 << 20), work, wall_s=0.5)
    assert paged_again.wall_s == 0.5 and paged_again.positions == paged.positions


def test_reset_prefix_cache_forgets_cached_prompts():
    llm = LLM(tiny("qwen3", **SMALL), max_model_len=64, block_size=4, kv_cache_memory_bytes=1 << 20)
    prompt = list(range(10, 27))  # 17 tokens: 4 full blocks
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.block_manager.stats().num_cached_blocks == 4
    assert llm.reset_prefix_cache() == 4
    assert llm.engine.block_manager.stats().num_cached_blocks == 0
    llm.engine.keep_trace, llm.engine.trace = True, []
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.trace[0].num_batched_tokens == 17  # computed again, no prefix hit


def test_vllm_names_point_at_real_code():
    for concept, ours, theirs, where in serving.VLLM_NAMES:
        module, _, attr = where.partition(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if where == "kvpaging.entrypoints.llm:LLM.__init__":
            import inspect

            params = inspect.signature(obj).parameters
            name = ours.split("(")[1].split("=")[0]
            assert name in params, (concept, name)
    import dataclasses

    from kvpaging import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids",
                 "ignore_eos", "logprobs"):
        assert name in fields
    md = serving.vllm_names_markdown()
    assert md.count("\n") == len(serving.VLLM_NAMES) + 1
    for needed in ("block_size", "num_gpu_blocks", "slot_mapping", "enable_prefix_caching", "max_num_batched_tokens",
                   "max_num_seqs", "enforce_eager", 'kv_cache_dtype="fp8"', "gpu_memory_utilization",
                   "SamplingParams", "CompletionOutput", "abort_request", "chunked", "preemption"):
        assert needed in md, needed


# ------------------------------------------------------------------ the notebooks


NOTEBOOKS = ["08_cuda_graphs", "09_fp8_kv_cache", "10_putting_it_together",
             "solutions/08_solutions", "solutions/09_solutions", "solutions/10_solutions"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_saved_executed_and_small(name):
    path = ROOT / "lessons" / f"{name}.ipynb"
    assert path.stat().st_size < 2_000_000, f"{path.name} is {path.stat().st_size:,} bytes"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), "save the notebook executed"
    assert not any(o.get("output_type") == "error" for c in code for o in c["outputs"])
    assert "widgets" not in nb["metadata"], "no stored widget state (plotly widgets embed plotly.js)"
    text = json.dumps(nb)
    # figures are plotly's own notebook output, which JupyterLab draws offline and untrusted: no script from a CDN
    assert "cdn.plot.ly" not in text and "<script" not in text


def test_run_events_reads_refusals_and_preemptions():
    """serving.run_events finds the contiguous baseline's first refusal and every preemption, checked against the
    step records and the allocator's arithmetic."""
    from kvpaging import LLM, SamplingParams
    from kvpaging.models import tiny
    from kvpaging.teach.serving import run_events
    from kvpaging.visualizers import Dashboard

    llm = LLM(tiny("qwen3", num_hidden_layers=1), num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=6)
    dash = Dashboard(llm)
    prompts = [list(range(10, 10 + n)) for n in (6, 7, 5, 6, 8, 5)]
    dash.run(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    ev = run_events(dash)
    assert ev.num_slots == 48
    # the contiguous baseline reserves prompt + max_tokens: 18 + 19 fit in 48 slots, the third (17) does not
    assert ev.refused_step == 1 and ev.refused.requested == 5 + 12 and ev.refused.total_free == 48 - 18 - 19
    assert ev.waited_steps >= 1 and ev.paged_running_then == 6
    records = dash.replay.records
    assert [s for s, _, _ in ev.preemptions] == [r.step for r in records for _ in r.preempted]
    assert ev.preemptions, "12 blocks of 4 for six growing sequences must run dry"
