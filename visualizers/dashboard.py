"""Dashboard: every view in one layout, driven by one set of Play / Pause / Step controls.

Live, in a notebook cell::

    dash = Dashboard(llm)
    outputs = dash.run(prompts, SamplingParams(max_tokens=32))   # draws while the engine runs

or follow an engine that something else drives (``llm.generate``, a server loop)::

    dash = Dashboard(llm); dash.attach(); display(dash)
    llm.generate(prompts, params)
    dash.detach()

and in replay, from a trace recorded earlier (here or on another machine)::

    Dashboard.from_trace(load_trace("run.json"))

All views share one :class:`~.replay.TraceReplay`, so a record is replayed
once however many views show it. While the engine runs, the dashboard redraws
at most ``fps`` times a second and always shows the newest step; the slider
then lets you go back over every step.
"""

from __future__ import annotations

import threading
from html import escape

from kvpaging.visualizers.base import DisplaysAsWidget, LiveFeed, PlaybackControls, View
from kvpaging.visualizers.block_table import BlockTableView
from kvpaging.visualizers.bubbles import BubbleTimeline
from kvpaging.visualizers.contiguous_view import ContiguousMemoryView, ContiguousTraceSim
from kvpaging.visualizers.memory_map import MemoryMapView
from kvpaging.visualizers.replay import TraceReplay
from kvpaging.visualizers.throughput import ThroughputPanel
from kvpaging.visualizers.trace_io import save_chrome_trace, save_trace

__all__ = ["Dashboard"]

#: Below this width a dashboard panel moves onto a row of its own.
MIN_PANEL_PX = 560


