"""Helpers for lessons 04 and 04b (the paged KV cache; attention through it): workloads, fragmentation,
concurrency at a budget, kernel checks, the gather's memory traffic.

Everything here drives the real :class:`~kvpaging.BlockManager` or the real
kernels; the notebook only calls these functions and shows the numbers.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass

import torch

from kvpaging.core.block_manager import BlockManager

__all__ = [
    "show",
    "timed",
    "random_workload",
    "fragmentation",
    "fragmentation_by_block_size",
    "ConcurrencyResult",
    "concurrency_at_budget",
    "run_engine_traced",
    "compare_decode_kernels",
    "GatherTraffic",
    "gather_traffic",
]


def show(view, max_frames: int = 30, live: bool = True) -> None:
    """Display a view: the live widget (in Jupyter) and a static plotly animation that renders without a kernel.

    The static copy is plotly's own notebook output (the ``application/vnd.plotly.v1+json``
    mime bundle), which JupyterLab draws itself, offline and untrusted; its frames are at
    most ``max_frames`` sampled steps, and it opens on the step the live view shows.
    """
    from IPython.display import display

    if live:
        display(view)
    view.display_static(max_frames)


def show_figure(fig) -> None:
    """A plain plotly figure as plotly's notebook output (renders offline, untrusted, with no kernel)."""
    from kvpaging.visualizers.static import display_figure

    display_figure(fig)


@contextlib.contextmanager
def timed():
    """``with timed() as t: ...`` then ``t.seconds``; synchronises CUDA so GPU work is counted."""

    class _T:
        seconds = 0.0

    t = _T()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield t
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t.seconds = time.perf_counter() - start


