"""Helpers for lesson 08 (CUDA graphs): count the operators of a decode step, time decode steps,
and read GPU figures recorded in ``benchmarks/RESULTS.md``.

Why count operators? On a GPU every operator a forward pass dispatches (a matmul,
a norm, an add, a copy ...) is at least one kernel launch, and the host pays a few
microseconds for each whatever the batch size. Counting them on any machine tells
how many launches a decode step costs; a CUDA graph replays all of them with one call.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "OpCount",
    "count_decode_step_ops",
    "dispatch_overhead_us",
    "decode_step_ms",
    "interleaved_step_ms",
    "launches_per_layer",
    "GpuTable",
    "read_results_table",
    "default_results_path",
    "CUDA_GRAPHS_MARKER",
    "show_figure",
    "step_time_figure",
]

def _storages(tree) -> set[int]:
    leaves, _ = tree_flatten(tree)
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor) and t.numel()}


class _CountOps(TorchDispatchMode):
    """Counts the aten operators that reach the dispatcher, and which of them do work.

    An operator whose every output aliases one of its inputs (a view, a reshape, a
    ``.to()`` to the dtype a tensor already has) does no work and would launch no
    GPU kernel; every other operator, and every in-place one (name ending in ``_``),
    counts as a launch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        outputs = _storages(out)
        if name.endswith("_") or not outputs or not outputs <= _storages((args, kwargs)):
            self.launches[name] += 1
        return out


@dataclass(frozen=True)
class OpCount:
    """Operators dispatched by one engine step."""

    batch: int
    total: int  # every aten operator
    launches: int  # those that do work (views excluded): about one GPU kernel launch each
    by_name: dict[str, int] = field(default_factory=dict)  # launches per operator name

    def top(self, k: int = 8) -> list[tuple[str, int]]:
        return Counter(self.by_name).most_common(k)


