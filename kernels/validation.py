"""Argument checks shared by the torch references and the Triton kernels.

A Triton kernel given a wrong shape does not fail politely: it reads the wrong
memory and returns garbage, or crashes the process. So every entry point checks
shapes, dtypes and devices first and raises ``ValueError`` naming the bad value.

These checks only look at shapes, dtypes and devices, never at tensor contents,
so they cost no GPU synchronisation and are safe inside CUDA-graph capture. The
one exception is ``copy_blocks``' block mapping, whose few numbers are read on
the host (:func:`check_block_mapping`): copy-on-write runs eagerly, never inside
a graph, and a bad pair would overwrite a block another sequence still reads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpaging.kernels.fp8 import is_fp8

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (None ones are skipped) live on one device; return it."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but {named[0][0]} is on {device}; "
                "all tensors must be on one device"
            )
    return device


def check_index(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    """An index tensor (slot mapping, block table, lengths) with an exact dtype
    and shape; ``None`` in ``shape`` means any size."""
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and have != want for have, want in zip(t.shape, shape)):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {wanted}, got {_shape(t)}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    identical shape and dtype, model dtype or FP8."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {_shape(k_cache)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {_shape(v_cache)} differs from k_cache shape {_shape(k_cache)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache is on {k_cache.device}")
    if not (k_cache.dtype in FLOAT_DTYPES or is_fp8(k_cache.dtype)):
        raise ValueError(f"cache dtype must be float16, bfloat16, float32 or float8_e4m3fn, got {k_cache.dtype}")


def check_input_dtype(name: str, x: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """Queries, keys and values are float; they match a non-FP8 cache's dtype."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if not is_fp8(cache_dtype):
        if x.dtype != cache_dtype:
            raise ValueError(f"{name} dtype {x.dtype} differs from the cache dtype {cache_dtype}")


def check_scales(
    cache_dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_kv_heads: int,
) -> None:
    """FP8 caches need float32 scales, per KV head ``[num_kv_heads]`` or per
    tensor (``[1]`` or 0-d); other caches take none."""
    if not is_fp8(cache_dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale only apply to a float8_e4m3fn cache; this cache is {cache_dtype}")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a float8_e4m3fn cache needs {name} (got None)")
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{name} must be a float32 tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")
        if not (s.dim() <= 1 and s.numel() in (1, num_kv_heads)):
            raise ValueError(
                f"{name} must have shape [{num_kv_heads}] (per KV head), [1] or [] (per tensor), "
                f"got {_shape(s)}"
            )


def check_store_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_cache_pair(k_cache, v_cache)
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got {_shape(key)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {_shape(value)} differs from key shape {_shape(key)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key [num_tokens, num_kv_heads, head_dim] = {_shape(key)} does not match the cache's "
            f"[.., num_kv_heads, head_dim] = {_shape(k_cache)}"
        )
    check_input_dtype("key", key, k_cache.dtype)
    check_input_dtype("value", value, k_cache.dtype)
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
    check_index("slot_mapping", slot_mapping, torch.int64, (key.shape[0],))
    check_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
    check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
    )


def _check_attention_common(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale):
    check_cache_pair(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got {_shape(query)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} differs from the cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_input_dtype("query", query, k_cache.dtype)
    check_index("block_tables", block_tables, torch.int32, (None, None))
    check_index("seq_lens", seq_lens, torch.int32, (block_tables.shape[0],))
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
    check_scales(k_cache.dtype, k_scale, v_scale, num_kv_heads)


def check_decode_args(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits) -> None:
    _check_attention_common(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    if block_tables.shape[0] != query.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but query has batch {query.shape[0]}")
    if not (num_splits is None or (isinstance(num_splits, int) and num_splits >= 1)):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    check_same_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale,
    )


def check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale) -> None:
    _check_attention_common(query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    check_index("cu_seqlens_q", cu_seqlens_q, torch.int32, (block_tables.shape[0] + 1,))
    check_same_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale,
    )


