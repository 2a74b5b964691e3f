"""The helpers that lessons 07-09 call instead of long cells (kvpaging.teach.scheduling / graphs), on tiny models."""

from __future__ import annotations

import pytest

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.teach import graphs
from kvpaging.teach.scheduling import (ChunkBreakdown, LongPromptRun, chunk_breakdown, long_prompt_arrives,
                                       step_wall_time_figure)


def _make_llm(model, **kw):
    cfg = dict(block_size=16, num_blocks=64, max_model_len=256, seed=0)
    cfg.update(kw)
    return LLM(model, **cfg)


@pytest.fixture(scope="module")
def shared_prefix_runs():
    """Two running requests and a long prompt that shares their first two blocks, at budgets 16 and 128."""
    model = tiny("qwen3", num_hidden_layers=2, vocab_size=512)
    shared = list(range(3, 35))  # 32 tokens: two full blocks of 16
    return {budget: long_prompt_arrives(lambda **kw: _make_llm(model, **kw), budget, decode_tokens=12, arrive_after=6,
                                        running_prompts=[shared + [7], shared + [9]],
                                        long_prompt=shared + list(range(100, 150)),
                                        long_params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            for budget in (16, 128)}


# ------------------------------------------------------------------ lesson 07

def test_chunk_breakdown_reads_the_cut_the_cache_and_the_gaps(shared_prefix_runs):
    chunked, whole = (chunk_breakdown(shared_prefix_runs[b]) for b in (16, 128))
    # the first 32 tokens were cached by the running prompts; the other 50 go 14 a step beside the two decodes
    assert chunked.cached_tokens == whole.cached_tokens == 32
    assert chunked.chunks == [14, 14, 14, 8] and whole.chunks == [50]
    assert chunked.decodes_beside == whole.decodes_beside == 2
    assert chunked.gaps_with_chunk == shared_prefix_runs[16].prefill_steps == 4 and whole.gaps_with_chunk == 1
    itl = shared_prefix_runs[16].itl_ms
    assert chunked.gaps_per_request == sum(map(len, itl.values())) // len(itl) > chunked.gaps_with_chunk


def test_median_is_chunk_step_means_more_than_half():
    assert ChunkBreakdown([60] * 9, 16, 4, 12, 9).median_is_chunk_step
    assert not ChunkBreakdown([60] * 6, 16, 4, 12, 6).median_is_chunk_step  # exactly half: the median is not a chunk's
    assert not ChunkBreakdown([507], 16, 4, 12, 1).median_is_chunk_step


def test_chunk_breakdown_refuses_a_run_without_the_long_prompt():
    empty = LongPromptRun(64, [], 1, 1, ["run0"], {"run0": [1.0]}, 0, 0, 0)
    with pytest.raises(ValueError, match="no prefill step"):
        chunk_breakdown(empty)


def test_step_wall_time_figure_draws_every_step_of_every_run(shared_prefix_runs):
    fig = step_wall_time_figure(shared_prefix_runs)
    assert [t.name for t in fig.data] == ["budget 16", "budget 128"]
    for trace, run in zip(fig.data, shared_prefix_runs.values()):
        assert list(trace.x) == [r.step for r in run.trace]
        assert list(trace.y) == pytest.approx([r.wall_time * 1e3 for r in run.trace])
    assert fig.layout.yaxis.type == "log"


# ------------------------------------------------------------------ lesson 08

def test_launches_per_layer_splits_a_line():
    assert graphs.launches_per_layer({2: 123, 8: 441}) == pytest.approx((53.0, 17.0))
    with pytest.raises(ValueError, match="two or more"):
        graphs.launches_per_layer({4: 277})


def test_launches_per_layer_predicts_a_third_model():
    """Every layer dispatches the same operators: the line through 1 and 2 layers gives 3 layers' count exactly."""
    counts = {}
    for layers in (1, 2, 3):
        llm = LLM(tiny("qwen3", num_hidden_layers=layers, vocab_size=512), max_model_len=64,
                  enable_prefix_caching=False, kv_cache_memory_bytes=1 << 20)
        counts[layers] = graphs.count_decode_step_ops(llm, 2, prompt_len=4).launches
    per_layer, rest = graphs.launches_per_layer({k: counts[k] for k in (1, 2)})
    assert per_layer > 10 and rest > 0
    assert rest + 3 * per_layer == pytest.approx(counts[3])


def test_interleaved_step_ms_times_every_engine_at_every_batch(monkeypatch):
    model = tiny("qwen3", num_hidden_layers=1, vocab_size=512)
    engines = {name: LLM(model, max_model_len=64, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 20)
               for name in ("first", "second")}
    calls = []
    step_ms = graphs.decode_step_ms

    def counting(llm, batch, **kw):
        calls.append((llm, batch, kw.get("repeats")))
        return step_ms(llm, batch, prompt_len=4, tokens=3, **kw)

    monkeypatch.setattr(graphs, "decode_step_ms", counting)
    side = graphs.interleaved_step_ms(engines, [1, 2], rounds=3)
    assert list(side) == ["first", "second"] and all(list(v) == [1, 2] for v in side.values())
    assert all(ms > 0 for v in side.values() for ms in v.values())
    # three rounds, each: batch 1 on both engines, then batch 2 on both, one repeat each
    first, second = engines["first"], engines["second"]
    one_round = [(first, 1, 1), (second, 1, 1), (first, 2, 1), (second, 2, 1)]
    assert calls == one_round * 3
    assert not any(llm.engine.has_unfinished_requests() for llm in engines.values())


def test_interleaved_step_ms_keeps_the_middle_round(monkeypatch):
    times = iter([5.0, 50.0, 1.0, 10.0, 3.0, 30.0])  # round by round: engine a, then engine b
    monkeypatch.setattr(graphs, "decode_step_ms", lambda llm, batch, repeats: next(times))
    assert graphs.interleaved_step_ms({"a": object(), "b": object()}, [1], rounds=3) == {"a": {1: 3.0}, "b": {1: 30.0}}
