"""``paged_prefill_attention`` in Triton: causal attention of query chunks over a paged cache.

Reference: :func:`kvpaging.kernels.reference.paged_prefill_attention`.

One kernel serves a fresh prefill, a later chunk of a chunked prefill, a
prefix-cache hit (the prefix's K/V is already in the cache) and even decode:
sequence ``i``'s ``q_len`` queries are the last ``q_len`` of its ``seq_len``
cached tokens, so query ``j`` sits at position ``context_len + j`` with
``context_len = seq_len - q_len`` and sees keys ``0 .. context_len + j``.

The grid: (query tile, KV head)
-------------------------------
Query tokens of all sequences are packed one after another. The host cuts each
sequence's queries into tiles of ``QUERIES_PER_TILE`` tokens and builds a small
map, tile -> (sequence, first query of the tile), so each program knows whose
queries it has without searching ``cu_seqlens_q``. The grid then is
``(number of tiles, num_kv_heads)``. It depends on the lengths, which is fine:
prefill runs eagerly, never inside a CUDA graph.

Memory access pattern
---------------------
* Query tile: ``BLOCK_M`` rows, each one (query token, query head of this KV
  head's group) pair, with the group members of a token next to each other:
  row ``r`` is token ``r // GROUP_PAD``, head ``r % GROUP_PAD`` of the group.
  In ``query[token, head, :]`` the heads of a group are adjacent, so a token's
  rows are one contiguous run of ``group * head_dim`` numbers. Packing the group
  into the rows means each K/V tile is read once for all heads sharing it.
* K/V tiles: ``BLOCK_N`` tokens at a time, each found through the block table
  (``block_tables[seq, t // block_size]``, offset ``t % block_size``) and read
  as one contiguous ``head_dim`` row, as in decode. Key tiles stop at the last
  position any query of the tile can see, so the upper triangle of a causal
  prefill is never loaded.
* Online softmax in base 2 (see the decode kernel): a running max, sum and
  weighted value sum per row, rescaled whenever the max grows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpaging.kernels.fp8 import is_fp8
from kvpaging.kernels.triton_utils import (NO_WINDOW, dot_dtype, matmul, padded_head_dim, scale_pointer_and_stride, soft_cap,
                           unit_stride)
from kvpaging.kernels.validation import (check_head_dim, check_last_dim_contiguous, check_prefill_args, check_triton_device,
                         check_sinks, check_softcap, check_window)

LOG2_E = math.log2(math.e)


def prefill_tiles(head_dim_pad: int, group_pad: int, dot) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: query rows per program, keys per inner step, warps.

    Chosen from the Hopper compile report (``python -m kvpaging.kernels.compile_check``),
    which fails on any spill:

    * 16-bit products (tensor cores): 64 x 64 tiles with 4 warps up to head dim
      128. At 256 the accumulator alone is 64 x 256 floats: with 4 warps the
      kernel sat at the 255-register limit, so 8 warps share it and keys come
      32 at a time.
    * float32 products run without tensor cores, and each thread holds whole
      rows of both operands: 64 x 64 tiles spilled 8-11 KB per thread (even the
      tiny test model's head dim 32 hit 255 registers). 32 keys at a time and 8
      warps fit up to head dim 128; head dim 256 takes 32 query rows and 16 keys.
    """
    if dot == tl.float32:
        block_m, block_n, num_warps = (64, 32, 8) if head_dim_pad <= 128 else (32, 16, 8)
    else:
        block_m, block_n, num_warps = (64, 64, 4) if head_dim_pad <= 128 else (64, 32, 8)
    return max(block_m, group_pad), block_n, num_warps  # at least one whole GQA group per tile


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    tile_seq_ptr,  # int32 [num_tiles]: which sequence a tile belongs to
    tile_first_query_ptr,  # int32 [num_tiles]: index of its first query in that sequence
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,  # float32 [num_heads] (with SINKS): each head's sink logit
    qk_scale,  # softmax scale * log2(e)
    window,  # a sliding window: a query sees keys after its position - window (NO_WINDOW: all before it)
    softcap,  # soft-capping of the scores (with SOFTCAP): softcap * tanh(score / softcap)
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
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
    BLOCK_M: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP_PAD
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,  # whether the scores are soft-capped (a separate compiled kernel: no cost without)
    SINKS: tl.constexpr,  # whether each head's softmax has a sink entry
    DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = tl.load(tile_seq_ptr + tile)
    first_query = tl.load(tile_first_query_ptr + tile)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Rows: (query token, group member) pairs.
    rows = tl.arange(0, BLOCK_M)
    query_index = first_query + rows // GROUP_PAD  # within this sequence's chunk
    member = rows % GROUP_PAD
    row_mask = (query_index < q_len) & (member < GROUP)
    heads = kv_head * GROUP + member
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    token = (q_begin + query_index).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * query_stride_token + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    query_position = context_len + query_index  # position of each row's token in its sequence

    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * k_scale_stride)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The tile's last query sees the most keys: positions < kv_end; its first
    # query's window starts earliest, at kv_begin (0 without a window).
    kv_end = context_len + tl.minimum(first_query + QUERIES_PER_TILE, q_len)
    kv_begin = tl.maximum(context_len + first_query - window + 1, 0)
    table_row = block_tables_ptr + seq * table_stride_batch
    head_offset = kv_head * cache_stride_head
    key_in_tile = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        key_position = kv_start + key_in_tile
        is_real = key_position < kv_end
        block_ids = tl.load(table_row + key_position // BLOCK_SIZE, mask=is_real, other=0)
        token_offsets = (
            block_ids.to(tl.int64) * cache_stride_block
            + (key_position % BLOCK_SIZE) * cache_stride_offset
            + head_offset
        )
        kv_offsets = token_offsets[:, None] + dims[None, :]
        kv_mask = is_real[:, None] & dim_mask[None, :]

        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = matmul(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        # Causal: a query sees keys at its own position and before (and after position - window).
        visible = ((key_position[None, :] <= query_position[:, None])
                   & (key_position[None, :] > query_position[:, None] - window) & is_real[None, :])
        scores = tl.where(visible, scores, float("-inf"))

        # a row whose window begins after this tile's keys has seen nothing yet: its max stays -inf, and
        # shifting by 0 instead keeps exp2(-inf - -inf) = NaN out of its sums (they stay 0)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        correction = tl.exp2(m - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l = l * correction + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * correction[:, None] + matmul(p.to(DOT_DTYPE), v)
        m = m_new

    if SINKS:  # one more softmax entry per head, with no value: it only adds to the denominator
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634  # log2 units
        m_final = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_final)
        l = l * rescale + tl.exp2(sink - m_final)
        acc = acc * rescale[:, None]
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr + kv_head * v_scale_stride)
    tl.store(
        out_ptr + token[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _tile_map(
    cu_seqlens_q: list[int], seq_lens: list[int], num_query_tokens: int, queries_per_tile: int
) -> tuple[list[int], list[int]]:
    """For every query tile: its sequence and the index of its first query there.

    Example with 4 queries per tile and chunk lengths [6, 0, 3]: sequence 0 gets
    tiles starting at queries 0 and 4, sequence 1 none, sequence 2 one tile at 0:
    ``tile_seq = [0, 0, 2]``, ``tile_first_query = [0, 4, 0]``.
    """
    if cu_seqlens_q[0] != 0 or cu_seqlens_q[-1] > num_query_tokens:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at most at {num_query_tokens} query tokens, "
            f"got {cu_seqlens_q}"
        )
    tile_seq, tile_first_query = [], []
    for seq, (start, end) in enumerate(zip(cu_seqlens_q, cu_seqlens_q[1:])):
        q_len = end - start
        if not 0 <= q_len <= seq_lens[seq]:
            raise ValueError(
                f"sequence {seq} has {q_len} query tokens and seq_len {seq_lens[seq]}; "
                "need 0 <= q_len <= seq_len"
            )
        for first in range(0, q_len, queries_per_tile):
            tile_seq.append(seq)
            tile_first_query.append(first)
    return tile_seq, tile_first_query


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over a paged KV cache.

    Same arguments and result as the reference. Each sequence needs
    ``q_len <= seq_len``; rows of ``query`` past ``cu_seqlens_q[-1]`` are left
    as zeros. ``window``: a sliding window (0: none); keys before the first
    query's window are not read. ``softcap``: soft-capping of the scores (0: none).
    ``sinks``: attention sinks (gpt-oss), one logit per query head.
    """
    check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale)
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    check_triton_device(query.device, k_cache.dtype)
    check_head_dim(query.shape[2])
    check_last_dim_contiguous(query=query, k_cache=k_cache, v_cache=v_cache)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")

    # The kernel steps through a block table row, the lengths and the query starts one element at a time.
    block_tables, seq_lens, cu_seqlens_q = unit_stride(block_tables), unit_stride(seq_lens), unit_stride(cu_seqlens_q)

    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = padded_head_dim(head_dim)
    dot = dot_dtype(query.dtype, k_cache.dtype)
    block_m, block_n, num_warps = prefill_tiles(head_dim_pad, group_pad, dot)
    out = torch.zeros_like(query)

    # The lengths come to the host once (prefill runs eagerly, this sync is
    # fine) to size the grid and build the tile map.
    queries_per_tile = block_m // group_pad
    tile_seq, tile_first_query = _tile_map(cu_seqlens_q.tolist(), seq_lens.tolist(), query.shape[0], queries_per_tile)
    num_tiles = len(tile_seq)
    if num_tiles == 0:
        return out
    tile_seq = torch.tensor(tile_seq, dtype=torch.int32, device=query.device)
    tile_first_query = torch.tensor(tile_first_query, dtype=torch.int32, device=query.device)

    k_scale_arg, k_scale_stride = scale_pointer_and_stride(k_scale, placeholder=query)
    v_scale_arg, v_scale_stride = scale_pointer_and_stride(v_scale, placeholder=query)

    _prefill_kernel[(num_tiles, num_kv_heads)](
        query, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
        tile_seq, tile_first_query, k_scale_arg, v_scale_arg,
        out if sinks is None else sinks.float().contiguous(),  # (a placeholder pointer without sinks)
        float(scale) * LOG2_E,
        window or NO_WINDOW,
        float(softcap),
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        k_scale_stride, v_scale_stride,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        QUERIES_PER_TILE=queries_per_tile,
        BLOCK_N=block_n,
        FP8=is_fp8(k_cache.dtype),
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        DOT_DTYPE=dot,
        num_warps=num_warps,
    )
    return out
