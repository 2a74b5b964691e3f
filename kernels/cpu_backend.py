"""The engine's "cpu" attention backend: the torch backend, with decode attention done by a C kernel.

On a CPU the torch backend's decode attention spends most of its time moving
memory, not computing: it gathers every sequence's blocks into a padded copy
of the keys and values (the cache is read, the copy written), then SDPA reads
the copy, padding included. ``cpu/decode_attention.c`` does what the Triton
kernel does on a GPU instead: it follows each sequence's block table and reads
every cached key and value once, where it lies. Same maths as
``reference.paged_decode_attention``; the tests hold it to that reference.
How the C code is built and loaded: ``kernels/cpu/__init__.py``.

Float32 and bfloat16 caches on the CPU go to the C kernel (what the engine uses
for models in those dtypes there), over the whole context, the query and the output
in the cache's dtype and the arithmetic in float32, as the torch backend does it (a
bfloat16 query is widened and the output rounded inside the kernel); anything else (float16 or FP8 caches, CUDA
tensors, sliding-window, soft-capped or sink layers) is served by the torch
backend's function, so this backend accepts every input the torch backend does. ``store_kv``, prefill attention and
``copy_blocks`` are the torch backend's.
"""

from __future__ import annotations

import torch

from kvpaging.kernels import torch_backend
from kvpaging.kernels.cpu import (ARGMAX_PROFILER_NAME, PROFILER_NAME, RMS_NORM_PROFILER_NAME, ROTARY_PROFILER_NAME,
                                  available, call_named, decode_attention_fn, unavailable_reason)
from kvpaging.kernels.torch_backend import copy_blocks, paged_prefill_attention, store_kv
from kvpaging.kernels.validation import check_decode_args

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "available",
           "unavailable_reason", "PROFILER_NAME", "RMS_NORM_PROFILER_NAME", "ROTARY_PROFILER_NAME", "ARGMAX_PROFILER_NAME"]
NAME = "cpu"


def _served_by_c(query, k_cache, block_tables, seq_lens, k_scale) -> bool:
    return (
        query.dtype == k_cache.dtype
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and k_scale is None
        and query.device.type == "cpu"
        and query.stride(-1) == 1
        and block_tables.stride(-1) == 1
        and seq_lens.is_contiguous()
    )


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           num_splits=None, window=0, softcap=0.0, sinks=None):
    """``reference.paged_decode_attention``, by the C kernel for float32 and bfloat16 on the CPU (see the module
    docstring)."""
    check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)
    fn = decode_attention_fn(k_cache.dtype)
    if (fn is None or window or softcap or sinks is not None
            or not _served_by_c(query, k_cache, block_tables, seq_lens, k_scale)):
        return torch_backend.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                    k_scale, v_scale, num_splits, window, softcap, sinks)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # (the torch backend's views need that too)
        raise ValueError("the cpu backend needs contiguous caches (as the engine allocates them)")
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    dtype = query.dtype
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype)  # a bfloat16 one: rounded from float32 by the kernel
    threads = max(1, min(torch.get_num_threads(), batch))  # the sequences are shared out among torch's threads
    stride = num_heads * max(width * block_size, 1)  # one thread's [heads, tokens] scratch
    scores = torch.empty(threads * stride, dtype=torch.float32)
    block = torch.empty(threads * block_size * num_kv_heads * head_dim if dtype != torch.float32 else 1,
                        dtype=torch.float32)  # where each thread widens a bfloat16 block
    error = torch.zeros(2, dtype=torch.int64)
    args = (query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
            block_tables.data_ptr(), block_tables.stride(0), width, seq_lens.data_ptr(), out.data_ptr(),
            scores.data_ptr(), stride, block.data_ptr(), error.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
            block_size, float(scale), threads)
    status = call_named(PROFILER_NAME, fn, args)
    if status == 1:
        b, n = error.tolist()
        raise ValueError(f"seq_lens[{b}]={n} is more than block_tables' {width} blocks of {block_size} tokens hold")
    if status == 2:
        b, n = error.tolist()
        raise ValueError(f"block_tables row {b} holds block {n}, outside the cache's {num_blocks} blocks")
    return out
