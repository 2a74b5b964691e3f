"""Paged KV cache kernels: tensors in, tensors out.

Four operations, each in two versions with the same signature:

==========================  ===============================================
``store_kv``                write new keys/values into their cache slots
``paged_decode_attention``  one query token per sequence (flash-decoding)
``paged_prefill_attention`` a chunk of query tokens per sequence, causal
``copy_blocks``             copy whole blocks in every layer (copy-on-write)
==========================  ===============================================

* ``kvpaging.kernels.reference``: plain torch, any device. Read these first;
  they are also the test oracle. ``torch_backend`` is the engine's "torch" backend:
  the references, with decode attention done by torch's fused SDPA (same maths).
  ``cpu_backend`` is the "cpu" backend (the default on a CPU with a C compiler): the torch
  backend with decode attention done by a C kernel, ``cpu/decode_attention.c``, that reads
  the blocks in place (compiled on first use). The same library holds the RMSNorm exact to the bit
  (``cpu/rms_norm.c``) that ``kvpaging.kernels.cpu.layers`` gives the model's norm layers.
* ``kvpaging.kernels.store_kv`` etc. (this package's top level): the Triton
  kernels, in ``triton_*.py``. They run on a CUDA GPU, or on the CPU when
  ``TRITON_INTERPRET=1`` is set (slowly: meant for tests and for reading).

``fp8`` holds the FP8 (e4m3) helpers: per-KV-head scales, quantize, dequantize.
``testing`` builds random paged caches (for tests, the benchmark and notebooks).
``compile_check`` compiles the Triton kernels for Hopper (sm_90) on a machine without a
GPU and reports registers, spills and shared memory (``make test`` runs it).

Why the Triton entry points are loaded lazily
---------------------------------------------
``import kvpaging.kernels`` does not import Triton. The Triton modules are
imported the first time one of their functions is looked up, because

1. Triton is only installed on Linux; the references must work everywhere;
2. Triton decides between compiling and interpreting a kernel when the kernel
   is *defined*, from ``TRITON_INTERPRET``; loading late lets a notebook or a
   test configuration set that variable after ``import kvpaging``.
"""

from __future__ import annotations

import importlib
import importlib.util

# Python run from the repository's root also finds this folder as a top-level package called `kernels`: the name
# of Hugging Face's kernels package, which transformers probes for by importing it while it is itself half imported.
# Under that name the folder imports nothing (importing kvpaging from here then would be a circular import and break
# `import transformers`), and it has no __version__, which transformers reads as "kernels not installed".
if __name__ == "kvpaging.kernels":
    from kvpaging.kernels import fp8, reference
    from kvpaging.kernels.fp8 import (compute_kv_scales, dequantize_fp8, dequantize_kv_cache, quantize_fp8,
                                      quantize_kv_cache)
    from kvpaging.kernels.validation import interpreter_enabled

# public name -> module that defines it
_TRITON_ENTRY_POINTS = {
    "store_kv": "triton_store_kv",
    "paged_decode_attention": "triton_decode_attention",
    "paged_prefill_attention": "triton_prefill_attention",
    "copy_blocks": "triton_copy_blocks",
}

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "reference",
    "fp8",
    "triton_available",
    "compute_kv_scales",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_kv_cache",
    "dequantize_kv_cache",
]


def triton_available() -> bool:
    """True when the Triton kernels can run here: Triton is installed and either
    a CUDA (or ROCm) GPU is present or ``TRITON_INTERPRET=1`` is set (CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if interpreter_enabled():
        return True
    import torch

    return torch.cuda.is_available()


def __getattr__(name: str):
    # Called only for names not found the ordinary way: the Triton entry points.
    if name in _TRITON_ENTRY_POINTS:
        module = importlib.import_module(f".{_TRITON_ENTRY_POINTS[name]}", __name__)
        function = getattr(module, name)
        globals()[name] = function  # later lookups skip this function
        return function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRITON_ENTRY_POINTS))
