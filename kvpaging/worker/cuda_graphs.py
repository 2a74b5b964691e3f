"""CUDA graphs for decode steps: launch a whole forward pass with one call.

At small batch sizes a decode step is *launch-bound*: the GPU finishes each
tiny kernel faster than Python and the driver can queue the next one, so most
of the step is the host issuing hundreds of launches. A CUDA graph records the
launches of one forward pass once and replays them with a single call.

A graph replays fixed shapes at fixed addresses, so:

* we capture one graph per *padded* batch size from a ladder (1, 2, 4, 8, then
  every 16 up to ``max_num_seqs``), and run a batch of 11 in the graph for 16;
* every input lives in a static buffer that the graph reads; each step copies
  its real inputs in and pads the extra rows with slot -1 (``store_kv`` skips
  them) and sequence length 0 (decode attention returns zeros for them);
* the block-table buffer has a fixed width (blocks of a ``max_model_len``
  sequence), and the Triton decode kernel's launch grid depends only on batch
  size, head counts and that width, never on sequence lengths.

Prefill and mixed steps run eagerly: their shapes change every step.
"""

from __future__ import annotations

import bisect
import logging

import torch

logger = logging.getLogger("kvpaging")

__all__ = ["batch_size_ladder", "DecodeGraphs"]


def batch_size_ladder(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode forward passes, one per padded batch size, sharing one memory pool."""

    def __init__(self, runner, max_batch: int, max_blocks_per_seq: int) -> None:
        self.runner = runner
        self.sizes = batch_size_ladder(max_batch)
        dev = runner.device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(1, largest, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(1, largest, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=dev)
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its pool
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside capture (Triton compiles, allocator settles)
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _forward(self, size: int) -> torch.Tensor:
        return self.runner.forward(self.input_ids[:, :size], self.positions[:, :size], self.slot_mapping[:size],
                                   self.block_tables[:size], self.seq_lens[:size], self._no_prefill, size,
                                   logits_to_keep=0)

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size that holds ``batch`` rows, or None if the batch is too large."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, inputs, size: int) -> torch.Tensor:
        """Replay the graph for ``size`` on a decode-only step; returns the logits for ``logits_indices`` (the model's
        dtype)."""
        n = inputs.num_decodes
        width = inputs.block_tables.shape[1]
        self.input_ids[0, :n].copy_(inputs.input_ids[0])
        self.positions[0, :n].copy_(inputs.positions[0])
        self.slot_mapping[:n].copy_(inputs.slot_mapping)
        self.block_tables[:n, :width].copy_(inputs.block_tables)
        self.seq_lens[:n].copy_(inputs.seq_lens)
        if size > n:  # padding rows: no store, zero-length attention
            self.input_ids[0, n:size].zero_()
            self.positions[0, n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.graphs[size].replay()
        return self.logits[size][0].index_select(0, inputs.logits_indices)
