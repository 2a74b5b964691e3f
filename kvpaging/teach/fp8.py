"""Helpers for lesson 09 (FP8 KV cache): look inside e4m3 numbers, and measure what an FP8 pool holds.

The quantization itself lives in :mod:`kvpaging.kernels.fp8`; this module only
explains it (bit fields, the rounding grid) and measures the engine
(blocks per byte budget, sequences served at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

__all__ = [
    "e4m3_fields",
    "e4m3_positive_values",
    "round_trip_table",
    "PoolCapacity",
    "measure_pool_capacity",
    "grid_figure",
]

E4M3_BIAS = 7


def e4m3_fields(value: float) -> dict:
    """The float8_e4m3fn encoding of ``value`` (after rounding): bits and what they mean.

    Layout: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. A normal number is
    ``(-1)^s * 2^(e-7) * (1 + m/8)``; exponent 0 gives subnormals ``2^-6 * m/8``.
    There is no infinity; only ``S.1111.111`` is NaN, which is why 448 (``0.1111.110``) is the top.
    """
    code = torch.tensor([value], dtype=torch.float32).to(FP8_DTYPE).view(torch.uint8).item()
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
    stored = torch.tensor([code], dtype=torch.uint8).view(FP8_DTYPE).float().item()
    if exp == 0:
        formula = f"{'-' if sign else ''}2^-6 * {man}/8"
    else:
        formula = f"{'-' if sign else ''}2^{exp - E4M3_BIAS} * (1 + {man}/8)"
    return {"value": value, "bits": f"{sign}.{exp:04b}.{man:03b}", "sign": sign, "exponent": exp,
            "mantissa": man, "stored": stored, "formula": formula}


def e4m3_positive_values() -> torch.Tensor:
    """Every finite, non-negative float8_e4m3fn value, ascending (0 up to 448)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(FP8_DTYPE).float()


def round_trip_table(values, scale: float = 1.0) -> list[dict]:
    """For each value: what the cache stores (``x / scale`` rounded to e4m3) and what comes back (``* scale``)."""
    x = torch.tensor(list(values), dtype=torch.float32).reshape(-1, 1, 1)  # [n, heads=1, dim=1]
    s = torch.tensor([scale], dtype=torch.float32)
    q = quantize_fp8(x, s)
    back = dequantize_fp8(q, s).flatten()
    rows = []
    for v, code, b in zip(x.flatten().tolist(), q.flatten().float().tolist(), back.tolist()):
        rows.append({"x": v, "x / scale": v / scale, "stored e4m3": code, "dequantized": b,
                     "abs error": abs(b - v), "rel error": abs(b - v) / abs(v) if v else 0.0,
                     "saturated": abs(v / scale) > FP8_MAX})
    return rows


@dataclass(frozen=True)
class PoolCapacity:
    kv_cache_dtype: str  # as passed to LLM ("auto" or "fp8")
    element_dtype: str  # what one stored number is, e.g. "float32" or "float8_e4m3fn"
    bytes_per_element: int
    budget_bytes: int
    num_blocks: int
    pool_bytes: int  # bytes of the K and V tensors the runner allocated
    seq_len: int
    blocks_per_seq: int
    capacity: int  # num_blocks // blocks_per_seq: sequences of seq_len that fit at once
    peak_running: int  # measured: most sequences running in one step
    num_preemptions: int


def measure_pool_capacity(model, budget_bytes: int, seq_len: int, kv_cache_dtype: str = "auto",
                          num_requests: int | None = None, block_size: int = 16, seed: int = 0) -> PoolCapacity:
    """Build an engine whose KV pool gets ``budget_bytes``, and count what it serves at once.

    Every request is a ``seq_len - 1``-token prompt plus one generated token, so each
    sequence holds ``ceil((seq_len - 1) / block_size)`` blocks for its whole life, and
    the only limit on how many run together is the pool (``max_num_seqs`` and the
    token budget are set out of the way). Prefix caching is off: random prompts share
    nothing anyway, and it keeps the count plain.
    """
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget_bytes, block_size=block_size,
              max_model_len=seq_len, enable_prefix_caching=False, max_num_seqs=1024,
              max_num_batched_tokens=1 << 20)
    engine = llm.engine
    num_blocks = engine.config.num_blocks
    blocks_per_seq = -(-(seq_len - 1) // block_size)
    capacity = num_blocks // blocks_per_seq
    if num_requests is None:
        num_requests = capacity + max(2, capacity // 4)  # more than fit: some must wait
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, engine.vocab_size, (num_requests, seq_len - 1), generator=g).tolist()
    peak = 0

    def watch(record) -> None:
        nonlocal peak
        peak = max(peak, len(record.scheduled))

    engine.add_observer(watch)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.remove_observer(watch)
    kv_dtype = engine.runner.kv_cache_dtype
    element = torch.empty((), dtype=kv_dtype).element_size()
    return PoolCapacity(kv_cache_dtype, str(kv_dtype).replace("torch.", ""), element, budget_bytes, num_blocks,
                        engine.runner.kv_cache_bytes, seq_len, blocks_per_seq, capacity, peak,
                        engine.scheduler.num_preemptions)


def grid_figure():
    """The e4m3 grid: every positive value, and the gap to the next one (log axes)."""
    import plotly.graph_objects as go

    v = e4m3_positive_values()[1:]  # skip 0 for the log axis
    gaps = (v[1:] - v[:-1]).tolist()
    fig = go.Figure(go.Scatter(x=v[:-1].tolist(), y=gaps, mode="markers", name="gap to next value"))
    fig.add_trace(go.Scatter(x=v[:-1].tolist(), y=(v[:-1] / 8).tolist(), mode="lines", name="value / 8",
                             line={"dash": "dot"}))
    fig.update_xaxes(type="log", title_text="e4m3 value")
    fig.update_yaxes(type="log", title_text="distance to the next representable value")
    fig.update_layout(title="e4m3: the grid gets coarser as numbers grow (relative step 1/8 to 1/16)",
                      height=380, width=760)
    return fig
