"""Lesson 11: a server under load, measured the way a client sees it.

The lesson starts kvpaging's OpenAI-compatible server inside the notebook
(``serve``), sends it chat requests with the official ``openai`` client at a chosen
rate (``run_load``: Poisson arrivals, each request streamed), and reads two kinds of
figures from one run:

- the client's: time to first token (TTFT), time per output token (TPOT), the gaps
  between streamed chunks (ITL), requests and tokens per second;
- the engine's, from the step records of the same run: how long each request waited
  in the queue before its first step, and how many batch slots sat idle while requests
  waited (lesson 06's bubbles, here as queueing delay).

``benchmarks/serving.py`` measures the same client-side figures from the command line
(with ``httpx``, against any server); this module is its notebook-sized cousin.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass, field

from kvpaging.teach import text_table

__all__ = ["RequestTiming", "LoadRun", "percentile", "arrival_offsets", "chat_requests", "token_requests", "document_request",
           "serve", "run_load", "latency_throughput_figure", "idle_slots_while_waiting", "sweep_table",
           "request_timeline_figure", "itl_figure", "cache_prompts", "policy_ratios", "PrefillSpread",
           "prefill_spread", "prefill_table"]


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linear between closest ranks (numpy's default); None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: a Poisson process of ``rate`` per second.

    The gaps between arrivals are exponential with mean ``1 / rate``, from a seeded generator, so
    the same seed gives the same schedule. ``rate=inf`` sends everything at once.
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, offsets = 0.0, []
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def chat_requests(questions, max_tokens: int, system: str | None = None) -> list[dict]:
    """One chat request (OpenAI ``messages``) per question, each answering in at most ``max_tokens`` tokens."""
    head = [{"role": "system", "content": system}] if system else []
    return [{"messages": head + [{"role": "user", "content": q}], "max_tokens": max_tokens, "kind": "chat"}
            for q in questions]


def token_requests(prompts: list[list[int]], lengths: list[int]) -> list[dict]:
    """One completion request per prompt of token ids, each generating exactly its ``lengths`` tokens (``ignore_eos``):
    for a model without a tokenizer, or a load whose answer lengths are chosen (``batching.request_stream``). The
    server streams each token's id (``return_token_ids``), which is what the timing counts."""
    return [{"prompt": list(p), "max_tokens": n, "kind": "chat", "extra_body": {"ignore_eos": True, "return_token_ids": True}}
            for p, n in zip(prompts, lengths)]


def document_request(tokenizer, doc_tokens: int, max_tokens: int,
                     question: str = "What is this text about? Answer in one sentence.") -> dict:
    """A long chat request: ``doc_tokens`` tokens of real prose (Python's documentation), then ``question``."""
    from kvpaging.teach.text import real_text

    ids = tokenizer(real_text(8 * doc_tokens + 200), add_special_tokens=False)["input_ids"][:doc_tokens]
    text = tokenizer.decode(ids)
    return {"messages": [{"role": "user", "content": f"{text}\n\n{question}"}], "max_tokens": max_tokens,
            "kind": "long"}


