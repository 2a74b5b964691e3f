"""The helpers behind lesson 11 (kvpaging.teach.load: a served engine under load), and the saved notebooks."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvpaging import LLM, SamplingParams
from kvpaging.models import tiny
from kvpaging.engine.step_record import ScheduledEntry, StepRecord
from kvpaging.teach import load

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ arrivals and percentiles


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [0.004, 0.001, 0.003, 0.002, 0.005]
    assert load.percentile(values, 50) == pytest.approx(0.003)
    assert load.percentile(values, 0) == 0.001 and load.percentile(values, 100) == 0.005
    assert load.percentile(values, 90) == pytest.approx(0.0046)  # 0.004 + 0.6 * (0.005 - 0.004)
    assert load.percentile([], 50) is None


def test_arrivals_are_a_seeded_poisson_process():
    a = load.arrival_offsets(2000, rate=4.0, seed=3)
    assert a == load.arrival_offsets(2000, rate=4.0, seed=3) != load.arrival_offsets(2000, rate=4.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential gaps of mean 1 / rate
    assert load.percentile(gaps, 50) == pytest.approx(math.log(2) / 4.0, rel=0.15)  # ... whose median is ln 2 / rate
    assert load.arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        load.arrival_offsets(3, 0.0)


def test_chat_requests_carry_the_system_prompt_and_the_cap():
    reqs = load.chat_requests(["a?", "b?"], max_tokens=7, system="Be brief.")
    assert [r["messages"][-1]["content"] for r in reqs] == ["a?", "b?"]
    assert all(r["messages"][0] == {"role": "system", "content": "Be brief."} and r["max_tokens"] == 7
               and r["kind"] == "chat" for r in reqs)
    assert load.chat_requests(["a?"], 3)[0]["messages"] == [{"role": "user", "content": "a?"}]


# ------------------------------------------------------------------ a run's figures


def _timing(kind, sent, ttft, latency, tokens, itl=()):
    return load.RequestTiming(kind=kind, sent=sent, ttft=ttft, latency=latency, output_tokens=tokens, itl=list(itl))


def _record(step, start, running, waiting, arrivals=None):
    entries = tuple(ScheduledEntry(f"r{i}", i, 0, 1, False) for i in running)
    return StepRecord(step=step, start_time=start, wall_time=0.01, scheduled=entries, num_batched_tokens=len(entries),
                      preempted=(), finished=(), blocks_copied=(), num_free_blocks=0, num_used_blocks=0,
                      num_cached_blocks=0, num_tokens_stored=0, num_waiting=waiting, num_running=len(running),
                      arrivals=arrivals or {})


def test_load_run_reads_throughput_latencies_and_queue_waits():
    requests = [_timing("chat", 0.0, 0.1, 1.1, 11, itl=[0.1] * 10), _timing("chat", 0.5, 0.3, 0.7, 5, itl=[0.1] * 4),
                _timing("long", 1.0, 0.9, 1.0, 1), load.RequestTiming(kind="chat", sent=1.5, error="boom")]
    records = [_record(0, 10.0, [0], 0, {"a": 10.0}), _record(1, 10.6, [0, 1], 0, {"b": 10.5}),
               _record(2, 11.3, [0, 1, 2], 0, {"c": 11.0})]
    run = load.LoadRun("x", 2.0, 2.0, requests, records)
    assert run.failed == 1 and run.request_throughput == 1.5 and run.output_throughput == 8.5  # 3 done, 17 tokens, 2 s
    assert run.ttft_ms(50) == pytest.approx(300) and run.ttft_ms(50, "long") == pytest.approx(900)
    assert requests[0].tpot == pytest.approx(0.1) and requests[2].tpot is None  # one token: no gap to average
    assert run.tpot_ms(50) == pytest.approx(100) and run.itl_ms(99, "chat") == pytest.approx(100)
    assert run.e2e_ms(50, "chat") == pytest.approx(900)
    assert run.queue_waits() == pytest.approx([0.0, 0.1, 0.3])  # first step's start - arrival
    row = run.row()
    assert row["done"] == 3 and row["queue wait p50"] == pytest.approx(100)
    table = load.sweep_table([run, run])
    assert len(table.splitlines()) == 4 and "| x | 2.00 | 1.50 | 8.5 | 300 |" in table
    assert len(load.latency_throughput_figure({"static": [run], "continuous": [run, run]}).data) == 4
    assert len(load.request_timeline_figure({"static": run, "continuous": run}).data) == 4
    box = load.itl_figure({"a": run}, kind="chat").data[0]
    assert len(box.y) == 14 and max(box.y) == pytest.approx(100)


def test_idle_slots_are_counted_only_while_someone_waits():
    records = [_record(0, 0.0, [0, 1], 0), _record(1, 0.1, [0], 2), _record(2, 0.2, [0, 1, 2, 3], 1)]
    assert load.idle_slots_while_waiting(records, num_slots=4) == (3 + 0, 8)
    assert load.idle_slots_while_waiting(records[:1], num_slots=4) == (0, 0)


@pytest.mark.parametrize("scheduling,idle", [("static", True), ("continuous", False)])
def test_a_static_batch_keeps_arrivals_waiting_beside_idle_slots(scheduling, idle):
    """The lesson's claim, in step counts: a request arriving while a static batch decodes waits beside empty
    slots until the batch is done; continuous batching seats it at the next step."""
    llm = LLM(tiny("qwen3", num_hidden_layers=2, vocab_size=512), max_model_len=64, max_num_seqs=4,
              scheduling=scheduling, kv_cache_memory_bytes=1 << 20)
    engine = llm.engine
    engine.keep_trace, engine.trace = True, []
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()
    engine.step()  # a has sampled its first tokens: a static batch is closed now
    engine.add_request("b", [8, 9], params)
    while engine.has_unfinished_requests():
        engine.step()
    wasted, waiting = load.idle_slots_while_waiting(engine.trace, num_slots=4)
    if idle:
        assert waiting >= 4 * 3 and wasted == waiting - waiting // 4  # one slot busy (a), three idle, every such step
    else:
        assert (wasted, waiting) == (0, 0)  # b never waited a step


def test_token_requests_stream_token_ids_of_exactly_their_lengths():
    """Section 3's load: completions of token ids on a model with no tokenizer, each generating exactly its drawn
    length (ignore_eos); every token streamed counts, with its id as the text the client keeps."""
    llm = LLM(tiny("qwen3", num_hidden_layers=2, vocab_size=512), max_model_len=64, max_num_seqs=4,
              kv_cache_memory_bytes=1 << 20)
    requests = load.token_requests([[5, 6, 7], [8, 9], [10] * 12], [3, 1, 6])
    assert requests[0] == {"prompt": [5, 6, 7], "max_tokens": 3, "kind": "chat",
                           "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    server = load.serve(llm, name="tiny")
    try:
        run = load.run_load(server, requests, 50.0, seed=2)
    finally:
        server.stop()
    assert run.failed == 0 and [t.output_tokens for t in run.requests] == [3, 1, 6]
    # a chunk carries one token, or several when the server's stream fell behind the engine: never more gaps than tokens
    assert all(len(t.itl) <= n - 1 for t, n in zip(run.requests, [3, 1, 6])) and all(0 < t.ttft <= t.latency for t in run.requests)
    assert [len(t.text.split()) for t in run.requests] == [3, 1, 6]  # every token's id, whatever the chunking
    assert all(int(i) < 512 for t in run.requests for i in t.text.split())


# ------------------------------------------------------------------ a served engine under load (trained model)


@pytest.fixture(scope="module")
def trained_llm(one_thread):
    return LLM("smollm2", num_blocks=64, max_model_len=512, max_num_seqs=4)


def test_run_load_through_a_served_engine(trained_llm):
    chats = load.chat_requests(["What is 12 times 12?", "Who wrote Romeo and Juliet?", "What is photosynthesis?"],
                               max_tokens=4)
    doc = load.document_request(trained_llm.get_tokenizer(), 40, max_tokens=2)
    server = load.serve(trained_llm, name="smollm2")
    try:
        run = load.run_load(server, chats + [doc], offsets=[0.0, 0.0, 0.05, 0.1], label="t")
        burst = load.run_load(server.url, chats[:2], math.inf, model="smollm2")  # a bare URL: no engine records
    finally:
        server.stop()
    assert run.failed == 0 and [t.kind for t in run.requests] == ["chat"] * 3 + ["long"]
    assert all(0 < t.output_tokens <= 4 and t.text and 0 < t.ttft <= t.latency for t in run.requests)
    assert [t.sent >= offset for t, offset in zip(run.requests, [0.0, 0.0, 0.05, 0.1])] == [True] * 4
    assert run.requests[3].output_tokens <= 2 and run.requests[3].prompt_tokens > 40
    assert len(run.queue_waits()) == 4 and all(w >= 0 for w in run.queue_waits())  # one first step per request
    assert sum(len(r.scheduled) > 0 for r in run.records) == len(run.records) > 0
    assert run.output_throughput == pytest.approx(sum(t.output_tokens for t in run.requests) / run.duration)
    assert burst.failed == 0 and burst.records == [] and burst.queue_wait_ms(50) is None
    with pytest.raises(ValueError, match="2 offsets for 3 requests"):
        load.run_load("http://127.0.0.1:9", chats, offsets=[0.0, 0.0], model="m")


# ------------------------------------------------------------------ the notebooks

NOTEBOOKS = ["11_serving_under_load", "solutions/11_solutions"]


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
    assert "cdn.plot.ly" not in text and "<script" not in text


# a measured figure typed into prose: a number followed by a unit of time, a rate or a ratio
MEASURED = re.compile(r"\d[\d,.]*\s*(ms\b|s\b|req/s|requests/s|tok(en)?s/s|×|x\b|%)")


def test_lesson_prose_holds_no_typed_measurement():
    """Figures of a run belong in cell outputs (computed), never in the markdown a run cannot change."""
    nb = json.loads((ROOT / "lessons" / "11_serving_under_load.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            assert not MEASURED.search(text), MEASURED.search(text).group(0)
