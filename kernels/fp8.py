"""FP8 (e4m3) KV cache: scales, quantize, dequantize.

An FP8 KV cache stores every key and value in one byte instead of two, so a
decode step, which is limited by how fast it can read the cache, reads half as
many bytes. The price is precision: ``float8_e4m3fn`` has 3 mantissa bits and
its largest finite value is 448, so each number is stored as

    cache = clamp(x / scale, -448, 448)   rounded to e4m3
    x    ~= cache * scale

and ``scale`` is chosen so that the largest ``|x|`` lands near 448.

Why one scale per KV head (a float32 tensor of shape ``[num_kv_heads]``)
----------------------------------------------------------------------
Different heads have very different ranges (a few heads carry outliers many
times larger than the rest). With one scale for the whole tensor the quiet heads
would use only a few of the 256 codes; with one scale per head each head gets
the whole range. It costs nothing in the kernels: every attention program
handles exactly one KV head, so it loads its one K scale and one V scale once.
A per-tensor scale (shape ``[1]`` or a 0-d tensor) is accepted everywhere too
and simply means "the same number for every head".

Where the scales come from
--------------------------
``compute_kv_scales`` measures them (amax / 448) on sample keys or values, for
example from a calibration prompt. vLLM reads precomputed scales from the
checkpoint, or uses 1.0; this package leaves that choice to the model runner.

All functions here are plain torch and run on any device.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# The largest finite float8_e4m3fn value: 0b0_1111_110 = 1.75 * 2**8.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# A scale of 0 would divide by zero when quantizing an all-zero head; any tiny
# positive number works, because 0 / tiny is still 0.
MIN_SCALE = 1e-12


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 cache dtype this package uses (``torch.float8_e4m3fn``)."""
    return dtype == FP8_DTYPE


def compute_kv_scales(x: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """Scales that map the largest ``|x|`` to 448, the e4m3 maximum.

    Args:
        x: keys or values ``[..., num_kv_heads, head_dim]`` in any float dtype,
            for example ``[num_tokens, num_kv_heads, head_dim]`` or a whole
            cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        per_head: one scale per KV head (shape ``[num_kv_heads]``) when True,
            one for the whole tensor (shape ``[1]``) when False.

    Returns:
        float32 scales on ``x``'s device, never zero.
    """
    if x.dim() < 2:
        raise ValueError(f"expected [..., num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    magnitude = x.detach().abs().float()
    if per_head:
        # Reduce over every dimension except the head dimension (-2).
        amax = magnitude.transpose(-2, 0).reshape(x.shape[-2], -1).amax(dim=1)
    else:
        amax = magnitude.amax().reshape(1)
    return (amax / FP8_MAX).clamp(min=MIN_SCALE)


def _broadcastable(scale: torch.Tensor) -> torch.Tensor:
    """View a ``[num_kv_heads]``, ``[1]`` or 0-d scale as ``[num_kv_heads or 1, 1]``
    so that it lines up with the ``[..., num_kv_heads, head_dim]`` tail of a
    key, value or cache tensor."""
    return scale.float().reshape(-1, 1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` as ``float8_e4m3fn``.

    ``x`` is ``[..., num_kv_heads, head_dim]``; ``scale`` is per head or per
    tensor. The clamp matters: torch turns out-of-range values into NaN (e4m3fn
    has no infinity), and a NaN in the cache would poison every later token.
    """
    scaled = x.float() / _broadcastable(scale).to(x.device)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``x.float() * scale`` in ``dtype``: the inverse of :func:`quantize_fp8`
    up to the e4m3 rounding error (about 1/16 of the value)."""
    return (x.float() * _broadcastable(scale).to(x.device)).to(dtype)


def quantize_kv_cache(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A new FP8 copy of a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache."""
    if cache.dim() != 4:
        raise ValueError(
            "expected a cache [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    return quantize_fp8(cache, scale)


def dequantize_kv_cache(
    cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The cache as ``dtype`` numbers: FP8 caches are multiplied by their scale,
    other caches are only converted (``scale`` must then be None)."""
    if is_fp8(cache.dtype):
        if scale is None:
            raise ValueError("an FP8 cache needs its scale to be dequantized")
        return dequantize_fp8(cache, scale, dtype)
    if scale is not None:
        raise ValueError(f"a {cache.dtype} cache is not quantized; pass scale=None")
    return cache.to(dtype)
