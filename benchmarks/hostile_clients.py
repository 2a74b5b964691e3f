"""Attack a real ``kvpaging serve`` the way hostile clients would, and measure how it holds up.

The script starts ``python -m kvpaging.entrypoints.serve tiny-qwen3`` as a subprocess on a free port of
127.0.0.1 (``OMP_NUM_THREADS=1``, the server's default timeouts: headers 10 s, body 30 s,
graceful shutdown 5 s, 512 connections), then runs four parts against it, one after another:

1. slowloris: 25 raw sockets drip request headers one byte every 0.5 s and never finish them,
   25 more send whole headers (``content-length: 1000``) and half a body, then stall; while they
   are open, 10 ordinary greedy completions must still get 200. Each slow socket is timed until
   the server closes it (headers: ~10 s; bodies: an HTTP 408 at ~30 s, then closed);
2. web-page probes: POSTs that do not say they are JSON (415), a foreign ``Host`` (400), a
   foreign ``Origin`` (403); ``kvpaging:request_success_total`` on ``/metrics`` must not move;
3. hostile sampling values (top_k=2**63, temperature=1e999, seed=2**64, n=0, ...) sent while two
   innocent greedy streams run: each must get 400, and the innocents must end as they would alone
   (200 tokens, finish_reason "length", the same token ids as when each ran alone);
4. shutdown under load: SIGTERM with 8 long and 2 short streams in flight; the short ones must end
   normally, the long ones with an error event ``server_shutting_down`` and ``data: [DONE]``, and
   the process must exit with status 0, with no traceback in its log.

It prints a markdown report (a table per part, then every expectation, PASS or FAIL) and exits
with status 1 if any expectation failed, 3 if the whole run overran ``--deadline``. Every wait is
bounded and the server is killed in a ``finally``; a run takes about a minute::

    .venv/bin/python benchmarks/hostile_clients.py
    .venv/bin/python benchmarks/hostile_clients.py --json hostile.json   # the figures as JSON too

Everything stays on 127.0.0.1. The server's log goes to a temporary file (``--keep-log PATH`` keeps
a copy), which part 4 reads.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-qwen3"
HOST = "127.0.0.1"
SERVER_ARGS = ["--num-blocks", "160", "--max-model-len", "2048", "--log-level", "info"]
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, GRACE_S = 10.0, 30.0, 5.0  # kvpaging serve's defaults, not passed
ORDINARY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}


# =============================================================================== bookkeeping
class Expectations:
    """Every expectation checked, in order, with what was seen."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bool, str]] = []

    def check(self, what: str, ok: bool, seen: object = "") -> bool:
        self.items.append((what, bool(ok), str(seen)))
        return bool(ok)

    @property
    def failed(self) -> list[tuple[str, bool, str]]:
        return [item for item in self.items if not item[1]]


