"""``store_kv`` in Triton: write new keys and values into their cache slots.

Reference: :func:`kvpaging.kernels.reference.store_kv`.

Memory access pattern
---------------------
One program per token. A token's keys for all KV heads are
``num_kv_heads * head_dim`` numbers in a row of ``key``, and its slot in the
cache, ``k_cache[block_id, offset]``, is also one run of
``num_kv_heads * head_dim`` numbers (the cache is laid out
``[num_blocks, block_size, num_kv_heads, head_dim]``). So each program does one
contiguous read and one contiguous write per tensor, and programs for
neighbouring tokens of one sequence write neighbouring rows of one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpaging.kernels.fp8 import FP8_MAX, is_fp8
from kvpaging.kernels.triton_utils import scale_pointer_and_stride, unit_stride
from kvpaging.kernels.validation import (
    check_head_dim,
    check_last_dim_contiguous,
    check_store_kv_args,
    check_triton_device,
    interpreter_enabled,
)


@triton.jit
def _round_to_e4m3_grid(x):
    """Round float32 ``x`` (|x| <= 448) to the nearest e4m3 number, staying in float32.

    Only used under the CPU interpreter, whose float32 -> float8e4nv cast (triton
    3.9) loses the carry when rounding up to the next power of two (124 becomes
    64 instead of 128). After this rounding the cast has nothing left to round.
    e4m3 keeps 3 mantissa bits, so numbers in [2^e, 2^(e+1)) are spaced
    2^(e-3) apart; below 2^-6 (subnormals) the spacing stays 2^-9. Exact ties
    round up here rather than to even, a difference the tests tolerate.
    """
    exponent = tl.floor(tl.log2(tl.maximum(tl.abs(x), 0.015625)))  # 0.015625 = 2^-6
    step = tl.exp2(exponent - 3.0)
    return tl.floor(x / step + 0.5) * step


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    k_scale_stride,
    v_scale_stride,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_FP8_IN_SOFTWARE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token: leave the cache alone
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # A [heads, head_dim] tile: this token's K (or V) for every KV head.
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    key = tl.load(key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :], mask=mask
    )
    if FP8:
        # One scale per KV head (stride 0 when it is one scale per tensor).
        k_scale = tl.load(k_scale_ptr + heads * k_scale_stride, mask=heads < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads * v_scale_stride, mask=heads < NUM_KV_HEADS, other=1.0)
        key = key.to(tl.float32) / k_scale[:, None]
        value = value.to(tl.float32) / v_scale[:, None]
        # Clamp first: e4m3 has no infinity, out-of-range values would become NaN.
        key = tl.minimum(tl.maximum(key, -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value, -FP8_MAX), FP8_MAX)
        if ROUND_FP8_IN_SOFTWARE:
            key = _round_to_e4m3_grid(key)
            value = _round_to_e4m3_grid(value)

    # The slot's address: block, then offset inside the block. int64, because
    # block_id * cache_stride_block overflows 32 bits in a large cache.
    slot_base = block_id.to(tl.int64) * cache_stride_block + offset * cache_stride_offset
    cache_offsets = slot_base + heads[:, None] * cache_stride_head + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the
    cache slots given by ``slot_mapping`` (int64, negative = padding), in place.

    FP8 caches store ``clamp(x / scale, -448, 448)`` as ``float8_e4m3fn``. The
    K and V caches must have identical strides. See the reference for details.
    """
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_triton_device(key.device, k_cache.dtype)
    check_head_dim(key.shape[2])
    check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slot_mapping = unit_stride(slot_mapping)  # read as slot_mapping_ptr + token
    fp8 = is_fp8(k_cache.dtype)
    k_scale_arg, k_scale_stride = scale_pointer_and_stride(k_scale, placeholder=key)
    v_scale_arg, v_scale_stride = scale_pointer_and_stride(v_scale, placeholder=key)

    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale_stride, v_scale_stride,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8,
        FP8_MAX=FP8_MAX,
        ROUND_FP8_IN_SOFTWARE=fp8 and interpreter_enabled(),
        num_warps=4,
    )
