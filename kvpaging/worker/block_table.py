"""The model runner's own copy of the block tables: one row per live sequence, kept up to date from each step's
``SchedulerOutput.table_updates`` (vLLM v1's worker-side ``BlockTable``).

The block manager owns the tables and decides every change; it does not hand its own records to the runner.
Instead it writes down each change as a ``(row, column, block_ids)`` triple: a new table (a sequence admitted
or forked) is written from column 0, a block appended at the table's end from its column, and a copy-on-write
replaces the last column. The scheduler passes the step's triples on in its output, and this class applies
them, in order, to an array the runner keeps from step to step. A step's input preparation then takes the rows
it needs with one fancy-indexing call (copying each table from a Python list every step would cost a
microsecond or more per sequence).

Since tables only grow, a step's triples are few: one per admitted or forked sequence, and one per sequence
whose new token opened a new block. A row whose sequence ended is simply taken by a later one, whose first
triple (column 0) rewrites the row and clears what lies past it, so every row in use is its table followed by
zeros.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BlockTable"]


class BlockTable:
    """Every live block table, as rows of one int32 array that grows (doubling) when a row or column is missing."""

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int32)

    def apply(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """Write each ``(row, column, block_ids)`` in order: ``block_ids`` from ``column`` on, and from column 0,
        zeros after them (a row written from its first column is the whole table)."""
        for row, col, block_ids in updates:
            end = col + len(block_ids)
            rows, cols = self.array.shape
            if row >= rows or end > cols:
                grown = np.zeros((rows if row < rows else max(2 * rows, row + 1),
                                  cols if end <= cols else max(2 * cols, end)), dtype=np.int32)
                grown[:rows, :cols] = self.array
                self.array = grown
            self.array[row, col:end] = block_ids
            if col == 0:
                self.array[row, end:] = 0
