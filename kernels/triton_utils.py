"""Small helpers shared by the Triton kernels' Python wrappers.

Nothing here launches a kernel; it answers questions such as "may this tensor
go to a Triton kernel?" and "which dtype do the tensor-core dot products use?".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8 import is_fp8

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


def check_triton_device(device: torch.device, cache_dtype: torch.dtype) -> None:
    """Triton kernels run on a CUDA (or ROCm) GPU, or on the CPU under the interpreter."""
    if device.type == "cpu":
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