def check_copy_blocks_args(
    k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    if len(k_caches) != len(v_caches) or not k_caches:
        raise ValueError(f"need one k_cache and one v_cache per layer, got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0]
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        check_cache_pair(k, v)
        if not (k.shape == first.shape and k.dtype == first.dtype and k.device == first.device):
            raise ValueError(
                f"layer {layer} cache is {_shape(k)} {k.dtype} on {k.device}, layer 0 is "
                f"{_shape(first)} {first.dtype} on {first.device}; all layers must match"
            )
    check_index("block_mapping", block_mapping, torch.int64, (None, 2))
    check_same_device(k_cache=first, block_mapping=block_mapping)
    check_block_mapping(block_mapping, num_blocks=first.shape[0])


def check_block_mapping(block_mapping: torch.Tensor, num_blocks: int) -> None:
    """Every ``(src, dst)`` pair names blocks of the cache; destinations are distinct; no block
    is both a source and a destination.

    The Triton kernel copies all pairs at once, in parallel programs. If one
    pair's destination were another pair's source (a chain ``a -> b``, ``b -> c``),
    or a block were copied onto itself, whether a program read the old or the
    new contents would depend on timing; two pairs with one destination would
    race to write it. The torch reference would give one definite answer, so
    the backends would disagree, silently. Copy-on-write only ever copies into
    fresh blocks, so none of this is needed; all of it is refused, naming the
    block, before anything is copied.
    """
    pairs = block_mapping.tolist()
    for row, (src, dst) in enumerate(pairs):
        for side, block in (("source", src), ("destination", dst)):
            if not 0 <= block < num_blocks:
                raise ValueError(
                    f"block_mapping row {row}: {side} block {block} is outside the cache's blocks 0..{num_blocks - 1}"
                )
    destination_row: dict[int, int] = {}
    for row, (_, dst) in enumerate(pairs):
        if dst in destination_row:
            raise ValueError(
                f"block_mapping: destination block {dst} appears twice (rows {destination_row.get(dst)} and {row}); "
                "each block may be written once per call"
            )
        destination_row[dst] = row
    for row, (src, _) in enumerate(pairs):
        if src in destination_row:
            raise ValueError(
                f"block_mapping: block {src} is the source of row {row} and the destination of row "
                f"{destination_row.get(src)}; a block may not be both in one call (the copies run in parallel)"
            )


# --- checks specific to the Triton kernels ----------------------------------

# Head dims are padded to the next power of two (tl.arange needs one) and the
# padding is masked; past 256 a tile of keys no longer fits in registers.
MAX_HEAD_DIM = 256


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is set: kernels then run on the CPU, in numpy.

    Triton reads the variable when a kernel is *defined* (at import of the
    module holding the ``@triton.jit``), so it must be set before the Triton
    kernels of this package are first used.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class CompileOnlyTarget:
    """A GPU the kernels are compiled for, on a machine that does not have it.

    ``kvpaging.kernels.compile_check`` sets :data:`compile_only_target` while it
    drives the real wrappers with CPU tensors and a stand-in Triton driver whose
    "launch" compiles the kernel and records it instead of running it.
    """

    name: str  # e.g. "H100/H200 (sm_90)"
    arch: int  # compute capability as one number: 90 for 9.0
    num_sms: int  # streaming multiprocessors: choose_num_splits sizes its grid from them
    max_shared_bytes: int  # shared memory one block may use


# None except inside ``compile_check.compile_only(...)``.
compile_only_target: CompileOnlyTarget | None = None


def check_triton_device(device: torch.device, cache_dtype: torch.dtype) -> None:
    """Triton kernels run on a CUDA (or ROCm) GPU, or on the CPU under the interpreter
    (or, compiled but never launched, under ``compile_check``'s stand-in GPU)."""
    if device.type == "cpu":
        target = compile_only_target
        if target is not None:
            if is_fp8(cache_dtype) and target.arch < 89:
                raise ValueError(f"an FP8 (e4m3) KV cache needs compute capability 8.9+, not {target.name}")
            return
        if not interpreter_enabled():
            raise ValueError(
                "the Triton kernels got CPU tensors; use kvpaging.kernels.reference on a CPU, "
                "or set TRITON_INTERPRET=1 before importing the Triton kernels"
            )
        return
    if device.type != "cuda":
        raise ValueError(f"the Triton kernels run on CUDA devices, got {device}")
    if is_fp8(cache_dtype) and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"an FP8 (e4m3) KV cache needs an NVIDIA GPU of compute capability 8.9+ "
                f"(Ada, Hopper or newer); this one is {major}.{minor}"
            )


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton kernels (1..{MAX_HEAD_DIM})")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels assume each head's ``head_dim`` numbers sit next to each other
    in memory (stride 1), so that one row is one coalesced load."""
    for name, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")


def check_window(window) -> int:
    """A sliding window: the number of most recent positions a query sees (itself included); 0 means all."""
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise ValueError(f"window must be a non-negative int (0: the whole context), got {window!r}")
    return window


def check_softcap(softcap) -> float:
    """Soft-capping of the attention scores (Gemma 2): ``softcap * tanh(score / softcap)``; 0 means none."""
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap >= 0
            and softcap == softcap and softcap != float("inf")):
        raise ValueError(f"softcap must be a non-negative finite number (0: none), got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, num_heads: int, device) -> None:
    """Attention sinks (gpt-oss): one learned logit per query head, an extra entry in every softmax."""
    if sinks is None:
        return
    if not (isinstance(sinks, torch.Tensor) and sinks.shape == (num_heads,) and sinks.is_floating_point()):
        raise ValueError(
            f"sinks must be a float tensor of shape ({num_heads},) (one logit per query head), got "
            f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {device}")
