"""The model runner: owns the KV cache tensors and runs one packed forward pass per step.

Each step, every scheduled sequence contributes the tokens it needs computed
(a whole prompt, a prefill chunk, or one decode token). The runner packs them
into ONE padding-free batch of shape ``[1, num_tokens]``, with per-token
positions, as variable-length attention does. Beside the tokens it builds:

* ``slot_mapping``: for each new token, the cache slot where its K/V goes,
  ``block_table[pos // block_size] * block_size + pos % block_size``;
* ``block_tables`` and ``seq_lens``: where each sequence's whole context lives;
* ``prefill_cu_seqlens_q``: where each prefill chunk's queries start (one-token sequences are packed first);
* the indices of the positions whose logits are needed (the last token of each
  sequence that reaches its end this step; a mid-prompt chunk needs none).

This input preparation runs on the host every step, so it is written with as
little Python per token as possible. Between steps the runner keeps one thing of
its own: its copy of the block tables (``BlockTable``, one row per live sequence),
brought up to date from each step's ``table_updates`` before it is read; the rest
is rebuilt from the scheduler's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvpaging.config import EngineConfig
from kvpaging.core.scheduler_output import SchedulerOutput
from kvpaging.errors import UnsupportedModelError
from kvpaging.kernels.backends import get_backend
from kvpaging.kernels.cpu.layers import FastLayers
from kvpaging.models import private_copy
from kvpaging.worker.attention import ATTN_NAME, CURRENT_STEP, AttentionMetadata, register_attention
from kvpaging.worker.direct_forward import direct_forward_if_exact
from kvpaging.worker.fp8_scales import calibrate_fp8_scales
from kvpaging.worker.host_memory import keep_frame_chunks, keep_freed_memory
from kvpaging.worker.kv_layout import LayerKV, cache_indexes, config_layout, layer_groups
from kvpaging.worker.state_layers import install_state_layers

logger = logging.getLogger("kvpaging")

__all__ = ["ModelRunner", "BlockTable", "StepInputs", "prepare_step_inputs"]


class ModelRunner:
    """Runs the engine's private copy of the model, one packed forward pass per step, over the paged KV cache."""

    def __init__(self, model, config: EngineConfig, calibration_tokens: list[list[int]] | None = None,
                 capture_graphs: bool = True, kv_layout: list[LayerKV] | None = None) -> None:
        """``kv_layout``: each layer's key/value heads and widths as ``measure_kv_layout`` read them off the
        model (the engine passes what it sized the pool by); None: as the config describes them."""
        if not config.is_resolved:
            raise ValueError("ModelRunner needs a resolved EngineConfig (EngineConfig.resolve(model))")
        # (LLMEngine has run self_check.check_model_supported on the model before sizing the pool for it)
        model = self.model = private_copy(model).eval()
        self.block_size = config.block_size
        config_hf = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's large temporaries reuse mapped pages (kvpaging/worker/host_memory.py)
        keep_frame_chunks()  # and the host path's calls reuse the interpreter's frame chunks (the same file)
        self.num_layers = config_hf.num_hidden_layers
        # each layer's KV heads (this rank's share of them with tensor parallelism) and widths (kvpaging/worker/kv_layout.py)
        self.kv_layout = kv_layout or config_layout(config_hf, self.num_layers, config.tensor_parallel_size)
        if self.kv_layout is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s config declares its key/value shapes per layer and a first forward pass "
                "could not read them off its attention calls, so kvpaging cannot size its cache", "kv_shape")
        self.kv_cache_dtype = config.kv_torch_dtype
        self.backend_name = config.attention_backend
        self.backend = get_backend(config.attention_backend)  # an AttentionBackend (kernels/backends.py)
        # sliding layers among full ones: a block table per layer group, the groups' layers sharing tensors
        self.layer_groups = layer_groups(config_hf, self.kv_layout, config.max_model_len, config.tensor_parallel_size)
        self.kv_caches = self._allocate_kv_caches(config.num_blocks)
        # each K/V tensor pair once (layers of different groups share theirs), without state layers' empty ones
        self._distinct_caches = list({id(k): (k, v) for k, v in self.kv_caches if k.numel()}.values())
        self.kv_scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * len(self.kv_layout)
        self.cache_indexes = cache_indexes(self.kv_layout, self.num_layers)  # None: one attention call per layer
        register_attention()
        model.set_attn_implementation(ATTN_NAME)  # on the private copy: the user's model keeps its attention
        # a hybrid model's linear-attention / state-space layers: a state slot per sequence (kvpaging/worker/state_layers.py)
        self.state_slots = install_state_layers(model, config.max_num_seqs)
        self.fast_layers = _fast_layers(model, config)
        # with tensor parallelism every rank calibrates once the all-reduces are in place (its forward pass is a
        # part of the model's, not a whole one): kvpaging/distributed/tensor_parallel.py calls calibrate_fp8_scales then
        if self.kv_cache_dtype == torch.float8_e4m3fn and config.tensor_parallel_size == 1:
            self.kv_scales = calibrate_fp8_scales(self, calibration_tokens)
        # A ready 4D mask makes transformers skip building one; our attention ignores it.
        self._placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # the live block tables, from each step's table_updates: one array, or one per layer group
        self.block_tables = [BlockTable() for _ in range(self.layer_groups.num_groups if self.layer_groups else 1)]
        self.probe = None  # the load-time self-check's AttentionProbe during its steps (kvpaging/worker/self_check.py)
        self.graphs = None
        self._config = config
        # a Llama-structured model's forward with no module calls, where exact (kvpaging/worker/direct_forward.py)
        self.direct = direct_forward_if_exact(self, config)
        if capture_graphs:
            self.capture_graphs()

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One K and one V tensor ``[num_blocks, block_size, kv_heads, width]`` per cache (per layer, and per further
        attention call of a layer that makes two); zeros, not empty: masked-out positions are multiplied by a
        probability of 0, and 0 * NaN is NaN."""
        shapes = [(num_blocks, self.block_size, layer.num_kv_heads, layer.width) for layer in self.kv_layout]
        groups = self.layer_groups
        if groups is not None:  # the j-th layer of every group stores in the same tensors (a block is one group's)
            shared = [(torch.zeros(shapes[0], dtype=self.kv_cache_dtype, device=self.device),
                       torch.zeros(shapes[0], dtype=self.kv_cache_dtype, device=self.device))
                      for _ in range(groups.group_size)]
            return [shared[slot] for slot in groups.layer_slot]
        return [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)) for shape in shapes]

    @property
    def uses_graphs(self) -> bool:
        """Whether this runner serves its decode steps through CUDA graphs (once ``capture_graphs`` has run).

        Only the Triton kernels are capture-safe (no host syncs, padding slots skipped in-kernel);
        the torch backend checks and masks its padding on the host, so it always runs eagerly.
        With tensor parallelism a graph would have to capture the all-reduces too.
        """
        config = self._config
        return (not config.enforce_eager and self.device.type == "cuda" and config.attention_backend == "triton"
                and config.tensor_parallel_size == 1 and self.state_slots is None and self.layer_groups is None)

    def capture_graphs(self) -> None:
        """Capture the decode step in CUDA graphs, where they apply (the engine does it after its self-check)."""
        config = self._config
        if self.uses_graphs:
            from kvpaging.worker.cuda_graphs import DecodeGraphs

            with torch.inference_mode():
                self.graphs = DecodeGraphs(self, config.max_num_seqs, -(-config.max_model_len // self.block_size))
        elif not config.enforce_eager and self.device.type == "cuda":
            if self.state_slots is not None:
                why = "the state layers group each step's sequences on the host, which a graph cannot replay"
            elif self.layer_groups is not None:
                why = "the graphs hold one block table, and this model keeps one per layer group"
            else:
                why = f"CUDA graphs capture the Triton kernels on one rank only, not the {config.attention_backend} one"
            logger.info("decode steps run eagerly: %s", why)

    def shutdown(self) -> None:
        """Nothing to release here (a tensor-parallel runner stops its worker processes)."""

    @property
    def block_table(self) -> BlockTable:
        """The runner's block tables (the first layer group's, for a model with a table per group)."""
        return self.block_tables[0]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._distinct_caches)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks (every layer) before the forward that writes into the copies."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        caches = self._distinct_caches
        self.backend.copy_blocks([k for k, _ in caches], [v for _, v in caches], mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, prefill_cu_seqlens_q: torch.Tensor,
                num_decodes: int, logits_to_keep, rows=None, group_tables=None) -> torch.Tensor:
        """One forward pass of the model over the paged cache: the only place the model is called
        (eager steps and CUDA-graph captures both come here). Returns the model's logits ``[1, n, vocab]``."""
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            prefill_cu_seqlens_q=prefill_cu_seqlens_q,
            num_decodes=num_decodes,
            kv_caches=self.kv_caches,
            kv_scales=self.kv_scales,
            backend=self.backend,
            probe=self.probe,
            rows=rows,
        )
        if self.cache_indexes is not None:
            meta.cache_indexes, meta.calls = self.cache_indexes, [0] * self.num_layers
        if group_tables is not None:  # each layer reads its group's tables and slots
            meta.group_tables, meta.layer_group = group_tables, self.layer_groups.layer_group
        step = CURRENT_STEP.set(meta)  # for decoder layers that do not pass the keyword argument on
        try:
            if self.direct is not None and self.direct.still_exact():
                return self.direct(meta, input_ids, positions, logits_to_keep)
            return self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=self._placeholder_mask,  # a ready 4D mask: transformers builds none; we ignore it
                use_cache=False,
                logits_to_keep=logits_to_keep,
                **{ATTN_NAME: meta},
            ).logits
        finally:
            CURRENT_STEP.reset(step)

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's tables applied to the runner's own, then its input tensors (``prepare_step_inputs``)."""
        for table, group_updates in zip(self.block_tables, out.table_updates):  # one list of changes per layer group
            table.apply(group_updates)
        return prepare_step_inputs(out, [table.array for table in self.block_tables], self.device)

    def execute(self, out: SchedulerOutput, all_positions: bool = False) -> torch.Tensor:
        """Run the step. Returns the logits in the model's dtype, one row per sampling sequence, in scheduled order
        (or, with ``all_positions``, one row per packed token: for teacher-forced measurements). Whoever needs float32
        widens them (the sampler does; an all-greedy step on the CPU reads bfloat16 logits as they are, so a batch's
        float32 copy of them, megabytes a step, is never made)."""
        logits = self.run(self.prepare_inputs(out), out.blocks_to_copy, all_positions)
        if self.state_slots is not None and out.children:  # n > 1: each completion goes on from the prompt's state
            self.state_slots.copy_rows([(c.request.seqs[0].blocks.row, c.blocks.row) for c in out.children])
        return logits

    @torch.inference_mode()
    def run(self, inputs: StepInputs, blocks_to_copy: list[tuple[int, int]], all_positions: bool = False) -> torch.Tensor:
        """``execute`` once the step's inputs are built (a tensor-parallel worker receives them ready-made)."""
        self.copy_blocks(blocks_to_copy)
        num_tokens = inputs.input_ids.shape[1]
        if self.graphs is not None and not all_positions and inputs.num_decodes == num_tokens:
            size = self.graphs.padded_size(num_tokens)
            if size is not None:
                return self.graphs.run(inputs, size)
        logits = self.forward(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
            inputs.prefill_cu_seqlens_q, inputs.num_decodes,
            0 if all_positions else inputs.logits_indices,  # 0: transformers' "keep every position"
            inputs.rows, inputs.group_tables,
        )
        return logits[0]


