"""The printed views behind lessons 10 and 11 (kvpaging.teach.serving / load): the figures a lesson prints beside
its prose, counted from real runs on tiny models or from hand-made step records."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.engine.step_record import ScheduledEntry, StepRecord
from kvpaging.teach import load, serving

SMALL = dict(num_hidden_layers=1, vocab_size=512)


# ------------------------------------------------------------------ lesson 10: a served run, counted


@pytest.fixture(scope="module")
def dry_run(one_thread):
    """Six growing requests on 12 blocks of 4 tokens: the pool runs dry and the engine preempts."""
    from kvpaging.visualizers import Dashboard

    llm = LLM(tiny("qwen3", **SMALL), num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=6)
    dash = Dashboard(llm)
    prompts = [list(range(10, 10 + n)) for n in (6, 7, 5, 6, 8, 5)]
    outs = dash.run(prompts, SamplingParams(max_tokens=12, ignore_eos=True), display=False)
    return dash, outs


def test_run_summary_counts_the_dashboards_run(dry_run):
    dash, outs = dry_run
    run = serving.run_summary(dash, outs)
    records = dash.replay.records
    assert run.requests == 6 and run.generated_tokens == 6 * 12 and run.ended_at_eos == 0  # ignore_eos: all "length"
    assert run.steps == len(records) > 12  # at least one step per token of the longest answer
    assert run.max_num_seqs == 6 and 1 <= run.max_running <= 6
    assert run.num_blocks == 12 and run.peak_blocks == 12  # the pool ran dry...
    assert run.preemptions == sum(len(r.preempted) for r in records) > 0  # ... and the engine preempted
    assert run.max_waiting == max(r.num_waiting for r in records)
    report = run.report()
    assert "peak pool use                     12 of 12 blocks" in report
    assert f"preemptions                       {run.preemptions}" in report
    assert len(report.splitlines()) == 8


def test_run_events_report_names_the_refusal_and_every_preemption(dry_run):
    dash, _ = dry_run
    ev = serving.run_events(dash)
    assert ev.block_size == 4 and ev.num_blocks == 12
    report = ev.report()
    r = ev.refused
    assert f"request {r.request_id}" in report and f"asks for {r.requested} slots" in report
    assert f"free {r.total_free} of 48" in report
    assert f"({ev.paged_used_then * 4} slots)" in report
    assert report.count("blocks in use before") == len(ev.preemptions) > 0
    empty = serving.RunEvents(48, None, None, 0, 0, 0, [], 4, 12).report()
    assert empty == "contiguous panel: no refusal\npreemptions: 0"


def _output(text, tokens, finish):
    return SimpleNamespace(outputs=[SimpleNamespace(text=text, token_ids=list(range(tokens)), finish_reason=finish)])


def test_answers_table_cuts_long_answers_and_keeps_the_table_whole():
    outs = [_output("Paris.", 3, "stop"), _output("a | b\nc " + "x" * 80, 48, "length")]
    table = serving.answers_table(["Capital?", "Long?"], outs, width=10)
    lines = table.splitlines()
    assert lines[2] == "| Capital? | Paris. | 3 | stop |"
    assert lines[3] == "| Long? | a / b c xx… | 48 | length |"  # no stray column, no line break, cut at 10
    assert all(line.count("|") == 5 for line in lines)


def _step(step, scheduled, batched, waiting, free, start=0.0, arrivals=None):
    return StepRecord(step=step, start_time=start, wall_time=0.01, scheduled=tuple(scheduled),
                      num_batched_tokens=batched, preempted=(), finished=(), blocks_copied=(), num_free_blocks=free,
                      num_used_blocks=0, num_cached_blocks=0, num_tokens_stored=0, num_waiting=waiting,
                      num_running=len(scheduled), arrivals=arrivals or {})


def test_step_limits_names_the_limits_a_step_reached():
    config = SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    two = [ScheduledEntry(f"r{i}", i, 0, 8, True) for i in range(2)]
    assert serving.step_limits(_step(1, two, 16, 0, 10), config, shortest_prompt=5) == [
        "max_num_seqs", "max_num_batched_tokens"]
    one = two[:1]
    assert serving.step_limits(_step(1, one, 8, 0, 0), config, 5) == []  # nobody waits: the pool did not bind
    assert serving.step_limits(_step(1, one, 8, 3, 1), config, 5) == ["free blocks"]  # 4 slots < a 5-token prompt
    assert serving.step_limits(_step(1, one, 8, 3, 2), config, 5) == []  # 8 slots would hold it


# ------------------------------------------------------------------ lesson 11: load runs, printed


def _timing(kind, sent, ttft, latency, tokens, itl=()):
    return load.RequestTiming(kind=kind, sent=sent, ttft=ttft, latency=latency, output_tokens=tokens, itl=list(itl))


def test_load_run_summary():
    run = load.LoadRun("x", math.inf, 2.0, [_timing("chat", 0.0, 0.1, 1.0, 6), _timing("chat", 0.0, 0.2, 1.5, 10),
                                            load.RequestTiming(kind="chat", sent=0.0, error="boom")],
                       [_step(0, [ScheduledEntry("a", 0, 0, 5, True)], 5, 1, 9),
                        _step(1, [ScheduledEntry(r, i, 0, 1, False) for i, r in enumerate("ab")], 2, 0, 9)])
    lines = run.summary().splitlines()
    assert lines == ["requests        3 sent, 1 failed, answers of 6 to 10 tokens",
                     "duration        2.0 s",
                     "served          1.00 requests/s, 8.0 output tokens/s",
                     "engine steps    2, at most 2 sequences in one step"]
    assert len(load.LoadRun("y", 1.0, 1.0, [_timing("chat", 0.0, 0.1, 0.2, 2)]).summary().splitlines()) == 3


def test_policy_ratios_divide_rate_by_rate():
    def run(label, rate, ttfts, tpot_latency, waits):
        timings = [_timing("chat", 0.0, t, t + tpot_latency, 2) for t in ttfts]
        records = [_step(i, [ScheduledEntry(f"r{i}", i, 0, 1, True)], 1, 0, 9, start=w, arrivals={f"r{i}": 0.0})
                   for i, w in enumerate(waits)]
        return load.LoadRun(label, rate, 1.0, timings, records)

    runs = {"continuous": [run("c", 1.0, [0.1, 0.2], 0.1, [0.0, 0.0]), run("c", 2.0, [0.1, 0.1], 0.1, [0.0, 0.01])],
            "static": [run("s", 1.0, [0.2, 0.6], 0.1, [0.5, 0.5]), run("s", 2.0, [0.3, 0.3], 0.2, [0.25, 0.25])]}
    lines = load.policy_ratios(runs).splitlines()
    assert lines[0].split("  ")[0] == "rate asked (req/s)" and len(lines) == 3
    assert lines[1].split() == ["1.00", "2.67x", "2.99x", "500", "0", "1.00x"]  # medians 0.4 / 0.15; p99 0.596 / 0.199
    assert lines[2].split() == ["2.00", "3.00x", "3.00x", "250", "5", "2.00x"]
    assert len({len(line) for line in lines}) == 1  # aligned


def test_prefill_spread_counts_the_steps_of_a_chunked_prompt(one_thread):
    llm = LLM(tiny("qwen3", **SMALL), max_model_len=96, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    llm.generate([list(range(5, 45)), [7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    spread = load.prefill_spread(load.LoadRun("chunked", math.inf, 1.0, [], list(engine.trace)))
    assert spread.tokens == 40 and spread.largest_step == 16
    assert spread.steps >= math.ceil(40 / 16)  # the 40-token prompt in chunks of at most 16 tokens
    assert 0 < spread.largest_beside_decode <= 16  # the short request decoded beside a chunk of the long one
    with pytest.raises(ValueError, match="no step records"):
        load.prefill_spread(load.LoadRun("bare", 1.0, 1.0, []))


def test_prefill_spread_finds_the_biggest_step_a_decode_sat_through():
    doc = lambda n: ScheduledEntry("doc", 9, 0, n, True)  # noqa: E731
    chat = lambda r: ScheduledEntry(r, 1, 0, 1, False)  # noqa: E731
    records = [_step(0, [ScheduledEntry("a", 1, 0, 30, True)], 30, 0, 9),  # a's own prefill: no one decodes
               _step(1, [chat("a"), doc(200)], 201, 0, 9),  # a decodes beside the document's whole prefill
               _step(2, [chat("a")], 1, 0, 9), _step(3, [ScheduledEntry("doc", 9, 0, 1, False)], 1, 0, 9)]
    spread = load.prefill_spread(load.LoadRun("x", 1.0, 1.0, [], records))
    assert (spread.tokens, spread.steps, spread.largest_step, spread.largest_beside_decode) == (200, 1, 201, 201)
    late = load.prefill_spread(load.LoadRun("late", 1.0, 1.0, [], records[:1] + [_step(1, [doc(200)], 200, 0, 9)]))
    assert late.largest_beside_decode == 0  # the document came after the chats were done


def test_prefill_table_has_a_row_per_budget():
    def run(budget, gap, doc_ttft, chunks):
        timings = [_timing("chat", 0.0, 0.1, 0.1 + 3 * gap, 4, itl=[gap] * 3), _timing("long", 0.5, doc_ttft, 1.0, 2)]
        records = [_step(i, [ScheduledEntry("doc", 9, 0, 100 // chunks, True), ScheduledEntry("c", 1, 0, 1, False)],
                         100 // chunks + 2, 0, 9) for i in range(chunks)]
        return load.LoadRun(f"budget {budget}", math.inf, 1.0, timings, records)

    lines = load.prefill_table({2048: run(2048, 0.5, 0.2, 1), 25: run(25, 0.1, 0.4, 4)}).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1
    assert lines[1].split() == ["2,048", "500", "500", "500", "200", "1", "102"]
    assert lines[2].split() == ["25", "100", "100", "100", "400", "4", "27"]


# ------------------------------------------------------------------ a served engine, warmed (trained model)


def test_serve_with_warm_prompts_serves_them_from_the_prefix_cache(one_thread):
    llm = LLM("smollm2", num_blocks=64, max_model_len=512, max_num_seqs=4)
    chats = load.chat_requests(["What is 12 times 12?", "Who wrote Romeo and Juliet?"], max_tokens=3,
                               system="Keep your answers short.")
    server = load.serve(llm, name="smollm2", warm=chats)
    try:
        run = load.run_load(server, chats)
        again = load.cache_prompts(server, chats)
    finally:
        server.stop()
    assert run.failed == 0 and again.failed == 0 and again.label == "cache prompts"
    assert all(t.output_tokens == 1 for t in again.requests)  # cut to one token
    admissions = [e for r in run.records for e in r.scheduled if e.is_prefill]
    assert len(admissions) == 2 and all(e.start >= 16 for e in admissions)  # both prompts found cached blocks
