"""Faster linear and RMSNorm layers on a CPU, used only inside engine steps.

We run the transformers model itself; on a CPU two kinds of its layers are
worth a faster implementation of the *same* maths (measured by
``benchmarks/throughput_breakdown.py``):

* **Linear layers**, more than half of a step. ``F.linear`` on a float32 CPU
  tensor goes to the BLAS torch was built with (Intel MKL in the x86 wheels).
  torch also ships oneDNN, which its own compiled CPU code uses
  (``torch.ops.mkldnn._linear_pointwise``: float32 in and out, no reduced
  precision). On the AMD EPYC (Zen 4) development machine oneDNN ran
  layer-sized products about 2x faster, but costs about 10 µs more per call,
  so products under ``MIN_MACS`` multiply-adds stay on ``F.linear``
  (``python -m kvpaging.cpu_layers`` prints the comparison for the machine it
  runs on).
* **RMSNorm layers.** transformers writes RMSNorm as five tensor operations
  (square, mean, add, rsqrt, two multiplies), each a pass over memory with its
  own dispatch: 1.6 ms for a 2048 x 256 prefill chunk, where the one-pass C
  loop of ``kernels/cpu_rms_norm.c`` takes 0.05 ms.

When the engine serves a float32 model on the CPU, each such layer gets a
``forward`` that takes the fast path **only while an engine step runs**
(``engine_step()``) and otherwise calls the layer's own code, so
``model.generate()`` on the same model object is unchanged. The module's own
weight is used (no copy, nothing to keep in sync). A layer is only given the
fast path after it agreed with the layer's own ``forward`` on a probe input:
an RMSNorm variant with other maths (Gemma's ``1 + weight``, say) keeps its
own. ``KVPAGING_CPU_LAYERS=0`` turns all of it off, for measuring the
difference (``benchmarks/throughput.py --cpu-layers off``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["enable_cpu_layers", "engine_step", "CpuLayers", "MIN_MACS", "ENV_SWITCH"]

MIN_MACS = 1 << 20  # smaller products: F.linear (oneDNN's per-call cost outweighs its faster product)
ENV_SWITCH = "KVPAGING_CPU_LAYERS"

_active = False  # True only inside ``engine_step()``
_onednn_checked: bool | None = None  # the probe's verdict, once run


@dataclass(frozen=True)
class CpuLayers:
    """How many layers of a model have the fast path."""

    linears: int = 0
    rms_norms: int = 0


def onednn_linear():
    """oneDNN's float32 linear op, or None where this torch has none (check ``onednn_usable()`` before using it)."""
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_usable() -> bool:
    """Whether oneDNN's linear runs here and agrees with ``F.linear`` on a probe product."""
    global _onednn_checked
    if _onednn_checked is None:
        op = onednn_linear()
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(s, generator=g) for s in ((2, 16, 64), (48, 64), (48,)))
            _onednn_checked = op is not None and torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b),
                                                                rtol=1e-5, atol=1e-5)
        except (RuntimeError, TypeError, NotImplementedError):
            _onednn_checked = False
    return _onednn_checked


def _linear_forward(module: torch.nn.Linear, op):
    out_features = module.out_features

    def forward(input: torch.Tensor) -> torch.Tensor:
        if _active and input.dim() >= 2 and input.numel() * out_features >= MIN_MACS:
            return op(input, module.weight, module.bias, "none", [], "")
        return F.linear(input, module.weight, module.bias)

    forward.kvpaging_fast_path = True
    return forward


def _is_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def _rms_norm_forward(module: torch.nn.Module, own_forward, rms_norm):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if (_active and hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu"
                and hidden_states.is_contiguous()):
            return rms_norm(hidden_states, module.weight, module.variance_epsilon)
        return own_forward(hidden_states)

    forward.kvpaging_fast_path = True
    return forward


def _agrees(module: torch.nn.Module, own_forward, rms_norm) -> bool:
    """The C RMSNorm gives what the layer's own forward gives, on a probe input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, module.weight.shape[0], generator=g) * 3
    with torch.no_grad():
        try:
            return torch.allclose(rms_norm(x, module.weight, module.variance_epsilon), own_forward(x),
                                  rtol=1e-5, atol=1e-6)
        except (RuntimeError, ValueError, TypeError):
            return False


def enable_cpu_layers(model: torch.nn.Module) -> CpuLayers:
    """Give the float32 CPU linear and RMSNorm layers of ``model`` their step-gated fast path (see
    the module docstring), once per layer. Returns how many layers have it."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return CpuLayers()
    from .kernels import cpu_backend

    op = onednn_linear() if onednn_usable() else None
    rms_norm = cpu_backend.rms_norm if cpu_backend.available() else None
    linears = norms = 0
    for module in model.modules():
        patched = getattr(module.forward, "kvpaging_fast_path", False)
        if type(module) is torch.nn.Linear and op is not None:  # subclasses (LoRA, quantized, ...) keep theirs
            if module.weight.device.type != "cpu" or module.weight.dtype != torch.float32:
                continue
            if not patched:
                module.forward = _linear_forward(module, op)
            linears += 1
        elif rms_norm is not None and _is_rms_norm(module):
            if not patched:
                own_forward = module.forward
                if not _agrees(module, own_forward, rms_norm):
                    continue
                module.forward = _rms_norm_forward(module, own_forward, rms_norm)
            norms += 1
    return CpuLayers(linears, norms)


@contextlib.contextmanager
def engine_step():
    """Inside this block the patched layers take their fast path. The model runner wraps every
    step's forward in it; ``serving.run_static_generate(cpu_layers=True)`` wraps ``generate()``
    in it, to measure transformers with the same layers."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def _compare() -> None:
    """Print F.linear against oneDNN for layer-sized products on this machine."""
    op = onednn_linear()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; oneDNN usable: {onednn_usable()}")
    for rows in (1, 4, 16, 48, 512):
        cells = []
        for n, k in ((256, 256), (1024, 256), (4096, 256), (4096, 1024)):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            times = []
            for fn in (lambda: F.linear(x, w), lambda: op(x, w, None, "none", [], "")):
                fn()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                times.append((time.perf_counter() - t0) / 50 * 1e6)
            cells.append(f"[{rows}x{k}]@[{k}x{n}] {times[0]:8.1f} / {times[1]:8.1f} µs")
        print("   ".join(cells))


if __name__ == "__main__":
    _compare()