def _fast_layers(model, config: EngineConfig) -> FastLayers:
    """Faster CPU layers for the private copy (``kernels/cpu/layers.py``; ``cpu_fast_layers=None``: the exact ones),
    and oneDNN's kernels for every decode batch size made now, not one new size at a time in the middle of steps."""
    if config.cpu_fast_layers is False:
        return FastLayers()
    from kvpaging.kernels.cpu.layers import enable_fast_layers, warm_packed_products

    fast = enable_fast_layers(model, exact=config.cpu_fast_layers is None)
    seconds = warm_packed_products(model, config.max_num_seqs) if fast.linears else 0.0
    if seconds > 0.05:
        logger.info("oneDNN's kernels for decode batches of up to %d sequences made in %.2f s", config.max_num_seqs,
                    seconds)
    return fast


class BlockTable:
    """The runner's own copy of the block tables (vLLM v1's worker-side ``BlockTable``): one row per live sequence,
    rows of one int32 array that grows (doubling) when a row or column is missing.

    The block manager owns the tables and decides every change; it does not hand its records over. It writes
    each change down as a ``(row, column, block_ids)`` triple (a new table from column 0, a block appended at its
    column, a copy-on-write's new last block), the scheduler passes the step's triples on in
    ``SchedulerOutput.table_updates``, and :meth:`apply` writes them here before the step's inputs are read. Tables
    only grow, so a step brings few triples; a row whose sequence ended is taken by a later one, whose first
    triple rewrites it from column 0 and clears what lies past it. A step then takes the rows it needs in one
    fancy-indexing call (copying each table from a Python list every step would cost a microsecond or more each).
    """

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


