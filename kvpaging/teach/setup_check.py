"""Lesson 00: is everything installed, which device will run the lessons, and does the engine agree with transformers?"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpaging.config import auto_attention_backend

__all__ = ["environment", "format_environment", "transformers_greedy", "engine_greedy", "GreedyAgreement",
           "greedy_agreement", "all_agree"]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions, the device and how Triton kernels would run here, as a plain dict."""
    cuda = torch.cuda.is_available()
    triton_version = _version("triton") if importlib.util.find_spec("triton") is not None else None
    if triton_version is None:
        triton_mode = "not installed: the engine uses its torch reference kernels"
    elif cuda:
        triton_mode = "compiled for the GPU (the engine's default attention backend here)"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        triton_mode = "interpreter (TRITON_INTERPRET=1): runs on the CPU, slowly; not the engine's default here"
    else:
        triton_mode = "installed, but no GPU: the engine uses its CPU kernels here"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": triton_version,
        "kvpaging": _version("kvpaging"),
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "triton_mode": triton_mode,
        "attention_backend": auto_attention_backend(torch.device("cuda" if cuda else "cpu")),
    }


def format_environment(env: dict) -> str:
    """The dict of :func:`environment` as aligned ``name: value`` lines."""
    width = max(len(k) for k in env)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in env.items())


@torch.no_grad()
def transformers_greedy(model, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """``num_tokens`` greedy tokens from transformers' own ``model.generate()`` (batch 1, no end token).

    The end-of-sequence id is switched off for the call (and restored after), so
    that generate() produces exactly ``num_tokens`` tokens, like the engine with
    ``ignore_eos=True``.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    saved = model.config.eos_token_id, model.generation_config.eos_token_id
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=0)
    finally:
        model.config.eos_token_id, model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def engine_greedy(llm, prompts: Sequence[Sequence[int]], num_tokens: int, use_tqdm: bool = True) -> list[list[int]]:
    """Greedy tokens for every prompt from a kvpaging ``LLM``, all prompts in one batch."""
    from kvpaging.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=use_tqdm)
    return [o.outputs[0].token_ids for o in outputs]


@dataclass(frozen=True)
class GreedyAgreement:
    """How an engine's greedy tokens compare with a reference's for one prompt."""

    identical: bool
    position: int | None = None  # the first token where they differ
    gap: float | None = None  # the reference's top-2 logit gap there
    tolerance: float | None = None  # a gap below this is a tie
    chosen_in_top2: bool = False  # the engine's token there is one of the reference's two best

    @property
    def agrees(self) -> bool:
        """Identical, or parted at a genuine tie: the engine took one of the two best logits, and those
        were equal up to rounding, so either is right."""
        return self.identical or (self.chosen_in_top2 and self.gap < self.tolerance)

    def __str__(self) -> str:
        if self.identical:
            return "identical"
        kind = "a tie within rounding" if self.agrees else "NOT a tie"
        return f"differ from token {self.position}: top-2 logit gap {self.gap:.3g} there ({kind}, tolerance {self.tolerance:.3g})"


def greedy_agreement(model, prompt: Sequence[int], got: Sequence[int], reference: Sequence[int],
                     tolerance: float | None = None) -> GreedyAgreement:
    """Compare ``got`` with ``reference`` (greedy continuations of ``prompt``); where they first differ, read the
    reference model's two best logits after the common prefix, from one plain forward pass.

    Greedy decoding picks the largest logit; when the two largest are equal up to the
    rounding of the model's dtype, the order in which the engine and transformers add
    the same numbers decides between them, and both answers are right. The default
    ``tolerance``: 1e-4 in float32 (as the package's tests use), and 1% of the largest
    logit in a 16-bit dtype, whose 8 bits of mantissa round at about 0.4%.
    """
    got, reference = list(got), list(reference)
    if got == reference:
        return GreedyAgreement(True)
    position = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + reference[:position]], device=device)
        logits = model(ids).logits[0, -1].float()
    top2 = torch.topk(logits, 2)
    gap = (top2.values[0] - top2.values[1]).item()
    if tolerance is None:
        dtype = next(model.parameters()).dtype
        tolerance = 1e-4 if torch.finfo(dtype).bits >= 32 else 0.01 * max(1.0, abs(top2.values[0].item()))
    chosen_in_top2 = position < len(got) and got[position] in top2.indices.tolist()
    return GreedyAgreement(False, position, gap, tolerance, chosen_in_top2)


def all_agree(model, prompts, got, reference) -> bool:
    """Whether each of ``got`` is ``reference``'s greedy continuation of its prompt, or differs from it only
    where the two best logits tie up to the dtype's rounding (:func:`greedy_agreement`): the check for two runs of
    one model that must give the same greedy tokens (batched differently, chunked, preempted and recomputed)."""
    return all(greedy_agreement(model, p, a, b).agrees for p, a, b in zip(prompts, got, reference, strict=True))
