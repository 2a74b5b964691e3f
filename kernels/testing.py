"""Random paged KV caches, for the kernel tests, the benchmark and notebooks.

``random_paged_kv`` builds what a model runner would hold after some steps: K/V
caches full of random numbers, and per-sequence block tables that point at
scattered blocks in a random order (as a block pool hands them out after a
while), so a kernel that ignored the block table, or read past a sequence's
end, would give a visibly wrong answer. Nothing is ever all zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpaging.kernels.fp8 import compute_kv_scales, is_fp8, quantize_kv_cache


@dataclass
class PagedKV:
    """One layer's paged K/V cache and the tables that locate each sequence in it."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max_blocks]
    seq_lens: torch.Tensor  # int32 [batch]
    k_scale: torch.Tensor | None = None  # float32 [num_kv_heads] for an FP8 cache
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


def random_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    max_blocks: int | None = None,
    spare_blocks: int = 3,
) -> PagedKV:
    """A random cache holding ``len(seq_lens)`` sequences of the given lengths.

    Args:
        seq_lens: tokens per sequence (0 allowed).
        dtype: cache dtype; for ``torch.float8_e4m3fn`` the random values are
            drawn with a different range per KV head, then quantized with
            per-head scales (returned in ``k_scale`` / ``v_scale``).
        generator: a ``torch.Generator`` for reproducible draws; random numbers
            are drawn on its device (on ``device`` when None, which is much
            faster than drawing a big cache on the CPU and copying it over).
        max_blocks: block table width (default: the longest sequence's need).
            Columns past a sequence's last block hold random, valid block ids,
            which a correct kernel never reads.
        spare_blocks: blocks owned by nobody, also random.
    """
    blocks_needed = [(n + block_size - 1) // block_size for n in seq_lens]
    width = max(blocks_needed + [1]) if max_blocks is None else max_blocks
    if width < max(blocks_needed + [0]):
        raise ValueError(f"max_blocks={width} is too small for seq_lens={seq_lens}")
    num_blocks = sum(blocks_needed) + spare_blocks

    draw_on = generator.device if generator is not None else torch.device(device)

    # A random permutation of all block ids; each sequence takes the next few.
    order = torch.randperm(num_blocks, generator=generator, device=draw_on)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=generator, device=draw_on)
    taken = 0
    for row, need in enumerate(blocks_needed):
        block_tables[row, :need] = order[taken : taken + need]
        taken += need

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale = v_scale = None
    if is_fp8(dtype):
        # Heads of different ranges (keys 0.5 to 8, values 0.5 to 2), so that
        # per-head scales have work to do.
        k_range = torch.logspace(-1, 3, num_kv_heads, base=2.0, device=draw_on).reshape(1, 1, -1, 1)
        v_range = torch.logspace(1, -1, num_kv_heads, base=2.0, device=draw_on).reshape(1, 1, -1, 1)
        k_float = torch.randn(shape, generator=generator, device=draw_on) * k_range
        v_float = torch.randn(shape, generator=generator, device=draw_on) * v_range
        k_scale, v_scale = compute_kv_scales(k_float), compute_kv_scales(v_float)
        k_cache, v_cache = quantize_kv_cache(k_float, k_scale), quantize_kv_cache(v_float, v_scale)
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    else:
        k_cache = torch.randn(shape, generator=generator, device=draw_on).to(dtype)
        v_cache = torch.randn(shape, generator=generator, device=draw_on).to(dtype)

    return PagedKV(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def cu_seqlens(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32: where each sequence's packed rows start."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


#: ``copy_blocks`` mappings every backend must refuse before copying anything, with the message each
#: error carries, for a cache of 8 blocks: parallel copies would race on the first three (a destination
#: written twice, a block both read and written), and the last points outside the cache.
BAD_COPY_MAPPINGS: list[tuple[list[list[int]], str]] = [
    ([[1, 5], [2, 5]], "destination block 5 appears twice"),
    ([[1, 5], [5, 6]], "block 5 is the source of row 1 and the destination of row 0"),  # a chain
    ([[3, 3]], "block 3 is the source of row 0 and the destination of row 0"),  # onto itself
    ([[1, 8]], "destination block 8 is outside the cache's blocks 0..7"),
]
