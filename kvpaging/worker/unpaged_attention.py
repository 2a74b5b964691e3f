"""Attention calls outside an engine step, which the paged attention function hands here: the engine reading each
layer's key/value shapes off a forward pass before it sizes the cache (``kv_layout.MEASURING``), and the FP8
calibration pass (``fp8_scales.py``, a ``CALIBRATION_KWARG`` dict). Both get plain causal attention over the call's
own tokens; any other call without the step's metadata is refused, since attention without the cache would give
wrong tokens silently.
"""

from __future__ import annotations

import torch

from kvpaging.errors import UnsupportedModelError
from kvpaging.worker.kv_layout import MEASURING, record_call

CALIBRATION_KWARG = "kvpaging_calibration"  # a dict layer -> (k amax, v amax) per KV head, filled in place

__all__ = ["unpaged_call", "plain_attention", "no_metadata_error", "CALIBRATION_KWARG"]


def unpaged_call(module, query, key, value, scaling, dropout, kwargs) -> torch.Tensor:
    """A call outside an engine step: the engine measuring key/value shapes, or an FP8 calibration pass (both
    plain attention over the call's tokens, ``plain_attention``); anything else is refused, never served
    without the cache."""
    amax = kwargs.pop(CALIBRATION_KWARG, None)
    found = MEASURING.get()
    if found is not None:  # the engine reads each layer's key/value shapes before sizing the cache
        record_call(found, module, key, value)
    elif amax is None:
        raise no_metadata_error(module)
    else:  # record each KV head's largest |key| and |value|
        k_max = key.detach().abs().amax(dim=(0, 2, 3)).float()
        v_max = value.detach().abs().amax(dim=(0, 2, 3)).float()
        old = amax.get(module.layer_idx)
        amax[module.layer_idx] = (k_max, v_max) if old is None else (old[0].maximum(k_max), old[1].maximum(v_max))
    return plain_attention(module, query, key, value, dropout, scaling, kwargs)


def plain_attention(module, query, key, value, dropout, scaling, kwargs) -> torch.Tensor:
    """Causal attention over one unpaged call's tokens: transformers' SDPA; for a call with soft-capping or sinks,
    which SDPA does not do, the model's own modeling file's ``eager_attention_forward`` under a causal mask,
    windowed by the call's ``sliding_window``."""
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = None
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    q_len, k_len = query.shape[2], key.shape[2]
    pos_q = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    pos_k = torch.arange(k_len, device=query.device)[None, :]
    allowed = pos_k <= pos_q
    window = kwargs.get("sliding_window") or 0
    if window:
        allowed &= pos_k > pos_q - window
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def no_metadata_error(module) -> UnsupportedModelError:
    """Raised by the paged attention function when a call comes without the step's metadata."""
    layer = getattr(module, "layer_idx", None)
    return UnsupportedModelError(
        f"{type(module).__name__} (layer_idx={layer!r}) called kvpaging's paged attention outside an engine step "
        "(no 'kvpaging' keyword "
        "argument, no step running): the engine's private model was called directly. Attention would then run "
        "over the call's tokens alone, without the KV cache: kvpaging refuses rather than fall back to it.",
        "no_metadata")