@dataclass(eq=False)
class StepInputs:
    """The tensors of one packed step (see the module docstring)."""

    input_ids: torch.Tensor  # int64 [1, num_tokens]
    positions: torch.Tensor  # int64 [1, num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0; one-token sequences first
    seq_lens: torch.Tensor  # int32 [num_seqs]
    prefill_cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1]: query starts, counted from the first prefill token
    logits_indices: torch.Tensor  # int64 [num_sampling_seqs (+ tokens of prompt-logprob chunks)], in scheduled order
    num_decodes: int  # the first num_decodes tokens (and sequences) bring one token each
    rows: np.ndarray | None = None  # each sequence's block-table row, in the order of block_tables (its state slot)
    # with a block table per layer group: each group's (slot_mapping, block_tables), the first group's above too
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def prepare_step_inputs(out: SchedulerOutput, tables: list[np.ndarray],
                        device: torch.device | str = "cpu") -> StepInputs:
    """Build a step's input tensors from the scheduler's output and the block tables (``tables``: the runner's
    ``BlockTable.array`` of each layer group, one for most models, with the step's updates applied): the host
    work measured by the benchmarks.

    The decodes (one token each) are packed first, the multi-token chunks after
    them, so attention can serve the first part with the decode kernel and the
    rest with the prefill kernel. The decodes' token ids, positions and table rows
    come as lists and arrays in the scheduler's output; their slots, context lengths
    and block tables are computed for all of them at once with numpy, from their rows
    of ``tables``. A
    step of decodes only takes the shortest path (no packing). The chunks add a
    few numpy operations each (their tokens are copied once, as Python ints into
    one array); slots are ``block * block_size + offset``, as the cache lays them
    out. ``benchmarks/host_overhead.py``
    measures it: under 0.2 us per sequence-step on the 2-core VM of
    ``benchmarks/RESULTS.md``, most of it a dozen numpy and torch calls per step.
    """
    if getattr(device, "type", device) == "cpu":
        tensor = torch.from_numpy  # the array's memory, shared: no copy
    else:
        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)
    if not out.chunks:  # a step of decodes only (most steps of a busy engine): no packing, fewest calls
        return _decode_inputs(out, tables, tensor)
    return _mixed_inputs(out, tables, tensor)


