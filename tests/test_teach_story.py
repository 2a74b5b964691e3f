"""Lesson 03's workload served paged in lesson 04 (kvpaging.teach.fragmentation.serve_paged), and the
figures lesson 06 draws from its runs (kvpaging.teach.batching)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpaging.teach.batching import PolicyRun, blocks_freed, mean_blocks_used, memory_figure, throughput_figure
from kvpaging.teach.fragmentation import (WorkloadRequest, contiguous_served, make_workload, run_contiguous,
                                          serve_paged, serve_paged_on_engine, served_summary, tokens_to_compute)


def _requests(specs):
    return [WorkloadRequest(f"r{i}", arrival, prompt, max_tokens, out)
            for i, (arrival, prompt, max_tokens, out) in enumerate(specs)]


def test_without_memory_pressure_both_serve_every_token_on_time():
    """A pool larger than every reservation: no one waits, so a request admitted at step a
    produces its n tokens at steps a .. a+n-1 (the contiguous run frees its slots one step later)."""
    reqs = _requests([(0, 10, 64, 20), (1, 30, 128, 5), (4, 3, 64, 33)])
    paged = serve_paged(4096, reqs)
    contiguous = contiguous_served(run_contiguous(4096, reqs), reqs)
    last = max(r.arrival + r.output_len for r in reqs)
    assert len(paged) == last and len(contiguous) == last + 1
    for rows in (paged, contiguous):
        assert sum(r.tokens for r in rows) == sum(r.output_len for r in reqs)
        assert all(r.waiting == 0 for r in rows)
        # at step t, the requests that have arrived and not yet produced all their tokens each produce one
        for r in rows[:last]:
            assert r.tokens == sum(q.arrival <= r.index < q.arrival + q.output_len for q in reqs), r
    assert served_summary(paged).preemptions == 0


def test_paged_pool_accounts_in_whole_blocks():
    reqs = make_workload(24, seed=1)
    rows = serve_paged(1024, reqs, block_size=16)
    assert sum(r.tokens for r in rows) == sum(r.output_len for r in reqs)
    assert all(r.used_slots % 16 == 0 and 0 <= r.used_slots <= 1024 for r in rows)
    assert all(r.tokens <= r.running for r in rows)
    assert rows[-1].waiting == 0


def test_paging_sustains_more_streams_on_lesson_03s_workload():
    """The same requests on the same 1,024 slots: paged finishes sooner with more streams per step
    (lesson 04 reports the figures; this only pins the direction and that the work is the same)."""
    reqs = make_workload(24, seed=1)
    contiguous = served_summary(contiguous_served(run_contiguous(1024, reqs), reqs))
    paged = served_summary(serve_paged(1024, reqs))
    assert paged.tokens == contiguous.tokens == sum(r.output_len for r in reqs)
    assert paged.steps < contiguous.steps
    assert paged.peak_running > contiguous.peak_running
    assert paged.tokens_per_step > contiguous.tokens_per_step


def test_the_whole_engine_takes_the_steps_the_plan_takes():
    """serve_paged plans with the scheduler and block manager alone; serve_paged_on_engine runs the same requests
    through LLMEngine on a model: the same steps, streams, tokens, preemptions and computed tokens, step by step."""
    from kvpaging.models import tiny

    reqs = make_workload(10, seed=3)
    plan = serve_paged(320, reqs, block_size=16)  # 20 blocks: tight enough to preempt
    run = serve_paged_on_engine(tiny("qwen3"), 320, reqs, block_size=16)
    assert served_summary(plan).preemptions > 0
    assert [(r.running, r.tokens, r.preempted, r.computed) for r in run] == \
        [(r.running, r.tokens, r.preempted, r.computed) for r in plan]


def test_computed_tokens_count_recomputation_and_respect_the_budget():
    reqs = make_workload(24, seed=1)
    roomy = served_summary(serve_paged(16 * 1024, reqs))  # no preemption: each token computed once
    assert roomy.preemptions == 0 and roomy.computed == tokens_to_compute(reqs)
    tight = served_summary(serve_paged(1024, reqs))
    assert tight.preemptions > 0 and tight.computed > tokens_to_compute(reqs)  # evicted sequences are recomputed
    chunked = serve_paged(1024, reqs, max_num_batched_tokens=64)
    assert max(r.computed for r in chunked) <= 64 < tight.largest_step
    assert sum(r.tokens for r in chunked) == sum(r.output_len for r in reqs)


def test_serve_paged_refuses_a_request_larger_than_the_pool():
    with pytest.raises(ValueError, match="needs more than the pool's 4 blocks"):
        serve_paged(64, _requests([(0, 60, 64, 10)]), block_size=16)


def _run(policy, used, finished, seconds=2.0, tokens=12):
    trace = [SimpleNamespace(step=i + 1, num_used_blocks=u, finished_block_tables=f)
             for i, (u, f) in enumerate(zip(used, finished))]
    return PolicyRun(policy, trace, None, seconds, len(trace), tokens, [])


def test_lesson_06_memory_figures_count_from_the_trace():
    static = _run("static", [4, 4, 3, 3, 1], [{}, {}, {0: (1,)}, {}, {1: (2, 3), 2: (4,)}])
    continuous = _run("continuous", [4, 5, 2], [{}, {0: (1, 6)}, {1: (2,), 2: (3, 4)}])
    assert blocks_freed(static) == 4 and blocks_freed(continuous) == 5
    assert mean_blocks_used(static) == pytest.approx(15 / 5) and mean_blocks_used(continuous) == pytest.approx(11 / 3)
    fig = memory_figure({"static": static, "continuous": continuous})
    ends = [t for t in fig.data if t.mode == "markers"]
    assert [list(t.x) for t in ends] == [[3, 5], [2, 3]]
    bars = throughput_figure({"static": static, "continuous": continuous}).data
    assert list(bars[0].y) == [6.0, 6.0] and list(bars[1].y) == [12 / 5, 4.0]
