"""The engine's "cpu" attention backend: the torch backend, with decode and prefill attention done by C kernels.

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
backend's function, so this backend accepts every input the torch backend does. Prefill attention is the same story
at a larger scale: the torch backend makes one SDPA call per sequence and layer, after gathering the sequence's blocks
and (for a chunk after a cached prefix) building its causal mask, a few dozen tensor operations a sequence, which in a
busy server's prefill step of many short prompts cost more than the attention's arithmetic;
``cpu/prefill_attention.c`` does a layer's every chunk in one call, reading the blocks in place (float32 and bfloat16
caches, with the same exceptions as the decode kernel). ``store_kv`` writes a step's keys and values with one C call
where the rows allow (the torch backend's otherwise); ``copy_blocks`` is the torch backend's. For a step of decodes only, ``store_and_decode`` does a layer's store and attention in two C
calls, with the step's checks made and the kernel's scratch allocated once, at its first layer (``DecodeStep``).
"""

from __future__ import annotations

import torch

from kvpaging.kernels import torch_backend
from kvpaging.kernels.cpu import (ARGMAX_PROFILER_NAME, PREFILL_PROFILER_NAME, PROFILER_NAME, RMS_NORM_PROFILER_NAME,
                                  ROTARY_PROFILER_NAME, available, call_named, decode_attention_fn, prefill_attention_fn,
                                  store_kv_fn, unavailable_reason)