def median(values):
    return statistics.median(values) if values else None


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    def out(*command):
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in out("lscpu").splitlines()
                if line.startswith("Model name:")), platform.processor())
    # read-only git queries (no index refresh): which code was measured, and what was edited in it
    edited = [line[3:] for line in out("git", "--no-optional-locks", "status", "--porcelain", "--", "kvpaging")
              .splitlines() if len(line) > 3]  # "XY path"
    return {"date": out("date", "-u").strip(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": importlib.metadata.version("torch"),
            "commit": out("git", "--no-optional-locks", "rev-parse", "--short", "HEAD").strip(),
            "uncommitted_in_kvpaging": edited}


# =============================================================================== the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "kvpaging.entrypoints.serve", MODEL, "--port", str(port), *SERVER_ARGS]


def start_server(port: int, log) -> subprocess.Popen:
    # the log goes to a file, not a pipe: a pipe nobody reads fills up and blocks the server's logging
    return subprocess.Popen(server_command(port), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout_s:g} s")


def metric(url: str, name: str) -> float:
    """The sum of the Prometheus series ``name`` over its labels, from ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def requests_served(url: str) -> float:
    """``kvpaging:request_success_total``, over all its finished_reason labels (aborts included)."""
    return metric(url, "kvpaging:request_success_total")


# =============================================================================== streams
@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    name: str
    status: int | None = None
    events: list[str] = field(default_factory=list)  # every ``data:`` payload, [DONE] included
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error_code: str | None = None
    broken: str | None = None  # the transport error, when the connection failed before the stream's end
    finished: bool = False  # the reader is done, however it ended
    ended_at: float | None = None  # time.monotonic() at the end

    @property
    def ended_with_done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def last_json(self) -> dict | None:
        payloads = [e for e in self.events if e != "[DONE]"]
        return json.loads(payloads[-1]) if payloads else None


def read_stream(url: str, body: dict, stream: Stream, timeout_s: float) -> Stream:
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True},
                          timeout=httpx.Timeout(timeout_s, connect=10)) as response:
            stream.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                stream.events.append(data)
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    stream.error_code = chunk["error"].get("code")
                    continue
                for choice in chunk.get("choices", []):
                    stream.token_ids += choice.get("token_ids") or []
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        stream.broken = f"{type(error).__name__}: {error}"
    finally:
        stream.ended_at = time.monotonic()
        stream.finished = True
    return stream


def start_streams(url: str, bodies: dict[str, dict], timeout_s: float) -> tuple[dict[str, Stream], list]:
    streams = {name: Stream(name) for name in bodies}
    threads = [threading.Thread(target=read_stream, args=(url, bodies[name], streams[name], timeout_s),
                                name=f"stream-{name}", daemon=True) for name in bodies]
    for thread in threads:
        thread.start()
    return streams, threads


def wait_for(condition, timeout_s: float, every_s: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return condition()


# =============================================================================== part 1: slowloris
@dataclass
class SlowSocket:
    group: str  # "headers" or "body"
    sock: socket.socket
    opened: float
    to_drip: bytes = b""
    received: bytes = b""
    answered_after: float | None = None  # first byte from the server
    closed_after: float | None = None  # the server closed (or reset) the connection


HEADER_DRIP = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096  # never ends
BODY = json.dumps({**ORDINARY, "user": ""}).encode()
BODY = BODY[:-2] + b"x" * (1000 - len(BODY)) + b'"}'  # 1000 bytes of valid JSON, of which half is sent
BODY_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
             b"content-length: 1000\r\n\r\n")


def slowloris(port: int, per_group: int, drip_every_s: float, give_up_s: float, all_open: threading.Event,
              out: list[SlowSocket]) -> None:
    """Open the slow sockets, drip and watch them until the server has closed all (or ``give_up_s``)."""
    selector = selectors.DefaultSelector()
    try:
        for group in ("headers", "body"):
            for _ in range(per_group):
                sock = socket.create_connection((HOST, port), timeout=5)
                conn = SlowSocket(group, sock, time.monotonic())
                if group == "body":
                    sock.sendall(BODY_HEAD + BODY[:len(BODY) // 2])
                else:
                    conn.to_drip = HEADER_DRIP
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, conn)
                out.append(conn)
        all_open.set()
        start, next_drip = time.monotonic(), time.monotonic()
        while any(c.closed_after is None for c in out) and time.monotonic() - start < give_up_s:
            now = time.monotonic()
            if now >= next_drip:
                next_drip += drip_every_s
                for conn in out:
                    if conn.closed_after is None and conn.to_drip:
                        try:
                            conn.sock.send(conn.to_drip[:1])
                            conn.to_drip = conn.to_drip[1:]
                        except OSError:  # the server has closed it (EPIPE, ECONNRESET)
                            conn.closed_after = now - conn.opened
            for key, _ in selector.select(timeout=0.02):
                conn = key.data
                try:
                    data = conn.sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                now = time.monotonic()
                if data and conn.answered_after is None:
                    conn.answered_after = now - conn.opened
                conn.received += data
                if not data and conn.closed_after is None:
                    conn.closed_after = now - conn.opened
                if conn.closed_after is not None:
                    selector.unregister(conn.sock)
    finally:
        all_open.set()
        for conn in out:
            conn.sock.close()
        selector.close()


def ordinary_requests(url: str, count: int) -> tuple[list, list[float]]:
    """``count`` ordinary greedy completions, one after another: their statuses and latencies (s)."""
    statuses, latencies = [], []
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(count):
            start = time.monotonic()
            try:
                statuses.append(http.post("/v1/completions", json=ORDINARY).status_code)
            except httpx.HTTPError as error:
                statuses.append(type(error).__name__)
            latencies.append(time.monotonic() - start)
    return statuses, latencies


def part_slowloris(url: str, port: int, expect: Expectations) -> dict:
    baseline_statuses, baseline = ordinary_requests(url, 10)  # the same with no slow connection open, to compare
    conns: list[SlowSocket] = []
    all_open = threading.Event()
    worker = threading.Thread(target=slowloris, args=(port, 25, 0.5, BODY_TIMEOUT_S + 10, all_open, conns),
                              name="slowloris", daemon=True)
    worker.start()
    all_open.wait(30)
    statuses, latencies = ordinary_requests(url, 10)
    still_open = sum(c.closed_after is None for c in conns)  # after the 10 requests: should be all 50
    worker.join(BODY_TIMEOUT_S + 20)

    groups = {}
    for group, expected_s in (("headers", HEADER_TIMEOUT_S), ("body", BODY_TIMEOUT_S)):
        members = [c for c in conns if c.group == group]
        closed = [c.closed_after for c in members if c.closed_after is not None]
        got_408 = sum(c.received.startswith(b"HTTP/1.1 408") for c in members)
        answered = [c.answered_after for c in members if c.answered_after is not None]
        groups[group] = {"connections": len(members), "closed_by_server": len(closed), "got_408": got_408,
                         "answered": len(answered), "close_s_median": median(closed),
                         "close_s_min": min(closed, default=None), "close_s_max": max(closed, default=None),
                         "answer_s_median": median(answered)}
        expect.check(f"1. {group} group: all {len(members)} closed by the server", len(closed) == len(members) == 25,
                     f"{len(closed)}/{len(members)}")
        in_window = [s for s in closed if expected_s - 0.5 <= s <= expected_s + 3]
        expect.check(f"1. {group} group: closed {expected_s - 0.5:g}-{expected_s + 3:g} s after connecting",
                     len(in_window) == len(members), f"min {fmt(min(closed, default=None))} s, "
                                                     f"max {fmt(max(closed, default=None))} s")
    expect.check("1. body group: every connection got HTTP 408", groups["body"]["got_408"] == 25,
                 f"{groups['body']['got_408']}/25")
    expect.check("1. all 50 slow connections were still open after the 10 ordinary requests", still_open == 50,
                 f"{still_open} open")
    expect.check("1. the 10 ordinary requests got 200 while the slow connections were open",
                 statuses == [200] * 10, statuses)
    sample_408 = next((c.received for c in conns if c.group == "body" and c.received), b"")
    return {"groups": groups, "ordinary_statuses": statuses, "ordinary_latency_s": latencies,
            "ordinary_latency_s_median": median(latencies), "ordinary_latency_s_max": max(latencies),
            "baseline_statuses": baseline_statuses, "baseline_latency_s_median": median(baseline),
            "baseline_latency_s_max": max(baseline),
            "slow_connections_open_after_ordinary": still_open,
            "sample_408": sample_408.decode("latin-1", "replace")[:400]}


# =============================================================================== part 2: web-page probes
JSON_BODY = json.dumps(ORDINARY).encode()  # a request the server would serve, were it let through
PROBES = [  # (what, method, path, headers, expected status)
    ("POST /v1/completions, Content-Type: text/plain", "POST", "/v1/completions", {"content-type": "text/plain"},
     415),
    ("POST /v1/completions, no Content-Type", "POST", "/v1/completions", {}, 415),
    ("POST /v1/completions, Content-Type: application/x-www-form-urlencoded", "POST", "/v1/completions",
     {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("POST /v1/completions, Content-Type: multipart/form-data", "POST", "/v1/completions",
     {"content-type": "multipart/form-data; boundary=x"}, 415),
    ("GET /v1/models, Host: evil.example", "GET", "/v1/models", {"host": "evil.example"}, 400),
    ("GET /health, Host: evil.example", "GET", "/health", {"host": "evil.example"}, 400),
    ("POST /v1/completions (JSON), Origin: https://evil.example", "POST", "/v1/completions",
     {"content-type": "application/json", "origin": "https://evil.example"}, 403),
]


def part_probes(url: str, expect: Expectations) -> dict:
    rows = []
    before = requests_served(url)
    with httpx.Client(base_url=url, timeout=10) as http:
        for what, method, path, headers, expected in PROBES:
            response = http.request(method, path, headers=headers, content=JSON_BODY if method == "POST" else None)
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            outcome = "served" if response.is_success else "refused" if response.status_code == expected else "other"
            rows.append({"probe": what, "expected": expected, "status": response.status_code, "code": code,
                         "outcome": outcome})
            expect.check(f"2. {what}: refused with {expected}", response.status_code == expected,
                         f"{response.status_code} {code}")
        after = requests_served(url)
        # the control: the same body as JSON, without an Origin, is served, and the counter sees it
        control = http.post("/v1/completions", content=JSON_BODY, headers={"content-type": "application/json"})
        counted = wait_for(lambda: requests_served(url) == after + 1, 5, every_s=0.05)
    expect.check("2. no probe was served (request_success_total unchanged)", after == before and
                 not any(r["outcome"] == "served" for r in rows), f"{before:g} -> {after:g}")
    expect.check("2. control: the same body as JSON is served and counted", control.status_code == 200 and counted,
                 f"{control.status_code}, counter {after:g} -> {requests_served(url):g}")
    return {"probes": rows, "success_total_before": before, "success_total_after": after,
            "control_status": control.status_code, "control_counted": counted}


# =============================================================================== part 3: hostile sampling values
INNOCENTS = {"innocent A": [5, 6, 7], "innocent B": [11, 12, 13, 14]}
HOSTILE = [  # (what, raw JSON fields): raw text, since json cannot write 1e999
    ("top_k=2**63", f'"temperature": 1.0, "top_k": {2**63}'),
    ("temperature=1e999 (inf)", '"temperature": 1e999'),
    ("top_p=0", '"temperature": 1.0, "top_p": 0'),
    ("seed=2**64", f'"temperature": 1.0, "seed": {2**64}'),
    ("max_tokens=-1", '"temperature": 1.0, "max_tokens": -1'),
    ("n=0", '"temperature": 1.0, "n": 0'),
    ("logprobs=10**6", f'"temperature": 1.0, "logprobs": {10**6}'),
    ("stop_token_ids=[-1]", '"temperature": 1.0, "stop_token_ids": [-1]'),
]


def innocent_body(prompt: list[int]) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def hostile_text(fields: str) -> bytes:
    text = '{"model": "%s", "prompt": [5, 6, 7], %s}' % (MODEL, fields)
    if '"max_tokens"' not in fields:
        text = text[:-1] + ', "max_tokens": 8}'
    return text.encode()


def part_hostile_sampling(url: str, expect: Expectations) -> dict:
    alone = {name: read_stream(url, innocent_body(prompt), Stream(name), 60) for name, prompt in INNOCENTS.items()}
    streams, threads = start_streams(url, {n: innocent_body(p) for n, p in INNOCENTS.items()}, 60)
    both_running = wait_for(lambda: all(len(s.token_ids) >= 3 for s in streams.values()), 30)
    rows = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for what, fields in HOSTILE:
            try:
                response = http.post("/v1/completions", content=hostile_text(fields),
                                     headers={"content-type": "application/json"})
                status = response.status_code
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text[:200]
            except httpx.HTTPError as error:
                status, message = None, f"{type(error).__name__}: {error}"
            running = sum(not s.finished for s in streams.values())
            rows.append({"value": what, "status": status, "message": message, "innocents_running": running,
                         "innocent_tokens_so_far": [len(s.token_ids) for s in streams.values()]})
            expect.check(f"3. {what}: refused with 400", status == 400, f"{status}: {message[:80]}")
    for thread in threads:
        thread.join(60)
    health = httpx.get(url + "/health", timeout=10).status_code
    expect.check("3. both innocents were streaming when every hostile request was answered",
                 both_running and all(r["innocents_running"] == 2 for r in rows),
                 [r["innocents_running"] for r in rows])
    results = {}
    for name, s in streams.items():
        same = s.token_ids == alone[name].token_ids
        results[name] = {"status": s.status, "tokens": len(s.token_ids), "finish_reason": s.finish_reason,
                         "done": s.ended_with_done, "broken": s.broken, "same_as_alone": same,
                         "alone_tokens": len(alone[name].token_ids), "alone_finish_reason": alone[name].finish_reason}
        expect.check(f"3. {name}: 200 tokens, finish_reason length, then [DONE]", s.status == 200 and
                     len(s.token_ids) == 200 and s.finish_reason == "length" and s.ended_with_done and not s.broken,
                     f"{s.status}, {len(s.token_ids)} tokens, {s.finish_reason}, [DONE] {s.ended_with_done}")
        expect.check(f"3. {name}: the same token ids as when it ran alone", same and len(alone[name].token_ids) == 200,
                     f"first difference at {first_difference(s.token_ids, alone[name].token_ids)}" if not same else
                     "identical")
    expect.check("3. /health is 200 afterwards", health == 200, health)
    return {"hostile": rows, "innocents": results, "health_after": health}


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# =============================================================================== part 4: shutdown under load
def part_shutdown(url: str, process: subprocess.Popen, log_path: Path, expect: Expectations) -> dict:
    bodies = {f"long {i}": {"model": MODEL, "prompt": [5, 6], "max_tokens": 1900, "ignore_eos": True,
                            "temperature": 0} for i in range(8)}
    bodies |= {f"short {i}": {"model": MODEL, "prompt": [5, 6], "max_tokens": 20, "ignore_eos": True,
                              "temperature": 0} for i in range(2)}
    streams, threads = start_streams(url, bodies, 60)
    all_going = wait_for(lambda: all(len(s.events) >= 3 for s in streams.values()), 30)
    short_in_flight = sum(not s.finished for name, s in streams.items() if name.startswith("short"))
    long_in_flight = sum(not s.finished for name, s in streams.items() if name.startswith("long"))
    events_at_sigterm = {name: len(s.events) for name, s in streams.items()}
    sigterm_at = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        exit_code = process.wait(timeout=GRACE_S + 20)
    except subprocess.TimeoutExpired:
        exit_code = None
    exit_s = time.monotonic() - sigterm_at if exit_code is not None else None
    for thread in threads:
        thread.join(15)

    short_ok, long_shutdown, long_broken, long_other, end_s = 0, 0, 0, 0, []
    rows = []
    for name, s in streams.items():
        last = s.last_json()
        if name.startswith("short"):
            normal = (s.finish_reason == "length" and s.ended_with_done and len(s.token_ids) == 20
                      and s.error_code is None and not s.broken)
            short_ok += normal
            ending = "length, [DONE]" if normal else s.broken or f"{s.finish_reason}, {s.events[-1:]}"
        else:
            by_shutdown = (s.ended_with_done and last is not None
                           and last.get("error", {}).get("code") == "server_shutting_down")
            long_shutdown += by_shutdown
            long_broken += bool(s.broken)
            long_other += not by_shutdown and not s.broken
            ending = ("error server_shutting_down, [DONE]" if by_shutdown else
                      f"broken: {s.broken}" if s.broken else f"{s.finish_reason}, {s.events[-2:]}")
            if s.ended_at is not None:
                end_s.append(s.ended_at - sigterm_at)
        rows.append({"stream": name, "events_at_sigterm": events_at_sigterm[name], "tokens": len(s.token_ids),
                     "ending": ending,
                     "ended_s_after_sigterm": s.ended_at - sigterm_at if s.ended_at else None})
    log = log_path.read_text(errors="replace")
    tracebacks = log.count("Traceback")
    abort_lines = sum("the server is shutting down: aborting" in line for line in log.splitlines())
    header_closes = sum("its request headers took more than" in line for line in log.splitlines())
    expect.check("4. every stream had sent at least 3 events before SIGTERM", all_going,
                 f"fewest {min(events_at_sigterm.values())}")
    expect.check("4. the process exited with status 0", exit_code == 0, exit_code)
    expect.check(f"4. it exited within {GRACE_S + 5:g} s of SIGTERM", exit_s is not None and exit_s <= GRACE_S + 5,
                 fmt(exit_s))
    expect.check("4. both short streams ended normally (finish_reason length, then [DONE])", short_ok == 2,
                 f"{short_ok}/2")
    expect.check("4. all 8 long streams ended with error server_shutting_down, then [DONE]", long_shutdown == 8,
                 f"{long_shutdown}/8, {long_broken} broken")
    expect.check("4. no Traceback in the server's log", tracebacks == 0, tracebacks)
    expect.check("4. one 'shutting down: aborting' line per long stream", abort_lines == 8, abort_lines)
    return {"exit_code": exit_code, "exit_s_after_sigterm": exit_s, "short_in_flight_at_sigterm": short_in_flight,
            "long_in_flight_at_sigterm": long_in_flight, "short_ended_normally": short_ok,
            "long_ended_by_shutdown_event": long_shutdown, "long_broken": long_broken, "long_other": long_other,
            "long_end_s_median": median(end_s), "long_end_s_max": max(end_s, default=None),
            "log_tracebacks": tracebacks, "log_abort_lines": abort_lines, "log_header_timeout_closes": header_closes,
            "log_lines": len(log.splitlines()), "streams": rows}


# =============================================================================== the report
def report(meta: dict, results: dict, expect: Expectations) -> str:
    out = ["# Hostile clients against `kvpaging serve`", "",
           f"- date: {meta['date']}",
           f"- machine: {meta['cpu']}, {meta['cores']} cores; Python {meta['python']}, torch {meta['torch']}",
           f"- code: commit {meta['commit']}, " + (
               f"uncommitted changes in {', '.join(meta['uncommitted_in_kvpaging'])}"
               if meta["uncommitted_in_kvpaging"] else "no uncommitted changes in kvpaging/"),
           f"- command: `{meta['command']}`",
           f"- server: `OMP_NUM_THREADS=1 {meta['server_command']}` (default timeouts), healthy after "
           f"{fmt(meta.get('server_start_s'), 1)} s", ""]
    p1 = results.get("slowloris")
    if p1:
        g = p1["groups"]
        out += ["## 1. Slowloris (25 + 25 slow connections) and 10 ordinary requests meanwhile", "",
                table(["group", "connections", "closed by server", "HTTP 408", "close s (min)", "close s (median)",
                       "close s (max)"],
                      [[name, v["connections"], v["closed_by_server"], v["got_408"], v["close_s_min"],
                        v["close_s_median"], v["close_s_max"]] for name, v in
                       (("headers dripped 1 B / 0.5 s", g["headers"]), ("body half sent, then stalled", g["body"]))]),
                "", table(["10 ordinary requests", "got 200", "latency median (ms)", "latency max (ms)"],
                          [["with the 50 slow connections open", sum(s == 200 for s in p1["ordinary_statuses"]),
                            1000 * p1["ordinary_latency_s_median"], 1000 * p1["ordinary_latency_s_max"]],
                           ["before them (none open)", sum(s == 200 for s in p1["baseline_statuses"]),
                            1000 * p1["baseline_latency_s_median"],
                            1000 * p1["baseline_latency_s_max"]]]), "",
                f"All 50 slow connections were still open after the 10 requests: "
                f"{p1['slow_connections_open_after_ordinary']} open. The header group got no bytes back "
                f"({g['headers']['answered']} answered); the body group's 408 came "
                f"{fmt(g['body']['answer_s_median'])} s (median) after connecting."
                + (f" The server logged {results['shutdown']['log_header_timeout_closes']} header-timeout closes."
                   if results.get("shutdown") else ""), ""]
    p2 = results.get("probes")
    if p2:
        out += ["## 2. Web-page probes", "",
                table(["probe", "expected", "status", "error code", "outcome"],
                      [[r["probe"], r["expected"], r["status"], r["code"], r["outcome"]] for r in p2["probes"]]), "",
                f"`kvpaging:request_success_total`: {p2['success_total_before']:g} before the probes, "
                f"{p2['success_total_after']:g} after; the control (same body as JSON) got "
                f"{p2['control_status']} and was counted: {p2['control_counted']}.", ""]
    p3 = results.get("hostile_sampling")
    if p3:
        out += ["## 3. Hostile sampling values beside two innocent greedy streams", "",
                table(["value", "status", "innocents still streaming (tokens so far)", "message"],
                      [[r["value"], r["status"], f"{r['innocents_running']} "
                        f"({', '.join(map(str, r['innocent_tokens_so_far']))})",
                        r["message"][:90].replace("|", "\\|")] for r in p3["hostile"]]), "",
                table(["innocent", "status", "tokens", "finish_reason", "[DONE]", "same ids as alone"],
                      [[n, v["status"], v["tokens"], v["finish_reason"], v["done"], v["same_as_alone"]]
                       for n, v in p3["innocents"].items()]), ""]
    p4 = results.get("shutdown")
    if p4:
        out += ["## 4. SIGTERM with 8 long and 2 short streams in flight", "",
                table(["exit code", "s to exit", "short ended normally", "long: shutdown event + [DONE]",
                       "long: broken", "Tracebacks in log", "'shutting down: aborting' lines"],
                      [[p4["exit_code"], p4["exit_s_after_sigterm"], f"{p4['short_ended_normally']}/2",
                        f"{p4['long_ended_by_shutdown_event']}/8", p4["long_broken"], p4["log_tracebacks"],
                        p4["log_abort_lines"]]]), "",
                f"In flight at SIGTERM: {p4['short_in_flight_at_sigterm']}/2 short, "
                f"{p4['long_in_flight_at_sigterm']}/8 long.", "",
                table(["stream", "events before SIGTERM", "tokens in the end", "ending", "s after SIGTERM"],
                      [[r["stream"], r["events_at_sigterm"], r["tokens"], r["ending"], r["ended_s_after_sigterm"]]
                       for r in p4["streams"]]), ""]
    if results.get("error"):
        out += [f"**The run stopped early:** {results['error']}", ""]
    out += ["## Expectations", "", table(["expectation", "result", "seen"],
                                         [[w, "PASS" if ok else "**FAIL**", s[:120].replace("|", "\\|")]
                                          for w, ok, s in expect.items]), ""]
    failed = expect.failed
    out.append(f"**{len(expect.items) - len(failed)}/{len(expect.items)} expectations held.**" if not failed else
               f"**{len(failed)} of {len(expect.items)} expectations failed:** " + "; ".join(w for w, _, _ in failed))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    parser.add_argument("--keep-log", metavar="PATH", help="copy the server's log to PATH")
    parser.add_argument("--deadline", type=float, default=180,
                        help="seconds after which the whole run is abandoned (server killed, status 3)")
    args = parser.parse_args(argv)

    port = free_port()
    url = f"http://{HOST}:{port}"
    meta = machine()
    meta["command"] = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    meta["server_command"] = shlex.join(["python", *server_command(port)[1:]])
    expect, results = Expectations(), {}
    workdir = Path(tempfile.mkdtemp(prefix="kvpaging-hostile-"))
    log_path = workdir / "server.log"
    process = None
    started = time.monotonic()

    def overran():
        print(f"hostile_clients: the run took more than {args.deadline:g} s; killing the server", file=sys.stderr)
        if process is not None and process.poll() is None:
            process.kill()
        os._exit(3)

    watchdog = threading.Timer(args.deadline, overran)
    watchdog.daemon = True
    watchdog.start()
    try:
        with open(log_path, "w") as log:
            process = start_server(port, log)
            meta["server_start_s"] = wait_until_healthy(url, process, 120)
            results["slowloris"] = part_slowloris(url, port, expect)
            results["probes"] = part_probes(url, expect)
            results["hostile_sampling"] = part_hostile_sampling(url, expect)
            results["shutdown"] = part_shutdown(url, process, log_path, expect)
    except Exception as error:  # noqa: BLE001 — a part that could not run is a failed expectation, reported
        results["error"] = f"{type(error).__name__}: {error}"
        expect.check("the run completed", False, results["error"])
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        watchdog.cancel()
        if args.keep_log and log_path.exists():
            shutil.copyfile(log_path, args.keep_log)
        meta["wall_s"] = time.monotonic() - started
    print(report(meta, results, expect))
    print(f"\n(wall time {meta['wall_s']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results,
                                               "expectations": [{"what": w, "ok": ok, "seen": s}
                                                                for w, ok, s in expect.items]}, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)
    if expect.failed:
        print("\nFAILED: " + "; ".join(w for w, _, _ in expect.failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # SIGTERM to this script (a CI timeout) unwinds through the finally, which kills the server
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
