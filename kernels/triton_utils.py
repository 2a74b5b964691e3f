"""Small helpers shared by the Triton kernels' Python wrappers.

Nothing here launches a kernel; it answers questions such as "which dtype do
the tensor-core dot products use?". Argument checks live in ``validation.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpaging.kernels import validation
from kvpaging.kernels.validation import interpreter_enabled

# the window the kernels take for "no sliding window": longer than any context (a plain int, so one compiled kernel
# serves full and sliding layers alike)
NO_WINDOW = 1 << 30


def padded_head_dim(head_dim: int) -> int:
    """Next power of two, at least 16: the smallest K dimension ``tl.dot`` accepts."""
    return max(16, triton.next_power_of_2(head_dim))


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU the kernels run on (or are compiled for).

    The CPU interpreter gets 4: a few decode splits, enough to exercise the merge.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if validation.compile_only_target is not None:
        return validation.compile_only_target.num_sms
    return 4


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


def dot_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype | None = None):
    """The dtype the attention kernels feed to ``tl.dot``.

    * float16 / bfloat16 queries: that dtype, so the products run on tensor cores
      (FP8 keys and values are converted to it after loading).
    * float32 queries over a float32 cache: float32, multiplied exactly (see
      :func:`matmul`), without tensor cores; the kernels take smaller tiles for it.
    * float32 queries over an FP8 cache: float16. Every e4m3 number is exact in
      float16 (3 mantissa bits of 10), so the keys and values lose nothing; the
      queries and probabilities are rounded to 11 significant bits, far finer than
      the cache's 4. In float32 these products needed a few KB of spilled registers
      per thread (``python -m kvpaging.kernels.compile_check``); in float16 they run on
      tensor cores with none. A query above 65,504 would overflow, far beyond any
      model's attention queries.
    * Under the CPU interpreter, bfloat16 is fed as float32: the interpreter keeps
      bfloat16 as raw 16-bit integers and its ``tl.dot`` would multiply the bit
      patterns (seen with triton 3.9). GPU runs are unaffected.
    """
    if query_dtype == torch.float16:
        return tl.float16
    if query_dtype == torch.bfloat16 and not interpreter_enabled():
        return tl.bfloat16
    if query_dtype == torch.float32 and cache_dtype == torch.float8_e4m3fn:
        return tl.float16
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


def unit_stride(index: torch.Tensor) -> torch.Tensor:
    """``index`` itself when its last dimension has stride 1, else a contiguous copy.

    The kernels read index tensors (block table rows, lengths, slots, query
    starts) as ``pointer + i``. A view with another stride, say a column of a
    bigger table, would be read wrongly and silently; copying these few numbers
    costs nothing next to attention.
    """
    if index.dim() == 0 or index.shape[-1] <= 1 or index.stride(-1) == 1:
        return index
    return index.contiguous()


def bit_copy_dtype(element_size: int) -> torch.dtype:
    """An integer dtype as wide as one cache element: copying bits instead of
    numbers works for every cache dtype, FP8 included, and changes nothing."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element_size]


@triton.jit
def soft_cap(scores, softcap):
    """Gemma 2's soft-capping, on scores in log2 units (scaled by log2(e)): ``softcap * tanh(s / softcap)``
    of the natural score ``s``, returned in log2 units again. tanh(x) = 2 sigmoid(2x) - 1."""
    natural = scores * 0.6931471805599453  # ln(2) = 1 / log2(e)
    capped = softcap * (2.0 * tl.sigmoid(2.0 * natural / softcap) - 1.0)
    return capped * 1.4426950408889634  # log2(e)