from kvpaging.kernels.torch_backend import copy_blocks
from kvpaging.kernels.validation import check_decode_args, check_prefill_args

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "store_and_decode", "available",
           "unavailable_reason", "PROFILER_NAME", "PREFILL_PROFILER_NAME", "RMS_NORM_PROFILER_NAME", "ROTARY_PROFILER_NAME", "ARGMAX_PROFILER_NAME"]
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


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """``torch_backend.store_kv``: one C call for both caches where the rows allow it (float32 or bfloat16 rows of
    the caches' own dtype, each token's heads side by side); the torch backend's otherwise (FP8 caches, other
    layouts) and for a step with a slot outside the cache (a padding slot, which it skips: the C call writes nothing
    then)."""
    fn = store_kv_fn()
    if fn is not None and _c_stores(key, value, k_cache, v_cache, slot_mapping):
        if not _store(fn, _store_layout(key, value, k_cache, slot_mapping), key, value, k_cache, v_cache):
            return
    torch_backend.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _c_stores(key, value, k_cache, v_cache, slot_mapping) -> bool:
    head_dim = k_cache.shape[-1]
    return (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
            and key.device.type == slot_mapping.device.type == "cpu" and key.dim() == 3
            and key.shape[1:] == k_cache.shape[2:] and value.shape == key.shape and v_cache.shape == k_cache.shape
            and key.stride(2) == value.stride(2) == 1 and key.stride(1) == value.stride(1) == head_dim
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == key.shape[:1] and slot_mapping.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def _store_layout(key, value, k_cache, slot_mapping) -> tuple:
    """The C store's arguments besides the four tensors' addresses: rows' strides, the slots, their count and size."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (key.stride(0), value.stride(0), slot_mapping.data_ptr(), key.shape[0], num_kv_heads * head_dim,
            key.element_size(), num_blocks * block_size)


def _store(fn, layout, key, value, k_cache, v_cache) -> int:
    """The C store; 0, or (nothing written) 1 + the first token whose slot is outside the cache."""
    key_stride, value_stride, slots, tokens, row, size, num_slots = layout
    return fn(key.data_ptr(), key_stride, value.data_ptr(), value_stride, k_cache.data_ptr(), v_cache.data_ptr(),
              slots, tokens, row, size, num_slots)


# A chunk of at most this many query-key pairs (queries x its sequence's tokens) goes to the C kernel; a larger one to
# SDPA, whose products run on the CPU's matrix units in bfloat16 and which pays its fixed cost once for a large chunk.
# The C kernel's float32 loops were the faster up to about 20,000 pairs in bfloat16 and 1,000,000 in float32 (one
# sequence, the trained model's heads, an AMX Xeon: benchmarks/prefill_attention.py); a busy server's chunks after
# a cached system prompt are a few thousand, and the C kernel also takes a layer's every chunk in one call.
PREFILL_C_MAX_PAIRS = {torch.bfloat16: 16384, torch.float32: 1 << 20}
# prefill_attention.c's constants: query rows computed together and keys per tile (its scratch is sized by them)
PREFILL_ROWS, PREFILL_TILE = 4, 64  # (64: its largest tile, on AVX-512; smaller vectors take smaller tiles)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None,
                            v_scale=None, window=0, softcap=0.0, sinks=None):
    """``reference.paged_prefill_attention`` for float32 and bfloat16 on the CPU: a chunk that is its sequence's whole
    context (a prompt from position 0) by the torch backend's SDPA call, the model's own attention to the bit, and so
    is a chunk of more than ``PREFILL_C_MAX_PAIRS`` query-key pairs; every other chunk (after a cached prefix, a later
    chunk) of the layer in one call of the C kernel (``cpu/prefill_attention.c``). Other inputs: the torch backend's
    (see the module docstring)."""
    fn = prefill_attention_fn(k_cache.dtype)
    served = (fn is not None and not (window or softcap or sinks is not None) and cu_seqlens_q.is_contiguous()
              and _served_by_c(query, k_cache, block_tables, seq_lens, k_scale))
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    most = PREFILL_C_MAX_PAIRS.get(k_cache.dtype, 0)
    by_c = [i for i, n in enumerate(lens) if 0 < (q := starts[i + 1] - starts[i]) < n and q * n <= most]
    if not (served and by_c):  # (a step of whole prompts, the usual one without prefix-cache hits, among others)
        return torch_backend.paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                                     scale, k_scale, v_scale, window, softcap, sinks)
    check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the cpu backend needs contiguous caches (as the engine allocates them)")
    tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch, width = block_tables.shape
    by_sdpa = sorted(set(range(batch)).difference(by_c))  # the C kernel leaves these to SDPA (below)
    skip = torch.zeros(batch, dtype=torch.uint8)
    skip[by_sdpa] = 1
    longest = max(lens[i] for i in by_c)  # the scratch holds the keys and values of the C kernel's sequences only
    threads = max(1, torch.get_num_threads())
    stride = (2 * head_dim + PREFILL_ROWS) * -(-longest // PREFILL_TILE) * PREFILL_TILE  # floats a thread
    scratch = torch.empty(threads * stride, dtype=torch.float32)
    out = torch.empty(tokens, num_heads, head_dim, dtype=query.dtype)
    error = torch.zeros(3, dtype=torch.int64)
    args = (query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
            block_tables.data_ptr(), block_tables.stride(0), width, seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
            skip.data_ptr(), tokens, out.data_ptr(), scratch.data_ptr(), stride,
            error.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size, float(scale), threads)
    status = call_named(PREFILL_PROFILER_NAME, fn, args)
    if status:
        b, x, y = error.tolist()
        raise {1: ValueError(f"seq_lens[{b}]={x} is more than block_tables' {width} blocks of {block_size} tokens hold"),
               2: ValueError(f"block_tables row {b} holds block {x}, outside the cache's {num_blocks} blocks"),
               3: ValueError(f"sequence {b} has {x} queries but only seq_len={y} cached tokens"),
               4: ValueError(f"cu_seqlens_q[{b}:{b + 2}] = ({x}, {y}) does not rise from 0 within the query's "
                             f"{tokens} tokens"),
               -1: MemoryError(f"the prefill kernel found no memory for the work list of {batch} sequences")}[status]
    for i in by_sdpa:
        torch_backend.prefill_sequence(query, k_cache, v_cache, block_tables, i, starts[i], starts[i + 1], lens[i],
                                       scale, None, None, 0, 0.0, None, out)
    return out


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           num_splits=None, window=0, softcap=0.0, sinks=None):
    """``reference.paged_decode_attention``, by the C kernel for float32 and bfloat16 on the CPU (see the module
    docstring)."""
    check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)
    if (decode_attention_fn(k_cache.dtype) is None or window or softcap or sinks is not None
            or not _served_by_c(query, k_cache, block_tables, seq_lens, k_scale)):
        return torch_backend.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                    k_scale, v_scale, num_splits, window, softcap, sinks)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # (the torch backend's views need that too)
        raise ValueError("the cpu backend needs contiguous caches (as the engine allocates them)")
    return DecodeStep(query, k_cache, block_tables, seq_lens).attend(query, k_cache, v_cache, scale)


class DecodeStep:
    """The C decode kernel's call as every layer of one step makes it: the step's block tables and lengths, the
    shapes, and the scratch the kernel works in (each thread's scores, each thread's widened block), worked out and
    allocated once. Made from arguments already checked (``check_decode_args``, ``_served_by_c``)."""

    def __init__(self, query, k_cache, block_tables, seq_lens, key=None, value=None, slot_mapping=None) -> None:
        """``key``, ``value`` and ``slot_mapping`` (checked by ``_c_stores``): also the store's layout, for ``store``."""
        self.batch, self.num_heads, self.head_dim = query.shape
        self.num_blocks, self.block_size, self.num_kv_heads, _ = k_cache.shape
        self.dtype, self.cache_shape, self.query_shape, self.query_strides = (query.dtype, k_cache.shape, query.shape,
                                                                               query.stride())
        self.fn = decode_attention_fn(k_cache.dtype)
        self.block_tables, self.seq_lens, self.width = block_tables, seq_lens, block_tables.shape[1]
        self.threads = max(1, min(torch.get_num_threads(), self.batch))  # the sequences are shared out among them
        self.stride = self.num_heads * max(self.width * self.block_size, 1)  # one thread's [heads, tokens] scratch
        self.scores = torch.empty(self.threads * self.stride, dtype=torch.float32)
        self.block = torch.empty(self.threads * self.block_size * self.num_kv_heads * self.head_dim
                                 if self.dtype != torch.float32 else 1, dtype=torch.float32)  # a bfloat16 block widened
        self.error = torch.zeros(2, dtype=torch.int64)
        self.slot_mapping, self.kv_layout, self.store_layout = slot_mapping, None, None
        if key is not None:
            self.kv_layout = (key.shape, key.stride(), value.stride())
            self.store_fn, self.store_layout = store_kv_fn(), _store_layout(key, value, k_cache, slot_mapping)

    def fits(self, query, key, value, k_cache, v_cache, slot_mapping, block_tables) -> bool:
        """Whether this layer's call is one this step's plan was made for (the store's layout included)."""
        return (block_tables is self.block_tables and slot_mapping is self.slot_mapping and query.dtype is self.dtype
                and query.shape == self.query_shape and query.stride() == self.query_strides
                and (key.shape, key.stride(), value.stride()) == self.kv_layout and key.dtype is value.dtype is self.dtype
                and k_cache.shape == v_cache.shape == self.cache_shape and k_cache.dtype is v_cache.dtype is self.dtype
                and k_cache.is_contiguous() and v_cache.is_contiguous())

    def store(self, key, value, k_cache, v_cache) -> int:
        """The C store of this layer's keys and values (``_store``, from the layout worked out once)."""
        return _store(self.store_fn, self.store_layout, key, value, k_cache, v_cache)

    def attend(self, query, k_cache, v_cache, scale) -> torch.Tensor:
        out = torch.empty(self.batch, self.num_heads, self.head_dim, dtype=self.dtype)  # rounded by the kernel
        args = (query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                self.num_blocks, self.block_tables.data_ptr(), self.block_tables.stride(0), self.width,
                self.seq_lens.data_ptr(), out.data_ptr(), self.scores.data_ptr(), self.stride, self.block.data_ptr(),
                self.error.data_ptr(), self.batch, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
                float(scale), self.threads)
        status = call_named(PROFILER_NAME, self.fn, args)
        if status == 1:
            b, n = self.error.tolist()
            raise ValueError(f"seq_lens[{b}]={n} is more than block_tables' {self.width} blocks of {self.block_size} "
                             "tokens hold")
        if status == 2:
            b, n = self.error.tolist()
            raise ValueError(f"block_tables row {b} holds block {n}, outside the cache's {self.num_blocks} blocks")
        return out


def store_and_decode(meta, query, key, value, k_cache, v_cache, slot_mapping, block_tables, scale):
    """``store_kv`` then ``paged_decode_attention`` for one layer of a step whose every token is a decode, both in C,
    the step's checks made and its scratch allocated at its first layer (kept in ``meta.backend_state``); None, with
    nothing done, where the C kernels do not serve the call (the caller then takes the general path)."""
    plan = meta.backend_state
    if not (isinstance(plan, DecodeStep) and plan.fits(query, key, value, k_cache, v_cache, slot_mapping, block_tables)):
        seq_lens = meta.seq_lens
        if (decode_attention_fn(k_cache.dtype) is None or not _served_by_c(query, k_cache, block_tables, seq_lens, None)
                or not _c_stores(key, value, k_cache, v_cache, slot_mapping)):
            return None
        check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, None, None, None)
        plan = meta.backend_state = DecodeStep(query, k_cache, block_tables, seq_lens, key, value, slot_mapping)
    if plan.store(key, value, k_cache, v_cache):
        return None  # a slot outside the cache: nothing written
    return plan.attend(query, k_cache, v_cache, scale)
