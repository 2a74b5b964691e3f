"""Memory the process would give back and map again at every step, kept instead: the C library's (a model on the CPU,
glibc only) and the Python interpreter's frame chunks (every device: the engine's host path).

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

The interpreter's frame chunks (:func:`keep_frame_chunks`): CPython 3.11 to 3.13 keep Python frames on a data stack of
16 KiB chunks, each mapped when a call needs it and unmapped as soon as that call returns, so a loop whose calls sit at
a chunk's end maps and unmaps memory at every call (CPython issue gh-142183; ``kernels/cpu/frame_chunks.c``). Whether
the engine's loops sit there depends on how deep the caller is (a notebook cell, a test, a thread): at such depths
the scheduler, block manager and input preparation ran 1.2-3x slower, the trained model's ``generate`` up to 1.4x
(``python benchmarks/frame_chunks.py --engine``, ``--trained 8``; RESULTS.md, "The twenty-fifth session"). The
interpreter's arena allocator is wrapped once per process by one that keeps up to eight freed regions of at most
64 KiB (frame chunks; never pymalloc's arenas) and hands them out again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import sysconfig

logger = logging.getLogger("kvpaging")

__all__ = ["frame_chunks_reused", "keep_frame_chunks", "keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 256 << 20
_done: bool | None = None  # whether it was set, once tried
_chunks_kept: bool | None = None  # whether the frame chunks are kept, once tried


class _ArenaAllocator(ctypes.Structure):
    """CPython's ``PyObjectArenaAllocator``: a context and its alloc and free functions."""

    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


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


def keep_frame_chunks() -> bool:
    """Wrap the interpreter's arena allocator in ``frame_chunks.c``'s, which keeps freed frame chunks (see the module
    docstring), once per process; True if it is in place. Only on CPython 3.11 to 3.13 with the GIL (earlier ones keep
    frames elsewhere, 3.14 caches chunks itself), and where a C compiler builds ``frame_chunks.c``."""
    global _chunks_kept
    if _chunks_kept is None:
        _chunks_kept = False
        if (sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13)
                or sysconfig.get_config_var("Py_GIL_DISABLED")):
            return False
        from kvpaging.kernels import cpu

        functions = cpu.frame_chunk_keeper()
        if functions is None:
            logger.debug("frame chunks not kept: %s", cpu.frame_chunks_unavailable_reason())
            return False
        get, put = ctypes.pythonapi.PyObject_GetArenaAllocator, ctypes.pythonapi.PyObject_SetArenaAllocator
        get.restype = put.restype = None
        current, keeping = _ArenaAllocator(), _ArenaAllocator()
        get(ctypes.byref(current))
        functions[0](ctypes.byref(current), ctypes.byref(keeping))
        put(ctypes.byref(keeping))  # (the interpreter copies the struct)
        _chunks_kept = True
        logger.info("the interpreter keeps up to 8 freed frame chunks for reuse (CPython gh-142183): calls at a "
                    "chunk's end no longer map and unmap memory")
    return _chunks_kept


def frame_chunks_reused() -> int:
    """How many frame chunks (or other small regions) the kept ones have served so far; 0 before they are kept."""
    if not _chunks_kept:
        return 0
    from kvpaging.kernels import cpu

    return int(cpu.frame_chunk_keeper()[1]())
