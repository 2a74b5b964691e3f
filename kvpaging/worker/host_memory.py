"""The C library's allocator told to keep freed memory, for a model that runs on the CPU (glibc only).

torch's CPU tensors come from ``malloc``. glibc hands out a block over its mmap threshold (128 KiB at first, raised as
such blocks are freed, to 32 MiB at most) as pages fresh from the kernel and gives them back when the block is freed;
and it gives back the free memory at the top of its heap past a trim threshold. A forward pass makes and frees the
same large temporaries at every layer (a 2,048-token prefill of the trained model: a few megabytes each, hundreds a
step), so each of them came as fresh pages, each page a fault and the kernel zeroing it: 130,000 to 183,000 faults a
prefill, a third of its time (``benchmarks/prefill.py --engine-only``; RESULTS.md, "The thirteenth session"). Here
glibc keeps blocks up to 32 MiB in its heap and keeps up to 256 MiB of free memory instead of giving it back: after
the first step the temporaries reuse memory already mapped. The process keeps that memory (its peak of temporaries)
until it ends.

It is the process's allocator, so the setting is process-wide: set once, and not where the user tuned glibc's
malloc already (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` in the environment).
vLLM's CPU backend asks users for the same by preloading tcmalloc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("kvpaging")

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 256 << 20
_done: bool | None = None  # whether it was set, once tried


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory (see the module docstring); True if it is set now or was before."""
    global _done
    if _done is None:
        _done = False
        tuned = any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or (
            "malloc" in os.environ.get("GLIBC_TUNABLES", ""))
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and not tuned:
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                return False
            _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            if _done:
                logger.info("malloc keeps freed memory (blocks up to %d MiB from its heap, %d MiB of free memory kept): "
                            "a step's temporaries reuse mapped pages", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _done
