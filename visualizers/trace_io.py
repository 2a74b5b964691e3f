"""Traces on disk: our own JSON (round-trips exactly) and the Chrome / Perfetto trace-event format.

``save_trace(engine.trace, "run.json", block_size=16)`` writes every step
record; ``load_trace("run.json")`` gives them back as equal ``StepRecord``
objects, so a run recorded on a GPU box can be replayed in a notebook
anywhere: ``Dashboard.from_trace(load_trace("run.json"))``.

``save_chrome_trace(records, "run.trace.json")`` writes the format that
https://ui.perfetto.dev and chrome://tracing open: one track with a slice per
engine step, one track per request with a slice for every step that computed
tokens for it (prefill or decode), counter tracks for KV blocks and queue
lengths, and instant markers for preemptions. Times are microseconds since the
first step, as the format requires.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict

from ..engine import ScheduledEntry, StepRecord

__all__ = ["save_trace", "load_trace", "Trace", "to_chrome_trace", "save_chrome_trace", "records_to_json", "records_from_json"]

FORMAT = "kvpaging-trace"
VERSION = 1


class Trace(list):
    """A list of StepRecords that also carries ``meta`` (block_size, num_blocks, anything saved with it)."""

    def __init__(self, records: Iterable[StepRecord] = (), meta: dict | None = None) -> None:
        super().__init__(records)
        self.meta = dict(meta or {})


def _record_to_dict(r: StepRecord) -> dict:
    d = asdict(r)
    # JSON object keys are strings: keep the tables as [seq_id, [block ids]] pairs instead
    d["block_tables"] = [[sid, list(table)] for sid, table in r.block_tables.items()]
    return d


def _record_from_dict(d: dict) -> StepRecord:
    return StepRecord(
        step=int(d["step"]),
        start_time=float(d["start_time"]),
        wall_time=float(d["wall_time"]),
        scheduled=tuple(ScheduledEntry(**e) for e in d["scheduled"]),
        num_batched_tokens=int(d["num_batched_tokens"]),
        preempted=tuple(d["preempted"]),
        finished=tuple(d["finished"]),
        blocks_copied=tuple(tuple(pair) for pair in d["blocks_copied"]),
        num_free_blocks=int(d["num_free_blocks"]),
        num_used_blocks=int(d["num_used_blocks"]),
        num_cached_blocks=int(d["num_cached_blocks"]),
        num_tokens_stored=int(d["num_tokens_stored"]),
        num_waiting=int(d["num_waiting"]),
        num_running=int(d["num_running"]),
        block_tables={int(sid): tuple(table) for sid, table in d["block_tables"]},
    )


def records_to_json(records: Iterable[StepRecord], **meta) -> dict:
    return {"format": FORMAT, "version": VERSION, "meta": meta, "records": [_record_to_dict(r) for r in records]}


def records_from_json(data: dict) -> Trace:
    if data.get("format") != FORMAT:
        raise ValueError(f"not a kvpaging trace: format is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ValueError(f"kvpaging trace version {data.get('version')!r} is not supported (expected {VERSION})")
    return Trace((_record_from_dict(d) for d in data["records"]), data.get("meta"))


def save_trace(records: Iterable[StepRecord], path, **meta) -> None:
    """Write step records as JSON. Pass ``block_size=`` (and anything else) to keep it with them.

    A ``Trace`` (from :func:`load_trace`) keeps its own meta unless overridden.
    """
    meta = {**getattr(records, "meta", {}), **meta}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records_to_json(records, **meta), f, separators=(",", ":"))


def load_trace(path) -> Trace:
    """Read step records written by :func:`save_trace`: a list of ``StepRecord`` with ``.meta``."""
    with open(path, encoding="utf-8") as f:
        return records_from_json(json.load(f))


def to_chrome_trace(records: Iterable[StepRecord], *, process_name: str = "kvpaging engine") -> dict:
    """Step records as a Chrome trace-event JSON object (``{"traceEvents": [...]}``)."""
    records = list(records)
    pid = 1
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "engine steps"}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": 0}},
    ]
    if not records:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = records[0].start_time
    tids: dict[str, int] = {}

    def us(seconds: float) -> float:
        return round(seconds * 1e6, 3)

    for r in records:
        ts, dur = us(r.start_time - t0), max(us(r.wall_time), 0.001)
        events.append({
            "name": f"step {r.step}", "cat": "step", "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 0,
            "args": {
                "num_batched_tokens": r.num_batched_tokens, "num_seqs": len(r.scheduled),
                "num_running": r.num_running, "num_waiting": r.num_waiting,
                "preempted": list(r.preempted), "finished": list(r.finished),
                "blocks_copied": [list(p) for p in r.blocks_copied],
            },
        })
        per_request: dict[str, list[ScheduledEntry]] = {}
        for e in r.scheduled:
            per_request.setdefault(e.request_id, []).append(e)
        for rid, entries in per_request.items():
            if rid not in tids:
                tids[rid] = len(tids) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tids[rid],
                               "args": {"name": f"request {rid}"}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tids[rid],
                               "args": {"sort_index": tids[rid]}})
            prefill = any(e.is_prefill for e in entries)
            tokens = sum(e.num_tokens for e in entries)
            events.append({
                "name": f"prefill {tokens} tok" if prefill else "decode", "cat": "prefill" if prefill else "decode",
                "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tids[rid],
                "args": {"step": r.step, "tokens": tokens, "seq_ids": [e.seq_id for e in entries]},
            })
        events.append({"name": "KV blocks", "ph": "C", "ts": ts, "pid": pid,
                       "args": {"used": r.num_used_blocks, "free": r.num_free_blocks}})
        events.append({"name": "queues", "ph": "C", "ts": ts, "pid": pid,
                       "args": {"running": r.num_running, "waiting": r.num_waiting}})
        if r.preempted:
            events.append({"name": f"preempted {list(r.preempted)}", "ph": "i", "s": "p", "ts": ts, "pid": pid,
                           "tid": 0, "args": {"seq_ids": list(r.preempted)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(records: Iterable[StepRecord], path, **kwargs) -> None:
    """Write :func:`to_chrome_trace` to ``path``; open it at https://ui.perfetto.dev."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(records, **kwargs), f)
