"""Paged attention plugged into transformers models through ``AttentionInterface``.

We run the transformers model itself, not a re-implementation: its embedding,
RoPE, norms and MLPs are untouched. Only the attention call is ours. (On a CPU a
Llama-structured model's layers may be called straight rather than through their
modules, ``kvpaging/worker/direct_forward.py``: the same operations, the same
logits to the bit, checked before it is used; this function is called either way.) transformers
looks attention functions up by name (``config._attn_implementation``), so we
register one called ``"kvpaging"``. For each layer it receives the step's new
queries, keys and values (RoPE already applied) and:

1. writes the new keys and values into the paged cache at their slots
   (``store_kv`` with the step's slot mapping), then
2. attends each query over its own sequence's cached tokens, found through its
   block table. The runner packs sequences that bring one token (decodes) first:
   they go through ``paged_decode_attention`` in one batched call, and the
   multi-token prefill chunks after them through ``paged_prefill_attention``.

The step's bookkeeping travels as a keyword argument (``kvpaging=AttentionMetadata``)
that transformers passes down to every attention call. Some decoder layers do not
pass their keyword arguments on (StableLM, Nemotron); for them the runner also
holds the step's metadata in a context variable (``CURRENT_STEP``) for the length
of its forward pass, and the function reads it there. A call with neither means
someone called the engine's private model outside a step: the function raises
rather than attend without the cache, since that would give wrong tokens silently.
The exceptions are the passes that run the model unpaged before serving (reading the key/value layout, the FP8
calibration): ``unpaged_attention.py`` serves those.

The load-time self-check (``kvpaging/worker/self_check.py``) sets ``AttentionMetadata.probe``
for its few steps: every call is then recorded and checked (one call per layer,
key/value shapes that fit the cache, no attention argument the kernels ignore).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from kvpaging.errors import UnsupportedModelError
from kvpaging.worker.unpaged_attention import unpaged_call

ATTN_NAME = "kvpaging"

__all__ = ["AttentionMetadata", "register_attention", "ATTN_NAME", "CURRENT_STEP"]

# the step being run (ModelRunner.forward sets it around the model's forward pass), for layers that drop kwargs
CURRENT_STEP: contextvars.ContextVar = contextvars.ContextVar("kvpaging_step", default=None)


@dataclass(eq=False)
class AttentionMetadata:
    """Everything a layer's attention needs for one packed step."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]; one-token sequences come first
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache after this step
    prefill_cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1]: query starts within the prefill part
    num_decodes: int  # the first num_decodes tokens each belong to a different one-token sequence
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    kv_scales: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # per layer FP8 scales, or (None, None)
    backend: object  # an AttentionBackend (kernels/backends.py): store_kv, paged_*_attention, copy_blocks
    probe: object = None  # the self-check's AttentionProbe (kvpaging/worker/self_check.py) during its steps, else None
    rows: object = None  # each sequence's block-table row, decodes first: its state slot (kvpaging/worker/state_layers.py)
    # layers that call attention more than once a step (differential attention): each layer's cache per call
    # (kv_layout.cache_indexes) and the calls made so far in this step; None for models that call once a layer
    cache_indexes: list | None = None
    calls: list | None = None
    state_groups: list | None = None  # the step's sequences as state layers run them, worked out at the first one
    # sliding layers among full ones: each layer group's (slot_mapping, block_tables), and each layer's group
    # (kvpaging/core/layer_groups.py); None: every layer reads slot_mapping and block_tables above
    group_tables: list | None = None
    layer_group: tuple[int, ...] | None = None
    backend_state: object = None  # what the backend keeps for the step's later layers (the cpu backend's DecodeStep)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One layer's attention over the paged KV cache: store this step's keys and values, then attend."""
    meta: AttentionMetadata | None = kwargs.get(ATTN_NAME) or CURRENT_STEP.get()
    if meta is None:
        return unpaged_call(module, query, key, value, scaling, dropout, kwargs)  # unpaged_attention.py
    if meta.probe is not None:  # the load-time self-check: record and check this call
        meta.probe.record(module, query, key, value, dropout, kwargs)
    # transformers hands us [batch=1, heads, tokens, head_dim]; the kernels take [tokens, heads, head_dim]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    layer = module.layer_idx
    slot_mapping, block_tables = meta.slot_mapping, meta.block_tables
    if meta.group_tables is not None:  # this layer's group keeps tables of its own
        slot_mapping, block_tables = meta.group_tables[meta.layer_group[layer]]
    if meta.calls is not None:  # a layer that calls attention more than once a step: a cache for each call
        n = meta.calls[layer]
        meta.calls[layer] = n + 1
        layer = meta.cache_indexes[layer][n]
    k_cache, v_cache = meta.kv_caches[layer]
    width, value_width = k_cache.shape[-1], v.shape[-1]
    if k.shape[-1] != width or value_width != width:  # keys and values of two widths (kvpaging/worker/kv_layout.py)
        if k.shape[-1] > width or value_width > width:
            raise UnsupportedModelError(
                f"layer {layer} gives keys {k.shape[-1]} and values {value_width} wide, but its cache rows hold "
                f"{width}: the cache was sized for other shapes", "kv_shape")
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    k_scale, v_scale = meta.kv_scales[layer]
    window = kwargs.get("sliding_window") or 0  # a sliding layer's window (transformers: keys after q - window)
    softcap = kwargs.get("softcap") or 0.0  # Gemma 2's soft-capped attention scores
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks: one logit per query head
    out = _store_and_attend(meta, slot_mapping, block_tables, q, k, v, k_cache, v_cache, scaling, k_scale, v_scale,
                            window, softcap, sinks)
    if value_width != width:
        out = out[..., :value_width]
    return out.unsqueeze(0), None  # [1, tokens, heads, head_dim], as transformers expects


