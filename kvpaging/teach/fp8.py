"""Helpers for lesson 09 (FP8 KV cache): look inside e4m3 numbers, and measure what an FP8 pool holds.

The quantization itself lives in :mod:`kvpaging.kernels.fp8`; this module only
explains it (bit fields, the rounding grid), shows the calibrated scales,
measures how evenly a model spreads its attention (why a random-weight model's
accuracy figure says little about a trained one), and measures the engine
(blocks per byte budget, sequences served at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpaging.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

__all__ = [
    "e4m3_fields",
    "e4m3_positive_values",
    "round_trip_table",
    "PoolCapacity",
    "measure_pool_capacity",
    "grid_figure",
    "scale_spread",
    "scales_figure",
    "attention_entropy",
    "attention_entropy_figure",
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
                          num_requests: int | None = None, block_size: int = 16, seed: int = 0,
                          dtype: torch.dtype | None = None) -> PoolCapacity:
    """Build an engine whose KV pool gets ``budget_bytes``, and count what it serves at once.

    ``dtype`` serves the model converted to that dtype (the engine's own copy;
    ``model`` is left as it is), so ``kv_cache_dtype="auto"`` then stores that dtype.
    Every request must finish: ``generate`` raises if any failed.

    Every request is a ``seq_len - 1``-token prompt plus one generated token, so each
    sequence holds ``ceil((seq_len - 1) / block_size)`` blocks for its whole life, and
    the only limit on how many run together is the pool (``max_num_seqs`` and the
    token budget are set out of the way). Prefix caching is off: random prompts share
    nothing anyway, and it keeps the count plain.
    """
    from kvpaging.entrypoints.llm import LLM
    from kvpaging.sampling_params import SamplingParams

    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget_bytes, block_size=block_size,
              max_model_len=seq_len, enable_prefix_caching=False, max_num_seqs=1024,
              max_num_batched_tokens=1 << 20, dtype=dtype)
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
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.remove_observer(watch)
    if len(outs) != num_requests or any(c.finish_reason != "length" for o in outs for c in o.outputs):
        raise RuntimeError("not every request generated its token: the pool measurement is void")
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


def scale_spread(kv_scales) -> dict:
    """How different the calibrated ranges are: within a layer (across its KV heads) and across layers.

    ``kv_scales`` is ``llm.engine.runner.kv_scales``, a ``(k_scale, v_scale)`` pair of
    ``[num_kv_heads]`` tensors per layer. Ratios of largest to smallest amax (scale x 448).
    """
    k = torch.stack([ks for ks, _ in kv_scales]).float() * FP8_MAX  # [layers, heads]
    v = torch.stack([vs for _, vs in kv_scales]).float() * FP8_MAX
    within_k = k.max(1).values / k.min(1).values
    within_v = v.max(1).values / v.min(1).values
    return {"layers": k.shape[0], "kv_heads": k.shape[1],
            "k_within_layer": float(within_k.max()), "k_within_layer_layer": int(within_k.argmax()),
            "v_within_layer": float(within_v.max()), "v_within_layer_layer": int(within_v.argmax()),
            "k_across_layers": float(k.max() / k.min()), "v_across_layers": float(v.max() / v.min()),
            "k_amax": (float(k.min()), float(k.max())), "v_amax": (float(v.min()), float(v.max()))}


def scales_figure(kv_scales, title: str):
    """Calibrated amax (scale x 448) of every layer and KV head, keys and values side by side (log colour)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    k = (torch.stack([ks for ks, _ in kv_scales]).float() * FP8_MAX).T  # [heads, layers]
    v = (torch.stack([vs for _, vs in kv_scales]).float() * FP8_MAX).T
    lo, hi = float(torch.minimum(k.min(), v.min()).log10()), float(torch.maximum(k.max(), v.max()).log10())
    fig = make_subplots(rows=2, cols=1, subplot_titles=("keys: amax per layer and KV head",
                                                        "values: amax per layer and KV head"), vertical_spacing=0.2)
    for row, t in ((1, k), (2, v)):
        fig.add_trace(go.Heatmap(z=t.log10().tolist(), customdata=t.tolist(), zmin=lo, zmax=hi,
                                 x=list(range(t.shape[1])), y=[f"head {h}" for h in range(t.shape[0])],
                                 colorscale="Viridis", showscale=row == 1,
                                 colorbar={"title": "log10 amax"},
                                 hovertemplate="layer %{x}, %{y}: amax %{customdata:.3g}<extra></extra>"),
                      row=row, col=1)
    fig.update_xaxes(title_text="layer", row=2, col=1)
    fig.update_layout(title=title, height=360, width=760)
    return fig


@torch.inference_mode()
def attention_entropy(model, token_ids: list[int], skip_first: int = 16) -> torch.Tensor:
    """How evenly each layer spreads its attention over ``token_ids``: 1.0 is uniform, 0.0 all on one token.

    For every head and query position ``i`` (after the first ``skip_first``, which see too
    few tokens to tell), the entropy of its attention weights divided by ``log(i + 1)``,
    the entropy of the uniform distribution over the ``i + 1`` tokens it can see;
    averaged over heads and positions. Returns one figure per layer.

    Runs a private copy of ``model`` (same weights) with transformers' eager attention,
    which returns the weights; ``model`` itself is not changed.
    """
    from kvpaging.models import private_copy

    if len(token_ids) <= skip_first + 1:
        raise ValueError(f"need more than {skip_first + 1} tokens, got {len(token_ids)}")
    copy = private_copy(model).eval()
    copy.set_attn_implementation("eager")
    device = next(copy.parameters()).device
    out = copy(input_ids=torch.tensor([token_ids], device=device), output_attentions=True, use_cache=False,
               logits_to_keep=1)
    visible = torch.arange(1, len(token_ids) + 1, dtype=torch.float32, device=device)[skip_first:]
    per_layer = []
    for weights in out.attentions:  # [1, heads, queries, keys]
        p = weights[0, :, skip_first:].float()
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [heads, queries]
        per_layer.append((entropy / visible.log()).mean())
    return torch.stack(per_layer).cpu()


def attention_entropy_figure(per_layer: dict):
    """``attention_entropy`` of several models, one line each, against depth (layer / last layer)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, values in per_layer.items():
        values = [float(v) for v in values]
        depth = [i / max(len(values) - 1, 1) for i in range(len(values))]
        fig.add_trace(go.Scatter(x=depth, y=values, mode="lines+markers", name=name,
                                 hovertemplate="layer %{text}: %{y:.2f}<extra></extra>",
                                 text=list(range(len(values)))))
    fig.update_xaxes(title_text="depth (first layer 0, last layer 1)", range=[-0.03, 1.03])
    fig.update_yaxes(title_text="attention entropy / uniform", range=[0, 1.05])
    fig.update_layout(title="How evenly attention is spread (1 = every visible token weighs the same)",
                      height=340, width=760, legend={"orientation": "h", "y": -0.3})
    return fig
