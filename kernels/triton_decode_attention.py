"""``paged_decode_attention`` in Triton: flash-decoding over a paged KV cache.

Reference: :func:`kvpaging.kernels.reference.paged_decode_attention`.

Why split the context?
----------------------
A decode step has one query token per sequence, so there is little work per
sequence and a lot of cache to read. One program per (sequence, KV head) would
leave most of a GPU idle at small batch sizes while each program walks a long
context alone. Flash-decoding cuts each sequence's context into ``num_splits``
slices handled by separate programs, then merges their partial results.

Two kernels
-----------
1. ``_decode_split_kernel``, grid ``(batch, num_kv_heads, num_splits)``: each
   program reads its slice of one sequence's K/V for one KV head and computes
   softmax attention over that slice only. It writes the normalised partial
   output and the slice's log-sum-exp (LSE = log of the sum of exp(scores)).
2. ``_decode_merge_kernel``, grid ``(batch, num_heads)``: combines the slices.
   With ``w_s = exp(lse_s - max_s lse_s)``, the full output is
   ``sum_s w_s * out_s / sum_s w_s``, which is exactly softmax over all tokens.

Memory access pattern (split kernel)
------------------------------------
* Query: the ``group`` query heads that share this KV head are neighbours in
  ``query[b]``, so they are loaded once as a ``[GROUP_PAD, HEAD_DIM_PAD]`` tile;
  the scores for all of them come from one matrix product ``q @ k^T``
  (``tl.dot``, tensor cores on a GPU). ``tl.dot`` needs at least 16 rows, so a
  small group is padded with masked rows. K and V are read once for the group,
  not once per query head: this is where GQA saves bandwidth.
* K/V: the program walks its slice ``TILE_N`` tokens at a time. Token ``t``
  lives at ``cache[block_tables[b, t // block_size], t % block_size, kv_head]``:
  one ``head_dim`` row per token, contiguous in memory (a coalesced load);
  consecutive tokens of one block are ``num_kv_heads * head_dim`` apart.
  Addressing token by token makes any block size work, smaller or larger than
  the tile.
* Scores use ``exp2``: the softmax scale is pre-multiplied by log2(e), so
  ``exp2(s * log2(e)) = exp(s)`` and the GPU's fast base-2 exponential does the work.

CUDA graphs
-----------
The grid depends only on the batch size, head counts and ``num_splits``; with
``num_splits=None`` it is chosen from shapes (the block table's width, the batch
size, the GPU's SM count), never from ``seq_lens``. A program whose slice lies
past its sequence's end does no loop iterations and writes an empty partial
result (LSE = -inf, output 0). So a captured graph replays correctly for any
lengths, and a padded batch row with ``seq_len = 0`` produces zeros.

FP8
---
The K scale is folded into the softmax scale (one multiply per program instead
of one per element) and the V scale multiplies the slice's output once at the
end. The FP8 numbers are converted to the query dtype for ``tl.dot``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpaging.kernels.fp8 import is_fp8
from kvpaging.kernels.triton_utils import (
    NO_WINDOW,
    soft_cap,
    dot_dtype,
    matmul,
    multiprocessor_count,
    padded_head_dim,
    scale_pointer_and_stride,
    unit_stride,
)
from kvpaging.kernels.validation import (check_decode_args, check_head_dim, check_last_dim_contiguous, check_triton_device,
                         check_sinks, check_softcap, check_window)

LOG2_E = math.log2(math.e)
# A split with fewer tokens than this costs more to merge than it saves.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    partial_out_ptr,  # float32 [batch, num_heads, num_splits, HEAD_DIM]
    partial_lse_ptr,  # float32 [batch, num_heads, num_splits], log2 units
    qk_scale,  # softmax scale * log2(e)
    tokens_per_split,
    window,  # a sliding window: only the last `window` positions are seen (NO_WINDOW: all of them)
    softcap,  # soft-capping of the scores (with SOFTCAP): softcap * tanh(score / softcap)
    query_stride_batch,
    query_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    table_stride_batch,
    k_scale_stride,
    v_scale_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,  # whether the scores are soft-capped (a separate compiled kernel: no cost without)
    DOT_DTYPE: tl.constexpr,
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + batch)
    split_end = tl.minimum(split * tokens_per_split + tokens_per_split, seq_len)
    # a sliding window starts the context later: slices wholly before it are empty
    split_start = tl.maximum(split * tokens_per_split, seq_len - window)

    # The query heads of this KV head's group, one per row.
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        query_ptr + batch * query_stride_batch + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * k_scale_stride)

    # Online softmax state per row: running max m (log2 units), running sum l
    # of exp2(score - m), and the running weighted sum of values acc.
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    table_row = block_tables_ptr + batch * table_stride_batch
    head_offset = kv_head * cache_stride_head
    token_in_tile = tl.arange(0, TILE_N)
    # Every tile starts before split_end, so it holds at least one real token
    # and m becomes finite on the first iteration.
    for tile_start in range(split_start, split_end, TILE_N):
        positions = tile_start + token_in_tile
        is_real = positions < split_end
        # Page lookup: which block holds each token, and where inside it.
        block_ids = tl.load(table_row + positions // BLOCK_SIZE, mask=is_real, other=0)
        token_offsets = (
            block_ids.to(tl.int64) * cache_stride_block + (positions % BLOCK_SIZE) * cache_stride_offset + head_offset
        )
        kv_offsets = token_offsets[:, None] + dims[None, :]
        kv_mask = is_real[:, None] & dim_mask[None, :]

        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = matmul(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, TILE_N]
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(is_real[None, :], scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])
        l = l * correction + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * correction[:, None] + matmul(p.to(DOT_DTYPE), v)
        m = m_new

    # This slice's normalised output and log2-sum-exp; an empty slice (past the
    # end of its sequence) leaves output 0 and LSE -inf, i.e. weight 0 in the merge.
    has_tokens = l > 0.0
    out = acc / tl.where(has_tokens, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr + kv_head * v_scale_stride)
    lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))

    # Both partial tensors are contiguous: [batch, num_heads, num_splits] for
    # the LSE, with a trailing HEAD_DIM for the output.
    num_heads = tl.num_programs(1) * GROUP
    partial_rows = (batch * num_heads + heads).to(tl.int64) * tl.num_programs(2) + split  # [GROUP_PAD]
    tl.store(partial_lse_ptr + partial_rows, lse, mask=row_mask)
    tl.store(
        partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :],
        out,
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# num_splits is an ordinary argument, not a constexpr, and Triton is told not to
# specialise on its value (is it 1? divisible by 16?): eager decode changes the
# split count as the block table widens, and each new value would otherwise
# compile a new merge kernel. Only its power-of-two bucket, SPLITS_PAD, is compiled in.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    sinks_ptr,  # float32 [num_heads] (with SINKS): each head's sink logit
    out_stride_batch,
    out_stride_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    dim_mask = dims < HEAD_DIM

    # One row of the contiguous partial tensors: every split's result for this
    # (sequence, head), num_splits * HEAD_DIM floats in a row. int64: a big batch
    # times heads times splits times HEAD_DIM passes 2**31.
    row = (batch * NUM_HEADS + head).to(tl.int64) * num_splits
    lse = tl.load(partial_lse_ptr + row + splits, mask=split_mask, other=float("-inf"))
    partial = tl.load(
        partial_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    lse_max = tl.max(lse, axis=0)
    if SINKS:  # the sink is one more softmax entry, in the denominator only (it has no value)
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # natural logit -> log2 units
        lse_max = tl.maximum(lse_max, sink)
    # seq_len == 0: every slice is empty, lse_max is -inf; shifting by 0 instead
    # makes every weight exp2(-inf) = 0 and the output 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    if SINKS:
        total += tl.exp2(sink - lse_max)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)

    tl.store(
        out_ptr + batch * out_stride_batch + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def decode_tiles(head_dim_pad: int, dot, fp8: bool) -> tuple[int, int]:
    """``(TILE_N, num_warps)`` of the split kernel: keys per inner step, and warps.

    Chosen from the Hopper compile report (``python -m kvpaging.kernels.compile_check``),
    with triton 3.9 and 3.6 alike:

    * 16-bit products run on tensor cores: 64 keys a step (32 at head dim 256), 4 warps.
    * float32 products run without them, each thread holding whole rows of its
      operands: with 64 keys and 4 warps head dim 256 spilled about 5 KB per
      thread. Half the keys and 8 warps: no spills, under 80 registers.
    * an FP8 cache adds the conversion of every key and value: with 4 warps ptxas
      stopped at 128 registers and spilled (block size 1, head dim 128). 8 warps:
      no spills, at most 128 registers, in the whole matrix.
    """
    if dot == tl.float32:
        return (32 if head_dim_pad <= 128 else 16), 8
    return (64 if head_dim_pad <= 128 else 32), (8 if fp8 else 4)


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device) -> int:
    """How many slices to cut each context into, from shapes only.

    Enough (sequence, KV head, slice) programs to give every streaming
    multiprocessor about two, but no slice shorter than ``MIN_TOKENS_PER_SPLIT``
    tokens of the table's capacity. Sequence lengths are never consulted, so
    the answer (and the grid) is the same at every replay of a CUDA graph.
    """
    num_sms = multiprocessor_count(device)
    wanted = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    most_useful = triton.cdiv(max_blocks * block_size, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, most_useful, MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (one query token per sequence) over a paged KV cache.

    Same arguments and result as the reference. ``num_splits`` slices each
    context across programs (None: chosen from shapes, see
    :func:`choose_num_splits`; an explicit value is capped at ``MAX_SPLITS``);
    any value gives the same answer up to rounding. ``window``: a sliding window
    (0: the whole context); the slices before it read nothing. ``softcap``: soft-capping
    of the scores (0: none). ``sinks``: attention sinks, added where the slices are merged.
    """
    check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    check_triton_device(query.device, k_cache.dtype)
    check_head_dim(query.shape[2])
    check_last_dim_contiguous(query=query, k_cache=k_cache, v_cache=v_cache)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")

    # The kernel steps through a block table row and the lengths one element at a time.
    block_tables, seq_lens = unit_stride(block_tables), unit_stride(seq_lens)

    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_blocks, block_size, query.device)
    # An explicit count is capped too: the merge holds every split's partial result of
    # one head in registers, and more slices than MAX_SPLITS only add empty programs.
    num_splits = min(num_splits, MAX_SPLITS)

    head_dim_pad = padded_head_dim(head_dim)
    dot = dot_dtype(query.dtype, k_cache.dtype)
    tile_n, num_warps = decode_tiles(head_dim_pad, dot, is_fp8(k_cache.dtype))
    # Slices are whole tiles long, so only the last tile of a sequence is partial.
    tokens_per_split = triton.cdiv(triton.cdiv(max(1, max_blocks * block_size), num_splits), tile_n) * tile_n

    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    k_scale_arg, k_scale_stride = scale_pointer_and_stride(k_scale, placeholder=query)
    v_scale_arg, v_scale_stride = scale_pointer_and_stride(v_scale, placeholder=query)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, k_scale_arg, v_scale_arg,
        partial_out, partial_lse,
        float(scale) * LOG2_E,
        tokens_per_split,
        window or NO_WINDOW,
        float(softcap),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        k_scale_stride, v_scale_stride,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        FP8=is_fp8(k_cache.dtype),
        SOFTCAP=bool(softcap),
        DOT_DTYPE=dot,
        num_warps=num_warps,
    )
    _decode_merge_kernel[(batch, num_heads)](
        partial_out, partial_lse, out,
        partial_lse if sinks is None else sinks.float().contiguous(),  # (a placeholder pointer without sinks)
        out.stride(0), out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        SPLITS_PAD=triton.next_power_of_2(num_splits),  # 1, 2, 4, ... 64: at most 7 merge kernels
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SINKS=sinks is not None,
        num_warps=4,
    )
    return out
