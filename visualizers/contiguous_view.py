"""ContiguousMemoryView: the allocator paged attention replaced, failing in front of you.

Before paging, each request got one contiguous run of KV slots sized for its
worst case. The top panel draws the slot line: coloured runs are
reservations (the darker part holds real tokens, the lighter rest is
reserved for tokens that may never come), white gaps are holes. The bottom
panel follows *total free* against the *largest hole*: when they part, free
memory is scattered, and a request can be refused although enough slots are
free in total. That step is marked with a red cross, and the title says so.

Two sources of data:

- ``ContiguousMemoryView(simulate_contiguous(num_slots, events))``: a scripted
  scenario from :mod:`kvpaging.core.contiguous`;
- ``ContiguousMemoryView.from_trace(engine.trace, reserve_tokens=...)``: what a
  contiguous allocator would have done with the very requests of a paged run
  (:class:`ContiguousTraceSim`). It is a what-if: requests it refuses keep
  asking every step, while the real engine ran them anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpaging.core.contiguous import ContiguousAllocator, ContiguousStep, OutOfMemory, Reservation
from kvpaging.visualizers.base import PALETTE, SMALL, View
from kvpaging.visualizers.replay import TraceReplay

__all__ = [
    "ContiguousMemoryView",
    "ContiguousFrame",
    "contiguous_frame",
    "ContiguousTraceSim",
    "fragmentation_refusals",
]


@dataclass(frozen=True)
class ContiguousFrame:
    """The slot line after one step, and the free-memory history up to it."""

    run_starts: np.ndarray
    run_lengths: np.ndarray
    run_used: np.ndarray
    run_labels: list[str]
    run_colors: list[str]
    hole_starts: np.ndarray
    hole_lengths: np.ndarray
    total_free: np.ndarray  # per step, up to this one
    largest_hole: np.ndarray
    refusal_positions: np.ndarray  # steps (up to this one) that refused a request which would have fit in total
    refusal_sizes: np.ndarray
    refused_now: list[OutOfMemory]
    figures: dict
    title: str


def fragmentation_refusals(steps: Sequence[ContiguousStep]) -> list[tuple[int, OutOfMemory]]:
    """Every (position, refusal) where enough slots were free in total but not in one hole."""
    return [
        (i, r) for i, step in enumerate(steps) for r in step.results
        if isinstance(r, OutOfMemory) and r.blocked_by_fragmentation
    ]


def contiguous_frame(steps: Sequence[ContiguousStep], position: int, *, colors: dict | None = None,
                     label: str | None = None, refusals: list | None = None,
                     label_of: Callable[[int], str] | None = None) -> ContiguousFrame:
    """Arrays for the slot line after ``steps[position]`` (pure).

    ``colors`` maps request ids to colours (a stable colour per request);
    ``refusals`` may pass a precomputed :func:`fragmentation_refusals` list;
    ``label_of`` names a position the way the controls do (default ``t=position``).
    """
    label_of = label_of or (lambda i: f"t={i}")
    snap = steps[position].snapshot
    colors = colors if colors is not None else {}
    runs = snap.runs
    run_colors = [colors.get(r.request_id) or PALETTE[hash(str(r.request_id)) % len(PALETTE)] for r in runs]
    holes = snap.holes
    total_free = np.array([s.snapshot.total_free for s in steps[: position + 1]])
    largest = np.array([s.snapshot.largest_hole for s in steps[: position + 1]])
    refusals = fragmentation_refusals(steps) if refusals is None else refusals
    shown = [(i, r) for i, r in refusals if i <= position]
    refused_now = [r for i, r in shown if i == position]
    figures = {
        "num_slots": snap.num_slots,
        "reserved_slots": snap.reserved_slots,
        "used_slots": snap.used_slots,
        "total_free": snap.total_free,
        "largest_hole": snap.largest_hole,
        "num_holes": len(holes),
        "external_fragmentation": snap.external_fragmentation,
        "internal_waste": snap.internal_waste,
        "first_refusal": refusals[0][0] if refusals else None,
    }
    label = label if label is not None else label_of(position)
    title = (
        f"Contiguous allocator at {label}: {snap.total_free} slots free in {len(holes)} hole{'s' * (len(holes) != 1)}, "
        f"largest {snap.largest_hole}" + SMALL + f"{snap.reserved_slots}/{snap.num_slots} slots reserved, "
        f"{snap.used_slots} hold tokens (internal waste {snap.internal_waste:.0%})</span>"
    )
    if refused_now:
        r = refused_now[0]
        title += (SMALL + f"<b style='color:#d62728'>refused {r.request_id!s} ({r.requested} slots) although "
                  f"{r.total_free} are free in total: largest hole {r.largest_hole}</b></span>")
    elif shown:
        title += SMALL + f"first refusal by fragmentation at {label_of(shown[0][0])}</span>"
    return ContiguousFrame(
        run_starts=np.array([r.start for r in runs], dtype=np.int64),
        run_lengths=np.array([r.num_slots for r in runs], dtype=np.int64),
        run_used=np.array([r.num_used for r in runs], dtype=np.int64),
        run_labels=[f"{r.request_id}: {r.num_used}/{r.num_slots} used" for r in runs],
        run_colors=run_colors,
        hole_starts=np.array([h[0] for h in holes], dtype=np.int64),
        hole_lengths=np.array([h[1] for h in holes], dtype=np.int64),
        total_free=total_free,
        largest_hole=largest,
        refusal_positions=np.array([i for i, _ in shown], dtype=np.int64),
        refusal_sizes=np.array([r.requested for _, r in shown], dtype=np.int64),
        refused_now=refused_now,
        figures=figures,
        title=title,
    )


class ContiguousTraceSim:
    """Replays a paged engine's requests on a contiguous allocator, one record at a time.

    A request asks for ``reserve_tokens`` slots (an int for all, a dict by
    request id, or a function of the request id) when it is first scheduled,
    and keeps asking every step until a hole is large enough. Its used slots
    follow its longest sequence; its run is released when all its sequences
    have finished.
    """

    def __init__(self, replay: TraceReplay, num_slots: int | None = None,
                 reserve_tokens: int | dict | Callable[[str], int] | None = None) -> None:
        self.replay = replay
        self.num_slots = num_slots
        self.reserve_tokens = reserve_tokens
        self.allocator: ContiguousAllocator | None = None
        self.steps: list[ContiguousStep] = []
        self.pending: list[str] = []
        self.live: dict[str, set[int]] = {}
        self._default_need: int | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def need(self, request_id: str) -> int:
        r = self.reserve_tokens
        if r is None:
            if self._default_need is None:
                self._default_need = self.default_need
            return self._default_need
        if isinstance(r, dict):
            return int(r[request_id])
        if callable(r):
            return int(r(request_id))
        return int(r)

    @property
    def default_need(self) -> int:
        """Without a reserve size: one more than the longest sequence in the trace so far (its worst case).

        Worked out once per :meth:`sync`: for a replayed trace that is the whole run.
        """
        longest = max((int(d.num_tokens.max()) for d in self.replay.steps if d.num_tokens.size), default=1)
        return longest + 1

    def sync(self) -> None:
        replay = self.replay
        self._default_need = None
        if self.allocator is None and len(replay):
            self.allocator = ContiguousAllocator(self.num_slots or replay.num_blocks * replay.block_size)
        for position in range(len(self.steps), len(replay)):
            self._append(position)

    def _append(self, position: int) -> None:
        record = self.replay.records[position]
        derived = self.replay.steps[position]
        alloc = self.allocator
        actions, results = [], []
        # in arrival order (sequence ids are given at arrival): a step lists its one-token sequences first, and a
        # new request whose prompt was all found in the prefix cache but its last token is one of them
        for entry in sorted(record.scheduled, key=lambda e: e.seq_id):
            rid = entry.request_id
            if rid not in self.live:
                self.live[rid] = set()
                self.pending.append(rid)
            self.live[rid].add(entry.seq_id)
        for sid in derived.forked:
            self.live.setdefault(self.replay.request_of(sid), set()).add(sid)
        for rid in list(self.pending):
            action = ("reserve", rid, self.need(rid))
            result = alloc.reserve(rid, action[2])
            actions.append(action)
            results.append(result)
            if isinstance(result, Reservation):
                self.pending.remove(rid)
        lengths = dict(zip(derived.seq_ids.tolist(), derived.num_tokens.tolist()))
        reserved = {r.request_id: r for r in alloc.runs()}
        for rid, seqs in self.live.items():
            if rid in reserved:
                used = max((lengths.get(s, 0) for s in seqs), default=0)
                used = min(used, reserved[rid].num_slots)
                if used and used != reserved[rid].num_used:
                    actions.append(("use", rid, used))
                    results.append(alloc.set_used(rid, used))
        for sid in derived.ended:
            rid = self.replay.request_of(sid)
            seqs = self.live.get(rid)
            if seqs is None:
                continue
            seqs.discard(sid)
            if not seqs:
                del self.live[rid]
                if rid in reserved:
                    actions.append(("release", rid))
                    results.append(alloc.release(rid))
                elif rid in self.pending:
                    self.pending.remove(rid)  # finished before it ever got memory
        self.steps.append(ContiguousStep(position, tuple(actions), tuple(results), alloc.snapshot()))


class ContiguousMemoryView(View):
    """The contiguous baseline allocator, step by step (see the module docstring)."""

    height = 480
    title_lines = 3  # the state, the reservations, and a refusal

    def __init__(self, steps: Sequence[ContiguousStep] | None = None, *, controls: bool = True,
                 interval_ms: int | None = None, width: int | None = None, _sim: ContiguousTraceSim | None = None) -> None:
        super().__init__(controls=controls, interval_ms=interval_ms, width=width)
        self._sim = _sim
        self._steps = list(steps) if steps is not None else []
        self._colors: dict = {}
        self._refusals: list | None = None
        self.sync()
        self.open_at_default()

    @classmethod
    def from_trace(cls, trace, *, block_size: int | None = None, num_slots: int | None = None,
                   reserve_tokens=None, **kwargs) -> ContiguousMemoryView:
        """What a contiguous allocator of ``num_slots`` (default: the paged pool's size) makes of a trace."""
        replay = trace if isinstance(trace, TraceReplay) else TraceReplay(trace, block_size=block_size)
        return cls(_sim=ContiguousTraceSim(replay, num_slots, reserve_tokens), **kwargs)

    @property
    def steps(self) -> list[ContiguousStep]:
        return self._sim.steps if self._sim is not None else self._steps

    def sync(self) -> None:
        if self._sim is not None:
            before = len(self._sim)
            self._sim.sync()
            if len(self._sim) != before:
                self._refusals = None

    def num_positions(self) -> int:
        return len(self.steps)

    def position_label(self, position: int) -> str:
        if self._sim is not None and position < len(self._sim.replay):
            return f"step {self._sim.replay.records[position].step}"
        return f"t={position}"

    def default_position(self) -> int:
        """The first refusal by fragmentation, the moment lesson 03 is about; else the last step."""
        if self._refusals is None:
            self._refusals = fragmentation_refusals(self.steps)
        if self._refusals:
            return self._refusals[0][0]
        return max(self.num_positions() - 1, 0)

    def _color(self, request_id) -> str:
        if request_id not in self._colors:
            self._colors[request_id] = PALETTE[len(self._colors) % len(PALETTE)]
        return self._colors[request_id]

    def compute(self, position: int) -> ContiguousFrame:
        if self._refusals is None:
            self._refusals = fragmentation_refusals(self.steps)
        for r in self.steps[position].snapshot.runs:
            self._color(r.request_id)
        return contiguous_frame(self.steps, position, colors=self._colors, label=self.position_label(position),
                                refusals=self._refusals, label_of=self.position_label)

    def _x(self, positions) -> np.ndarray:
        """What the time axis shows for positions: engine steps for a trace, t for a scripted scenario."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._sim is not None and len(self._sim.replay):
            steps = np.array([r.step for r in self._sim.replay.records[: len(self.steps)]], dtype=np.int64)
            return steps[positions] if positions.size else positions
        return positions

    def base_figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=2, cols=1, row_heights=[0.35, 0.65], vertical_spacing=0.18,
                            subplot_titles=("slot line", "total free vs largest hole"))
        bar = {"orientation": "h", "y": [], "x": [], "base": []}
        fig.add_trace(go.Bar(name="reserved", marker={"color": [], "line": {"width": 1, "color": "#444"}},
                             opacity=0.45, hovertemplate="%{hovertext}<extra>reserved</extra>", **bar), row=1, col=1)
        fig.add_trace(go.Bar(name="holds tokens", marker={"color": [], "line": {"width": 0}},
                             hovertemplate="%{hovertext}<extra>used</extra>", **bar), row=1, col=1)
        fig.add_trace(go.Bar(name="hole (free)", marker={"color": "#ffffff", "line": {"width": 1, "color": "#bbb"},
                                                         "pattern": {"shape": "/", "fgcolor": "#ccc"}},
                             hovertemplate="hole at %{base}: %{x} slots<extra></extra>", **bar), row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name="total free", line={"color": "#1f77b4"},
                                 marker={"size": 4}), row=2, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name="largest hole", line={"color": "#ff7f0e"},
                                 marker={"size": 4}), row=2, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="refused although it fits in total",
                                 marker={"symbol": "x", "size": 12, "color": "#d62728"},
                                 hovertemplate="refused %{y} slots at %{x}<extra></extra>"), row=2, col=1)
        num_slots = self.steps[0].snapshot.num_slots if self.steps else 1
        fig.update_layout(
            barmode="overlay", height=self.height, margin={"l": 60, "r": 10, "b": 40},
            title={"text": "Contiguous allocator"}, legend={"orientation": "h", "y": -0.2},
            plot_bgcolor="#fafafa",
        )
        fig.update_xaxes(range=[0, num_slots], row=1, col=1)
        fig.update_yaxes(showticklabels=False, row=1, col=1)
        fig.update_xaxes(title_text="engine step" if self._sim is not None else "t",
                         row=2, col=1)
        fig.update_yaxes(title_text="slots", rangemode="tozero", row=2, col=1)
        return fig

    def frame(self, position: int) -> tuple[list[dict], dict]:
        f = self.compute(position)
        y_runs = ["memory"] * len(f.run_starts)
        xs = self._x(np.arange(len(f.total_free)))
        traces = [
            {"x": f.run_lengths, "base": f.run_starts, "y": y_runs, "hovertext": f.run_labels,
             "marker": {"color": f.run_colors}},
            {"x": f.run_used, "base": f.run_starts, "y": y_runs, "hovertext": f.run_labels,
             "marker": {"color": f.run_colors}},
            {"x": f.hole_lengths, "base": f.hole_starts, "y": ["memory"] * len(f.hole_starts)},
            {"x": xs, "y": f.total_free},
            {"x": xs, "y": f.largest_hole},
            {"x": self._x(f.refusal_positions), "y": f.refusal_sizes},
        ]
        layout = {"title": {"text": f.title}, "xaxis": {"range": [0, f.figures["num_slots"]]}}
        return traces, layout

    def summary(self, position: int | None = None) -> str:
        if not self.num_positions():
            return "ContiguousMemoryView: no steps yet"
        position = self.position if position is None else position
        f = self.compute(position)
        g = f.figures
        lines = [
            f"ContiguousMemoryView · {self.position_label(position)} ({position + 1} of {self.num_positions()})",
            f"  {g['num_slots']} slots: reserved {g['reserved_slots']}, holding tokens {g['used_slots']} "
            f"(internal waste {g['internal_waste']:.0%})",
            f"  free {g['total_free']} in {g['num_holes']} holes, largest hole {g['largest_hole']} "
            f"(external fragmentation {g['external_fragmentation']:.0%})",
        ]
        for r in f.refused_now:
            lines.append(f"  REFUSED {r.request_id!s}: {r.reason}")
        first = g["first_refusal"]
        lines.append("  no refusal by fragmentation" if first is None
                     else f"  first refusal by fragmentation at {self.position_label(first)}")
        return "\n".join(lines)
