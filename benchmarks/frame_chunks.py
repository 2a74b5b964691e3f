"""CPython 3.11's frame data stack, seen from Python: the cost of a plain call at each recursion depth.

A thread's frames live in chunks of a data stack; a chunk is freed as soon as the calls return below it, so a loop of
calls that each cross a chunk's end allocates and frees a chunk at every call. This calls a small function 200,000
times at every depth from 0 to 399 (and one frame deeper) and prints the depths where it took over twice the median time (see
``tests/conftest.py``, which runs the Triton interpreter's tests in a thread of their own for this reason).

    python benchmarks/frame_chunks.py
"""

from __future__ import annotations

import platform
import time


def leaf(a, b, c, d, e, f, g, h):
    return a


def at(depth: int, pad: int) -> float:
    if depth:
        return at(depth - 1, pad)
    if pad:  # one small frame more: the leaf's frame lands elsewhere in the chunk
        return at(0, pad - 1)
    start = time.perf_counter()
    for _ in range(200_000):
        leaf(1, 2, 3, 4, 5, 6, 7, 8)
    return time.perf_counter() - start


def main() -> None:
    times = [(f"{depth}+{pad}", at(depth, pad)) for depth in range(400) for pad in (0, 1)]
    median = sorted(t for _, t in times)[len(times) // 2]
    print(f"Python {platform.python_version()}: 200,000 calls take {median * 1e3:.1f} ms at the median depth")
    print("depths over twice that (depth, times the median):",
          [(depth, round(t / median, 1)) for depth, t in times if t > 2 * median])


if __name__ == "__main__":
    main()
