"""CPU memory in 2 MiB pages where Linux gives them, for the tensors a decode step streams through.

A decode step on the CPU reads every weight of the model once and every cached key and value of its sequences: a
few hundred megabytes a step, streamed at what one core can read. In ordinary 4 KiB pages, 2 MiB of weights span
512 pages, each needing its own entry in the core's translation cache (the TLB), which holds a few thousand at most:
a product that streams its weight misses it every 4 KiB and waits for a page-table walk. In 2 MiB pages one entry
covers what 512 did. Linux backs memory with such pages ("transparent huge pages") where the process asks for them
(``madvise(MADV_HUGEPAGE)``) and the system allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``always`` or ``madvise``, the usual default); elsewhere the memory is ordinary memory and nothing else changes.

The engine keeps the bfloat16 weights as the AMX product's tiles here (``layers.py``): the AMX products of one
decode step of the trained model took 15-25% less time from 2 MiB pages than from 4 KiB ones, in one process, in
turns (``benchmarks/amx_linear.py --pages``; RESULTS.md, "The eighteenth session"). The paged KV cache stays in
torch's memory: with its 1 GiB in 2 MiB pages, faulted in at load, ``LLM()`` on the trained model took 9.1-9.7 s
against 4.3-6.2 s (``benchmarks/one_time_costs.py``), for a decode attention about a tenth faster.

Memory comes straight from the kernel (an anonymous ``mmap``, zero-filled), not from torch's allocator, and goes back
when the last tensor viewing it is gone.
"""

from __future__ import annotations

import functools
import math
import mmap
import sys

import torch

__all__ = ["HUGE_PAGE", "huge_page_zeros", "zeros_in_huge_pages", "into_huge_pages", "huge_pages_allowed"]

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor of into_huge_pages starts on a cache line
_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_allowed() -> bool:
    """Whether this system backs memory that asks for it with 2 MiB pages (Linux with transparent huge pages in
    ``always`` or ``madvise`` mode)."""
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        with open(_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (a 1-D uint8 CPU tensor), in 2 MiB pages where the system gives them
    (:func:`huge_pages_allowed`), else torch's ordinary zeros."""
    if nbytes < HUGE_PAGE or not huge_pages_allowed():
        return torch.zeros(nbytes, dtype=torch.uint8)
    # anonymous and private (a shared mapping would be shmem, whose huge pages another setting governs), zero-filled;
    # one huge page more, to align
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view of it lives
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # the whole mapping: the 2 MiB pages inside it, wherever they start
    except OSError:  # refused: ordinary pages
        pass
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]  # each page faulted in (and zeroed by the kernel) when first touched


def zeros_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero CPU tensors of ``shapes`` and ``dtype``, contiguous, side by side in one region of 2 MiB pages
    (:func:`huge_page_zeros`), each from a cache line's start."""
    sizes = [dtype.itemsize * math.prod(shape) for shape in shapes]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _ALIGN) * _ALIGN)
    region = huge_page_zeros(offsets[-1])
    return [region[offset : offset + size].view(dtype).view(shape)
            for shape, size, offset in zip(shapes, sizes, offsets)]


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors`` (CPU tensors of one dtype) side by side in 2 MiB pages
    (:func:`zeros_in_huge_pages`): same shapes, dtype and values; the originals are not changed."""
    if not tensors:
        return []
    copies = zeros_in_huge_pages([tuple(t.shape) for t in tensors], tensors[0].dtype)
    for copy, t in zip(copies, tensors):
        copy.copy_(t)
    return copies
