"""Paged KV cache kernels in plain torch: read these first.

Each function here has the same signature as its Triton twin in
``triton_*.py`` and computes the same thing the obvious way. They are

* the test oracle: every Triton kernel is checked against them;
* the "torch" attention backend: the engine calls them directly on a CPU;
* the specification a learner reads before the fast version.

The paged layout
----------------
Per layer, keys live in ``k_cache[num_blocks, block_size, num_kv_heads, head_dim]``
(values in ``v_cache``, same shape). A sequence owns a list of blocks, its row of
``block_tables``; its token number ``t`` sits in block ``block_tables[t // block_size]``
at offset ``t % block_size``. A *slot* numbers every token position of the cache:
``slot = block_id * block_size + offset``.

Example with block_size = 4 and block table ``[7, 2]``: tokens 0..3 are in
block 7, tokens 4..5 in block 2 at offsets 0..1, so token 5 has slot 2 * 4 + 1 = 9.

Grouped-query attention (GQA)
-----------------------------
There are ``num_heads`` query heads but only ``num_kv_heads`` K/V heads;
each K/V head serves ``group = num_heads // num_kv_heads`` consecutive query
heads: query head ``h`` reads K/V head ``h // group`` (the same convention as
``repeat_kv`` in Hugging Face transformers).

FP8 caches
----------
When the cache dtype is ``float8_e4m3fn``, keys are stored as
``clamp(key / k_scale, -448, 448)`` and read back as ``cache.float() * k_scale``
(see ``fp8.py``). All arithmetic below is done in float32 and the result is cast
to the query's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpaging.kernels.fp8 import dequantize_kv_cache, is_fp8, quantize_fp8
from kvpaging.kernels.validation import (
    check_copy_blocks_args,
    check_decode_args,
    check_prefill_args,
    check_store_kv_args,
    check_sinks,
    check_softcap,
    check_window,
)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write this step's new keys and values into their cache slots, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 ``[num_tokens]``; ``slot = block_id * block_size + offset``.
            A negative slot marks a padding token: nothing is written for it.
        k_scale, v_scale: float32 scales for an FP8 cache, else None.
    """
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]

    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real]
    block_ids = slots // block_size
    offsets = slots % block_size

    k_cache[block_ids, offsets] = _to_cache_dtype(key[is_real], k_cache.dtype, k_scale)
    v_cache[block_ids, offsets] = _to_cache_dtype(value[is_real], v_cache.dtype, v_scale)


def _to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if is_fp8(cache_dtype):
        return quantize_fp8(x, scale)
    return x.to(cache_dtype)