def _decode_inputs(out: SchedulerOutput, tables: list[np.ndarray], tensor) -> StepInputs:
    """A step of decodes: one token each, at its sequence's last position."""
    pos, rows = out.decode_positions, out.decode_rows
    num_decodes = len(out.decodes)
    # a decode's position lies in the last block of its table, so its table is pos // block_size + 1 long
    width = int(pos.max()) // out.block_size + 1 if num_decodes else 0
    input_ids = np.array(out.decode_token_ids, dtype=np.int64).reshape(1, num_decodes)
    cols, offsets = np.divmod(pos, out.block_size)
    groups = [(tensor(_slots(t, rows, cols, offsets, out.block_size)), tensor(t[rows, :width])) for t in tables]
    return StepInputs(
        input_ids=tensor(input_ids),
        positions=tensor(pos.reshape(1, -1)),
        slot_mapping=groups[0][0],
        block_tables=groups[0][1],
        seq_lens=tensor((pos + 1).astype(np.int32)),  # a decode sees every token up to its own
        prefill_cu_seqlens_q=tensor(np.zeros(1, dtype=np.int32)),  # no prefill
        logits_indices=tensor(np.arange(num_decodes)),  # a decode's logits row is its own
        num_decodes=num_decodes,
        rows=rows,
        group_tables=groups if len(groups) > 1 else None,
    )