def _store_and_attend(meta: AttentionMetadata, slot_mapping, block_tables, q, k, v, k_cache, v_cache, scaling, k_scale,
                      v_scale, window, softcap, sinks) -> torch.Tensor:
    """The layer's keys and values into the cache, then its attention: in a step of decodes only, by the backend's
    one call for both where it has one (``store_and_decode``: the cpu backend's), else ``store_kv`` then ``_attend``."""
    store_and_decode = getattr(meta.backend, "store_and_decode", None)
    if (store_and_decode is not None and meta.num_decodes == q.shape[0] and k_scale is None and not window
            and not softcap and sinks is None):
        out = store_and_decode(meta, q, k, v, k_cache, v_cache, slot_mapping, block_tables, scaling)
        if out is not None:
            return out
    meta.backend.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _attend(meta, block_tables, q, k_cache, v_cache, scaling, k_scale, v_scale, window, softcap, sinks)


def _attend(meta: AttentionMetadata, block_tables, q, k_cache, v_cache, scaling, k_scale, v_scale, window, softcap,
            sinks) -> torch.Tensor:
    """The decodes (the first ``num_decodes`` tokens) with the decode kernel, the chunks after them with prefill's."""
    ops, nd = meta.backend, meta.num_decodes
    if nd == q.shape[0]:
        return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, meta.seq_lens, scaling,
                                          k_scale, v_scale, window=window, softcap=softcap, sinks=sinks)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = ops.paged_decode_attention(q[:nd], k_cache, v_cache, block_tables[:nd], meta.seq_lens[:nd],
                                              scaling, k_scale, v_scale, window=window, softcap=softcap, sinks=sinks)
    out[nd:] = ops.paged_prefill_attention(q[nd:], k_cache, v_cache, block_tables[nd:], meta.prefill_cu_seqlens_q,
                                           meta.seq_lens[nd:], scaling, k_scale, v_scale, window=window,
                                           softcap=softcap, sinks=sinks)
    return out


_registered = False


def register_attention() -> None:
    """Register the "kvpaging" attention function (and a matching no-op mask function) with transformers."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    # The FP8 calibration pass runs unpaged: its masks are built as for SDPA, matching the
    # SDPA call above; inside the engine a ready 4D placeholder mask makes transformers
    # skip mask creation altogether.
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _registered = True