def tables_in_range(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block tables as int64, with every entry past a sequence's last block set to block 0.

    Those entries are padding and may hold any number; pointing them at block 0
    keeps a gather in range. The tokens they bring in must be masked by the caller.
    """
    blocks_in_use = (seq_lens.long() + block_size - 1) // block_size  # [batch]
    column = torch.arange(block_tables.shape[1], device=block_tables.device)
    in_use = column[None, :] < blocks_in_use[:, None]  # [batch, max_blocks]
    return torch.where(in_use, block_tables, 0).long()


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence's tokens in order: ``[batch, max_blocks * block_size, num_kv_heads, head_dim]``
    in float32 (FP8 caches dequantized).

    Token ``t`` of sequence ``b`` is at ``[b, t]``. Positions ``>= seq_lens[b]``
    hold whatever the blocks happen to contain: callers must mask them.
    """
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    table = tables_in_range(block_tables, seq_lens, block_size)
    blocks = cache[table]  # [batch, max_blocks, block_size, num_kv_heads, head_dim]
    tokens = blocks.reshape(batch, max_blocks * block_size, num_kv_heads, head_dim)
    return dequantize_kv_cache(tokens, scale, torch.float32)


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
    """Attention of one new query token per sequence over its cached context (or the last ``window`` tokens of it).

    Args:
        query: ``[batch, num_heads, head_dim]``; the new token's own K/V is
            already in the cache (``store_kv`` runs first).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[batch, max_blocks]``.
        seq_lens: int32 ``[batch]``, tokens in the cache per sequence, the new
            one included. A length of 0 gives an all-zero output row.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        k_scale, v_scale: FP8 scales, or None for an unquantized cache.
        num_splits: ignored here (the Triton kernel splits the context across
            programs; one torch expression has nothing to split).
        window: sliding-window attention: the query sees only the last ``window``
            positions, its own included (transformers' ``kv > q - window``); 0: all.
        softcap: soft-capping of the scores (Gemma 2): each scaled score ``s``
            becomes ``softcap * tanh(s / softcap)`` before the softmax; 0: none.
        sinks: attention sinks (gpt-oss): ``[num_heads]`` learned logits, one more
            entry in each head's softmax that takes probability but has no value.

    Returns:
        ``[batch, num_heads, head_dim]`` in the query's dtype.
    """
    check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads

    # 1. Gather: follow the block table, token by token, for the whole batch.
    keys = gather_kv(k_cache, block_tables, seq_lens, k_scale)  # [batch, T, num_kv_heads, head_dim]
    values = gather_kv(v_cache, block_tables, seq_lens, v_scale)
    max_tokens = keys.shape[1]

    # 2. GQA: query heads [kv0: g0..g(group-1), kv1: ...], so split the head
    #    dimension into (kv head, position in its group).
    q = query.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,btkd->bkgt", q, keys) * scale  # [batch, kv, group, T]
    if softcap:  # squash every score into (-softcap, softcap)
        scores = softcap * torch.tanh(scores / softcap)

    # 3. Masked softmax: only the first seq_lens[b] positions are real tokens
    #    (with a window, only the last `window` of them).
    positions = torch.arange(max_tokens, device=query.device)
    is_real = positions[None, :] < seq_lens[:, None].long()
    if window:
        is_real &= positions[None, :] >= seq_lens[:, None].long() - window
    is_real = is_real[:, None, None, :]  # [batch, 1, 1, T]
    scores = scores.masked_fill(~is_real, float("-inf"))
    if sinks is not None:  # the sink: one more logit per head, whose probability is dropped after the softmax
        sink = sinks.float().reshape(1, num_kv_heads, group, 1).expand(batch, -1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    # A sequence of length 0 has every score at -inf and softmax gives NaN;
    # zeroing the masked positions turns its output into zeros instead.
    probs = torch.where(is_real, probs, 0.0)

    # 4. Weighted sum of the values.
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


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
    """Causal attention of a chunk of new query tokens per sequence over the cache.

    Serves prefill, chunked prefill and prefix-cache hits alike (and decode, as
    a chunk of one token): sequence ``i`` has ``q_len = cu_seqlens_q[i+1] -
    cu_seqlens_q[i]`` query tokens, packed one sequence after another in
    ``query``, and they are the LAST ``q_len`` of its ``seq_lens[i]`` cached
    tokens (their K/V already stored). Query ``j`` of the chunk sits at position
    ``context_len + j`` with ``context_len = seq_lens[i] - q_len`` and sees the
    keys at positions ``0 .. context_len + j``.

    Example: 10 tokens of a prompt were prefilled earlier, a chunk of 3 more
    arrives: seq_len = 13, q_len = 3, context_len = 10; the chunk's first query
    sees keys 0..10, its last sees 0..12.

    Args:
        query: ``[total_q_tokens, num_heads, head_dim]``.
        cu_seqlens_q: int32 ``[batch + 1]``, starts of each sequence's queries.
        seq_lens: int32 ``[batch]``, cached tokens per sequence, chunk included.
        window: sliding-window attention: query ``j`` sees only keys after position
            ``context_len + j - window``; 0: all.
        softcap, sinks: as :func:`paged_decode_attention`.
        other arguments: as :func:`paged_decode_attention`.

    Returns:
        ``[total_q_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale)
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)

    # One sequence at a time: lengths differ, and a loop reads plainly.
    for i in range(block_tables.shape[0]):
        q_start, q_end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        q_len, seq_len = q_end - q_start, int(seq_lens[i])
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {i} has {q_len} queries but only seq_len={seq_len} cached tokens")

        # 1. Gather this sequence's tokens from its blocks, in order.
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = dequantize_kv_cache(k, k_scale, torch.float32)  # [seq_len, num_kv_heads, head_dim]
        v = dequantize_kv_cache(v, v_scale, torch.float32)

        # 2. GQA: give every query head its own copy of the K/V head it reads.
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)

        # 3. Causal mask aligned to the END of the sequence: the queries are the
        #    last q_len positions. (torch's scaled_dot_product_attention with
        #    is_causal=True aligns the mask to the START, which is only right
        #    when q_len == seq_len; hence the explicit mask.)
        context_len = seq_len - q_len
        q_positions = context_len + torch.arange(q_len, device=query.device)
        k_positions = torch.arange(seq_len, device=query.device)
        visible = k_positions[None, :] <= q_positions[:, None]  # [q_len, seq_len]
        if window:  # sliding window: and only the last `window` positions up to the query's own
            visible &= k_positions[None, :] > q_positions[:, None] - window

        # 4. Ordinary softmax attention. Every query sees at least key 0, so no
        #    row is fully masked.
        q = query[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head; its probability is dropped
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def copy_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks in every layer, in place (copy-on-write after a fork).

    Args:
        k_caches, v_caches: one cache tensor per layer.
        block_mapping: int64 ``[num_pairs, 2]`` rows of ``(src, dst)`` block ids.
            A block may not be both a source and a destination in one call, and
            destinations must be distinct (copy-on-write copies into fresh blocks);
            a mapping that breaks this raises ``ValueError`` naming the block, before
            anything is copied (``validation.check_block_mapping``).
    """
    check_copy_blocks_args(k_caches, v_caches, block_mapping)
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]
