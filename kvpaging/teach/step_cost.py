"""What one decode step costs against how many sequences it holds: the curve that decides whether batching pays.

Continuous batching wins *steps*: more sequences share each step, so the same answers take fewer steps
(lesson 06 counts them). Whether it also wins *seconds* depends on one curve of the machine at hand: the time
of a decode step against its batch size.

- Where the step time stays flat as the batch grows, a step with 8 sequences costs about what a step with 1
  costs, and fewer steps mean less time. That is a GPU: a decode step reads every weight once however many
  sequences share it, so it is bound by memory bandwidth until the batch is in the hundreds (lesson 01).
- Where the step time grows with the batch, fewer steps need not mean less time. That is a CPU in float32:
  its matrix units reach their compute roof at a batch of a few sequences, and from there every sequence
  adds its own share of arithmetic. CPUs with bfloat16 matrix units (Intel's AMX, or AVX-512 BF16) run a
  bfloat16 matrix product several times faster than a float32 one, so their bfloat16 curve is flatter.

:func:`measure_step_curve` measures the curve with the engine itself (its own steps, the trained model);
:func:`gpu_step_curve` *models* it for named GPUs from the step's exact bytes and FLOPs
(``kvpaging.teach.roofline``) and their public peak figures: a roofline's best case, not a measurement.
A GPU run replaces the model with measurements where a GPU is at hand.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpaging.models import bf16_matrix_units  # noqa: F401  (the lessons read the CPU's units from here)
from kvpaging.teach import text_table
from kvpaging.teach.roofline import decode_cost, time_prefill_and_decode

__all__ = ["GPU", "GPUS", "StepCurve", "bf16_matrix_units", "measure_step_curve", "gpu_step_curve",
           "step_curve_figure", "step_curve_table", "predicted_speedup"]


@dataclass(frozen=True)
class GPU:
    """A GPU's public peak figures: dense 16-bit tensor-core FLOP/s (no sparsity) and memory bandwidth."""

    name: str
    peak_flops: float
    bandwidth: float  # bytes per second
    note: str = ""


# Spec-sheet figures (NVIDIA's data sheets): dense bf16 tensor FLOP/s, and memory bandwidth.
GPUS = (
    GPU("H100 SXM", 989e12, 3.35e12),
    GPU("H200", 989e12, 4.8e12),
    GPU("A100 80GB SXM", 312e12, 2.039e12),
    GPU("L4", 121e12, 0.3e12),
    GPU("T4", 65e12, 0.32e12, "fp16: the T4 has no bfloat16"),
)


