"""The visualizers' pure functions: step records in, arrays and numbers out, checked against known answers.

Known answers come from traces written out by hand (``kvpaging.visualizers.examples``,
whose docstring tells the story step by step), from the batching article's example,
and, for the replay, from the engine's own block pool: an observer snapshots every
block's reference count and fill at each step, and the replay, which sees only the
step records, must rebuild exactly that.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
from kvpaging.visualizers import (
    ARTICLE_OUTPUT_LENGTHS,
    ContiguousTraceSim,
    LatencyTracker,
    TraceReplay,
    article_example,
    block_table_frame,
    bubble_frame,
    contiguous_frame,
    infer_block_size,
    load_trace,
    memory_map_frame,
    pool_arrays,
    pool_figures,
    request_latencies,
    save_trace,
    simulate_batching,
    simulate_continuous_batching,
    simulate_static_batching,
    slot_timeline_from_trace,
    throughput_series,
    to_chrome_trace,
)
from kvpaging.visualizers import block_table as bt
from kvpaging.visualizers import memory_map as mm
from kvpaging.visualizers.bench import synthetic_trace
from kvpaging.visualizers.examples import BLOCK_SIZE, NUM_BLOCKS, chunked_prefill_trace, hand_trace
from kvpaging.visualizers.trace_io import Trace

from kvpaging import LLM, SamplingParams, simulate_contiguous
from kvpaging.core.contiguous import first_refusal
from kvpaging.engine.llm_engine import StepRecord
from kvpaging.models import tiny

# Fields that newer engines add to StepRecord so that nothing has to be worked out. Removing
# them gives the records an older engine wrote, which the replay must still read exactly.
RECORDED_EXTRAS = {"seq_num_tokens": {}, "forked": (), "sampled": (), "arrivals": {}, "finished_block_tables": {}}


def as_older_engine(records):
    present = {k: v for k, v in RECORDED_EXTRAS.items() if k in {f.name for f in dataclasses.fields(StepRecord)}}
    return [dataclasses.replace(r, **present) for r in records]


# -- batching: the article's example -------------------------------------------------------------------
def test_static_batching_article_example_is_1434_of_4096():
    t = simulate_static_batching(ARTICLE_OUTPUT_LENGTHS, num_slots=4)
    assert t.occupancy.shape == (4, 1024)
    assert (t.busy, t.capacity) == (1434, 4096)
    assert t.utilisation == 1434 / 4096
    # each slot holds its request for exactly its length, then idles to the end of the batch
    for slot, length in enumerate(ARTICLE_OUTPUT_LENGTHS):
        assert (t.occupancy[slot, :length] == slot).all()
        assert (t.occupancy[slot, length:] == -1).all()


def test_continuous_batching_with_nothing_queued_equals_static():
    static = simulate_static_batching(ARTICLE_OUTPUT_LENGTHS, 4)
    continuous = simulate_continuous_batching(ARTICLE_OUTPUT_LENGTHS, 4)
    np.testing.assert_array_equal(static.occupancy, continuous.occupancy)


def test_continuous_batching_refills_a_slot_on_the_iteration_it_frees():
    # slot 0 runs the 4-token request; the 1-token requests follow each other in slot 1
    c = simulate_continuous_batching([4, 1, 1, 1, 1], num_slots=2)
    np.testing.assert_array_equal(c.occupancy, [[0, 0, 0, 0], [1, 2, 3, 4]])
    assert c.utilisation == 1.0
    s = simulate_static_batching([4, 1, 1, 1, 1], num_slots=2)
    np.testing.assert_array_equal(s.occupancy, [[0, 0, 0, 0, 2, 4], [1, -1, -1, -1, 3, -1]])
    assert (s.busy, s.capacity) == (8, 12)


def test_article_example_with_a_queue():
    static, continuous = article_example(num_batches=3)
    assert (static.busy, static.capacity) == (3 * 1434, 3 * 4096)  # three identical batches
    assert continuous.busy == static.busy  # the same work ...
    assert continuous.num_iterations < static.num_iterations  # ... in fewer iterations
    assert continuous.utilisation > 0.5 > static.utilisation


@pytest.mark.parametrize("bad", [[0], [-3], [1.5], [True]])
def test_batching_rejects_bad_lengths(bad):
    with pytest.raises(ValueError, match="positive integers"):
        simulate_static_batching(bad, 2)


def test_batching_rejects_bad_slots_and_policy():
    with pytest.raises(ValueError, match="num_slots"):
        simulate_continuous_batching([1], 0)
    with pytest.raises(ValueError, match="policy"):
        simulate_batching([1], 1, "dynamic")


def test_bubble_frame_reveals_iterations_up_to_the_position():
    t = simulate_static_batching([2, 4], num_slots=2)
    f = bubble_frame(t, 1)
    assert np.isnan(f.z[:, 2:]).all() and not np.isnan(f.z[:, :2]).any()
    assert (f.busy, f.capacity) == (4, 4)
    assert "100.0%" in f.title
    full = bubble_frame(t)
    assert (full.busy, full.capacity) == (6, 8)
    assert (full.z[0, 2:] == 0).all()  # idle cells: code 0


def test_bubble_frame_samples_long_timelines_but_counts_everything():
    t = simulate_static_batching(ARTICLE_OUTPUT_LENGTHS, 4)
    f = bubble_frame(t, max_columns=100)
    assert f.z.shape[1] <= 100 and f.every == 11
    assert (f.busy, f.capacity) == (1434, 4096)


# -- replay: hand-built trace -------------------------------------------------------------------------------
@pytest.fixture
def replay():
    return TraceReplay(hand_trace(), block_size=BLOCK_SIZE)


def test_replay_sequence_lengths_hits_and_forks(replay):
    expected = [
        {0: 6},
        {0: 7, 1: 6},
        {0: 8, 1: 7, 2: 5, 3: 5},
        {1: 8, 2: 6, 3: 6},
        {2: 7, 3: 7},
    ]
    assert [replay.seq_lengths(i) for i in range(5)] == expected
    assert replay.steps[1].admitted == (1,)
    assert replay.steps[1].hit_blocks.tolist() == [0, 1]  # seq 1 reused block 0
    assert replay.steps[2].forked == (3,)
    assert replay.request_of(3) == "c"
    assert replay.steps[3].ended == (0,) and replay.steps[4].ended == (1,)
    assert replay.num_blocks == NUM_BLOCKS


def test_pool_arrays_after_fork_and_copy_on_write(replay):
    step3 = pool_arrays(replay, 2)
    assert step3.ref_count.tolist() == [2, 1, 1, 2, 2, 0, 0, 0]
    assert step3.fill.tolist() == [4, 4, 3, 4, 1, 0, 0, 0]
    assert step3.owner.tolist() == [-2, 0, 1, -2, -2, -1, -1, -1]
    step4 = pool_arrays(replay, 3)
    assert step4.ref_count.tolist() == [1, 0, 1, 2, 1, 0, 1, 0]  # block 3 still shared by seqs 2, 3
    assert step4.fill.tolist() == [4, 0, 4, 4, 2, 0, 2, 0]
    assert np.flatnonzero(step4.cached_free).tolist() == [1]
    step5 = pool_arrays(replay, 4)
    assert np.flatnonzero(step5.cached_free).tolist() == [0, 1, 2]


def test_replay_matches_the_recorded_totals(replay):
    for i, record in enumerate(replay.records):
        arrays = pool_arrays(replay, i)
        assert int(arrays.fill.sum()) == record.num_tokens_stored
        assert int((arrays.ref_count > 0).sum()) == record.num_used_blocks
        assert replay.steps[i].num_cached_derived == record.num_cached_blocks


def test_memory_map_frame_codes_text_and_figures(replay):
    f = memory_map_frame(replay, 3, columns=4)
    assert f.z.shape == (2, 4)
    owner = lambda seq: mm.OWNER_BASE + seq % len(mm.PALETTE)  # noqa: E731
    assert f.z.tolist() == [[owner(1), mm.CACHED_FREE, owner(1), mm.SHARED], [owner(3), mm.FREE, owner(2), mm.FREE]]
    assert f.text.tolist() == [["4", "", "4", "4"], ["2", "", "2", ""]]
    assert sorted(zip(f.partial_y.tolist(), f.partial_x.tolist())) == [(1, 0), (1, 2)]  # blocks 4 and 6
    g = f.figures
    assert (g["used_blocks"], g["tokens_stored"], g["allocated_slots"]) == (5, 16, 20)
    assert g["internal_fragmentation"] == pytest.approx(0.2)
    assert g["shared_savings_blocks"] == 1  # block 3 is in two tables
    assert "internal fragmentation 20.0%" in f.title
    shared = memory_map_frame(replay, 2, columns=8)
    assert shared.z[0, [0, 3, 4]].tolist() == [mm.SHARED] * 3


def test_pool_figures_shared_savings_after_fork(replay):
    g = pool_figures(replay, 2)
    assert g["shared_savings_blocks"] == 8 - 5
    assert g["internal_fragmentation"] == pytest.approx(1 - 16 / 20)


def test_memory_map_aggregates_huge_pools():
    records = synthetic_trace(num_blocks=20000, block_size=16, num_seqs=64, num_steps=3)
    rp = TraceReplay(records, block_size=16)
    f = memory_map_frame(rp, 2, max_cells=4096)
    assert f.blocks_per_cell == 5
    assert f.z.size <= 4096 + 64 and f.text is None
    used_cells = np.count_nonzero(~np.isnan(f.z) & (f.z != mm.FREE))
    assert used_cells >= records[-1].num_used_blocks // 5
    assert int(np.nansum(f.customdata[..., 3])) == records[-1].num_tokens_stored


def test_block_table_frame_marks_hits_shares_and_copies(replay):
    f = block_table_frame(replay, 1)
    assert f.seq_ids == [0, 1]
    assert f.z.tolist() == [[bt.SHARED, bt.PRIVATE], [bt.PREFIX_HIT, bt.PRIVATE]]
    assert f.text.tolist() == [["0×2", "1"], ["0×2", "2"]]
    assert any("1 prefix-cache hit block" in e for e in f.events)
    g = block_table_frame(replay, 3)
    assert g.seq_ids == [1, 2, 3]
    row = g.seq_ids.index(2)
    assert g.z[row].tolist() == [bt.SHARED, bt.COPIED]
    assert g.customdata[row, 1].tolist() == [6, 1, 2, 4]  # block 6, one ref, 2 tokens, copied from 4
    assert "copy-on-write: block 4 -> 6" in g.events
    assert "seq 0 finished" in g.events
    assert g.row_labels[row] == "seq 2 · c · 6 tok"


def test_block_table_pages():
    records = synthetic_trace(num_blocks=4096, num_seqs=256, num_steps=2)
    rp = TraceReplay(records, block_size=16)
    f = block_table_frame(rp, 1, page=10, rows_per_page=24)
    assert (f.page, f.num_pages) == (10, 11)
    assert f.seq_ids == list(range(240, 256))
    assert f.text is not None and f.z.shape == (16, 7)
    assert block_table_frame(rp, 1, page=99, rows_per_page=200).page == 1  # clamped to the last page
    assert block_table_frame(rp, 1, page=0, rows_per_page=200).text is None  # too many cells to label


# -- replay against the real engine --------------------------------------------------------------------
def _run_and_snapshot(llm, prompts, params):
    """Run the engine; at every step record what its pool really holds (tests may look inside)."""
    engine = llm.engine
    engine.keep_trace = True
    engine.trace = []
    truth = []

    def snapshot(record):
        blocks = engine.block_manager.pool.blocks
        truth.append((
            [b.ref_cnt for b in blocks],
            [b.num_filled if b.ref_cnt else 0 for b in blocks],
            [b.ref_cnt == 0 and b.block_hash is not None for b in blocks],
        ))

    engine.add_observer(snapshot)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine.remove_observer(snapshot)
    return outs, engine.trace, truth


@pytest.mark.parametrize("recorded", [True, False], ids=["as-recorded", "as-older-engine"])
@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 20), (8, 11)])
def test_replay_rebuilds_the_engine_pool_exactly(one_thread, block_size, num_blocks, recorded):
    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=num_blocks, block_size=block_size, max_model_len=80,
              max_num_batched_tokens=24)
    prefix = list(range(10, 30))
    prompts = [prefix + [40, 41], prefix + [50, 51, 52], list(range(60, 73)), prefix + [40, 41, 42, 43],
               prefix[:9], list(range(5, 8)), prefix[:8] + [90]]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=9, n=3, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),  # admitted and finished within one step
        SamplingParams(max_tokens=1, n=2, temperature=1.0, seed=1, ignore_eos=True),  # forks that end at once
        SamplingParams(max_tokens=4, ignore_eos=True),  # reuses what the one-step request left cached
    ]
    if not recorded:  # an older engine's replay is exact only until the first one-step request: leave them out
        prompts, params = prompts[:4], params[:4]
    _, recorded_trace, truth = _run_and_snapshot(llm, prompts, params)
    trace = recorded_trace if recorded else as_older_engine(recorded_trace)
    assert any(r.blocks_copied for r in trace), "the scenario should copy on write"
    assert any(r.preempted for r in trace), "the scenario should preempt"
    assert any(len(r.scheduled) and r.scheduled[-1].num_tokens < 13 and r.scheduled[-1].is_prefill for r in trace)
    assert infer_block_size(trace) == block_size
    rp = TraceReplay(trace)  # block size inferred
    assert rp.block_size == block_size
    # A sequence admitted and finished within one step is never among the running tables. An older
    # engine's records do not carry the tables of finished sequences, so from then on its replay
    # cannot know which blocks that request left in the prefix cache (see replay.py).
    one_step = [i for i, r in enumerate(trace) for e in r.scheduled
                if e.seq_id not in r.block_tables and (i == 0 or e.seq_id not in trace[i - 1].block_tables)]
    assert one_step or not recorded, "the scenario should admit and finish a sequence within one step"
    # Nor the table of a sequence that took a block (evicting what the block cached) in the very step it finished
    # or was preempted in; a one-step request is one such. The recorded trace says where that happened.
    grew_then_left = [i for i, r in enumerate(recorded_trace) for sid, table in r.finished_block_tables.items()
                      if set(table) - set(recorded_trace[i - 1].block_tables.get(sid, ()) if i else ())]
    assert set(one_step) <= set(grew_then_left)
    blind = len(trace) if recorded else min(grew_then_left + [len(trace)])
    assert blind > 8, "the exact part should cover the copy-on-write and the preemption"
    for i, (refs, fills, cached_free) in enumerate(truth):
        arrays = pool_arrays(rp, i)
        assert arrays.ref_count.tolist() == refs, f"step {i + 1}: reference counts"
        assert arrays.fill.tolist() == fills, f"step {i + 1}: block fill"
        if i < blind:
            assert arrays.cached_free.tolist() == cached_free, f"step {i + 1}: cached free blocks"


# -- contiguous baseline ------------------------------------------------------------------------------------
def test_contiguous_frame_of_a_scripted_scenario():
    events = [
        [("reserve", "a", 30), ("reserve", "b", 20), ("reserve", "c", 30), ("reserve", "f", 20)],  # full
        [("use", "a", 10), ("release", "b")],  # hole [30, 50)
        [("reserve", "d", 10), ("release", "f")],  # d takes [30, 40); holes [40, 50) and [80, 100)
        [("reserve", "e", 25)],  # 30 slots free, largest hole 20: refused by fragmentation
    ]
    steps = simulate_contiguous(100, events)
    assert first_refusal(steps) == 3
    f = contiguous_frame(steps, 3)
    assert f.run_starts.tolist() == [0, 30, 50] and f.run_lengths.tolist() == [30, 10, 30]
    assert f.run_used.tolist() == [10, 0, 0]
    assert list(zip(f.hole_starts.tolist(), f.hole_lengths.tolist())) == [(40, 10), (80, 20)]
    assert f.total_free.tolist() == [0, 20, 30, 30]
    assert f.largest_hole.tolist() == [0, 20, 20, 20]
    assert f.refusal_positions.tolist() == [3] and f.refusal_sizes.tolist() == [25]
    assert "refused e (25 slots) although 30 are free" in f.title
    assert f.figures["first_refusal"] == 3
    earlier = contiguous_frame(steps, 2)
    assert earlier.refused_now == [] and earlier.refusal_positions.size == 0


def test_contiguous_sim_of_a_paged_trace_finds_the_fragmentation_refusal():
    replay = TraceReplay(hand_trace(), block_size=BLOCK_SIZE)
    sim = ContiguousTraceSim(replay, num_slots=16, reserve_tokens={"a": 6, "b": 6, "c": 8})
    sim.sync()
    assert len(sim) == 5
    results = [[type(r).__name__ for r in s.results if type(r).__name__ == "OutOfMemory"] for s in sim.steps]
    assert results == [[], [], ["OutOfMemory"], ["OutOfMemory"], ["OutOfMemory"]]
    assert first_refusal(sim.steps) == 4  # step 5: 10 slots free in two holes of 6 and 4, c needs 8
    assert sim.steps[4].snapshot.total_free == 16  # b released at the end of step 5
    assert sim.steps[1].snapshot.used_slots == 6 + 6  # a's 7 tokens are capped at its 6 reserved slots


# -- throughput and latency ------------------------------------------------------------------------------
def test_throughput_series(replay):
    s = throughput_series(replay)
    assert s["step"].tolist() == [1, 2, 3, 4, 5]
    assert s["prefill_tokens"].tolist() == [6, 2, 5, 0, 0]
    assert s["decode_tokens"].tolist() == [0, 1, 2, 4, 3]
    assert s["kv_usage"].tolist() == [2 / 8, 3 / 8, 5 / 8, 5 / 8, 3 / 8]
    assert s["preempt_steps"].size == 0
    assert throughput_series(replay, 1)["step"].tolist() == [1, 2]


def test_latencies_from_the_trace():
    by_request = {r.request_id: r for r in request_latencies(hand_trace())}
    a = by_request["a"]  # scheduled at 1.0; tokens at the ends of steps 1..4: 1.5, 2.5, 3.5, 4.5
    assert (a.ttft, a.itl_median, a.num_tokens, a.from_arrival) == (0.5, 1.0, 4, False)
    assert by_request["b"].num_tokens == 4
    assert by_request["c"].num_tokens == 3  # completion 0 only, as RequestMetrics counts


def test_latency_of_a_chunked_prompt_starts_at_its_last_chunk():
    tracker = LatencyTracker()
    for r in chunked_prefill_trace():
        tracker.append(r)
    (p,) = tracker.latencies()
    assert p.num_tokens == 2  # the last chunk's token, then one decode
    assert p.ttft == pytest.approx(3.5 - 1.0)
    assert tracker.latencies(upto=1)[0].num_tokens == 0


def test_latencies_from_request_metrics(one_thread):
    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=32, block_size=4, max_model_len=64)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    lat = request_latencies((), {o.request_id: o.metrics for o in outs})
    for o, r in zip(outs, lat):
        assert r.ttft == o.metrics.time_to_first_token and r.from_arrival and r.num_tokens == 4


def test_slot_timeline_from_a_trace(replay):
    t = slot_timeline_from_trace(hand_trace())
    # seq 0 -> slot 0, seq 1 -> slot 1, seq 2 -> slot 2, fork child seq 3 -> slot 3 (from step 4);
    # request indices: a=0, b=1, c=2
    np.testing.assert_array_equal(t.occupancy, [
        [0, 0, 0, 0, -1],
        [-1, 1, 1, 1, 1],
        [-1, -1, 2, 2, 2],
        [-1, -1, -1, 2, 2],
    ])
    assert t.prefill[:, 0].tolist() == [True, False, False, False]
    assert (t.busy, t.capacity) == (13, 20)
    assert t.steps.tolist() == [1, 2, 3, 4, 5]


# -- traces on disk ----------------------------------------------------------------------------------------
def test_save_and_load_trace_round_trip(tmp_path):
    records = hand_trace()
    path = tmp_path / "run.json"
    save_trace(records, path, block_size=BLOCK_SIZE, note="hand")
    loaded = load_trace(path)
    assert isinstance(loaded, Trace) and loaded == records
    assert all(type(a) is type(b) and a == b for a, b in zip(loaded, records))
    assert loaded.meta == {"block_size": BLOCK_SIZE, "note": "hand"}
    assert TraceReplay(loaded).block_size == BLOCK_SIZE  # meta travels with it
    save_trace(loaded, tmp_path / "again.json")  # meta kept when saving a loaded trace
    assert load_trace(tmp_path / "again.json").meta["block_size"] == BLOCK_SIZE


def test_load_trace_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a kvpaging trace"):
        load_trace(path)


def test_chrome_trace_structure():
    records = hand_trace()
    data = json.loads(json.dumps(to_chrome_trace(records)))
    events = data["traceEvents"]
    assert isinstance(events, list)
    for e in events:
        assert isinstance(e["pid"], int) and e["ph"] in {"X", "M", "C", "i"}
        if e["ph"] != "C":
            assert isinstance(e["tid"], int)
    slices = [e for e in events if e["ph"] == "X"]
    steps = [e for e in slices if e["tid"] == 0]
    assert [e["name"] for e in steps] == [f"step {i}" for i in range(1, 6)]
    for e, r in zip(steps, records):
        assert e["ts"] == pytest.approx((r.start_time - 1.0) * 1e6)  # microseconds since the first step
        assert e["dur"] == pytest.approx(r.wall_time * 1e6)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[0] == "engine steps"
    tracks = {names[e["tid"]] for e in slices if e["tid"] != 0}
    assert tracks == {"request a", "request b", "request c"}
    c_slices = [e for e in slices if names[e["tid"]] == "request c"]
    assert [e["args"]["step"] for e in c_slices] == [3, 4, 5]
    assert c_slices[0]["name"] == "prefill 5 tok" and c_slices[1]["args"]["tokens"] == 2  # both completions
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    assert all(e["dur"] > 0 for e in slices)


# -- speed (a loose smoke check; real figures: python -m kvpaging.visualizers.bench) -----------------------
def test_one_frame_of_a_big_pool_is_fast():
    records = synthetic_trace(num_blocks=4096, num_seqs=256, num_steps=5)
    rp = TraceReplay(records, block_size=16)
    start = time.perf_counter()
    memory_map_frame(rp, 4)
    block_table_frame(rp, 4)
    throughput_series(rp, 4)
    assert time.perf_counter() - start < 0.5


def test_replay_of_a_bounded_trace_catches_up(one_thread):
    """engine.trace keeps only the newest steps: lengths start as guesses, marked, and become exact."""
    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=32, block_size=4, max_model_len=64)
    engine = llm.engine
    engine.keep_trace = True  # the default bounded deque
    llm.generate([list(range(5, 14)), list(range(20, 26))], SamplingParams(max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    recorded_late = TraceReplay(list(engine.trace)[5:], block_size=4)
    assert recorded_late.steps[0].exact.all()  # lengths in the records (newer engines): exact at once
    trace = as_older_engine(engine.trace)
    full = TraceReplay(trace, block_size=4)
    late = TraceReplay(trace[5:], block_size=4)
    assert late.steps[0].seq_ids.size == 2 and not late.steps[0].exact.any()  # joined mid-run: only guesses
    assert all("~" in label for label in block_table_frame(late, 0).row_labels)  # and the view says so
    # both sequences decode on, each soon opens a new block, and from then on the lengths are exact
    running = [i for i, d in enumerate(late.steps) if d.seq_ids.size == 2]
    last = running[-1]
    assert last > 5 and late.steps[last].exact.all()
    np.testing.assert_array_equal(late.steps[last].num_tokens, full.steps[last + 5].num_tokens)
    assert int(pool_arrays(late, last).fill.sum()) == late.records[last].num_tokens_stored


@pytest.mark.parametrize("recorded", [True, False], ids=["as-recorded", "as-older-engine"])
def test_trace_latencies_agree_with_request_metrics(one_thread, recorded):
    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=32, block_size=4, max_model_len=64,
              max_num_batched_tokens=8)  # the 11-token prompt is chunked
    llm.engine.keep_trace = True
    llm.engine.trace = []
    outs = llm.generate([list(range(5, 16)), [8, 9]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    trace = llm.engine.trace if recorded else as_older_engine(llm.engine.trace)
    by_request = {r.request_id: r for r in request_latencies(trace)}
    has_arrivals = recorded and "arrivals" in {f.name for f in dataclasses.fields(StepRecord)}
    for out in outs:
        lat, m = by_request[out.request_id], out.metrics
        assert lat.num_tokens == len(m.token_times) == 5
        assert lat.from_arrival == has_arrivals
        start = m.arrival_time if has_arrivals else m.first_scheduled_time
        # the record's end of step is taken a moment after the engine stamps the token
        assert 0 <= lat.ttft - (m.first_token_time - start) < 0.05


def test_chrome_trace_of_an_engine_run_shows_queueing(one_thread):
    llm = LLM(tiny("qwen3", num_hidden_layers=2), num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=1)
    llm.engine.keep_trace = True
    llm.engine.trace = []
    llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    events = to_chrome_trace(llm.engine.trace)["traceEvents"]
    assert all(e["ts"] >= 0 for e in events if "ts" in e)
    waiting = [e for e in events if e.get("cat") == "queue"]
    if "arrivals" in {f.name for f in dataclasses.fields(StepRecord)}:
        assert len(waiting) == 2  # one per request; the second waited for the first (max_num_seqs=1)
        assert max(e["dur"] for e in waiting) > min(e["dur"] for e in waiting)
    else:
        assert waiting == []
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["engine steps", "request gen-0", "request gen-1"]


def test_titles_say_ordinals_in_english():
    from kvpaging.visualizers.bubbles import ordinal

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]