@dataclass
class RequestTiming:
    """One request as its client saw it (seconds)."""

    kind: str  # "chat" or "long" (from the request's "kind")
    sent: float  # when it was sent, from the start of the run
    ttft: float | None = None  # sent -> first chunk carrying text
    latency: float | None = None  # sent -> end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between text-carrying chunks
    output_tokens: int = 0  # from the stream's usage
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(end - first token) / (output tokens - 1): the average gap after the first token."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadRun:
    """One run at one rate: what every client saw, and the engine's step records from the same run."""

    label: str
    rate: float  # requests per second asked for (inf: all at once)
    duration: float  # first request sent -> last stream ended
    requests: list[RequestTiming]
    records: list = field(default_factory=list)  # StepRecords of the engine while the run lasted

    def _done(self, kind: str | None) -> list[RequestTiming]:
        return [r for r in self.requests if not r.error and (kind is None or r.kind == kind)]

    @property
    def failed(self) -> int:
        return sum(bool(r.error) for r in self.requests)

    @property
    def request_throughput(self) -> float:
        return len(self._done(None)) / self.duration

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self._done(None)) / self.duration

    def ttft_ms(self, q: float = 50, kind: str | None = None) -> float | None:
        return _ms(percentile([r.ttft for r in self._done(kind)], q))

    def tpot_ms(self, q: float = 50, kind: str | None = None) -> float | None:
        return _ms(percentile([r.tpot for r in self._done(kind) if r.tpot is not None], q))

    def itl_ms(self, q: float = 50, kind: str | None = None) -> float | None:
        return _ms(percentile([gap for r in self._done(kind) for gap in r.itl], q))

    def e2e_ms(self, q: float = 50, kind: str | None = None) -> float | None:
        return _ms(percentile([r.latency for r in self._done(kind)], q))

    def queue_waits(self) -> list[float]:
        """Seconds each request waited in the engine's queue: its arrival -> the start of its first step."""
        return [record.start_time - arrival for record in self.records for arrival in record.arrivals.values()]

    def queue_wait_ms(self, q: float = 50) -> float | None:
        return _ms(percentile(self.queue_waits(), q))

    def summary(self) -> str:
        """The run's headline figures as labelled lines, for ``print``: requests, answer lengths, duration,
        throughput and, when the engine's step records were kept, its steps."""
        done = self._done(None)
        lengths = [r.output_tokens for r in done]
        lines = [f"{'requests':<16}{len(self.requests)} sent, {self.failed} failed"
                 + (f", answers of {min(lengths)} to {max(lengths)} tokens" if lengths else ""),
                 f"{'duration':<16}{self.duration:.1f} s",
                 f"{'served':<16}{self.request_throughput:.2f} requests/s, {self.output_throughput:.1f} output tokens/s"]
        if self.records:
            most = max(len(r.scheduled) for r in self.records)
            lines.append(f"{'engine steps':<16}{len(self.records)}, at most {most} sequences in one step")
        return "\n".join(lines)

    def row(self) -> dict:
        """The run's figures as one table row (milliseconds, per second)."""
        return {"target": self.label, "rate": self.rate, "done": len(self._done(None)), "failed": self.failed,
                "req/s": self.request_throughput, "tok/s": self.output_throughput,
                "TTFT p50": self.ttft_ms(50), "TTFT p99": self.ttft_ms(99), "queue wait p50": self.queue_wait_ms(50),
                "TPOT p50": self.tpot_ms(50), "ITL p99": self.itl_ms(99)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def serve(llm, name: str = "kvpaging", warm: list[dict] | None = None):
    """Serve ``llm`` (idle) on a free local port from this process: a ``BackgroundServer``, stop it with ``.stop()``.

    The same app as ``kvpaging serve``; ``server.url`` is its address, ``server.llm`` the ``AsyncLLM`` in front of
    the engine (a ``Dashboard`` can attach to it), and ``run_load(server, ...)`` listens to the engine's steps
    for as long as its run lasts. With ``warm``, those requests' prompts are computed first
    (``cache_prompts``), so that the timed runs find them in the prefix cache.
    """
    from kvpaging.entrypoints.serve import BackgroundServer, create_app

    server = BackgroundServer(create_app(llm, served_model_name=name))
    if warm:
        cache_prompts(server, warm)
    return server


def cache_prompts(server, requests: list[dict]) -> "LoadRun":
    """Send ``requests`` once, all at once, each cut to one token, and return that (unmeasured) run: their
    prompts then sit in the server's prefix cache, as on a server that has answered them before, so that a
    timed run that follows pays no one-time cost that another server's run does not."""
    return run_load(server, [dict(r, max_tokens=1) for r in requests], label="cache prompts")


async def _one(client, model: str, request: dict, start: float, delay: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    body = {k: v for k, v in request.items() if k != "kind"}
    timing = RequestTiming(kind=request.get("kind", "chat"), sent=time.perf_counter() - start)
    sent = time.perf_counter()
    last = None
    pieces = []
    chat = "prompt" not in body  # a chat (messages), or a completion of token ids (token_requests)
    try:
        api = client.chat.completions if chat else client.completions
        stream = await api.create(model=model, stream=True, temperature=0.0, stream_options={"include_usage": True},
                                  **body)
        async for chunk in stream:
            if chunk.usage is not None:
                timing.output_tokens = chunk.usage.completion_tokens
                timing.prompt_tokens = chunk.usage.prompt_tokens
            if not chunk.choices:
                continue  # the usage chunk
            if chat:
                piece = chunk.choices[0].delta.content
            else:
                ids = getattr(chunk.choices[0], "token_ids", None) or []
                piece = chunk.choices[0].text or ("" if not ids else " ".join(map(str, ids)) + " ")
            if not piece:
                continue  # the role chunk and the closing chunk carry no text
            now = time.perf_counter()
            if last is None:
                timing.ttft = now - sent
            else:
                timing.itl.append(now - last)
            last = now
            pieces.append(piece)
        timing.latency = time.perf_counter() - sent
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not raised, as a benchmark does
        timing.error = f"{type(error).__name__}: {error}"
    if last is None and not timing.error:
        timing.error = "no text streamed"
    timing.text = "".join(pieces)
    return timing


async def _load(base_url: str, model: str, requests: list[dict], offsets: list[float], api_key: str):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(_one(client, model, r, start, d) for r, d in zip(requests, offsets)))
        return list(timings), time.perf_counter() - start


def _run_in_thread(fn):
    """Run ``fn()`` in a thread of its own and return its result: a notebook's kernel already runs an event
    loop in its main thread, where ``asyncio.run`` is refused."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, name="kvpaging-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_load(server, requests: list[dict], rate: float = math.inf, *, offsets: list[float] | None = None,
             seed: int = 0, label: str = "", model: str | None = None, api_key: str = "none") -> LoadRun:
    """Send ``requests`` to ``server`` (a ``BackgroundServer``, or a base URL) at ``rate`` per second.

    Arrivals follow ``arrival_offsets(len(requests), rate, seed)``, or ``offsets`` (seconds from the
    start, one per request) when given; every request is a streamed chat completion at temperature 0.
    For a ``BackgroundServer`` the engine's step records of the run are kept too (an observer for the
    run's length), for the queue waits. Returns a ``LoadRun``.
    """
    base_url = getattr(server, "url", server)
    engine = getattr(getattr(server, "llm", None), "engine", None)
    if model is None:
        import httpx

        model = httpx.get(base_url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"},
                          timeout=10).json()["data"][0]["id"]
    if offsets is None:
        offsets = arrival_offsets(len(requests), rate, seed)
    elif len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} offsets for {len(requests)} requests")
    records: list = []
    if engine is not None:
        engine.add_observer(records.append)  # called on the engine thread: one list append per step
    try:
        timings, duration = _run_in_thread(lambda: asyncio.run(_load(base_url, model, requests, offsets, api_key)))
    finally:
        if engine is not None:
            engine.remove_observer(records.append)
    return LoadRun(label, rate, duration, timings, records)


def idle_slots_while_waiting(records, num_slots: int) -> tuple[int, int]:
    """(idle slot-steps while a request waited, slot-steps while a request waited), over ``records``.

    A step in which requests wait in the queue but fewer than ``num_slots`` sequences run has idle
    slots that a waiting request could have used: lesson 06's bubbles, which a server turns into
    queueing delay.
    """
    waiting = [r for r in records if r.num_waiting > 0]
    idle = sum(max(0, num_slots - len({e.seq_id for e in r.scheduled})) for r in waiting)
    return idle, num_slots * len(waiting)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def policy_ratios(runs: dict[str, list[LoadRun]], baseline: str = "continuous", other: str = "static") -> str:
    """A plain-text table comparing two policies' runs rate by rate (``runs[name][i]`` at the same rate):
    ``other``'s TTFT (median and p99) and TPOT (median) divided by ``baseline``'s (above 1: ``other`` is
    slower), and both median queue waits in ms."""
    header = ["rate asked (req/s)", f"TTFT p50 {other}/{baseline}", f"TTFT p99 {other}/{baseline}",
              f"queue wait p50 {other} (ms)", f"queue wait p50 {baseline} (ms)", f"TPOT p50 {other}/{baseline}"]
    rows = [[_rate_text(b.rate).replace(" requests/s", ""), _ratio(o.ttft_ms(50), b.ttft_ms(50)),
             _ratio(o.ttft_ms(99), b.ttft_ms(99)), _ms_text(o.queue_wait_ms(50)), _ms_text(b.queue_wait_ms(50)),
             _ratio(o.tpot_ms(50), b.tpot_ms(50))] for b, o in zip(runs[baseline], runs[other])]
    return text_table(header, rows)


@dataclass(frozen=True)
class PrefillSpread:
    """How a run's longest prefill was cut into steps, and the biggest step the other requests' decoding sat
    through (from the engine's step records)."""

    tokens: int  # prompt tokens computed for the request that prefilled the most (a cached prefix not counted)
    steps: int  # how many steps its prefill was spread over
    largest_step: int  # the most tokens any step of the run carried (prompt chunks and decode tokens together)
    largest_beside_decode: int  # the most tokens of a step in which another request decoded a token (0: none did)


def prefill_spread(run: LoadRun) -> PrefillSpread:
    """Find the request of ``run`` that prefilled the most tokens, and count the steps its prefill took:
    one when the step budget holds the whole prompt, ``prompt / budget`` or more when chunked. Also the
    biggest step in which another request decoded: the longest gap between two of its tokens."""
    tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    for record in run.records:
        for entry in record.scheduled:
            if entry.is_prefill:
                tokens[entry.request_id] = tokens.get(entry.request_id, 0) + entry.num_tokens
                steps[entry.request_id] = steps.get(entry.request_id, 0) + 1
    if not tokens:
        raise ValueError(f"run {run.label!r} has no step records with a prefill (run it through a served engine)")
    longest = max(tokens, key=tokens.get)
    beside = [r.num_batched_tokens for r in run.records
              if any(not e.is_prefill and e.request_id != longest for e in r.scheduled)]
    return PrefillSpread(tokens[longest], steps[longest], max(r.num_batched_tokens for r in run.records),
                         max(beside, default=0))


def prefill_table(runs: dict[int, LoadRun], chat: str = "chat", long: str = "long") -> str:
    """A plain-text table of runs of short chats with a long prompt among them, one row per step budget
    (``runs[budget]``): the chats' inter-token gaps (p99 and median) and time per output token, the long
    request's time to first token, how its prefill was spread over steps, and the biggest step the chats'
    decoding sat through (``prefill_spread``)."""
    header = ["budget (tokens/step)", "chats' ITL p99 (ms)", "chats' ITL p50 (ms)", "chats' TPOT p50 (ms)",
              "document's TTFT (ms)", "document's prefill steps", "biggest step beside a chat's decode (tokens)"]
    rows = []
    for budget, run in runs.items():
        spread = prefill_spread(run)
        rows.append([f"{budget:,}", _ms_text(run.itl_ms(99, chat)), _ms_text(run.itl_ms(50, chat)),
                     _ms_text(run.tpot_ms(50, chat)), _ms_text(run.ttft_ms(50, long)), str(spread.steps),
                     str(spread.largest_beside_decode)])
    return text_table(header, rows)


def sweep_table(runs: list[LoadRun]) -> str:
    """A markdown table of runs: throughput and latency percentiles (ms)."""
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["| policy | rate asked (req/s) | served req/s | output tok/s | TTFT p50 | TTFT p99 | queue wait p50 | "
             "TPOT p50 | ITL p99 |", "|---" * 9 + "|"]
    for run in runs:
        r = run.row()
        lines.append(f"| {r['target']} | {cell(r['rate'], '.2f')} | {r['req/s']:.2f} | {r['tok/s']:.1f} | "
                     f"{cell(r['TTFT p50'], ',.0f')} | {cell(r['TTFT p99'], ',.0f')} | "
                     f"{cell(r['queue wait p50'], ',.0f')} | {cell(r['TPOT p50'], ',.0f')} | "
                     f"{cell(r['ITL p99'], ',.0f')} |")
    return "\n".join(lines)


def latency_throughput_figure(runs: dict[str, list[LoadRun]], title: str = "Latency against throughput"):
    """TTFT (median and p99) against output tokens per second, one line per policy, a point per rate."""
    import plotly.graph_objects as go

    colours = {"static": "#fdb462", "continuous": "#80b1d3"}
    fig = go.Figure()
    for name, series in runs.items():
        series = sorted(series, key=lambda run: run.output_throughput)
        colour = colours.get(name, None)
        x = [run.output_throughput for run in series]
        text = [_rate_text(run.rate) for run in series]
        for q, dash in ((50, "solid"), (99, "dot")):
            fig.add_scatter(x=x, y=[run.ttft_ms(q) for run in series], mode="lines+markers", name=f"{name}, p{q}",
                            text=text, line={"dash": dash, "color": colour},
                            hovertemplate="%{text}<br>%{x:.1f} tok/s<br>TTFT %{y:,.0f} ms<extra></extra>")
    fig.update_layout(title=title, xaxis_title="output tokens per second (served)",
                      yaxis_title="time to first token (ms)", yaxis_type="log", height=380)
    return fig


def request_timeline_figure(runs: dict[str, LoadRun], title: str = "Each request, from the moment it was sent"):
    """One bar per request and run, on a shared time axis: grey from sent to first token, coloured while it streams."""
    from plotly.subplots import make_subplots

    colours = {"static": "#fdb462", "continuous": "#80b1d3"}
    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[f"{name}: {_rate_text(run.rate)}" for name, run in runs.items()])
    for row, (name, run) in enumerate(runs.items(), start=1):
        done = [t for t in run.requests if not t.error]
        labels = [f"request {i}" for i in range(len(done))]
        waits = [t.ttft for t in done]
        streams = [t.latency - t.ttft for t in done]
        fig.add_bar(y=labels, x=waits, base=[t.sent for t in done], orientation="h", marker_color="#cccccc",
                    name="sent → first token", showlegend=row == 1, legendgroup="wait", row=row, col=1,
                    hovertemplate="waited %{x:.2f} s<extra></extra>")
        fig.add_bar(y=labels, x=streams, base=[t.sent + t.ttft for t in done], orientation="h",
                    marker_color=colours.get(name, "#80b1d3"), name=f"{name}: streaming", row=row, col=1,
                    customdata=[t.output_tokens for t in done],
                    hovertemplate="%{customdata} tokens in %{x:.2f} s<extra></extra>")
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    fig.update_xaxes(title_text="seconds since the run started", row=len(runs), col=1)
    fig.update_layout(title=title, barmode="overlay", height=220 + 160 * len(runs))
    return fig


def itl_figure(runs: dict, kind: str | None = None, title: str = "Gaps between consecutive tokens"):
    """The inter-token gaps (ms) of each run's requests of ``kind``, one box per run, every gap drawn."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, run in runs.items():
        gaps = [1000 * gap for t in run._done(kind) for gap in t.itl]
        fig.add_box(y=gaps, name=run.label or str(name), boxpoints="all", jitter=0.4, pointpos=0,
                    hovertemplate="%{y:,.0f} ms<extra></extra>")
    fig.update_layout(title=title, yaxis_title="ms between two tokens", yaxis_type="log", height=360,
                      showlegend=False)
    return fig


def _rate_text(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:.2f} requests/s"
