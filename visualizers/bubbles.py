"""BubbleTimeline: batch slots x iterations, static batching's bubbles next to continuous batching.

Each row is a batch slot, each column an iteration (one forward pass); a
cell is coloured by the request in the slot, grey when the slot is idle. The
grey cells are the bubbles: compute paid for and wasted (iterations not yet
run stay white). Each panel's title gives its utilisation, busy
slot-iterations over all slot-iterations so far. Panels share their x axis,
so the policy that finishes first visibly ends first.

Three ways to fill it:

- ``BubbleTimeline.simulate([50, 120, 240, 1024], num_slots=4)``: static and
  continuous batching simulated from output lengths alone (no model), see
  :mod:`.batching`;
- ``BubbleTimeline(engine.trace)``: the slots of a real run;
- ``BubbleTimeline.from_traces({"static": trace_a, "continuous": trace_b})``: two real
  runs of the same prompts, one per scheduling policy, side by side.

Very long timelines are drawn with every ``k``-th iteration (the title says
so); the utilisation figures always count every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpaging.visualizers.base import PALETTE, SMALL_PX, View, discrete_colorscale
from kvpaging.visualizers.batching import IDLE, EngineSlots, SlotTimeline, simulate_continuous_batching, simulate_static_batching
from kvpaging.visualizers.replay import TraceReplay

__all__ = ["BubbleTimeline", "BubbleFrame", "bubble_frame"]

#: An idle slot: a neutral grey, darker than any request colour, so that the bubbles stand out.
IDLE_COLOR = "#a3a3a3"
COLORS = (IDLE_COLOR,) + PALETTE  # code 0: idle; code 1 + k: a request with colour PALETTE[k]


@dataclass(frozen=True)
class BubbleFrame:
    """One panel's grid up to an iteration. ``z``: 0 idle, 1 + k request colour, NaN not yet run."""

    z: np.ndarray
    customdata: np.ndarray  # (request index or -1, prefill 0/1)
    x: np.ndarray  # iteration (or step) number of each drawn column
    busy: int
    capacity: int
    every: int  # 1: every iteration drawn; k: every k-th
    title: str


def bubble_frame(timeline: SlotTimeline, upto: int | None = None, *, name: str | None = None,
                 max_columns: int = 1200, max_rows: int = 128) -> BubbleFrame:
    """Grid arrays for ``timeline`` with iterations after ``upto`` blanked (pure).

    The grid keeps its full width from the start, so an animation fills it in
    from left to right instead of rescaling.
    """
    occ = timeline.occupancy
    total = occ.shape[1]
    upto = total - 1 if upto is None else min(upto, total - 1)
    busy, capacity = timeline.utilisation_until(upto) if upto >= 0 else (0, 0)
    every = max(1, math.ceil(total / max_columns))
    rows_every = max(1, math.ceil(occ.shape[0] / max_rows))
    cols = np.arange(0, total, every)
    grid = occ[::rows_every][:, cols]
    z = np.where(grid == IDLE, 0, 1 + grid % len(PALETTE)).astype(np.float64)
    z[:, cols > upto] = np.nan
    prefill = timeline.prefill[::rows_every][:, cols] if timeline.prefill is not None else np.zeros_like(grid, bool)
    customdata = np.stack([grid, prefill.astype(np.int64)], axis=-1)
    x = timeline.steps[cols] if timeline.steps is not None else cols
    util = busy / capacity if capacity else 0.0
    title = f"{name or timeline.policy}: {util:.1%} utilised ({busy:,} / {capacity:,} slot-iterations)"
    if every > 1 or rows_every > 1:
        title += f" · every {ordinal(every)} iteration" + (f", every {ordinal(rows_every)} slot" if rows_every > 1 else "")
    return BubbleFrame(z, customdata, x, busy, capacity, every, title)


class _EnginePanel:
    """A panel fed by a trace: slot occupancy built record by record."""

    def __init__(self, replay: TraceReplay, num_slots: int | None) -> None:
        self.replay = replay
        self.slots = EngineSlots(num_slots)

    def sync(self) -> None:
        for record in self.replay.records[len(self.slots):]:
            self.slots.append(record)

    def timeline(self) -> SlotTimeline:
        return self.slots.timeline()


HOVER = "slot %{y}, iteration %{x}<br>request %{customdata[0]} (-1: idle), prefill %{customdata[1]}<extra></extra>"