def count_decode_step_ops(llm, batch: int, prompt_len: int = 16, seed: int = 0) -> OpCount:
    """Operators dispatched by one decode step of ``batch`` sequences.

    Adds ``batch`` random prompts, runs steps until every sequence is decoding,
    counts the operators of exactly one decode step, then aborts the requests
    (the engine is left idle and its pool clean).
    """
    from kvpaging.sampling_params import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("count_decode_step_ops needs an idle engine")
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    ids = [f"count-{seed}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    try:
        # prefill until every prompt has produced its first token: the next step is decode-only
        for _ in range(100):
            engine.step()
            if all(s.num_computed_tokens >= s.prompt_len for s in engine.scheduler.running) and \
                    len(engine.scheduler.running) == batch and not engine.scheduler.waiting:
                break
        counter = _CountOps()
        with counter:
            engine.step()
    finally:
        for rid in ids:
            if rid in engine.scheduler.requests:
                engine.abort_request(rid)
    return OpCount(batch, sum(counter.counts.values()), sum(counter.launches.values()), dict(counter.launches))


def dispatch_overhead_us(repeats: int = 2000) -> float:
    """Median host time (microseconds) to dispatch one tiny operator on this machine.

    A 1-element add does almost no arithmetic, so its time is what any operator
    costs the host before the device does anything: argument parsing, dispatch,
    allocation. On a GPU the launch itself comes on top.
    """
    a = torch.ones(1)
    b = torch.ones(1)
    for _ in range(100):  # warm up
        torch.add(a, b)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.add(a, b)
        samples.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(samples)


def decode_step_ms(llm, batch: int, prompt_len: int = 32, tokens: int = 16, seed: int = 0,
                   repeats: int = 2) -> float:
    """Median wall time (ms) of a decode-only step with ``batch`` running sequences.

    Uses the engine's own step records (``StepRecord.wall_time``): the whole step,
    scheduler and sampler included, as a server would see it. On CUDA the engine
    syncs when it reads the sampled tokens back, so wall time includes the GPU's work.
    The first run warms up and is not counted.
    """
    from kvpaging.sampling_params import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, engine.vocab_size, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    keep, trace = engine.keep_trace, engine.trace
    engine.keep_trace = True
    times: list[float] = []
    try:
        for run in range(repeats + 1):
            engine.trace = []
            llm.generate(prompts, params, use_tqdm=False)
            if run == 0:
                continue
            times += [r.wall_time for r in engine.trace
                      if r.scheduled and len(r.scheduled) == batch and not any(e.is_prefill for e in r.scheduled)]
    finally:
        engine.keep_trace, engine.trace = keep, trace
    if not times:
        raise RuntimeError(f"no decode-only step with {batch} sequences was recorded")
    return statistics.median(times) * 1e3


def interleaved_step_ms(engines: dict, batches, rounds: int = 3,
                        desc: str = "interleaved rounds") -> dict[str, dict[int, float]]:
    """Decode step time (ms) of each engine at each batch size, measured in interleaved rounds.

    ``engines`` maps a name to an ``LLM``. Every round times each engine once at every
    batch size (:func:`decode_step_ms` with ``repeats=1``), one engine after the other, so a
    busy moment on the machine hits all of them alike; the middle of the rounds' times
    (``sorted(times)[rounds // 2]``) is kept. Returns ``{name: {batch: ms}}``.
    """
    from kvpaging.progress import track

    samples = {(name, b): [] for name in engines for b in batches}
    for _ in track(range(rounds), desc=desc):
        for b in batches:
            for name, llm in engines.items():
                samples[name, b].append(decode_step_ms(llm, b, repeats=1))
    return {name: {b: sorted(samples[name, b])[rounds // 2] for b in batches} for name in engines}


def launches_per_layer(launches: dict[int, int]) -> tuple[float, float]:
    """Split a decode step's launches into a part per layer and the rest: ``launches = rest + per_layer * layers``.

    ``launches`` maps a number of layers to the launches of one decode step of a model
    with that many layers (:func:`count_decode_step_ops`); at least two different layer
    counts are needed. A least-squares line through the points: with two, exact.
    Returns ``(per_layer, rest)``; the rest is embedding, final norm, LM head and sampler.
    """
    if len(launches) < 2:
        raise ValueError(f"need launches at two or more layer counts, got {sorted(launches)}")
    per_layer, rest = statistics.linear_regression(list(launches), list(launches.values()))
    return per_layer, rest


# ------------------------------------------------------------------ figures recorded on a GPU

CUDA_GRAPHS_MARKER = "cuda_graphs"


def default_results_path() -> Path:
    """``benchmarks/RESULTS.md`` of the repository this package was installed from (editable install)."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"


@dataclass(frozen=True)
class GpuTable:
    """One measured table from RESULTS.md, with what the file says about where and when."""

    header: list[str]
    rows: list[list[str]]
    device: str | None
    date: str | None
    command: str | None

    def column(self, name: str) -> list[str]:
        i = next(k for k, h in enumerate(self.header) if name.lower() in h.lower())
        return [r[i] for r in self.rows]

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


_META = {
    "device": re.compile(r"^\s*[-*]?\s*\**(device|machine|gpu)\**\s*[:=]\s*(.+)$", re.I),
    "date": re.compile(r"^\s*[-*]?\s*\**date\**\s*[:=]\s*(.+)$", re.I),
    "command": re.compile(r"^\s*[-*]?\s*\**command\**\s*[:=]\s*`?(.+?)`?\s*$", re.I),
}


def _parse_table(lines: list[str]) -> tuple[list[str], list[list[str]]] | None:
    table: list[str] = []  # the first run of consecutive table lines
    for ln in lines:
        if ln.strip().startswith("|"):
            table.append(ln.strip())
        elif table:
            break
    if len(table) < 3:
        return None
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table]
    header, rule, rows = cells[0], cells[1], cells[2:]
    if not all(set(c) <= set("-: ") for c in rule):
        return None
    return header, [r for r in rows if len(r) == len(header)]


def _meta(lines: list[str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {"device": None, "date": None, "command": None}
    for ln in lines:
        for key, rx in _META.items():
            m = rx.match(ln)
            if m and found[key] is None:
                found[key] = m.groups()[-1].strip().strip("*").strip()
    return found


def read_results_table(path: str | Path | None = None, marker: str = CUDA_GRAPHS_MARKER,
                       must_contain: str = "eager") -> GpuTable | None:
    """The table between ``<!-- results:MARKER -->`` and ``<!-- /results:MARKER -->`` in RESULTS.md.

    Inside the markers, lines such as ``device: NVIDIA H200``, ``date: 2025-01-31`` and
    ``command: python benchmarks/cuda_graphs.py ...`` say where the figures come from.
    Without markers, the first Markdown table whose header mentions ``must_contain``
    under a heading that mentions the marker's words is taken (the heading's section
    supplies the device, date and command lines). Returns None when the file or the
    table does not exist: the caller must then say that nothing was measured.
    """
    path = default_results_path() if path is None else Path(path)
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"<!--\s*results:{re.escape(marker)}\s*-->(.*?)<!--\s*/results:{re.escape(marker)}\s*-->",
                  text, re.S)
    sections = [m.group(1)] if m else []
    if not sections:
        words = marker.replace("_", " ").lower()
        parts = re.split(r"^(#+ .*)$", text, flags=re.M)
        for i in range(1, len(parts) - 1, 2):
            if words in parts[i].lower().replace("-", " "):
                sections.append(parts[i + 1])
    for body in sections:
        lines = body.splitlines()
        parsed = _parse_table(lines)
        if parsed is None or must_contain.lower() not in " ".join(parsed[0]).lower() or not parsed[1]:
            continue
        meta = _meta(lines)
        return GpuTable(parsed[0], parsed[1], meta["device"], meta["date"], meta["command"])
    return None


# ------------------------------------------------------------------ pictures

def show_figure(fig) -> None:
    """Display a plotly figure as plotly's notebook output (renders offline, untrusted, with no kernel)."""
    from kvpaging.visualizers.static import display_figure

    display_figure(fig)


def step_time_figure(series: dict[str, dict[int, float]], title: str = "Decode step time vs batch size"):
    """Two panels: ms per step, and ms per sequence (step time / batch), one line per series."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("ms per decode step", "ms per sequence per step"))
    for name, points in series.items():
        b = sorted(points)
        fig.add_trace(go.Scatter(x=b, y=[points[k] for k in b], mode="lines+markers", name=name), 1, 1)
        fig.add_trace(go.Scatter(x=b, y=[points[k] / k for k in b], mode="lines+markers", name=name,
                                 showlegend=False), 1, 2)
    fig.update_xaxes(type="log", title_text="batch size (sequences decoding)")
    fig.update_yaxes(type="log", col=2)
    fig.update_layout(title=title, height=380, width=900)
    return fig
