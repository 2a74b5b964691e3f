"""What every view shares: playback controls, live feeding, static HTML export, colours.

A view is split in two on purpose:

- a **pure function** turns step records into arrays (``memory_map_frame``,
  ``block_table_frame``, ...). It knows nothing of widgets, so it is tested
  with plain asserts and timed without a browser;
- a thin **view class** puts those arrays into a plotly ``FigureWidget``.

The base class :class:`View` below does the widget plumbing once: a step
slider with Play / Pause / Step (:class:`PlaybackControls`), redrawing on
change, a static animation (plotly frames with play buttons and a slider,
axes fixed over every frame, opening on the view's step) shown in a notebook
as plotly's own output or written as an HTML page, and a plain-text summary
for terminals.

Live views follow an engine through :class:`LiveFeed`. The engine calls its
observer after every step, so the observer only appends the record to a queue
and returns: drawing there would slow the engine down. A painter (a background
thread, or the loop of ``Dashboard.run``) wakes a few times a second, takes
every queued record at once, and draws only the newest state. When the engine
outruns the display, intermediate steps are skipped, never queued up.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

__all__ = [
    "DisplaysAsWidget",
    "View",
    "TraceView",
    "PlaybackControls",
    "LiveFeed",
    "PALETTE",
    "discrete_colorscale",
    "sample_positions",
    "json_safe",
    "SMALL",
    "small_lines",
    "presentation",
    "PLAY_SECONDS",
    "play_interval_ms",
    "flat_update",
]

#: Soft colours for sequences and requests, chosen so black text stays readable and none
#: of them looks like the strong red that marks shared blocks.
PALETTE = (
    "#8dd3c7", "#bebada", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bc80bd", "#ccebc5",
    "#ffed6f", "#a6cee3", "#b2df8a", "#cab2d6", "#ffd92f", "#66c2a5", "#8da0cb", "#e5c494",
)


#: Font sizes in pixels: a plot title, its smaller lines, text inside cells. Sized for a projector
#: as much as for a laptop.
TITLE_PX, SMALL_PX, CELL_PX = 16, 13, 12

#: Starts a second, smaller line in a plot title (close it with "</span>"); relative to the title's
#: size, so that it grows with it (see presentation()).
SMALL = f"<br><span style='font-size:{SMALL_PX / TITLE_PX:.4g}em'>"

#: Text size of the views made from now on, relative to the sizes above; presentation() sets it.
TEXT_SCALE = 1.0


def presentation(on: bool = True, scale: float = 1.4) -> None:
    """Larger text in every view made afterwards, for a classroom projector; ``presentation(False)`` undoes it.

    Titles, axis labels, legends and the numbers inside cells all grow by ``scale``, and the
    figures grow a little taller to hold them.
    """
    global TEXT_SCALE
    TEXT_SCALE = float(scale) if on else 1.0


def small_lines(parts: list[str], max_chars: int = 70, max_lines: int = 2) -> str:
    """``parts`` joined by "; " into at most ``max_lines`` small title lines of about ``max_chars``.

    A plot title does not wrap: a long line is cut off at the edge of the figure.
    """
    lines: list[str] = []
    current = ""
    for i, part in enumerate(parts):
        candidate = f"{current}; {part}" if current else part
        if current and len(candidate) > max_chars:
            if len(lines) == max_lines - 1:
                current += f"; … {len(parts) - i} more"
                break
            lines.append(current)
            current = part
        else:
            current = candidate
    if current:
        lines.append(current)
    return "".join(SMALL + line + "</span>" for line in lines)


def discrete_colorscale(colors: Iterable[str]) -> list[list]:
    """A heatmap colorscale where integer code ``k`` gets ``colors[k]``; use zmin=-0.5, zmax=len-0.5."""
    colors = list(colors)
    n = len(colors)
    scale = []
    for k, color in enumerate(colors):
        scale.append([k / n, color])
        scale.append([(k + 1) / n, color])
    return scale


def json_safe(value):
    """Replace NaN by None in the arrays of a trace or layout update.

    Pure functions mark "nothing here" with NaN (numpy's way), but a widget
    update travels as JSON, where NaN is not allowed; plotly draws None as a
    gap, which is what NaN meant.
    """
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        missing = np.isnan(value)
        if missing.any():
            out = value.astype(object)
            out[missing] = None
            return out.tolist()
    return value


#: A whole run plays in about this many seconds at speed 1x, however many steps it has.
PLAY_SECONDS = 25.0


def play_interval_ms(num_positions: int, seconds: float = PLAY_SECONDS, fastest: int = 60, slowest: int = 800) -> int:
    """Milliseconds per step so that ``num_positions`` steps play in about ``seconds``.

    Clamped: a kernel redraws every step of a live view, so no faster than ``fastest``; a
    short run should still move, so no slower than ``slowest``.
    """
    if num_positions <= 1:
        return slowest
    return int(min(max(1000 * seconds / (num_positions - 1), fastest), slowest))


def flat_update(update: dict, prefix: str = "") -> dict:
    """``{"marker": {"color": c}, "x": x}`` -> ``{"marker.color": c, "x": x}``: one key per property."""
    flat = {}
    for key, value in update.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_update(value, path + "."))
        else:
            flat[path] = value
    return flat


def _plain(value):
    """Arrays as lists (and tuples as lists): an update passed straight to the widget skips plotly's validators."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def sample_positions(num_positions: int, max_frames: int) -> list[int]:
    """At most ``max_frames`` positions spread evenly over ``0..num_positions-1``, ends included."""
    if num_positions <= 0:
        return []
    if num_positions <= max_frames:
        return list(range(num_positions))
    picked = np.unique(np.linspace(0, num_positions - 1, max_frames).round().astype(int))
    return picked.tolist()


class PlaybackControls:
    """Play / Pause, a speed menu, Step, Back and a slider over positions ``0..n-1``.

    Play moves at a pace that plays the whole run in about :data:`PLAY_SECONDS` (at 1×),
    however many steps it has; the speed menu scales that.

    The Play widget animates in the browser and is linked to the slider there
    (``jslink``), so playing costs the kernel one redraw per frame and nothing
    else. The kernel listens to the slider only; Step and Back move the slider.
    """

    SPEEDS = (("½×", 0.5), ("1×", 1.0), ("2×", 2.0), ("4×", 4.0))

    def __init__(self, num_positions: int, on_change: Callable[[int], None], interval_ms: int | None = None) -> None:
        import ipywidgets as widgets

        top = max(num_positions - 1, 0)
        self._fixed_interval = interval_ms  # None: scale with the run (a whole run plays in ~PLAY_SECONDS)
        self.play = widgets.Play(value=top, min=0, max=top, step=1, interval=self._base_interval(num_positions),
                                 description="Play", show_repeat=False, tooltip="play / pause")
        self.speed = widgets.Dropdown(options=self.SPEEDS, value=1.0, description="speed", tooltip="play speed",
                                      layout=widgets.Layout(width="130px"),
                                      style={"description_width": "initial"})
        self.speed.observe(lambda _change: self._set_interval(), names="value")
        self.slider = widgets.IntSlider(value=top, min=0, max=top, description="step", continuous_update=True,
                                        readout=False, layout=widgets.Layout(width="260px", min_width="120px",
                                                                             flex="1 1 auto"))
        self.back_button = widgets.Button(description="◀", tooltip="one step back", layout=widgets.Layout(width="40px"))
        self.step_button = widgets.Button(description="Step ▶", tooltip="one step forward",
                                          layout=widgets.Layout(width="80px"))
        self.label = widgets.HTML()
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self._on_change = on_change
        self._quiet = False  # True while the program itself moves the slider: no redraw callback
        self.slider.observe(self._changed, names="value")
        self.step_button.on_click(lambda _button: self.step(+1))
        self.back_button.on_click(lambda _button: self.step(-1))
        self.widget = widgets.HBox(
            [self.play, self.speed, self.back_button, self.step_button, self.slider, self.label],
            layout=widgets.Layout(align_items="center", flex_flow="row wrap", max_width="100%"),
        )
        self.widget.add_class("kvpaging-controls")

    @property
    def value(self) -> int:
        return self.slider.value

    def _base_interval(self, num_positions: int) -> int:
        return self._fixed_interval if self._fixed_interval is not None else play_interval_ms(num_positions)

    def _set_interval(self) -> None:
        base = self._base_interval(self.slider.max + 1)
        self.play.interval = max(int(base / self.speed.value), 20)

    def step(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, self.slider.min), self.slider.max)

    def set_value_quietly(self, value: int) -> None:
        """Move the slider without calling back: for a caller that draws the position itself."""
        self._quiet = True
        try:
            self.slider.value = value
        finally:
            self._quiet = False

    def set_num_positions(self, num_positions: int, follow: bool = True) -> None:
        """Grow the range (live runs); keep to the newest position if the slider was at the end.

        Only the slider moves: the caller redraws.
        """
        top = max(num_positions - 1, 0)
        at_end = self.slider.value >= self.slider.max
        self._quiet = True
        try:
            self.slider.max = self.play.max = top
            if follow and at_end:
                self.slider.value = top
        finally:
            self._quiet = False
        self._set_interval()

    def _changed(self, change) -> None:
        if not self._quiet:
            self._on_change(change["new"])