class BubbleTimeline(View):
    """Slots x iterations for one or more panels (see the module docstring)."""

    height = 420
    title_lines = 1

    def __init__(self, trace=None, *, block_size: int | None = None, num_slots: int | None = None,
                 panels: list | None = None, controls: bool = True, interval_ms: int | None = None,
                 max_columns: int = 1200, width: int | None = None) -> None:
        super().__init__(controls=controls, interval_ms=interval_ms, width=width)
        self.max_columns = max_columns
        if panels is None:
            replay = trace if isinstance(trace, TraceReplay) else TraceReplay(trace or (), block_size=block_size)
            panels = [("engine", _EnginePanel(replay, num_slots))]
        self.panels: list[tuple[str, SlotTimeline | _EnginePanel]] = panels
        self._timelines: list[SlotTimeline] = []
        self._title_y: list[float] | None = None
        self.sync()
        self.open_at_default()

    @classmethod
    def simulate(cls, output_lengths, num_slots: int, **kwargs) -> BubbleTimeline:
        """Static vs continuous batching for these output lengths, no model needed."""
        lengths = list(output_lengths)
        panels = [("static batching", simulate_static_batching(lengths, num_slots)),
                  ("continuous batching", simulate_continuous_batching(lengths, num_slots))]
        return cls(panels=panels, **kwargs)

    @classmethod
    def from_traces(cls, traces: dict, *, num_slots: int | None = None, block_size: int | None = None,
                    **kwargs) -> BubbleTimeline:
        """One panel per named trace: ``from_traces({"static": trace_a, "continuous": trace_b})``."""
        panels = []
        for name, trace in traces.items():
            replay = trace if isinstance(trace, TraceReplay) else TraceReplay(trace, block_size=block_size)
            panels.append((name, _EnginePanel(replay, num_slots)))
        return cls(panels=panels, **kwargs)

    @property
    def timelines(self) -> list[SlotTimeline]:
        return self._timelines

    def sync(self) -> None:
        timelines = []
        for _, source in self.panels:
            if isinstance(source, _EnginePanel):
                source.sync()
                timelines.append(source.timeline())
            else:
                timelines.append(source)
        self._timelines = timelines

    def num_positions(self) -> int:
        return max((t.num_iterations for t in self._timelines), default=0)

    def position_label(self, position: int) -> str:
        for t in self._timelines:
            if t.steps is not None and position < len(t.steps):
                return f"step {t.steps[position]}"
        return f"iteration {position}"

    def compute(self, position: int) -> list[BubbleFrame]:
        return [bubble_frame(t, position, name=name, max_columns=self.max_columns)
                for (name, _), t in zip(self.panels, self._timelines)]

    def base_figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        n = len(self.panels)
        fig = make_subplots(rows=n, cols=1, vertical_spacing=0.25 / max(n, 1),
                            subplot_titles=[name for name, _ in self.panels])
        for i in range(n):
            fig.add_trace(go.Heatmap(z=[[None]], colorscale=discrete_colorscale(COLORS), zmin=-0.5,
                                     zmax=len(COLORS) - 0.5, showscale=False, ygap=2, hovertemplate=HOVER,
                                     name=self.panels[i][0]), row=i + 1, col=1)
            fig.update_yaxes(title_text="slot", autorange="reversed", showgrid=False, row=i + 1, col=1)
            fig.update_xaxes(showgrid=False, row=i + 1, col=1)
        fig.update_xaxes(title_text="iteration (engine step)", row=n, col=1)
        if n > 1:  # one time axis for every panel: the policy that finishes first ends first on screen
            fig.update_xaxes(matches="x", showticklabels=True)
        fig.update_layout(height=max(self.height, 220 * n), margin={"l": 50, "r": 10, "b": 40},
                          title={"text": "Batch slots over iterations: grey = idle slot (a bubble)"},
                          plot_bgcolor="#ffffff")
        return fig

    def frame(self, position: int) -> tuple[list[dict], dict]:
        frames = self.compute(position)
        traces = [{"z": f.z, "customdata": f.customdata, "x": f.x} for f in frames]
        layout = {}
        for i, t in enumerate(self._timelines):  # whole slots only, while there are few enough to label
            layout[f"yaxis{i + 1 if i else ''}"] = {"dtick": 1 if t.num_slots <= 32 else None}
        if self._title_y is None:
            self._title_y = [a.y for a in self.base_figure().layout.annotations]
        fig_annotations = []
        for f, y in zip(frames, self._title_y):  # subplot titles, rewritten with the running utilisation
            fig_annotations.append({"text": f.title, "xref": "paper", "yref": "paper", "x": 0.5, "y": y,
                                    "xanchor": "center", "yanchor": "bottom", "showarrow": False,
                                    "font": {"size": round(SMALL_PX * self.text_scale)}})
        layout["annotations"] = fig_annotations
        return traces, layout

    def summary(self, position: int | None = None) -> str:
        if not self.num_positions():
            return "BubbleTimeline: no iterations yet"
        position = self.position if position is None else position
        lines = [f"BubbleTimeline · {self.position_label(position)} ({position + 1} of {self.num_positions()})"]
        for f in self.compute(position):
            lines.append("  " + f.title)
        for (name, _), t in zip(self.panels, self._timelines):
            lines.append(f"  {name} grid ('.' idle, letters = requests), first 80 iterations:")
            for slot in range(min(t.num_slots, 16)):
                row = t.occupancy[slot, :80]
                lines.append("    " + "".join("." if r == IDLE else chr(ord("a") + r % 26) for r in row))
        return "\n".join(lines)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st, 22nd, ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