@dataclass(frozen=True)
class StepCurve:
    """Seconds per decode step at each batch size: measured on this machine, or modelled for a GPU."""

    label: str
    batches: tuple[int, ...]
    seconds: tuple[float, ...]
    measured: bool

    def at(self, batch: float) -> float:
        """Seconds per step at ``batch`` sequences, read off the curve: linear between measured batches, and past
        the largest one along the last segment's slope (flat if that slope falls), as a prefill chunk of many
        tokens needs. Below the smallest batch, the smallest batch's time."""
        pairs = list(zip(self.batches, self.seconds))
        if batch <= pairs[0][0] or len(pairs) == 1:
            return pairs[0][1]
        for (b0, s0), (b1, s1) in zip(pairs, pairs[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        return s1 + max(0.0, (s1 - s0) / (b1 - b0)) * (batch - b1)

    def growth(self, batch: int) -> float:
        """How many times the step at ``batch`` sequences costs the step at the smallest batch."""
        return self.at(batch) / self.seconds[0]

    def regime(self) -> str:
        """"flat" when a step of the largest batch costs less than 1.5x a step of the smallest (a bigger batch is
        nearly free), else "climbing"."""
        return "flat" if self.growth(self.batches[-1]) < 1.5 else "climbing"


def measure_step_curve(model, tokenizer=None, dtype: torch.dtype | None = None, batches: Sequence[int] = (1, 4, 16, 64),
                       context_len: int = 16, decode_steps: int = 6, label: str | None = None) -> StepCurve:
    """Median seconds of one decode step of the engine at each batch size, on ``model`` in ``dtype``.

    Each batch runs once to warm up and once measured (``time_prefill_and_decode``): ``batch`` random prompts
    of ``context_len`` tokens, prefilled in one step, then ``decode_steps`` decode steps, of which the median
    counts. The engine gets a private copy of the model in ``dtype`` (the model itself is left alone).
    """
    from kvpaging import LLM

    batches = tuple(sorted(batches))
    largest = batches[-1]
    max_len = context_len + decode_steps + 2
    blocks_per_seq = -(-max_len // 16)
    llm = LLM(model, tokenizer, dtype=dtype, block_size=16, num_blocks=2 * largest * blocks_per_seq + 8,
              max_model_len=max_len + 16, max_num_seqs=largest, max_num_batched_tokens=max(2048, largest * context_len),
              seed=0)
    seconds = tuple(time_prefill_and_decode(llm, context_len, batch=b, decode_steps=decode_steps, repeats=1,
                                            progress=False)["decode_step_s"] for b in batches)
    weight = next(llm.engine.model.parameters())
    dtype_name = str(weight.dtype).replace("torch.", "")
    threads = torch.get_num_threads()  # what the engine's matrix products ran on, not only what the machine has
    where = (f"this CPU ({threads} thread{'s' * (threads > 1)} of {os.cpu_count()} cores)" if weight.device.type == "cpu"
             else f"this {weight.device.type} device")
    return StepCurve(label or f"{where}, {dtype_name}", batches, seconds, True)


def gpu_step_curve(config, gpu: GPU, batches: Sequence[int] = (1, 4, 16, 64), context_len: int = 16,
                   dtype: torch.dtype = torch.bfloat16) -> StepCurve:
    """The roofline's best case for one decode step on ``gpu``: the slower of moving the step's bytes at the
    GPU's bandwidth and doing its FLOPs at its peak. A model, labelled so: real engines reach perhaps 60-80%
    of the bandwidth and add launch and host time (lesson 08)."""
    seconds = []
    for b in batches:
        cost = decode_cost(config, context_len, batch=b, dtype=dtype)
        seconds.append(max(cost.flops / gpu.peak_flops, cost.bytes / gpu.bandwidth))
    return StepCurve(f"{gpu.name} (model)", tuple(batches), tuple(seconds), False)


def predicted_speedup(curve: StepCurve, static_run, continuous_run) -> float:
    """Continuous over static batching in tokens per second, as the curve predicts it from the steps each run took.

    Each step of a run's trace costs what the curve says for the tokens it computed (a decode computes one per
    sequence, a prompt chunk its length; a matrix product's rows are tokens either way); a run's predicted seconds
    per useful token is their sum over its useful tokens. Summing step by step matters: a static batch drains from
    8 sequences to 1, and the curve is not a straight line, so the cost at the mean batch is not the mean cost. The
    curve is measured on short contexts, so a prompt chunk's attention is under-counted: an estimate."""
    def seconds_per_token(run) -> float:
        return sum(curve.at(sum(e.num_tokens for e in record.scheduled)) for record in run.trace) / run.useful_tokens

    return seconds_per_token(static_run) / seconds_per_token(continuous_run)


def step_curve_table(curves: Sequence[StepCurve]) -> str:
    """Milliseconds per decode step, and the growth over the smallest batch, as an aligned text table."""
    batches = curves[0].batches
    header = ["", *[f"batch {b}" for b in batches], f"x at {batches[-1]}"]
    return text_table(header, [[c.label, *[_ms(s) for s in c.seconds], f"{c.growth(batches[-1]):.1f}x"] for c in curves])


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"


def step_curve_figure(curves: Sequence[StepCurve]):
    """Step time relative to a step of one sequence, against the batch: flat means batching is free.

    Measured curves are solid, modelled ones dashed; hovering shows the milliseconds."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for c in curves:
        fig.add_scatter(x=list(c.batches), y=[s / c.seconds[0] for s in c.seconds], mode="lines+markers", name=c.label,
                        line={"dash": "solid" if c.measured else "dash", "width": 3 if c.measured else 2},
                        customdata=[s * 1e3 for s in c.seconds],
                        hovertemplate="batch %{x}: %{customdata:.3g} ms per step (%{y:.2f}x batch 1)<extra>"
                                      + c.label + "</extra>")
    fig.add_hline(y=1, line_dash="dot", line_color="#888")
    fig.update_xaxes(type="log", title_text="sequences in the decode step (batch)", tickvals=list(curves[0].batches))
    fig.update_yaxes(title_text="step time / step time at batch 1")
    fig.update_layout(title="What a decode step costs as the batch grows (solid: measured here; dashed: a model)",
                      height=440, margin={"t": 60, "l": 70, "r": 20, "b": 60})
    return fig
