"""BlockTableView: every running sequence's block table, logical block -> physical block.

A row is one sequence; column ``i`` is its logical block ``i`` (tokens
``i*block_size`` to ``(i+1)*block_size - 1``); the number in the cell is the
physical block id that holds them, the way a page table maps virtual pages to
physical frames. Colours tell where a block came from:

- **private**: only this sequence holds it;
- **shared** (the label says ``id ×refs``): several tables hold it;
- **prefix hit**: it was found in the prefix cache when the sequence was
  admitted, so its tokens were never recomputed;
- **copied now**: copy-on-write in this very step: a sequence about to write
  into a shared, partly filled block got its own copy first.

Hundreds of sequences are shown a page at a time (``rows_per_page``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpaging.visualizers.base import CELL_PX, TraceView, discrete_colorscale, small_lines
from kvpaging.visualizers.replay import TraceReplay

__all__ = ["BlockTableView", "BlockTableFrame", "block_table_frame", "PRIVATE", "SHARED", "PREFIX_HIT", "COPIED"]

PRIVATE, SHARED, PREFIX_HIT, COPIED = 0, 1, 2, 3
COLORS = ("#a6cee3", "#fb9a99", "#b2df8a", "#ff7f00")
NAMES = ("private", "shared", "prefix-cache hit", "copy-on-write now")
TEXT_LIMIT = 1200  # write block ids into cells only up to this many cells


@dataclass(frozen=True)
class BlockTableFrame:
    """One page of block tables after one step.

    ``z[row, i]`` is a category (PRIVATE, SHARED, PREFIX_HIT, COPIED) or NaN
    past the end of the table; ``customdata[row, i]`` is (physical block id,
    reference count, tokens in the block, copied-from block id or -1).
    """

    z: np.ndarray
    text: np.ndarray | None
    customdata: np.ndarray
    row_labels: list[str]
    seq_ids: list[int]
    page: int
    num_pages: int
    events: list[str]  # what happened to tables in this step, in words
    title: str


def block_table_frame(replay: TraceReplay, position: int, *, page: int = 0, rows_per_page: int = 24) -> BlockTableFrame:
    """The block tables of the running sequences on ``page`` after step ``position`` (pure)."""
    record = replay.records[position]
    derived = replay.steps[position]
    bs = replay.block_size
    tables = record.block_tables
    seq_ids = derived.seq_ids.tolist()
    num_pages = max(1, math.ceil(len(seq_ids) / rows_per_page))
    page = min(max(page, 0), num_pages - 1)
    shown = seq_ids[page * rows_per_page : (page + 1) * rows_per_page]
    index = {s: i for i, s in enumerate(seq_ids)}

    refs: dict[int, int] = {}
    for table in tables.values():
        for b in table:
            refs[b] = refs.get(b, 0) + 1
    copied_from = {dst: src for src, dst in record.blocks_copied}

    width = max((len(tables[s]) for s in shown), default=1) or 1
    z = np.full((len(shown), width), np.nan)
    ids = np.full((len(shown), width), -1, dtype=np.int64)
    ref = np.zeros((len(shown), width), dtype=np.int64)
    fill = np.zeros((len(shown), width), dtype=np.int64)
    src = np.full((len(shown), width), -1, dtype=np.int64)
    labels = []
    for row, sid in enumerate(shown):
        table = tables[sid]
        i = index[sid]
        length = int(derived.num_tokens[i])
        hits = int(derived.hit_blocks[i])
        n = len(table)
        t = np.asarray(table, dtype=np.int64)
        ids[row, :n] = t
        ref[row, :n] = [refs[b] for b in table]
        fill[row, :n] = np.clip(length - np.arange(n) * bs, 0, bs)
        cat = np.where(ref[row, :n] > 1, SHARED, PRIVATE).astype(np.float64)
        cat[: min(hits, n)] = PREFIX_HIT
        for j, b in enumerate(table):
            if b in copied_from:
                cat[j] = COPIED
                src[row, j] = copied_from[b]
        z[row, :n] = cat
        approx = "" if derived.exact[i] else "~"
        labels.append(f"seq {sid} · {replay.request_of(sid)} · {approx}{length} tok")

    text = None
    if z.size <= TEXT_LIMIT:
        text = np.where(ids >= 0, ids.astype(str), "")
        text = np.where(ref > 1, np.char.add(np.char.add(text, "×"), ref.astype(str)), text)

    events = []
    for sid in derived.admitted:
        hits = int(derived.hit_blocks[index[sid]])
        if hits:
            events.append(f"seq {sid} admitted with {hits} prefix-cache hit block{'s' * (hits != 1)}")
        else:
            events.append(f"seq {sid} admitted")
    for sid in derived.forked:
        events.append(f"seq {sid} forked (shares all its parent's blocks)")
    for s, d in record.blocks_copied:
        events.append(f"copy-on-write: block {s} -> {d}")
    for sid in record.preempted:
        events.append(f"seq {sid} preempted (blocks freed, will recompute)")
    for sid in record.finished:
        events.append(f"seq {sid} finished")
    title = f"Block tables after step {record.step}: {len(seq_ids)} running sequences"
    if num_pages > 1:
        title += f" (page {page + 1} of {num_pages})"
    if events:
        title += small_lines(events)
    customdata = np.stack([ids, ref, fill, src], axis=-1)
    return BlockTableFrame(z, text, customdata, labels, shown, page, num_pages, events, title)


HOVER = (
    "%{customdata[4]}<br>logical block %{x} -> physical block %{customdata[0]}<br>"
    "references %{customdata[1]} · tokens %{customdata[2]}<br>copied from %{customdata[3]} (-1: not copied)"
    "<extra></extra>"
)


class BlockTableView(TraceView):
    """Block tables step by step: ``BlockTableView(engine.trace, block_size=4)``.

    ``rows_per_page`` sequences are drawn at once; the page selector above the
    figure (or ``view.page``) moves through the rest.
    """

    height = 420
    title_lines = 3  # the title, and events in up to two small lines

    def __init__(self, trace=None, *, block_size: int | None = None, rows_per_page: int = 24,
                 controls: bool = True, interval_ms: int | None = None, width: int | None = None) -> None:
        super().__init__(trace, block_size=block_size, controls=controls, interval_ms=interval_ms, width=width)
        import ipywidgets as widgets

        self.rows_per_page = rows_per_page
        self.page_selector = widgets.BoundedIntText(value=1, min=1, max=1, description="page",
                                                    layout=widgets.Layout(width="140px"))
        self.page_selector.observe(lambda change: self.redraw(), names="value")
        self.page_selector.layout.display = "none"  # shown once there is more than one page
        self._extra_widgets.append(self.page_selector)

    @property
    def page(self) -> int:
        """The page shown, counted from 0."""
        return self.page_selector.value - 1

    @page.setter
    def page(self, value: int) -> None:
        self.page_selector.value = min(max(value + 1, 1), self.page_selector.max)

    def compute(self, position: int) -> BlockTableFrame:
        return block_table_frame(self.replay, position, page=self.page, rows_per_page=self.rows_per_page)

    def base_figure(self):
        import plotly.graph_objects as go

        fig = go.Figure()
        fig.add_trace(go.Heatmap(
            z=[[None]], colorscale=discrete_colorscale(COLORS), zmin=-0.5, zmax=len(COLORS) - 0.5,
            showscale=False, xgap=2, ygap=2, texttemplate="%{text}", textfont={"size": CELL_PX},
            hovertemplate=HOVER, name="block tables",
        ))
        for name, color in zip(NAMES, COLORS):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                     marker={"symbol": "square", "size": 12, "color": color}))
        fig.update_layout(
            height=self.height, margin={"l": 10, "r": 10, "b": 40},
            title={"text": "Block tables"},
            xaxis={"title": "logical block (in a cell: the physical block id; ×n: shared by n tables)",
                   "showgrid": False, "zeroline": False, "dtick": 1},
            yaxis={"autorange": "reversed", "showgrid": False, "automargin": True},
            legend={"orientation": "h", "y": -0.15}, plot_bgcolor="#fafafa",
        )
        return fig

    def frame(self, position: int) -> tuple[list[dict], dict]:
        f = self.compute(position)
        self.page_selector.max = f.num_pages
        self.page_selector.layout.display = None if f.num_pages > 1 else "none"
        # rows are numbered and labelled with ticks, not categories: a label names the sequence's length,
        # which changes every step, and a static animation fixes its axes to categories seen in any frame
        labels = f.row_labels or [""]
        rows = list(range(len(labels)))
        # the hover names the row's sequence: its label rides along as a fifth customdata column
        row_label = np.broadcast_to(np.array(labels[: f.customdata.shape[0]], dtype=object)[:, None, None],
                                    f.customdata.shape[:2] + (1,))
        customdata = np.concatenate([f.customdata.astype(object), row_label], axis=-1)
        heat = {"z": f.z if f.z.size else np.full((1, 1), np.nan), "text": f.text, "customdata": customdata,
                "y": rows, "x": list(range(f.z.shape[1]))}
        layout = {"title": {"text": f.title}, "xaxis": {"dtick": 1 if f.z.shape[1] <= 40 else None},
                  "yaxis": {"tickvals": rows, "ticktext": labels}}
        return [heat], layout

    def summary(self, position: int | None = None, max_rows: int = 20) -> str:
        if not len(self.replay):
            return "BlockTableView: no steps yet"
        position = self.position if position is None else position
        f = block_table_frame(self.replay, position, page=0, rows_per_page=max_rows)
        record = self.replay.records[position]
        lines = [f"BlockTableView · step {record.step} ({position + 1} of {len(self.replay)}) · "
                 f"{len(record.block_tables)} running sequences (×n shared by n, ^ prefix hit, * copied now)"]
        marks = {PRIVATE: "", SHARED: "", PREFIX_HIT: "^", COPIED: "*"}
        for row, label in enumerate(f.row_labels):
            cells = []
            for j in range(f.z.shape[1]):
                if np.isnan(f.z[row, j]):
                    break
                block, refs = int(f.customdata[row, j, 0]), int(f.customdata[row, j, 1])
                cells.append(f"{block}{marks[int(f.z[row, j])]}" + (f"×{refs}" if refs > 1 else ""))
            lines.append(f"  {label:<28} [{' '.join(cells)}]")
        if len(record.block_tables) > max_rows:
            lines.append(f"  ... {len(record.block_tables) - max_rows} more sequences")
        lines.extend(f"  event: {e}" for e in f.events)
        return "\n".join(lines)