class Dashboard(DisplaysAsWidget):
    """Block tables, memory map, bubbles, contiguous baseline and throughput of one engine or trace."""

    def __init__(self, llm=None, *, trace=None, block_size: int | None = None, fps: float = 4.0,
                 interval_ms: int | None = None, rows_per_page: int = 16, max_cells: int = 4096,
                 num_slots: int | None = None, reserve_tokens=None, panel_width: int | None = None) -> None:
        self.engine = getattr(llm, "engine", llm)
        num_blocks = None
        if self.engine is not None:
            block_size = block_size or self.engine.config.block_size
            num_blocks = self.engine.config.num_blocks
            if reserve_tokens is None:
                reserve_tokens = {}  # run() fills it: prompt + max_tokens; other requests fall back below
        self.fps = fps
        self.replay = trace if isinstance(trace, TraceReplay) else TraceReplay(
            trace if trace is not None else (), block_size=block_size, num_blocks=num_blocks)
        self._reserve = reserve_tokens
        self._sim = ContiguousTraceSim(self.replay, None, self._reserve_for if isinstance(reserve_tokens, dict)
                                       else reserve_tokens)
        # Widths follow the output area (fit_to_width): two panels side by side where there is room
        # for two of MIN_PANEL_PX (their titles need it), one above the other where there is not; the
        # controls stick to the top of the notebook either way. A panel_width fixes the widths.
        self.panel_width = panel_width
        half = {"controls": False, "width": panel_width}
        self.block_table = BlockTableView(self.replay, rows_per_page=rows_per_page, **half)
        self.memory_map = MemoryMapView(self.replay, max_cells=max_cells, **half)
        self.bubbles = BubbleTimeline(self.replay, num_slots=num_slots, **half)
        self.contiguous = ContiguousMemoryView(_sim=self._sim, **half)
        self.throughput = ThroughputPanel(self.replay, controls=False,
                                          width=2 * panel_width if panel_width else None)
        self.views: list[View] = [self.block_table, self.memory_map, self.bubbles, self.contiguous, self.throughput]
        self.position = self.block_table.default_position()  # the busiest step of a replayed trace
        self._at_end = self.position >= len(self.replay) - 1
        self._interval_ms = interval_ms
        self._controls: PlaybackControls | None = None
        self._widget = None
        self._feed: LiveFeed | None = None
        self._reserving = None  # the engine whose admissions _note_reserves reads, while attached
        self._displayed = False
        self._lock = threading.RLock()  # the live painter and the kernel both draw
        for view in self.views:
            view.position = self.position

    @classmethod
    def from_trace(cls, trace, *, block_size: int | None = None, **kwargs) -> Dashboard:
        """Replay a recorded trace (``engine.trace``, or ``load_trace(path)``)."""
        return cls(trace=trace, block_size=block_size, **kwargs)

    def _reserve_for(self, request_id: str) -> int:
        """Contiguous worst case of a request: prompt + max_tokens when run() or the live observer saw them
        (a request admitted and finished within one step is gone before it is seen), else max_model_len."""
        if request_id in self._reserve:
            return self._reserve[request_id]
        if self.engine is not None:
            return self.engine.config.max_model_len
        return self._sim.default_need

    # -- playback ------------------------------------------------------------------------------------
    @property
    def controls(self) -> PlaybackControls:
        if self._controls is None:
            self._controls = PlaybackControls(len(self.replay), self.show, self._interval_ms)
            self._controls.set_value_quietly(self.position)
            self._update_label()
        return self._controls

    def _update_label(self) -> None:
        n = len(self.replay)
        label = self.block_table.position_label(self.position) if n else "-"
        self._controls.label.value = f"<code>{label}</code> ({self.position + 1 if n else 0} / {n})"

    def show(self, position: int) -> None:
        """Show every view after step ``position`` (an index into the trace)."""
        with self._lock:
            n = len(self.replay)
            position = int(min(max(position, 0), max(n - 1, 0)))
            self.position = position
            self._at_end = position >= n - 1
            for view in self.views:
                view.show(position)
            if self._controls is not None:
                if self._controls.slider.value != position:
                    self._controls.set_value_quietly(position)
                self._update_label()

    def step(self, delta: int = 1) -> None:
        self.show(self.position + delta)

    def refresh(self, follow: bool = True) -> None:
        """Take the records that arrived since the last frame; called by the live feed."""
        with self._lock:
            was_at_end = self._at_end
            for view in self.views:
                view.sync()
            n = len(self.replay)
            if self._controls is not None:
                self._controls.set_num_positions(n, follow=False)
            self.show(n - 1 if (follow and was_at_end) else self.position)

    # -- live -----------------------------------------------------------------------------------------
    def attach(self, engine=None, *, background: bool = True) -> LiveFeed:
        """Follow an engine live (default: the one given to the constructor)."""
        if engine is not None:
            self.engine = getattr(engine, "engine", engine)
        if self.engine is None:
            raise ValueError("no engine to attach to: Dashboard(llm).attach() or dashboard.attach(llm)")
        self.detach()
        self._feed = LiveFeed(self.replay, [self], fps=self.fps)
        self._feed.attach(self.engine, background=background)
        if isinstance(self._reserve, dict):
            self._reserving = self.engine
            self.engine.add_observer(self._note_reserves)
        return self._feed

    def _note_reserves(self, record) -> None:
        """An observer, in the engine's thread: the contiguous baseline's worst case (prompt + max_tokens) of
        each request the engine admitted this step, read while the engine still holds the request (requests
        added by a server or by hand, which run() does not see)."""
        requests = self._reserving.scheduler.requests
        limit = self._reserving.config.max_model_len
        for rid in record.arrivals:
            request = requests.get(rid)
            if request is not None and rid not in self._reserve:
                self._reserve[rid] = min(request.prompt_len + request.params.max_tokens, limit)

    def detach(self) -> None:
        if self._feed is not None:
            self._feed.detach()
            self._feed = None
        if self._reserving is not None:
            self._reserving.remove_observer(self._note_reserves)
            self._reserving = None

    def run(self, prompts, sampling_params=None, *, display: bool = True):
        """Add ``prompts`` to the engine and step it to completion, drawing as it goes.

        Returns their ``RequestOutput``s in the order given, like ``LLM.generate``.
        """
        from kvpaging.engine.llm_engine import normalize_batch

        if self.engine is None:
            raise ValueError("Dashboard.run needs an engine: Dashboard(llm).run(prompts, params)")
        engine = self.engine
        prompts, params = normalize_batch(prompts, sampling_params)
        if display and not self._displayed:
            from IPython.display import display as ipy_display

            ipy_display(self)
        was_attached = self._feed is not None
        self.detach()  # one feed at a time, or every record would arrive twice
        feed = LiveFeed(self.replay, [self], fps=self.fps)
        feed.attach(engine, background=False)
        try:
            def reserve(request_ids):  # the contiguous baseline's worst case: prompt + max_tokens
                if isinstance(self._reserve, dict):
                    for rid, sp in zip(request_ids, params):
                        self._reserve[rid] = engine.scheduler.requests[rid].prompt_len + sp.max_tokens

            outputs = engine.run_batch(prompts, params, prefix="r", on_step=feed.tick, on_added=reserve)
        finally:
            feed.detach()
            if was_attached:
                self.attach()
        results = {out.request_id: out for out in outputs}
        metrics = {rid: out.metrics for rid, out in results.items() if out.metrics is not None}
        self.throughput.metrics.update(metrics)
        # the run is over and its last step is empty (every request has left): open on the busiest one
        self.show(self.block_table.default_position())
        self.throughput.redraw()
        return outputs

    # -- display ---------------------------------------------------------------------------------------
    @property
    def widget(self):
        if self._widget is None:
            import ipywidgets as widgets

            from kvpaging.visualizers.base import fit_to_width

            def row(*views):
                for v in views:  # each panel grows to share the row; below MIN_PANEL_PX the row wraps
                    v.widget.layout.flex = f"1 1 {MIN_PANEL_PX}px"
                    v.widget.layout.width = "auto" if len(views) > 1 else "100%"
                return widgets.HBox([v.widget for v in views],
                                    layout=widgets.Layout(flex_flow="row wrap", width="100%"))

            header = widgets.HTML("<b>kvpaging dashboard</b> — block tables, physical pool, batch slots, "
                                  "the contiguous baseline and throughput, step by step")
            # The controls stay in reach: they stick to the top of the notebook while the panels scroll
            # by. A sticky element sticks inside its nearest box that clips or scrolls, so the boxes
            # between the dashboard and the notebook's scroller (the output area's, the widget box's)
            # let their content show instead; the panels fit their width (fit_to_width) anyway.
            style = widgets.HTML(
                "<style>"
                ".jp-OutputArea:has(.kvpaging-dashboard), .jp-OutputArea-child:has(.kvpaging-dashboard),"
                " .jp-OutputArea-output:has(.kvpaging-dashboard), .kvpaging-dashboard"
                " {overflow: visible !important; min-width: 0 !important;}"
                " .kvpaging-dashboard > .kvpaging-controls {position: sticky; top: 0; z-index: 10;"
                " background: var(--jp-layout-color0, white); border-bottom: 1px solid #ddd;}</style>")
            rows = [
                fit_to_width(),
                style,
                header,
                self.controls.widget,
                row(self.block_table, self.memory_map),
                row(self.bubbles, self.contiguous),
                row(self.throughput),
            ]
            self._widget = widgets.VBox(rows, layout=widgets.Layout(width="100%", min_width="0"))
            self._widget.add_class("kvpaging-dashboard")
        return self._widget

    def summary(self, position: int | None = None) -> str:
        position = self.position if position is None else position
        if not len(self.replay):
            return "Dashboard: no steps yet"
        return "\n\n".join(view.summary(position) for view in self.views)

    # -- export -----------------------------------------------------------------------------------------
    def display_static(self, max_frames: int = 30) -> None:
        """Every view's static animation as plotly's notebook output, on the dashboard's step.

        Saved in a notebook, they render with no kernel, untrusted and offline.
        """
        from kvpaging.visualizers.static import display_figure

        for view in self.views:
            view.position = self.position
            display_figure(view.static_figure(max_frames), text=view.summary(self.position))

    def to_html(self, path=None, *, self_contained: bool = True, max_frames: int = 60) -> str:
        """Every view's static animation on one HTML page (each with its own play button and slider)."""
        parts = []
        for i, view in enumerate(self.views):
            fig = view.static_figure(max_frames)
            include = (True if self_contained else "cdn") if i == 0 else False
            parts.append(fig.to_html(include_plotlyjs=include, full_html=False, auto_play=False))
        summary = escape(self.summary(len(self.replay) - 1)) if len(self.replay) else ""
        html = (
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvpaging dashboard</title></head><body>"
            "<h2>kvpaging dashboard</h2>" + "".join(f"<div>{p}</div>" for p in parts)
            + f"<h3>Summary of the last step</h3><pre>{summary}</pre></body></html>"
        )
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(html)
        return html

    def save_trace(self, path) -> None:
        save_trace(self.replay.records, path, block_size=self.replay.block_size, num_blocks=self.replay.num_blocks)

    def save_chrome_trace(self, path) -> None:
        save_chrome_trace(self.replay.records, path)