def random_workload(num_requests: int, seed: int = 0, prompt_range=(16, 1024), output_range=(16, 512)):
    """``(prompt_len, output_len)`` pairs, each drawn uniformly from its inclusive range."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num_requests)]


def fragmentation(workload, block_size: int, at: str = "end") -> float:
    """Internal fragmentation measured on a real BlockManager: empty allocated slots / allocated slots.

    Every request is allocated its prompt, then grows one decode token at a time
    (``append_slots``) up to ``at="end"``: its whole output, or ``at="half"``:
    half of it (a snapshot of a busy server, where requests are mid-way).
    """
    if at not in ("end", "half"):
        raise ValueError(f"at must be 'end' or 'half', got {at!r}")
    need = sum(-(-(p + o) // block_size) for p, o in workload)
    bm = BlockManager(need + 1, block_size, enable_prefix_caching=False)
    for i, (p, o) in enumerate(workload):
        # (not `assert bm.allocate_sequence(...)`: under python -O the call itself would vanish)
        ok = bm.allocate_sequence(i, p)
        for _ in range(o if at == "end" else o // 2):
            ok = ok and bm.append_slots(i, 1)
        if not ok:  # the pool is sized for the whole workload: this cannot happen
            raise RuntimeError(f"request {i} found no room in a pool sized for the whole workload")
    return bm.stats().internal_fragmentation


def fragmentation_by_block_size(workload, block_sizes=(1, 8, 16, 32, 64, 128, 256), at: str = "end") -> dict[int, float]:
    return {bs: fragmentation(workload, bs, at) for bs in block_sizes}


@dataclass(frozen=True)
class ConcurrencyResult:
    budget_tokens: int
    paged: int  # requests resident at once, each at its final length, blocks as tokens arrive
    paged_halfway: int  # same, each half way through its output
    reserve_max_model_len: int  # contiguous: every request reserves max_model_len slots
    reserve_prompt_plus_max_tokens: int  # contiguous: prompt + max_tokens slots each

    def ratios(self) -> dict[str, float]:
        return {
            "paged / reserve max_model_len": self.paged / max(self.reserve_max_model_len, 1),
            "paged / reserve prompt+max_tokens": self.paged / max(self.reserve_prompt_plus_max_tokens, 1),
        }


def _count_paged(workload, budget_tokens: int, block_size: int, fraction: float) -> int:
    bm = BlockManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    fits = 0
    for i, (p, o) in enumerate(workload):
        if not bm.allocate_sequence(i, p + int(o * fraction)):
            break
        fits += 1
    return fits


def _count_reserved(sizes, budget_tokens: int) -> int:
    used = fits = 0
    for s in sizes:
        if used + s > budget_tokens:
            break
        used += s
        fits += 1
    return fits


def concurrency_at_budget(workload, budget_tokens: int, block_size: int, max_model_len: int,
                          max_tokens: int) -> ConcurrencyResult:
    """How many requests of ``workload`` (taken in order) are resident at once in ``budget_tokens`` KV slots.

    Paged: a real BlockManager of ``budget_tokens // block_size`` blocks, each
    request holding blocks only for the tokens it has (at its final length, the
    most it ever holds, and half way through its output). Contiguous: each
    request reserves its worst case up front, either ``max_model_len`` slots or
    ``prompt + max_tokens`` slots (``max_tokens`` is the cap the client sent;
    the real output is usually shorter).
    """
    return ConcurrencyResult(
        budget_tokens=budget_tokens,
        paged=_count_paged(workload, budget_tokens, block_size, 1.0),
        paged_halfway=_count_paged(workload, budget_tokens, block_size, 0.5),
        reserve_max_model_len=budget_tokens // max_model_len,
        reserve_prompt_plus_max_tokens=_count_reserved([p + max_tokens for p, _ in workload], budget_tokens),
    )


def run_engine_traced(llm, prompts, params, use_tqdm: bool = True):
    """Run ``llm.generate`` keeping every StepRecord; returns (outputs, trace list)."""
    engine = llm.engine
    engine.keep_trace = True
    engine.trace = []
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    trace = list(engine.trace)
    engine.keep_trace = False
    return outputs, trace


def compare_decode_kernels(seq_lens=(5, 17, 40), num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                           block_size: int = 4, seed: int = 0, device: str = "cpu"):
    """Run the torch reference and the Triton decode kernel on one random paged cache.

    Returns ``(max_abs_diff, reference_out, triton_out)``. On a CPU, set
    ``TRITON_INTERPRET=1`` before the Triton kernels are first used (they are
    then interpreted: slow, so keep sizes tiny).
    """
    import kvpaging.kernels as K
    from kvpaging.kernels.testing import random_paged_kv

    g = torch.Generator(device=device).manual_seed(seed)
    kv = random_paged_kv(list(seq_lens), num_kv_heads, head_dim, block_size, device=device, generator=g)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g, device=device)
    scale = head_dim ** -0.5
    ref = K.reference.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    tri = K.paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    return float((ref.float() - tri.float()).abs().max()), ref, tri


@dataclass
class GatherTraffic:
    """One layer's K and V bytes: what the torch reference's gather builds, against what a kernel reading the
    cache in place reads (lesson 04b)."""

    padded_tokens: int  # token slots per sequence in the gathered tensor: the longest sequence's blocks
    gathered_bytes: int  # K and V, every sequence padded to padded_tokens, in float32
    read_bytes: int  # K and V of the real tokens only, in the cache's dtype


def gather_traffic(seq_lens, block_size: int, num_kv_heads: int, head_dim: int,
                   cache_dtype: torch.dtype = torch.bfloat16) -> GatherTraffic:
    """Counted from the shapes, as ``kernels.reference.gather_kv`` lays its tensor out: one row per sequence,
    as wide as the block table (the longest sequence's blocks), float32."""
    width = max(-(-n // block_size) for n in seq_lens) * block_size
    per_token = num_kv_heads * head_dim
    gathered = 2 * len(seq_lens) * width * per_token * 4
    read = 2 * sum(seq_lens) * per_token * torch.empty((), dtype=cache_dtype).element_size()
    return GatherTraffic(width, gathered, read)
