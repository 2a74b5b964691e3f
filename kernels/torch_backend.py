"""The engine's "torch" attention backend: the references, with two hot spots done by fused torch ops.

``reference.py`` spells every step out (einsum, mask, softmax, einsum) so that
it can be read and trusted. The engine runs the same maths on every layer of
every step, so two functions here take shortcuts that give the same numbers
with fewer passes over memory:

* ``paged_decode_attention`` gathers each sequence's blocks exactly like the
  reference, then hands the masked attention to
  ``torch.nn.functional.scaled_dot_product_attention`` (one fused kernel
  instead of five separate ops; about 3x faster on a CPU). The query heads
  that share a KV head are laid out as that KV head's "queries", so GQA needs
  no copy of the keys.
* ``store_kv`` writes all new keys with one ``index_copy_`` into the cache
  viewed as a flat list of slots, when no slot is padding.

Prefill attention and ``copy_blocks`` are the references themselves. The
tests check this module against the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import is_fp8
from .reference import copy_blocks, gather_kv, paged_prefill_attention
from .reference import store_kv as reference_store_kv

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks"]


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if is_fp8(k_cache.dtype) or key.dtype != k_cache.dtype or bool((slot_mapping < 0).any()):
        reference_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           num_splits=None):
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_kv(k_cache, block_tables, seq_lens, k_scale).transpose(1, 2)  # [batch, kv_heads, T, head_dim]
    values = gather_kv(v_cache, block_tables, seq_lens, v_scale).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    visible = (positions[None, :] < seq_lens[:, None].long())[:, None, None, :]  # [batch, 1, 1, T]
    q = query.float().reshape(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    # a sequence of length 0 sees no key at all: zeros, as the reference gives (CUDA-graph padding)
    out = torch.where((seq_lens > 0)[:, None, None, None], out, 0.0)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)