# The browser half of fit_to_width(): watch the view's (or dashboard's) box and, when its width changes,
# send the window a "resize" event, which every plot made with config.responsive follows.
_FIT_TO_WIDTH_ESM = """
export default {
  render({ el }) {
    el.style.display = "none";
    let box = null, width = -1, tries = 0;
    const observer = new ResizeObserver(() => {
      const w = box.getBoundingClientRect().width;
      if (w > 0 && Math.abs(w - width) >= 1) {
        width = w;
        window.dispatchEvent(new Event("resize"));
      }
    });
    const start = () => {
      box = el.closest(".kvpaging-dashboard, .kvpaging-view");
      if (box) observer.observe(box);
      else if (tries++ < 50) setTimeout(start, 100);
    };
    setTimeout(start, 0);
    return () => observer.disconnect();
  },
};
"""
_fit_class = None


def fit_to_width():
    """An invisible widget that makes the plots of its view or dashboard as wide as their box.

    A FigureWidget is first drawn before it is attached to the page, so it cannot see how wide its
    output area is and takes plotly's default of 700 px: cropped on a laptop, lost space on a
    projector. Plots made with ``config.responsive`` follow the window's "resize" events; this widget
    sends one whenever the box it sits in changes width (first display included).
    """
    global _fit_class
    if _fit_class is None:
        import anywidget

        class FitToWidth(anywidget.AnyWidget):
            _esm = _FIT_TO_WIDTH_ESM

        _fit_class = FitToWidth
    return _fit_class()


