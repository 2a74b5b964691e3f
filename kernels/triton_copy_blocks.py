"""``copy_blocks`` in Triton: copy whole cache blocks in every layer with one launch.

Reference: :func:`kvpaging.kernels.reference.copy_blocks`.

Copy-on-write: when two sequences share a partly filled last block (after a
fork, or ``n > 1`` samples of one prompt) and one of them appends a token, the
block manager gives it a fresh block and asks for the old block's contents to
be copied there, in every layer, for keys and values.

One launch for all layers
-------------------------
The caches of different layers are separate tensors, so the kernel gets a small
int64 tensor holding each cache's address (``tensor.data_ptr()``: the K caches
of every layer, then the V caches) and turns the number back into a pointer.
That works on a GPU and under the CPU interpreter alike (the interpreter reads
host memory at those addresses). Grid: ``(2 * num_layers, num_pairs)``, one
program per (cache, block pair).

Memory access pattern
---------------------
A block, ``[block_size, num_kv_heads, head_dim]``, is one contiguous run of
memory (the wrapper checks), so each program streams ``CHUNK`` elements at a
time from the source block to the destination block. The elements are copied
as integers of the same width: bits, not numbers, so FP8 and NaN payloads come
through untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .triton_utils import bit_copy_dtype
from .validation import check_copy_blocks_args, check_triton_device

CHUNK = 1024  # elements per load/store


@triton.jit
def _copy_blocks_kernel(
    cache_addresses_ptr,  # int64 [2 * num_layers]: data_ptr() of every cache
    block_mapping_ptr,  # int64 [num_pairs, 2]: (src, dst)
    mapping_stride_pair,
    mapping_stride_side,
    cache_stride_block,
    BLOCK_NUMEL: tl.constexpr,
    WORD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    cache_index = tl.program_id(0)
    pair = tl.program_id(1)
    cache = tl.load(cache_addresses_ptr + cache_index).to(tl.pointer_type(WORD))
    src_block = tl.load(block_mapping_ptr + pair * mapping_stride_pair)
    dst_block = tl.load(block_mapping_ptr + pair * mapping_stride_pair + mapping_stride_side)
    src = cache + src_block * cache_stride_block
    dst = cache + dst_block * cache_stride_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        mask = offsets < BLOCK_NUMEL
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def copy_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy block ``src`` to block ``dst`` for every ``(src, dst)`` row of the
    int64 ``block_mapping [num_pairs, 2]``, in every layer's K and V cache.

    All caches must share shape, dtype, strides and device, and each block must
    be contiguous in memory. A block may not be both a source and a
    destination in one call (programs run in parallel).
    """
    check_copy_blocks_args(k_caches, v_caches, block_mapping)
    caches = [*k_caches, *v_caches]
    first = caches[0]
    check_triton_device(first.device, first.dtype)
    for i, cache in enumerate(caches):
        if cache.stride() != first.stride():
            raise ValueError(f"cache {i} has strides {cache.stride()}, cache 0 has {first.stride()}; they must match")
    if first.shape[0] > 0 and not first[0].is_contiguous():
        raise ValueError(f"each cache block must be contiguous in memory, got strides {first.stride()}")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return

    # Rebuilt on every call: copy-on-write is rare and runs eagerly, and the
    # caches' addresses are only a few numbers.
    cache_addresses = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    _copy_blocks_kernel[(len(caches), num_pairs)](
        cache_addresses,
        block_mapping,
        block_mapping.stride(0),
        block_mapping.stride(1),
        first.stride(0),
        BLOCK_NUMEL=math.prod(first.shape[1:]),
        WORD=bit_copy_dtype(first.element_size()),
        CHUNK=CHUNK,
        num_warps=4,
    )
