"""``copy_blocks`` in Triton: copy whole cache blocks in every layer with one launch.

Reference: :func:`kvpaging.kernels.reference.copy_blocks`.

Copy-on-write: when two sequences share a partly filled last block (after a
fork, or ``n > 1`` samples of one prompt) and one of them appends a token, the
block manager gives it a fresh block and asks for the old block's contents to
be copied there, in every layer, for keys and values.

One launch for all layers
-------------------------
The caches of different layers are separate tensors, but one kernel argument is
a pointer to only one of them. So the kernel gets the first cache as its base
pointer, plus a small int64 tensor saying where every cache starts relative to
that base, in elements: ``(data_ptr(cache_i) - data_ptr(cache_0)) / element_size``
(the K caches of every layer, then the V caches). Base pointer plus offset is
ordinary pointer arithmetic, so it works on a GPU and under the CPU interpreter
alike (the interpreter uses real host addresses). Grid:
``(2 * num_layers, num_pairs)``, one program per (cache, block pair).

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

from kvpaging.kernels.triton_utils import bit_copy_dtype
from kvpaging.kernels.validation import check_copy_blocks_args, check_triton_device

CHUNK = 1024  # elements per load/store


@triton.jit
def _copy_blocks_kernel(
    base_ptr,  # the first cache, viewed as integers of the element's width
    cache_starts_ptr,  # int64 [2 * num_layers]: where each cache starts, in elements from base_ptr
    block_mapping_ptr,  # int64 [num_pairs, 2]: (src, dst)
    mapping_stride_pair,
    mapping_stride_side,
    cache_stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    cache_index = tl.program_id(0)
    pair = tl.program_id(1)
    cache = base_ptr + tl.load(cache_starts_ptr + cache_index)
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
    destination in one call, and destinations must be distinct (programs run
    in parallel): such a mapping raises ``ValueError`` before anything is copied.
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
    # caches' starts are only a few numbers. Torch aligns every tensor to its
    # element size, so the byte distances divide exactly.
    element_size = first.element_size()
    starts = [(c.data_ptr() - first.data_ptr()) // element_size for c in caches]
    cache_starts = torch.tensor(starts, dtype=torch.int64, device=first.device)
    _copy_blocks_kernel[(len(caches), num_pairs)](
        first.view(bit_copy_dtype(element_size)),
        cache_starts,
        block_mapping,
        block_mapping.stride(0),
        block_mapping.stride(1),
        first.stride(0),
        BLOCK_NUMEL=math.prod(first.shape[1:]),
        CHUNK=CHUNK,
        num_warps=4,
    )
