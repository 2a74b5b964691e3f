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


def dot_dtype_and_precision(query_dtype: torch.dtype):
    """The dtype the attention kernels feed to ``tl.dot``, and its precision flag.

    * float16 / bfloat16 queries: that dtype, so the products run on tensor cores
      (FP8 keys and values are converted to it after loading).
    * float32 queries: float32 with ``input_precision="ieee"``; Triton's default
      for float32 (TF32) keeps only 10 mantissa bits, too few for fp32 tests.
    * Under the CPU interpreter, bfloat16 is fed as float32: the interpreter keeps
      bfloat16 as raw 16-bit integers and its ``tl.dot`` would multiply the bit
      patterns (seen with triton 3.9). GPU runs are unaffected.
    """
    if query_dtype == torch.float16:
        return tl.float16, "tf32"  # the flag only affects float32 operands
    if query_dtype == torch.bfloat16 and not interpreter_enabled():
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


def bit_copy_dtype(element_size: int):
    """An integer Triton dtype as wide as one cache element: copying bits instead
    of numbers works for every cache dtype, FP8 included, and changes nothing."""
    return {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[element_size]