def _mixed_inputs(out: SchedulerOutput, tables: list[np.ndarray], tensor) -> StepInputs:
    """A step with chunks: the decodes' tokens first, then each chunk's tokens ``[start, start + n)``."""
    pos, rows = out.decode_positions, out.decode_rows
    num_decodes = len(out.decodes)
    input_ids = list(out.decode_token_ids)
    chunk_positions = []
    for s in out.chunks:
        input_ids += s.seq.token_ids[s.start : s.start + s.num_new_tokens]
        chunk_positions.append(np.arange(s.start, s.start + s.num_new_tokens))
    chunk_rows = np.array([s.table_row for s in out.chunks])
    lengths = np.array([s.num_new_tokens for s in out.chunks])
    ends = np.array([s.start + s.num_new_tokens for s in out.chunks])  # each chunk's context length
    ends_in_step = np.cumsum(lengths)  # where each chunk's tokens end, counted from the first chunk token
    positions = np.concatenate([pos, *chunk_positions])
    token_rows = np.concatenate([rows, np.repeat(chunk_rows, lengths)])  # each token's table row
    width = int(positions.max()) // out.block_size + 1  # the longest table: a last position is in a last block
    seq_rows = np.concatenate([rows, chunk_rows])
    sampling = np.array([s.sample for s in out.chunks])
    logits_indices = np.concatenate([np.arange(num_decodes), num_decodes - 1 + ends_in_step[sampling]])
    if out.prompt_logprob_chunks:  # every token of these chunks, after the sampling rows
        firsts = num_decodes + ends_in_step - lengths
        logits_indices = np.concatenate([logits_indices] + [firsts[k] + np.arange(lengths[k])
                                                            for k in out.prompt_logprob_chunks])
    # every table is a row of one array: the step takes its rows in one call
    cols, offsets = np.divmod(positions, out.block_size)
    groups = [(tensor(_slots(t, token_rows, cols, offsets, out.block_size)), tensor(t[seq_rows, :width]))
              for t in tables]
    return StepInputs(
        input_ids=tensor(np.fromiter(input_ids, np.int64, len(input_ids)).reshape(1, -1)),  # (faster than np.array)
        positions=tensor(positions.reshape(1, -1)),
        slot_mapping=groups[0][0],
        block_tables=groups[0][1],
        seq_lens=tensor(np.concatenate([pos + 1, ends]).astype(np.int32)),
        prefill_cu_seqlens_q=tensor(np.concatenate([[0], ends_in_step]).astype(np.int32)),
        logits_indices=tensor(logits_indices),
        num_decodes=num_decodes,
        rows=seq_rows,
        group_tables=groups if len(groups) > 1 else None,
    )


def _slots(tables: np.ndarray, rows: np.ndarray, cols: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each token: block ``table[row][col]`` (``col = pos // block_size``), at ``offset = pos %
    block_size`` in it."""
    return tables[rows, cols].astype(np.int64) * block_size + offsets
