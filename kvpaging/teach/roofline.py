"""Lesson 01: count the FLOPs and bytes of a prefill step and a decode step, measure the device, draw a roofline.

The counts come from the model's config alone:

- FLOPs: every weight matrix of shape (out, in) costs ``2 * out * in`` FLOPs per
  token that goes through it (a multiply and an add). Attention adds
  ``4 * num_heads * head_dim`` FLOPs per (query token, key token) pair and layer
  (Q·K and the weighted sum of V). The logits are computed for the last token
  of each sequence only (``logits_to_keep=1``), like an engine does.
- Bytes: the least a step must move between memory and the compute units. Every
  weight matrix is read once per step, however many tokens share it; every
  sequence reads its whole KV cache once and writes the KV of its new tokens.
  Activations and the embedding rows are left out (small next to the weights).

Arithmetic intensity = FLOPs / bytes. Below the device's ridge point
(peak FLOP/s / bandwidth) a step is memory bound: the compute units wait for data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpaging.core.kv_math import kv_bytes_per_token, num_kv_cache_layers
from kvpaging.teach import text_table

__all__ = [
    "StepCost",
    "DeviceRoof",
    "matmul_params",
    "prefill_cost",
    "decode_cost",
    "measure_roof",
    "measure_matmul_flops",
    "measure_copy_bandwidth",
    "time_prefill_and_decode",
    "roofline_figure",
    "roofline_table",
    "synchronize",
]


def _cfg(config, name, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _shape(config) -> dict:
    text = _cfg(config, "text_config")
    if _cfg(config, "num_hidden_layers") is None and text is not None:
        config = text
    hidden = int(_cfg(config, "hidden_size"))
    heads = int(_cfg(config, "num_attention_heads"))
    return {
        "layers": int(_cfg(config, "num_hidden_layers")),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(_cfg(config, "num_key_value_heads") or heads),
        "head_dim": int(_cfg(config, "head_dim") or hidden // heads),
        "intermediate": int(_cfg(config, "intermediate_size")),
        "vocab": int(_cfg(config, "vocab_size")),
    }


def matmul_params(config) -> dict:
    """Weights that take part in matrix multiplications, per layer and for the LM head.

    A layer: Q, K, V and O projections, and a gated MLP (gate, up, down: three
    hidden x intermediate matrices), as in Llama, Mistral, Qwen2/3 and Phi-3.
    Biases and norms are a rounding error and left out.
    """
    s = _shape(config)
    attn = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
    mlp = 3 * s["hidden"] * s["intermediate"]
    per_layer = attn + mlp
    lm_head = s["hidden"] * s["vocab"]
    return {"per_layer": per_layer, "layers": per_layer * s["layers"], "lm_head": lm_head,
            "total": per_layer * s["layers"] + lm_head}


@dataclass(frozen=True)
class StepCost:
    """The work of one engine step: FLOPs and the least bytes it must move."""

    name: str
    batch: int
    new_tokens: int  # per sequence
    past_tokens: int  # per sequence, already in the KV cache before the step
    flops: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes


def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    from kvpaging.core.kv_math import dtype_nbytes

    return dtype_nbytes(dtype)


def step_cost(config, *, name: str, batch: int, new_tokens: int, past_tokens: int,
              dtype=torch.bfloat16, kv_dtype=None) -> StepCost:
    """FLOPs and bytes of one step in which ``batch`` sequences each compute ``new_tokens`` tokens."""
    if batch < 1 or new_tokens < 1 or past_tokens < 0:
        raise ValueError("batch and new_tokens must be >= 1, past_tokens >= 0")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    s = _shape(config)
    p = matmul_params(config)
    tokens = batch * new_tokens
    # every new token i (1-based) attends to past_tokens + i keys (causal)
    key_pairs = new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2
    attn_flops = 4 * s["heads"] * s["head_dim"] * key_pairs * num_kv_cache_layers(config) * batch
    flops = 2 * p["layers"] * tokens + 2 * p["lm_head"] * batch + attn_flops
    per_token_kv = kv_bytes_per_token(config, kv_dtype)
    return StepCost(
        name=name, batch=batch, new_tokens=new_tokens, past_tokens=past_tokens, flops=int(flops),
        weight_bytes=p["total"] * _dtype_bytes(dtype),
        kv_read_bytes=per_token_kv * past_tokens * batch,
        kv_write_bytes=per_token_kv * new_tokens * batch,
    )


def prefill_cost(config, prompt_len: int, batch: int = 1, dtype=torch.bfloat16) -> StepCost:
    """A whole prompt of ``prompt_len`` tokens in one step (nothing cached yet)."""
    return step_cost(config, name=f"prefill {prompt_len} tok x {batch}", batch=batch, new_tokens=prompt_len,
                     past_tokens=0, dtype=dtype)


def decode_cost(config, context_len: int, batch: int = 1, dtype=torch.bfloat16) -> StepCost:
    """One new token per sequence, each attending to ``context_len`` cached tokens."""
    return step_cost(config, name=f"decode x {batch}", batch=batch, new_tokens=1, past_tokens=context_len,
                     dtype=dtype)


# --------------------------------------------------------------------------- measuring the device


def synchronize(device) -> None:
    """Wait for queued GPU work (a no-op on the CPU), so that a timer measures the work itself."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device, repeats: int) -> float:
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_matmul_flops(device="cpu", dtype=torch.float32, n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of one large square matmul (2 n^3 FLOPs): close to what the device can compute."""
    n = n or (8192 if torch.device(device).type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, device, repeats)


def measure_copy_bandwidth(device="cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of copying one large buffer (each byte read once and written once)."""
    nbytes = nbytes or ((2 << 30) if torch.device(device).type == "cuda" else (256 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), device, repeats)


@dataclass(frozen=True)
class DeviceRoof:
    """What the device can do at best: compute (FLOP/s) and memory bandwidth (bytes/s)."""

    device: str
    dtype: torch.dtype
    peak_flops: float
    bandwidth: float

    @property
    def ridge(self) -> float:
        """FLOP/byte above which a kernel can be compute bound."""
        return self.peak_flops / self.bandwidth

    def time_at_best(self, cost: StepCost) -> float:
        """The roofline's prediction: the step takes as long as the slower of computing and moving."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth)

    def bound(self, cost: StepCost) -> str:
        return "memory" if cost.intensity < self.ridge else "compute"


def measure_roof(device="cpu", dtype=torch.float32) -> DeviceRoof:
    return DeviceRoof(str(device), dtype, measure_matmul_flops(device, dtype), measure_copy_bandwidth(device))


# --------------------------------------------------------------------------- timing the model


def time_prefill_and_decode(llm, prompt_len: int, batch: int = 1, decode_steps: int = 16, repeats: int = 2,
                            seed: int = 0, progress: bool = True) -> dict:
    """Median seconds of one prefill step and of one decode step, measured on the engine's own steps.

    Each repeat adds ``batch`` random prompts of ``prompt_len`` tokens, then calls
    ``llm.engine.step()`` by hand: the first step computes every prompt at once
    (a prefill step; ``max_num_batched_tokens`` must be at least
    ``batch * prompt_len``), each later one a single new token per sequence (a
    decode step). One extra warm-up repeat is not counted.
    """
    from kvpaging.progress import track
    from kvpaging.sampling_params import SamplingParams

    engine = llm.engine
    if engine.config.max_num_batched_tokens < batch * prompt_len:
        raise ValueError("max_num_batched_tokens must hold every prompt, for the first step to be a pure prefill")
    device = next(engine.model.parameters()).device
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    prefill, decode = [], []
    for r in track(range(repeats + 1), desc=f"batch {batch}, prompt {prompt_len}", disable=not progress):
        for i in range(batch):
            prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
            engine.add_request(f"timing-{seed}-{r}-{i}", prompt, params)
        step_times = []
        while engine.has_unfinished_requests():
            synchronize(device)
            t0 = time.perf_counter()
            engine.step()
            synchronize(device)
            step_times.append(time.perf_counter() - t0)
        if r:
            prefill.append(step_times[0])
            decode.append(statistics.median(step_times[1:]))
    return {"prefill_s": statistics.median(prefill), "decode_step_s": statistics.median(decode),
            "batch": batch, "prompt_len": prompt_len, "mean_context": prompt_len + decode_steps // 2}


# --------------------------------------------------------------------------- the picture


def roofline_figure(roof: DeviceRoof, points: Sequence[tuple[str, StepCost, float | None]], title: str | None = None):
    """A log-log roofline with one marker per (label, cost, measured seconds or None).

    A measured step sits at its achieved FLOP/s (flops / seconds); an unmeasured
    one at the roofline's best case, drawn hollow.
    """
    import numpy as np
    import plotly.graph_objects as go

    lo = min([0.1] + [c.intensity / 3 for _, c, _ in points])
    hi = max([roof.ridge * 30] + [c.intensity * 3 for _, c, _ in points])
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    fig = go.Figure()
    fig.add_scatter(x=x, y=np.minimum(roof.peak_flops, roof.bandwidth * x), mode="lines", name="roofline",
                    line={"color": "#444", "width": 3})
    fig.add_vline(x=roof.ridge, line_dash="dot", line_color="#888",
                  annotation_text=f"ridge {roof.ridge:.1f} FLOP/B", annotation_position="top left")
    for label, cost, seconds in points:
        measured = seconds is not None
        y = cost.flops / seconds if measured else cost.flops / roof.time_at_best(cost)
        fig.add_scatter(x=[cost.intensity], y=[y], mode="markers+text", name=label, text=[label],
                        textposition="bottom center",
                        marker={"size": 13, "symbol": "circle" if measured else "circle-open", "line": {"width": 2}},
                        hovertemplate=f"{label}<br>%{{x:.2f}} FLOP/B<br>%{{y:.3g}} FLOP/s"
                                      f"<extra>{'measured' if measured else 'roofline best case'}</extra>")
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP per byte moved)")
    fig.update_yaxes(type="log", title_text="FLOP/s")
    fig.update_layout(title=title or f"Roofline of {roof.device} ({str(roof.dtype).replace('torch.', '')})",
                      height=460, showlegend=True, margin={"t": 60, "l": 70, "r": 20, "b": 60})
    return fig


def roofline_table(roof: DeviceRoof, points: Sequence[tuple[str, StepCost, float]]) -> str:
    """The steps of :func:`roofline_figure` as an aligned text table, one row per (label, cost, measured seconds).

    Columns: intensity (FLOP/byte), what bounds the step on this roofline
    (``roof.bound``), the roofline's best-case time, the measured time, and the
    share of the measured compute peak the step used (its FLOPs over its
    measured time, against ``roof.peak_flops``).
    """
    header = ("step", "FLOP/byte", "bound", "best case", "measured", "compute used")
    rows = [(label, f"{cost.intensity:.2f}", roof.bound(cost), f"{roof.time_at_best(cost) * 1e3:.2f} ms",
             f"{seconds * 1e3:.2f} ms", f"{cost.flops / seconds / roof.peak_flops:.1%} of peak")
            for label, cost, seconds in points]
    return text_table(header, rows)
