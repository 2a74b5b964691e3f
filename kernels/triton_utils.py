"""Small helpers shared by the Triton kernels' Python wrappers.

Nothing here launches a kernel; it answers questions such as "which dtype do
the tensor-core dot products use?". Argument checks live in ``validation.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import interpreter_enabled


def padded_head_dim(head_dim: int) -> int:
    """Next power of two, at least 16: the smallest K dimension ``tl.dot`` accepts."""
    return max(16, triton.next_power_of_2(head_dim))


def scale_pointer_and_stride(scale: torch.Tensor | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, int]:
    """How a kernel finds head ``h``'s FP8 scale: ``scale_ptr + h * stride``.

    A per-KV-head scale ``[num_kv_heads]`` has stride 1; a per-tensor scale
    (``[1]`` or 0-d) gets stride 0, so every head reads the same number. An
    unquantized cache has no scale: the kernel never reads it, but Triton still
    needs a pointer argument, so any tensor stands in.
    """
    if scale is None:
        return placeholder, 0
    return scale, (scale.stride(0) if scale.numel() > 1 else 0)


def dot_dtype(query_dtype: torch.dtype):
    """The dtype the attention kernels feed to ``tl.dot``.

    * float16 / bfloat16 queries: that dtype, so the products run on tensor cores
      (FP8 keys and values are converted to it after loading).
    * float32 queries: float32, multiplied exactly (see :func:`matmul`).
    * Under the CPU interpreter, bfloat16 is fed as float32: the interpreter keeps
      bfloat16 as raw 16-bit integers and its ``tl.dot`` would multiply the bit
      patterns (seen with triton 3.9). GPU runs are unaffected.
    """
    if query_dtype == torch.float16:
        return tl.float16
    if query_dtype == torch.bfloat16 and not interpreter_enabled():
        return tl.bfloat16
    return tl.float32


@triton.jit
def matmul(a, b):
    """``tl.dot(a, b)``, exact for float32 operands.

    For float32, Triton's default on NVIDIA GPUs is TF32, which keeps only 10
    mantissa bits: too few for float32 tests. 16-bit operands have no such
    choice and keep Triton's default.
    """
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def bit_copy_dtype(element_size: int) -> torch.dtype:
    """An integer dtype as wide as one cache element: copying bits instead of
    numbers works for every cache dtype, FP8 included, and changes nothing."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element_size]
