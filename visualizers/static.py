"""Static figures: axes fixed over a whole animation, and plotly's own notebook output.

Two things a saved notebook or an exported page needs that a live widget does not:

- **Axes that hold every frame.** plotly.js computes an axis's autorange when a
  figure is first drawn and keeps it while the animation plays, so a static
  animation whose first frame is small (one step, two requests, one logical
  block) cuts off everything that comes later. :func:`fix_axis_ranges` reads
  every frame, works out how far each axis must reach, and writes the range
  (or, for a category axis, the list of categories) into the layout, fixed.
- **Output that renders without a kernel, or without plotly.** :func:`figure_bundle` is the
  ``application/vnd.plotly.v1+json`` mime bundle that JupyterLab and Notebook 7
  draw themselves (the ``jupyterlab-plotly`` renderer ships inside plotly), in a
  notebook that is neither trusted nor online: no ``<script>`` to strip, no CDN
  to reach. Frames travel in the bundle and the renderer adds them, so the
  play button and the slider animate there too.
- **A picture for pages that draw no plotly** (GitHub's and nbviewer's notebook
  views): with ``KVPAGING_STATIC_IMAGES=1``, as ``make save-lessons`` sets it when it
  runs the lessons for the repository, the bundle also carries an ``image/png`` of
  the figure (an animation's last frame), drawn by plotly's own export (kaleido, in
  a local Chrome or Chromium: nothing downloaded). Off by default, because JupyterLab
  ranks a PNG above plotly's own renderer: a figure with one is shown as the picture.
  So a learner's run draws interactive figures, and a saved lesson opened without
  running shows the pictures until its cells run again.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterable

import numpy as np

__all__ = ["fix_axis_ranges", "axis_extents", "figure_bundle", "display_figure", "static_png", "compact_png"]


class _Extent:
    """How far one axis must reach: numeric bounds, or categories in order of first appearance."""

    def __init__(self) -> None:
        self.lo = math.inf  # exact bounds (heatmap cell edges, bar edges, zero under bars)
        self.hi = -math.inf
        self.points_lo = math.inf  # data points that want a little room around them (markers, bar tops)
        self.points_hi = -math.inf
        self.categories: dict[str, None] = {}

    def exact(self, lo: float, hi: float) -> None:
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)

    def points(self, values: Iterable) -> None:
        for v in values:
            if isinstance(v, str):
                self.categories.setdefault(v, None)
            elif v is not None and not (isinstance(v, float) and math.isnan(v)):
                self.points_lo, self.points_hi = min(self.points_lo, float(v)), max(self.points_hi, float(v))

    def range(self, pad_fraction: float = 0.05) -> list[float] | None:
        """[low, high]: exact bounds as they are; points that reach past them get a margin."""
        lo, hi = min(self.lo, self.points_lo), max(self.hi, self.points_hi)
        if not math.isfinite(lo) or not math.isfinite(hi):
            return None
        pad = pad_fraction * ((hi - lo) or max(abs(hi), 1.0))
        if self.points_lo < self.lo:
            lo = self.points_lo - pad
        if self.points_hi > self.hi:
            hi = self.points_hi + pad
        return [lo, hi]


def _values(v) -> list:
    if v is None:
        return []
    if isinstance(v, np.ndarray):
        return v.ravel().tolist()
    if isinstance(v, (list, tuple)):
        out = []
        for item in v:
            out.extend(_values(item) if isinstance(item, (list, tuple, np.ndarray)) else [item])
        return out
    return [v]


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values)


def _cell_edges(centres: list, count: int) -> tuple[float, float] | None:
    """Outer edges of ``count`` heatmap cells centred on numeric ``centres`` (indices when absent)."""
    if not centres:
        centres = list(range(count))
    centres = [c for c in centres if c is not None]
    if not centres or not _numeric(centres):
        return None
    c = np.asarray(centres, dtype=float)
    half = float(np.min(np.diff(np.sort(c)))) / 2 if len(c) > 1 and np.ptp(c) > 0 else 0.5
    return float(c.min()) - half, float(c.max()) + half


def _bar_width(positions: list) -> float:
    p = np.unique(np.asarray(positions, dtype=float))
    return float(np.min(np.diff(p))) if len(p) > 1 else 1.0


def _trace_states(fig) -> list[list[dict]]:
    """The traces as each frame shows them (the base figure first): plain dicts, frame data laid over."""
    base = [t.to_plotly_json() for t in fig.data]
    states = [base]
    for frame in fig.frames or ():
        merged = [dict(t) for t in base]
        indices = list(frame.traces) if frame.traces is not None else list(range(len(frame.data or ())))
        for index, data in zip(indices, frame.data or ()):
            merged[index] = {**merged[index], **data.to_plotly_json()}
        states.append(merged)
    return states


def _axis_key(axis_id: str) -> str:
    """'x' -> 'xaxis', 'y3' -> 'yaxis3'."""
    return axis_id[0] + "axis" + axis_id[1:]


def axis_extents(fig) -> dict[str, _Extent]:
    """For every axis a trace draws on ('x', 'y2', ...): how far it must reach in any frame."""
    extents: dict[str, _Extent] = {}
    barmode = fig.layout.barmode

    def extent(axis_id: str) -> _Extent:
        return extents.setdefault(axis_id, _Extent())

    for traces in _trace_states(fig):
        stacks: dict[tuple, dict] = {}  # (position axis, value axis) -> position -> (positive sum, negative sum)
        for t in traces:
            if t.get("visible") is False:
                continue
            kind = t.get("type", "scatter")
            xa, ya = t.get("xaxis") or "x", t.get("yaxis") or "y"
            if kind == "heatmap":
                z = t.get("z")
                z = np.asarray(z if z is not None else [[None]], dtype=object)
                if z.ndim != 2 or z.size == 0 or all(v is None for v in z.ravel()):
                    continue
                for axis_id, key, count in ((xa, "x", z.shape[1]), (ya, "y", z.shape[0])):
                    centres = _values(t.get(key))
                    edges = _cell_edges(centres, count)
                    if edges is not None:
                        extent(axis_id).exact(*edges)
                    else:
                        extent(axis_id).points(centres)
            elif kind == "bar":
                horizontal = t.get("orientation") == "h"
                pos_axis, val_axis = (ya, xa) if horizontal else (xa, ya)
                positions = _values(t.get("y" if horizontal else "x"))
                values = _values(t.get("x" if horizontal else "y"))
                if not values:
                    continue
                if not positions:
                    positions = list(range(len(values)))
                if _numeric(positions):
                    half = _bar_width(positions) / 2
                    extent(pos_axis).exact(min(positions) - half, max(positions) + half)
                else:
                    extent(pos_axis).points(positions)
                base = t.get("base")
                bases = _values(base) if isinstance(base, (list, tuple, np.ndarray)) else [base or 0] * len(values)
                error = t.get("error_y" if not horizontal else "error_x") or {}
                plus = _values(error.get("array")) if error.get("visible", True) is not False else []
                extent(val_axis).exact(0, 0)
                stack = stacks.setdefault((pos_axis, val_axis), {}) if barmode in ("stack", "relative") else None
                for i, (p, v) in enumerate(zip(positions, values)):
                    if v is None or (isinstance(v, float) and math.isnan(v)):
                        continue
                    b = bases[i] if i < len(bases) and bases[i] is not None else 0
                    err = plus[i] if i < len(plus) and plus[i] is not None else 0
                    if stack is not None:
                        up, down = stack.get(p, (0.0, 0.0))
                        up, down = (up + v, down) if v >= 0 else (up, down + v)
                        stack[p] = (up, down)
                        extent(val_axis).points([e for e in (up + err, down) if e != 0])
                    else:
                        top = b + v + err
                        extent(val_axis).exact(b, b)  # a bar's foot is exact; its top gets room
                        extent(val_axis).points([top])
            elif kind in ("scatter", "scattergl"):
                x, y = _values(t.get("x")), _values(t.get("y"))
                if not y:
                    continue
                if not x:
                    x = list(range(len(y)))
                extent(xa).points(x)
                extent(ya).points(y)
    return extents


def fix_axis_ranges(fig, pad_fraction: float = 0.05):
    """Fix every axis of ``fig`` (frames included) to the reach of all its frames; returns ``fig``.

    An axis whose range the figure already fixes (``range`` set in the layout)
    is left alone, and so is its direction: an axis drawn reversed stays
    reversed. Category axes get their categories from every frame, in order of
    first appearance, so a bar that only appears later has its place from the start.
    """
    extents = axis_extents(fig)
    # axes tied together by `matches` share one reach
    for axis_id in list(extents):
        matches = fig.layout[_axis_key(axis_id)].matches if _axis_key(axis_id) in fig.layout else None
        if matches and matches != axis_id:
            target = extents.setdefault(matches, _Extent())
            e = extents[axis_id]
            target.exact(e.lo, e.hi)
            target.points([e.points_lo, e.points_hi] if math.isfinite(e.points_lo) else [])
            for c in e.categories:
                target.categories.setdefault(c, None)
    for axis_id in list(extents):
        key = _axis_key(axis_id)
        axis = fig.layout[key]
        e = extents[axis.matches] if axis.matches in extents else extents[axis_id]  # matched axes: one reach
        if axis.range is not None and axis.autorange is not True:
            continue
        reversed_ = axis.autorange == "reversed"
        if axis.rangemode == "tozero":
            e.exact(0, 0)
        if e.categories:
            cats = list(e.categories)
            update = {"categoryorder": "array", "categoryarray": cats, "range": [-0.5, len(cats) - 0.5]}
        else:
            r = e.range(pad_fraction)
            if r is None:
                continue
            update = {"range": r}
        if reversed_:
            update["range"] = update["range"][::-1]
        update["autorange"] = False
        fig.layout[key].update(update)
    return fig


def figure_bundle(fig, text: str | None = None) -> dict:
    """``fig`` as the ``application/vnd.plotly.v1+json`` mime bundle, frames included, with a static PNG of it
    when asked for and kaleido and a browser are at hand (:func:`static_png`).

    ``text`` is the plain-text fallback (a terminal, nbval, a renderer without plotly).
    """
    import json

    import plotly.io as pio

    spec = json.loads(pio.to_json(fig, validate=False, remove_uids=False))
    spec.setdefault("config", {}).update({"displaylogo": False, "responsive": True})
    title = fig.layout.title.text if fig.layout.title and fig.layout.title.text else "plotly figure"
    bundle = {"application/vnd.plotly.v1+json": spec, "text/plain": text or f"<{title.split('<br>')[0]}>"}
    png = static_png(fig)
    if png is not None:
        import base64

        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    return bundle


def static_png(fig, scale: float = 1.0) -> bytes | None:
    """A PNG of ``fig`` (of its last frame, without play button or slider, when it is an animation), drawn by
    plotly's export through kaleido in a local Chrome or Chromium, when ``KVPAGING_STATIC_IMAGES=1``; None
    otherwise, or when kaleido or a browser is missing. The browser starts once per process (about 3 s), then
    a figure takes a fraction of a second."""
    import os
    import warnings

    if os.environ.get("KVPAGING_STATIC_IMAGES", "0") != "1" or not _kaleido_ready():
        return None
    import plotly.graph_objects as go
    import plotly.io as pio

    still = go.Figure(fig)
    if fig.frames and len(fig.frames[-1].data) == len(fig.data):
        still = go.Figure(data=fig.frames[-1].data, layout=fig.layout)
    still.layout.updatemenus, still.layout.sliders = (), ()
    try:
        with warnings.catch_warnings():  # plotly notes that the running server ignores its per-call options
            warnings.simplefilter("ignore")
            png = pio.to_image(still, format="png", width=fig.layout.width or 900, height=fig.layout.height or 450,
                               scale=scale)
    except Exception:  # noqa: BLE001 - an image is a courtesy: never fail a figure for it
        return None
    return compact_png(png)


def compact_png(png: bytes) -> bytes:
    """The same picture in at most 256 colours (a chart has few; its anti-aliased edges lose nothing visible),
    about a quarter of the bytes, so that a lesson's figures stay within its size budget; as it is without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return png
    out = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256).save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


@functools.cache
def _kaleido_ready() -> bool:
    """Start kaleido's browser, once per process; False when there is no kaleido or no browser for it."""
    import atexit
    import warnings

    try:
        import kaleido

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kaleido.start_sync_server(silence_warnings=True)
    except Exception:  # noqa: BLE001 - figures then go without an image
        return False
    atexit.register(kaleido.stop_sync_server, silence_warnings=True)
    return True


def display_figure(fig, text: str | None = None) -> None:
    """Display ``fig`` as plotly's notebook output: drawn by JupyterLab itself, offline and untrusted."""
    from IPython.display import display

    display(figure_bundle(fig, text), raw=True)
