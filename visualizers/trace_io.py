"""Traces on disk: our own JSON (round-trips exactly) and the Chrome / Perfetto trace-event format.

``save_trace(engine.trace, "run.json", block_size=16)`` writes every step
record; ``load_trace("run.json")`` gives them back as equal ``StepRecord``
objects, so a run recorded on a GPU box can be replayed in a notebook
anywhere: ``Dashboard.from_trace(load_trace("run.json"))``.

``save_chrome_trace(records, "run.trace.json")`` writes the format that
https://ui.perfetto.dev and chrome://tracing open: one track with a slice per
engine step, one track per request with a slice for every step that computed
tokens for it (prefill or decode) and, when the records carry arrival times, a
"waiting" slice from arrival to first scheduling; counter tracks for KV blocks
and queue lengths, and instant markers for preemptions. Times are microseconds
since the earliest event, as the format requires.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterable
from dataclasses import asdict

from kvpaging.engine.llm_engine import ScheduledEntry, StepRecord

__all__ = [
    "save_trace",
    "load_trace",
    "Trace",
    "to_chrome_trace",
    "save_chrome_trace",
    "records_to_json",
    "records_from_json",
]

FORMAT = "kvpaging-trace"
VERSION = 1


class Trace(list):
    """A list of StepRecords that also carries ``meta`` (block_size, num_blocks, anything saved with it)."""

    def __init__(self, records: Iterable[StepRecord] = (), meta: dict | None = None) -> None:
        super().__init__(records)
        self.meta = dict(meta or {})


def _record_to_dict(r: StepRecord) -> dict:
    # JSON object keys are strings: a dict keyed by seq id comes back through _from_json
    return asdict(r)


def _from_json(value, tp):
    """Rebuild a value of type ``tp`` (from the dataclass annotations) out of its JSON form."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(v, args[0]) for v in value)
        return tuple(_from_json(v, a) for v, a in zip(value, args))
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        items = value.items() if isinstance(value, dict) else value  # version 1 wrote [key, value] pairs
        return {_from_json(k, key_type): _from_json(v, value_type) for k, v in items}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _from_json(value[f.name], hints[f.name])
                     for f in dataclasses.fields(tp) if f.name in value})
    if tp is int:
        return int(value)
    if tp is float:
        return float(value)
    return value


def _record_from_dict(d: dict) -> StepRecord:
    """A StepRecord from its JSON form; fields missing in an older file keep their defaults."""
    return _from_json(d, StepRecord)


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
    arrivals: dict[str, float] = {}
    for r in records:
        arrivals.update(getattr(r, "arrivals", None) or {})  # recorded by newer engines
    t0 = min([records[0].start_time, *arrivals.values()])
    tids: dict[str, int] = {}
    waited: set[str] = set()

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
            if rid in arrivals and rid not in waited:  # from arrival to first scheduling: queued
                waited.add(rid)
                events.append({"name": "waiting", "cat": "queue", "ph": "X", "ts": us(arrivals[rid] - t0),
                               "dur": max(us(r.start_time - arrivals[rid]), 0.001), "pid": pid, "tid": tids[rid],
                               "args": {"arrival_time": arrivals[rid]}})
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
