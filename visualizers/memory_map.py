"""MemoryMapView: the physical KV pool as a grid of blocks.

Each cell is one physical block, coloured by what it is doing:

- the colour of its **owning sequence** when exactly one block table holds it;
- **red** when several tables share it (a prefix, or the prompt of an ``n > 1``
  request): one copy of the KV serves all of them;
- **blue-grey** when it is free but still holds a prefix-cache entry, so a
  later request with the same prefix can take it back without recomputing;
- **white** when it is free.

The number in a cell is how many of its ``block_size`` slots hold a token.
Only a sequence's last block can be partly filled, so paging wastes less than
one block per sequence: that waste is the *internal fragmentation* in the
title, and partly filled blocks are ringed so they stand out. Pools too large
to draw block by block are drawn ``k`` blocks to a cell (the title says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpaging.visualizers.base import CELL_PX, PALETTE, TraceView, discrete_colorscale, small_lines
from kvpaging.visualizers.replay import TraceReplay, pool_arrays, table_blocks_of

__all__ = ["MemoryMapView", "MemoryMapFrame", "memory_map_frame", "pool_figures", "FREE", "CACHED_FREE", "SHARED"]

FREE, CACHED_FREE, SHARED = 0, 1, 2
OWNER_BASE = 3  # code 3 + k: owned by a sequence with colour PALETTE[k]
STATE_COLORS = ("#ffffff", "#b0bec5", "#e41a1c")
COLORS = STATE_COLORS + PALETTE
TEXT_LIMIT = 1024  # write the fill count into cells only up to this many cells


@dataclass(frozen=True)
class MemoryMapFrame:
    """Everything needed to draw the pool after one step.

    ``z[row, col]`` is a colour code (FREE, CACHED_FREE, SHARED or
    ``OWNER_BASE + k``), NaN past the last block. ``customdata[row, col]`` is
    (first block id, last block id, owner seq id or -1/-2, tokens stored,
    reference count). ``partial_x/y`` locate partly filled blocks.
    """

    z: np.ndarray
    customdata: np.ndarray
    text: np.ndarray | None
    partial_x: np.ndarray
    partial_y: np.ndarray
    blocks_per_cell: int
    figures: dict
    title: str


def grid_columns(num_cells: int) -> int:
    """Columns for a grid about twice as wide as tall: a power of two from 8 to 64."""
    return int(min(64, max(8, 2 ** math.ceil(math.log2(math.sqrt(2 * max(num_cells, 1)))))))


def pool_figures(replay: TraceReplay, position: int) -> dict:
    """The running figures of the pool after step ``position``, exact from the record."""
    record = replay.records[position]
    bs = replay.block_size
    used = record.num_used_blocks
    allocated = used * bs
    table_blocks = table_blocks_of(record)
    derived = replay.steps[position]
    return {
        "num_blocks": replay.num_blocks,
        "block_size": bs,
        "used_blocks": used,
        "free_blocks": record.num_free_blocks,
        "cached_blocks": record.num_cached_blocks,
        "cached_free_blocks": int(derived.cached_free.size),
        "tokens_stored": record.num_tokens_stored,
        "allocated_slots": allocated,
        "internal_fragmentation": 0.0 if allocated == 0 else 1.0 - record.num_tokens_stored / allocated,
        "shared_savings_blocks": table_blocks - used,
        "usage": used / replay.num_blocks if replay.num_blocks else 0.0,
        "num_sequences": len(record.block_tables),
    }


def memory_map_frame(replay: TraceReplay, position: int, *, max_cells: int = 4096,
                     columns: int | None = None) -> MemoryMapFrame:
    """Grid arrays for the pool after step ``position`` (a pure function of the trace).

    ``max_cells`` bounds the number of cells: a bigger pool is drawn ``k``
    blocks to a cell, each cell showing its most common state.
    """
    arrays = pool_arrays(replay, position)
    num_blocks = replay.num_blocks
    bs = replay.block_size
    codes = np.full(num_blocks, FREE, dtype=np.int64)
    codes[arrays.cached_free] = CACHED_FREE
    owned = arrays.owner >= 0
    codes[owned] = OWNER_BASE + arrays.owner[owned] % len(PALETTE)
    codes[arrays.owner == -2] = SHARED

    k = max(1, math.ceil(num_blocks / max_cells))
    num_cells = math.ceil(num_blocks / k)
    cols = columns or grid_columns(num_cells)
    rows = math.ceil(num_cells / cols)
    padded = rows * cols * k

    def cells(values: np.ndarray, fill_value) -> np.ndarray:
        out = np.full(padded, fill_value, dtype=np.float64)
        out[:num_blocks] = values
        return out.reshape(rows * cols, k)

    ids = np.arange(num_blocks)
    if k == 1:
        z = cells(codes, np.nan)[:, 0]
        first = last = cells(ids, -1)[:, 0]
        owner = cells(arrays.owner, -1)[:, 0]
        tokens = cells(arrays.fill, 0)[:, 0]
        refs = cells(arrays.ref_count, 0)[:, 0]
    else:
        # each cell shows its most common state; an owned majority keeps its first owner's colour
        state = np.where(codes >= OWNER_BASE, OWNER_BASE, codes)
        grouped = cells(state, -1)
        counts = np.stack([(grouped == s).sum(axis=1) for s in (FREE, CACHED_FREE, SHARED, OWNER_BASE)], axis=1)
        winner = np.array([FREE, CACHED_FREE, SHARED, OWNER_BASE])[counts.argmax(axis=1)]
        code_cells = cells(codes, -1)
        first_owned = np.where(code_cells >= OWNER_BASE, code_cells, np.inf).min(axis=1)
        z = np.where(winner == OWNER_BASE, first_owned, winner).astype(np.float64)
        z[counts.sum(axis=1) == 0] = np.nan
        first = cells(ids, -1)[:, 0]
        last = np.minimum(first + k - 1, num_blocks - 1)
        owner = np.where(winner == OWNER_BASE, (grouped == OWNER_BASE).sum(axis=1), -1)  # blocks in use
        tokens = cells(arrays.fill, 0).sum(axis=1)
        refs = cells(arrays.ref_count, 0).max(axis=1)
        z[first < 0] = np.nan
    customdata = np.stack([first, last, owner, tokens, refs], axis=-1).reshape(rows, cols, 5)
    z = z.reshape(rows, cols)

    text = None
    if k == 1 and rows * cols <= TEXT_LIMIT:
        text = np.where(refs > 0, tokens.astype(np.int64).astype(str), "").reshape(rows, cols)
    if k == 1:
        partial = np.flatnonzero((arrays.ref_count > 0) & (arrays.fill < bs))
        partial_y, partial_x = np.divmod(partial, cols)
    else:
        partial_x = partial_y = np.zeros(0, dtype=np.int64)

    figures = pool_figures(replay, position)
    record = replay.records[position]
    title = (
        f"KV pool after step {record.step}: {figures['used_blocks']}/{num_blocks} blocks used "
        f"({figures['usage']:.0%})" + (f", {k} blocks per cell" if k > 1 else "")
        + small_lines([f"{figures['tokens_stored']} tokens in {figures['allocated_slots']} allocated slots",
                       f"internal fragmentation {figures['internal_fragmentation']:.1%}",
                       f"sharing saves {figures['shared_savings_blocks']} blocks"], max_chars=60)
    )
    return MemoryMapFrame(z, customdata, text, partial_x, partial_y, k, figures, title)


HOVER_ONE = (
    "block %{customdata[0]}<br>owner seq %{customdata[2]} (-1 free, -2 shared)<br>"
    "tokens %{customdata[3]}<br>references %{customdata[4]}<extra></extra>"
)
HOVER_MANY = (
    "blocks %{customdata[0]}-%{customdata[1]}<br>in use %{customdata[2]}<br>"
    "tokens %{customdata[3]}<br>max references %{customdata[4]}<extra></extra>"
)


class MemoryMapView(TraceView):
    """The physical pool, step by step: ``MemoryMapView(engine.trace, block_size=4)``.

    ``max_cells`` bounds the grid (a bigger pool is drawn several blocks to a
    cell). See the module docstring for the colours.
    """

    height = 460
    title_lines = 3  # the pool, and its figures in up to two small lines

    def __init__(self, trace=None, *, block_size: int | None = None, max_cells: int = 4096,
                 controls: bool = True, interval_ms: int | None = None, width: int | None = None) -> None:
        super().__init__(trace, block_size=block_size, controls=controls, interval_ms=interval_ms, width=width)
        self.max_cells = max_cells

    def compute(self, position: int) -> MemoryMapFrame:
        return memory_map_frame(self.replay, position, max_cells=self.max_cells)

    def base_figure(self):
        import plotly.graph_objects as go

        fig = go.Figure()
        fig.add_trace(go.Heatmap(
            z=[[None]], colorscale=discrete_colorscale(COLORS), zmin=-0.5, zmax=len(COLORS) - 0.5,
            showscale=False, xgap=1, ygap=1, hovertemplate=HOVER_ONE, texttemplate="%{text}",
            textfont={"size": CELL_PX - 1}, name="blocks",
        ))
        fig.add_trace(go.Scatter(
            x=[], y=[], mode="markers", name="partly filled",
            marker={"symbol": "square-open", "size": 12, "color": "#222222", "line": {"width": 2}},
            hoverinfo="skip",
        ))
        # legend entries for the fixed colours (the traces themselves have no legend)
        for name, color in (("free", STATE_COLORS[FREE]), ("cached, free", STATE_COLORS[CACHED_FREE]),
                            ("shared", STATE_COLORS[SHARED]), ("owned (colour = sequence)", PALETTE[0])):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                     marker={"symbol": "square", "size": 12, "color": color,
                                             "line": {"width": 1, "color": "#999"}}))
        fig.update_layout(
            height=self.height, margin={"l": 60, "r": 10, "b": 40},
            title={"text": "KV pool"},
            xaxis={"showgrid": False, "zeroline": False,
                   "title": "column (block id = row label + column; in a cell: tokens it holds)"},
            yaxis={"showgrid": False, "zeroline": False, "autorange": "reversed", "title": "first block of row"},
            legend={"orientation": "h", "y": -0.12}, plot_bgcolor="#fafafa",
        )
        return fig

    def frame(self, position: int) -> tuple[list[dict], dict]:
        f = self.compute(position)
        heat = {"z": f.z, "customdata": f.customdata, "text": f.text,
                "hovertemplate": HOVER_ONE if f.blocks_per_cell == 1 else HOVER_MANY}
        partial = {"x": f.partial_x, "y": f.partial_y}
        rows, cols = f.z.shape
        per_row = cols * f.blocks_per_cell
        step = max(1, rows // 16)  # at most ~16 labels down the side
        layout = {
            "title": {"text": f.title},
            "yaxis": {"tickvals": list(range(0, rows, step)),
                      "ticktext": [str(r * per_row) for r in range(0, rows, step)]},
            "xaxis": {"dtick": 1 if cols <= 16 else None},
        }
        return [heat, partial], layout

    def summary(self, position: int | None = None) -> str:
        if not len(self.replay):
            return "MemoryMapView: no steps yet"
        position = self.position if position is None else position
        f = self.compute(position)
        g = f.figures
        lines = [
            f"MemoryMapView · step {self.replay.records[position].step} ({position + 1} of {len(self.replay)})",
            f"  pool {g['num_blocks']} blocks x {g['block_size']} slots: used {g['used_blocks']} ({g['usage']:.0%}), "
            f"free {g['free_blocks']} (of which cached {g['cached_free_blocks']}), sequences {g['num_sequences']}",
            f"  tokens stored {g['tokens_stored']} in {g['allocated_slots']} allocated slots: "
            f"internal fragmentation {g['internal_fragmentation']:.1%}; "
            f"sharing saves {g['shared_savings_blocks']} blocks",
        ]
        lines.append("  map (# full, + partly filled, S shared, c cached-free, . free):")
        lines.extend("    " + row for row in text_map(self.replay, position))
        return "\n".join(lines)


def text_map(replay: TraceReplay, position: int, max_blocks: int = 512, width: int = 64) -> list[str]:
    """The pool as rows of characters, for terminals: the first ``max_blocks`` blocks."""
    arrays = pool_arrays(replay, position)
    n = min(replay.num_blocks, max_blocks)
    chars = np.full(n, ".", dtype="<U1")
    chars[arrays.cached_free[:n]] = "c"
    used = arrays.ref_count[:n] > 0
    chars[used & (arrays.fill[:n] >= replay.block_size)] = "#"
    chars[used & (arrays.fill[:n] < replay.block_size)] = "+"
    chars[arrays.ref_count[:n] > 1] = "S"
    rows = ["".join(chars[i : i + width]) for i in range(0, n, width)]
    if replay.num_blocks > n:
        rows.append(f"... {replay.num_blocks - n} more blocks")
    return rows
