"""The linear layers on a CPU: oneDNN's matrix product instead of the default one, inside engine steps.

More than half of a CPU engine step is the model's linear layers (measured by
``benchmarks/throughput_breakdown.py``). ``torch.nn.functional.linear`` on a
float32 CPU tensor goes to the BLAS torch was built with (Intel MKL in the x86
wheels). torch also ships oneDNN, which it uses for its own compiled CPU code
(``torch.ops.mkldnn._linear_pointwise``: the same product, float32 in and out,
no reduced precision). Which one is faster depends on the CPU: on the AMD EPYC
(Zen 4) development machine oneDNN ran layer-sized products about 2x faster, but
it costs about 10 µs more per call, so products under about a million
multiply-adds (a few rows through a small layer) are faster with ``F.linear``
(``python -m kvpaging.cpu_linear`` prints the comparison for the machine it runs on).

So, when the engine serves a float32 model on the CPU, every ``nn.Linear`` of
the model gets a ``forward`` that, **only while an engine step runs** and only
for products of at least ``MIN_MACS`` multiply-adds, calls oneDNN with the module's own
weight (no copy, nothing to keep in sync); otherwise it is the ordinary
``F.linear``. ``model.generate()`` on the same model object is untouched.
Nothing is changed when the op is missing, fails, or disagrees with ``F.linear``
on a probe product, or when ``KVPAGING_ONEDNN_LINEAR=0`` is set (for measuring
the difference; ``benchmarks/throughput.py --onednn-linear off``).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn.functional as F

__all__ = ["enable_onednn_linears", "use_onednn", "MIN_MACS"]

MIN_MACS = 1 << 20  # smaller products: F.linear (oneDNN's per-call cost outweighs its faster product)
ENV_SWITCH = "KVPAGING_ONEDNN_LINEAR"

_active = False  # True only inside ``use_onednn()`` (the runner wraps every step in it)
_checked: bool | None = None  # the probe's verdict, once run


def _onednn_linear():
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_usable() -> bool:
    """Whether oneDNN's linear runs here and agrees with ``F.linear`` on a probe product."""
    global _checked
    if _checked is None:
        op = _onednn_linear()
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(s, generator=g) for s in ((2, 16, 64), (48, 64), (48,)))
            _checked = op is not None and torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b),
                                                         rtol=1e-5, atol=1e-5)
        except (RuntimeError, TypeError, NotImplementedError):
            _checked = False
    return _checked


def _forward_for(module: torch.nn.Linear, op):
    out_features = module.out_features

    def forward(input: torch.Tensor) -> torch.Tensor:
        if _active and input.dim() >= 2 and input.numel() * out_features >= MIN_MACS:
            return op(input, module.weight, module.bias, "none", [], "")
        return F.linear(input, module.weight, module.bias)

    forward.kvpaging_onednn = True
    return forward


def enable_onednn_linears(model: torch.nn.Module) -> int:
    """Give every float32 CPU ``nn.Linear`` of ``model`` the step-gated oneDNN ``forward``
    (see the module docstring). Returns how many modules have it; 0 when oneDNN is not used."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not onednn_usable():
        return 0
    op = _onednn_linear()
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # subclasses (quantized, LoRA, ...) keep their own forward
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        if not getattr(module.forward, "kvpaging_onednn", False):
            module.forward = _forward_for(module, op)
        count += 1
    return count


@contextlib.contextmanager
def use_onednn():
    """Inside this block the patched linear layers use oneDNN. The model runner wraps every step's
    forward in it; ``serving.run_static_generate(onednn_linears=True)`` wraps ``generate()`` in it,
    to measure transformers with the same matrix products."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def _compare() -> None:
    """Print F.linear against oneDNN for layer-sized products on this machine."""
    op = _onednn_linear()
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