class DisplaysAsWidget:
    """Jupyter shows the object as its ``widget`` (text: its ``summary()``); ``repr`` is the summary.

    Displaying it also sets ``_displayed``, so a live run knows it need not display it again."""

    _displayed = False

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        self._displayed = True
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)
        if bundle is not None:
            bundle["text/plain"] = self.summary()
        return bundle

    def __repr__(self) -> str:
        return self.summary()


class View(DisplaysAsWidget):
    """Base of every view: subclasses provide data, this class draws it.

    Subclasses implement :meth:`num_positions`, :meth:`position_label`,
    :meth:`base_figure` (traces and layout, drawn once), :meth:`frame`
    (the per-position updates: a list of dicts, one per trace, and a dict of
    layout changes) and :meth:`summary`.
    """

    #: figure height in pixels
    height = 420
    #: the most lines its title ever has (a title line and small lines): the top margin makes room for them
    title_lines = 2

    def __init__(self, *, controls: bool = True, interval_ms: int | None = None, width: int | None = None) -> None:
        self.width = width  # pixels; None: as wide as the output area
        self.text_scale = TEXT_SCALE
        self.position = 0
        self._at_end = True  # on the newest step: live updates move the view along
        self._figure = None
        self._widget = None
        self._controls: PlaybackControls | None = None
        self._want_controls = controls
        self._interval_ms = interval_ms
        self._lock = threading.RLock()  # the painter thread and the kernel both draw
        self._extra_widgets: list = []  # e.g. a page selector, shown above the figure

    # -- to implement ------------------------------------------------------------------------------
    def num_positions(self) -> int:
        raise NotImplementedError

    def position_label(self, position: int) -> str:
        return str(position)

    def default_position(self) -> int:
        """Where the view opens: the step worth looking at first. Here the last one; views override it."""
        return max(self.num_positions() - 1, 0)

    def open_at_default(self) -> None:
        """Move to :meth:`default_position` (constructors call it; so does a live run when it ends)."""
        self.position = self.default_position()
        self._at_end = self.position >= self.num_positions() - 1

    def base_figure(self):
        raise NotImplementedError

    def frame(self, position: int) -> tuple[list[dict], dict]:
        raise NotImplementedError

    def summary(self, position: int | None = None) -> str:
        raise NotImplementedError

    def sync(self) -> None:
        """Catch up with new records (live views); nothing to do for fixed data."""

    # -- drawing -------------------------------------------------------------------------------------
    @property
    def figure(self):
        """The plotly FigureWidget, built on first use."""
        if self._figure is None:
            import plotly.graph_objects as go

            with self._lock:
                fig = go.FigureWidget(self._sized(self.base_figure()))
                if self.width is None:  # follow the width of the output area (see fit_to_width)
                    fig._config = dict(fig._config or {}, responsive=True)
                self._figure = fig
                self._apply(self.position)
        return self._figure

    @property
    def controls(self) -> PlaybackControls | None:
        if self._controls is None and self._want_controls:
            self._controls = PlaybackControls(self.num_positions(), self.show, self._interval_ms)
            self._controls.set_value_quietly(self.position)
            self._update_label()
        return self._controls

    @property
    def widget(self):
        """Controls (unless the view is part of a dashboard) above the figure."""
        if self._widget is None:
            import ipywidgets as widgets

            parts = [fit_to_width()]
            if self.controls is not None:
                parts.append(self.controls.widget)
            parts.extend(self._extra_widgets)
            parts.append(self.figure)
            self._widget = widgets.VBox(parts, layout=widgets.Layout(width="100%", min_width="0"))
            self._widget.add_class("kvpaging-view")
        return self._widget

    def show(self, position: int) -> None:
        """Draw the state after step ``position`` (clamped to the data)."""
        with self._lock:
            n = self.num_positions()
            position = int(min(max(position, 0), max(n - 1, 0)))
            self.position = position
            self._at_end = position >= n - 1
            if self._figure is not None:
                self._apply(position)
            if self._controls is not None and self._controls.slider.value != position:
                self._controls.set_value_quietly(position)
            self._update_label()

    def redraw(self) -> None:
        self.show(self.position)

    def refresh(self, follow: bool = True) -> None:
        """Take new records and, if the view was on the newest step, move to the new newest."""
        with self._lock:
            was_at_end = self._at_end
            self.sync()
            n = self.num_positions()
            if self._controls is not None:
                self._controls.set_num_positions(n, follow=False)  # show() below moves the slider
            if follow and was_at_end:
                self.show(n - 1)
            else:
                self.redraw()

    def _apply(self, position: int) -> None:
        if self.num_positions() == 0:
            return
        traces, layout = self.frame(position)
        fig = self._figure
        updates = [flat_update(json_safe(update)) for update in traces]
        # One Plotly.update() per redraw: for each property a list with one value per trace. plotly.py's
        # own batch_update leaves a placeholder where a trace does not change a property (even when another
        # trace sets it to the value it already has), and FigureWidget's browser side took that placeholder
        # as a value: the contiguous view's white holes came out in plotly's default green. So every trace
        # sends every property of the batch it has, its current value when unchanged, and only traces
        # that cannot share a property (a scatter has no `base`) go in a second update.
        keys = {key for update in updates for key in update}
        groups: dict[frozenset, list[tuple[int, dict]]] = {}
        for index, (trace, update) in enumerate(zip(fig.data, updates)):
            for key in keys - update.keys():
                if key in trace:
                    update[key] = trace[key]
            groups.setdefault(frozenset(update), []).append((index, update))
        relayout = flat_update(json_safe(layout)) if layout else {}
        batches = list(groups.values())
        for i, batch in enumerate(batches):
            restyle = {key: [_plain(update[key]) for _, update in batch] for key in batch[0][1]}
            fig.plotly_update(restyle_data=restyle, relayout_data=relayout if i == len(batches) - 1 else {},
                              trace_indexes=[index for index, _ in batch])
        if not batches and relayout:
            fig.plotly_update(relayout_data=relayout)

    def _sized(self, fig):
        """The fixed width if any, and a top margin that holds the title's lines and the subplot titles.

        The title hangs from the top of the figure; below its last line come the subplot titles
        (annotations just above the plot area), so neither runs into the other.
        """
        if self.width is not None:
            fig.update_layout(width=self.width, autosize=False)
        s = self.text_scale
        title_px, small_px = TITLE_PX * s, SMALL_PX * s
        subplot_titles = [a for a in fig.layout.annotations if a.yref == "paper" and a.y is not None and a.y >= 0]
        for a in subplot_titles:
            a.font.size = round(small_px)
        at_top = any(a.y >= 1 - 1e-9 for a in subplot_titles)  # a subplot title just under the figure's title
        top = 12 + title_px + 6 + (small_px + 5) * (self.title_lines - 1) + (small_px + 14 if at_top else 10)
        fig.update_layout(title={"yref": "container", "y": 1, "yanchor": "top", "pad": {"t": 12},
                                 "x": 0, "xanchor": "left", "xref": "paper", "font": {"size": round(title_px)}},
                          margin={"t": round(top)}, font={"size": round(12 * s)})
        if s != 1:
            for trace in fig.data:
                if "textfont.size" in trace and trace.textfont.size:
                    trace.textfont.size = round(trace.textfont.size * s)
            fig.update_layout(height=round((fig.layout.height or 450) * (1 + (s - 1) / 2)))
        return fig

    def _update_label(self) -> None:
        if self._controls is not None:
            n = self.num_positions()
            label = self.position_label(self.position) if n else "-"
            self._controls.label.value = f"<code>{label}</code> ({self.position + 1 if n else 0} / {n})"

    # -- static export ------------------------------------------------------------------------------
    def static_figure(self, max_frames: int = 120):
        """A plain ``go.Figure`` with one animation frame per (sampled) step, play buttons and a slider.

        It opens on the view's own position (``view.show(k)`` picks it), and its axes are fixed to
        the reach of every frame (:func:`~.static.fix_axis_ranges`): plotly.js does not rescale
        axes while an animation plays.
        """
        import plotly.graph_objects as go

        from kvpaging.visualizers.static import fix_axis_ranges

        self.sync()
        fig = self._sized(go.Figure(self.base_figure()))
        n = self.num_positions()
        start = int(min(max(self.position, 0), max(n - 1, 0)))
        positions = sorted(set(sample_positions(n, max_frames)) | ({start} if n else set()))
        if not positions:
            return fig
        frames = []
        for p in positions:
            traces, layout = self.frame(p)
            data = [dict(json_safe(update), type=trace.type) for trace, update in zip(fig.data, traces)]
            frames.append(go.Frame(data=data, traces=list(range(len(data))), layout=json_safe(layout), name=str(p)))
        first_traces, first_layout = self.frame(start)
        for trace, update in zip(fig.data, first_traces):
            trace.update(json_safe(update))
        fig.update_layout(json_safe(first_layout))
        fig.frames = frames
        fix_axis_ranges(fig)
        # a whole run plays in about PLAY_SECONDS, whatever the number of sampled frames; "fast" is 4x
        per_frame = play_interval_ms(len(positions), fastest=40, slowest=1000) if self._interval_ms is None \
            else self._interval_ms

        def play(ms: int) -> dict:
            return {"frame": {"duration": ms, "redraw": True}, "fromcurrent": True, "transition": {"duration": 0}}

        pause_args = {"frame": {"duration": 0, "redraw": False}, "mode": "immediate", "transition": {"duration": 0}}
        # The controls go below the plot area (paper y = 0), pushed past the x-axis title by a padding
        # in pixels: the buttons first, the slider on a row of its own under them, its label (the step
        # shown) at its right end, clear of the buttons; the legend moves to the right.
        fig.update_layout(
            updatemenus=[{
                "type": "buttons", "direction": "left", "x": 0.0, "xanchor": "left", "showactive": False,
                "y": 0, "yanchor": "top", "pad": {"t": 62},
                "buttons": [
                    {"label": "▶ Play", "method": "animate", "args": [None, play(per_frame)]},
                    {"label": "▶▶ 4× faster", "method": "animate", "args": [None, play(max(per_frame // 4, 20))]},
                    {"label": "❚❚ Pause", "method": "animate", "args": [[None], pause_args]},
                ],
            }],
            sliders=[{
                "x": 0.0, "len": 1.0, "xanchor": "left", "y": 0, "yanchor": "top", "pad": {"t": 100},
                "active": positions.index(start),
                "currentvalue": {"prefix": "", "xanchor": "right", "font": {"size": 13}},
                "steps": [
                    {"label": self.position_label(p), "method": "animate",
                     "args": [[str(p)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True},
                                         "transition": {"duration": 0}}]}
                    for p in positions
                ],
            }],
            legend={"orientation": "v", "x": 1.02, "y": 1, "xanchor": "left", "yanchor": "top"},
            margin={"b": 190, "r": 170},
            height=(fig.layout.height or 450) + 140,
        )
        if self.width is not None:
            fig.update_layout(width=self.width + 170)  # room for the legend, now on the right
        return fig

    def display_static(self, max_frames: int = 30) -> None:
        """Display the static animation as plotly's notebook output (renders with no kernel, offline)."""
        from kvpaging.visualizers.static import display_figure

        display_figure(self.static_figure(max_frames), text=self.summary())

    def to_html(self, path=None, *, self_contained: bool = True, max_frames: int = 120) -> str:
        """The static animation as an HTML page; written to ``path`` if given.

        ``self_contained=True`` embeds plotly.js (about 4.5 MB, works offline);
        ``False`` loads it from the plotly CDN (small file, needs the internet).
        """
        html = self.static_figure(max_frames).to_html(
            include_plotlyjs=True if self_contained else "cdn", full_html=True, auto_play=False
        )
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(html)
        return html



class TraceView(View):
    """A view of an engine trace, held in a shared :class:`~.replay.TraceReplay`.

    Give it a list of step records (``engine.trace``, ``load_trace(path)``), a
    ``TraceReplay`` (to share one between views), or nothing and
    :meth:`attach` it to an engine to watch it live.
    """

    def __init__(self, trace=None, *, block_size: int | None = None, controls: bool = True,
                 interval_ms: int | None = None, width: int | None = None) -> None:
        from kvpaging.visualizers.replay import TraceReplay

        super().__init__(controls=controls, interval_ms=interval_ms, width=width)
        if isinstance(trace, TraceReplay):
            self.replay = trace
        else:
            self.replay = TraceReplay(trace if trace is not None else (), block_size=block_size)
        self._feed: LiveFeed | None = None
        self.open_at_default()

    def num_positions(self) -> int:
        return len(self.replay)

    def position_label(self, position: int) -> str:
        if not len(self.replay):
            return "-"
        return f"step {self.replay.records[position].step}"

    def default_position(self) -> int:
        """The busiest step: the most running sequences, then the most blocks in use (the first such).

        A finished run's last step is empty (every sequence has left), so a view of a
        whole trace opens where there is something to see.
        """
        records = self.replay.records
        if not records:
            return 0
        return max(range(len(records)),
                   key=lambda i: (len(records[i].block_tables), records[i].num_used_blocks, -i))

    def attach(self, engine, *, fps: float = 4.0, background: bool = True) -> LiveFeed:
        """Follow ``engine`` (an ``LLMEngine`` or ``LLM``) live, redrawing at most ``fps`` times a second."""
        self._feed = LiveFeed(self.replay, [self], fps=fps)
        self._feed.attach(engine, background=background)
        return self._feed

    def detach(self) -> None:
        if self._feed is not None:
            self._feed.detach()
            self._feed = None


class LiveFeed:
    """An engine observer that only queues records, and a throttled painter that draws the newest.

    ``observe`` is what the engine calls after every step: one deque append and
    a flag, nothing that could slow the engine down. ``tick`` (called by the
    painter thread every ``1/fps`` seconds, or by a loop that drives the
    engine) moves all queued records into the replay and redraws the views
    once, showing the newest state: never a backlog of stale frames.
    """

    def __init__(self, replay, views: list[View], fps: float = 4.0) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps!r}")
        self.replay = replay
        self.views = views
        self.interval = 1.0 / fps
        self.queue: collections.deque = collections.deque()
        self.dirty = False
        self.num_frames = 0  # redraws so far: tests check the throttle with it
        self._last_paint = 0.0
        self._engine = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # the observer: keep it this small
    def observe(self, record) -> None:
        self.queue.append(record)
        self.dirty = True

    def attach(self, engine, background: bool = True) -> None:
        engine = getattr(engine, "engine", engine)  # an LLM holds its LLMEngine as .engine
        if self.replay.block_size is None:
            self.replay.block_size = engine.config.block_size
        if self.replay.num_blocks is None:
            self.replay.num_blocks = engine.config.num_blocks
        engine.add_observer(self.observe)
        self._engine = engine
        if background:
            self._stop.clear()
            self._thread = threading.Thread(target=self._paint_loop, name="kvpaging-live-feed", daemon=True)
            self._thread.start()

    def detach(self) -> None:
        """Stop following: remove the observer, stop the painter, draw the final state."""
        if self._engine is not None:
            try:
                self._engine.remove_observer(self.observe)
            except ValueError:
                pass  # the engine detached it already (it raised once)
            self._engine = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self.tick(force=True)

    def tick(self, force: bool = False) -> bool:
        """Draw if there is something new and a frame is due (or ``force``); True if it drew."""
        if not self.dirty:
            return False
        now = time.perf_counter()
        if not force and now - self._last_paint < self.interval:
            return False
        with self._lock:
            self.dirty = False
            new = []
            while self.queue:
                new.append(self.queue.popleft())
            self.replay.extend(new)
            for view in self.views:
                view.refresh(follow=True)
            self._last_paint = time.perf_counter()
            self.num_frames += 1
        return True

    def _paint_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a drawing error must not kill the painter silently
                import logging

                logging.getLogger("kvpaging").exception("live view failed to draw")
