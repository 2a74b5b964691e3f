"""The engine's "torch" attention backend: the references, with the hot spots done by fused torch ops.

``reference.py`` spells every step out (einsum, mask, softmax, einsum) so that
it can be read and trusted. The engine runs the same maths on every layer of
every step, so the functions here take shortcuts that give the same numbers
with fewer passes over memory and fewer small operations:

* **Gathering blocks** with ``index_select`` on the cache viewed as one row per
  block (``[num_blocks, block_size * num_kv_heads * head_dim]``): each block is
  one contiguous row, copied whole. The reference's ``cache[table]`` computes
  the same tensor through general advanced indexing, about 4x slower on a CPU.
* ``paged_decode_attention`` hands the masked attention to
  ``torch.nn.functional.scaled_dot_product_attention`` (one fused kernel
  instead of five separate ops). The query heads that share a KV head are laid
  out as that KV head's "queries", so GQA needs no copy of the keys.
* ``paged_prefill_attention`` runs one fused SDPA call per sequence, with
  ``enable_gqa`` instead of copying every KV head ``group`` times, and the
  causal mask built only when the chunk does not start at position 0. It runs
  in the query's dtype when the cache holds that dtype unscaled: a bfloat16
  model's prompt is then attended exactly as its own sdpa attention does it
  (bit for bit for a chunk from position 0, and 2-3x faster on a CPU than
  widening everything to float32, which FP8 caches, soft-capping and sinks still do).
* ``store_kv`` writes all new keys with one ``index_copy_`` into the cache
  viewed as a flat list of slots, when no slot is padding.

``copy_blocks`` is the reference itself. The tests check this module against
the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpaging.kernels.fp8 import dequantize_kv_cache, is_fp8
from kvpaging.kernels.reference import copy_blocks, tables_in_range
from kvpaging.kernels.reference import store_kv as reference_store_kv
from kvpaging.kernels.validation import check_prefill_args, check_sinks, check_softcap, check_window

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks"]


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """``reference.store_kv`` by one ``index_copy_`` per cache. A padding (negative) slot goes to the reference,
    which skips it. On a GPU that means looking for one first (an index out of range there is a device-side
    assert); on the CPU ``index_copy_`` itself refuses it with an IndexError, so the common call, with none, looks
    for nothing: what it wrote before raising were real tokens' own keys and values, which the reference writes
    again (and a slot past the cache raises there too)."""
    if (is_fp8(k_cache.dtype) or key.dtype != k_cache.dtype
            or (slot_mapping.device.type != "cpu" and bool((slot_mapping < 0).any()))):
        reference_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    try:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
    except IndexError:
        reference_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale, dtype=torch.float32) -> torch.Tensor:
    """The listed blocks' tokens, in order, as ``dtype``: ``[len(blocks) * block_size, num_kv_heads, head_dim]``."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks)
    return dequantize_kv_cache(rows.view(-1, num_kv_heads, head_dim), scale, dtype)


def _attention(q, k, v, visible, scale, softcap, sink=None, is_causal=False):
    """Fused SDPA; with soft-capping or sinks (which SDPA has no option for), the same maths spelled out.

    ``q`` ``[..., heads, q_len, d]``; ``k``, ``v`` ``[..., kv_heads, t, d]`` (GQA: the heads of a group
    share one KV head); ``visible`` a boolean mask broadcast to ``[..., heads, q_len, t]``, or None
    with ``is_causal``; ``sink`` each head's sink logit, broadcast to ``[..., heads, q_len, 1]``.
    """
    if not softcap and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sink.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           num_splits=None, window=0, softcap=0.0, sinks=None):
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    blocks = tables_in_range(block_tables, seq_lens, block_size).reshape(-1)  # padding -> block 0, masked below
    shape = (batch, max_blocks * block_size, num_kv_heads, head_dim)
    keys = _gather_blocks(k_cache, blocks, k_scale).view(shape).transpose(1, 2)  # [batch, kv_heads, T, head_dim]
    values = _gather_blocks(v_cache, blocks, v_scale).view(shape).transpose(1, 2)
    positions = torch.arange(shape[1], device=query.device)
    visible = positions[None, :] < seq_lens[:, None]
    if window:  # sliding window: only the last `window` positions
        visible &= positions[None, :] >= seq_lens[:, None] - window
    visible = visible[:, None, None, :]  # [batch, 1, 1, T]
    q = query.float().reshape(batch, num_kv_heads, group, head_dim)
    if softcap or sinks is not None:  # (the spelled-out path takes a KV head's group as its query rows)
        sink = None if sinks is None else sinks.reshape(1, num_kv_heads, 1, group, 1)
        out = _attention(q[:, :, None], keys[:, :, None], values[:, :, None], visible[:, :, None], scale, softcap,
                         sink)[:, :, 0]
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    # a sequence of length 0 sees no key at all: zeros, as the reference gives (CUDA-graph padding)
    out = torch.where((seq_lens > 0)[:, None, None, None], out, 0.0)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def prefill_sequence(query, k_cache, v_cache, block_tables, i, q_start, q_end, seq_len, scale, k_scale, v_scale, window,
                     softcap, sinks, out) -> None:
    """Sequence ``i``'s chunk, ``query[q_start:q_end]``, attended into ``out[q_start:q_end]`` (arguments checked as
    :func:`paged_prefill_attention` checks them): one fused SDPA call over its gathered blocks."""
    q_len = q_end - q_start
    if q_len == 0:
        return
    if q_len > seq_len:
        raise ValueError(f"sequence {i} has {q_len} queries but only seq_len={seq_len} cached tokens")
    sink = None if sinks is None else sinks.reshape(1, -1, 1, 1)
    block_size = k_cache.shape[1]
    # SDPA in the query's own dtype where the cache holds that dtype unscaled (a bfloat16 model: what its own
    # sdpa attention computes, to the bit for a chunk from position 0); else in float32 (FP8 caches, the
    # spelled-out maths of soft-capping and sinks)
    dtype = (query.dtype if k_cache.dtype == query.dtype and k_scale is None and not softcap and sinks is None
             else torch.float32)
    blocks = block_tables[i, : -(-seq_len // block_size)].long()
    # 4-D [1, heads, tokens, head_dim] inputs: CPU SDPA runs its fused kernel only on 4-D tensors
    k = _gather_blocks(k_cache, blocks, k_scale, dtype)[:seq_len].transpose(0, 1)[None]  # [1, kv_heads, seq_len, d]
    v = _gather_blocks(v_cache, blocks, v_scale, dtype)[:seq_len].transpose(0, 1)[None]
    q = query[q_start:q_end].to(dtype).transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
    if q_len == seq_len and not (window and window < seq_len):  # from position 0, no window: plain causal
        o = _attention(q, k, v, None, scale, softcap, sink, is_causal=True)
    else:  # the queries are the LAST q_len positions: the causal mask is aligned to the end
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos[:, None]
        if window:  # sliding window: and only the last `window` positions up to the query's own
            visible &= k_pos > q_pos[:, None] - window
        o = _attention(q, k, v, visible, scale, softcap, sink)
    out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None,
                            v_scale=None, window=0, softcap=0.0, sinks=None):
    check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale)
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, query.shape[1], query.device)
    out = torch.zeros_like(query)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        prefill_sequence(query, k_cache, v_cache, block_tables, i, starts[i], starts[i + 1], seq_len, scale, k_scale,
                         v_scale, window, softcap, sinks, out)
    return out
