"""Lesson 00: is everything installed, which device will run the lessons, and does the engine agree with transformers?"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
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
    gap: float | None = None  # how far below the best logit there the farther of the two tokens lies
    tolerance: float | None = None  # a gap up to this is a tie

    @property
    def agrees(self) -> bool:
        """Identical, or parted at a genuine tie: both tokens' logits were equal to the best up to rounding, so
        either is right."""
        return self.identical or self.gap <= self.tolerance

    def __str__(self) -> str:
        if self.identical:
            return "identical"
        kind = "a tie within rounding" if self.agrees else "NOT a tie"
        return (f"differ from token {self.position}: the two tokens lie up to {self.gap:.3g} below the best logit "
                f"there ({kind}, tolerance {self.tolerance:.3g})")


def greedy_agreement(model, prompt: Sequence[int], got: Sequence[int], reference: Sequence[int],
                     tolerance: float | None = None, reference_logits=None) -> GreedyAgreement:
    """Compare ``got`` with ``reference`` (greedy continuations of ``prompt``); where they first differ, read the
    reference model's logits after the common prefix, from one plain forward pass, or, given ``reference_logits``
    (one row per reference token: ``generate(..., output_logits=True, return_dict_in_generate=True).logits``), the
    very logits the reference chose its token from.

    Greedy decoding picks the largest logit; when the best logits are equal up to the rounding of the model's
    dtype, the order in which the engine and transformers add the same numbers decides between them, and each of
    those answers is right. So they agree there when both tokens' logits lie within ``tolerance`` of the best. The
    default ``tolerance``: 1e-4 in float32 (as the package's tests use); in a 16-bit dtype three units in the last
    place of the best logit (at 33, 0.75 in bfloat16: the logits of one forward pass in bfloat16 round to steps of
    0.25 there, and transformers' own ``generate()`` and a plain forward pass part by such a step).
    """
    got, reference = list(got), list(reference)
    if got == reference:
        return GreedyAgreement(True)
    position = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
    if reference_logits is not None and position < len(reference_logits):
        logits = reference_logits[position].reshape(-1).float()
    else:
        device = next(model.parameters()).device
        with torch.no_grad():
            ids = torch.tensor([list(prompt) + reference[:position]], device=device)
            logits = model(ids).logits[0, -1].float()
    best = logits.max().item()
    if tolerance is None:
        dtype = next(model.parameters()).dtype
        ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(1.0, abs(best))))
        tolerance = 1e-4 if torch.finfo(dtype).bits >= 32 else 3 * ulp
    # a sequence that ended at ``position`` has no token there: not a tie
    behind = [best - logits[seq[position]].item() if position < len(seq) else math.inf for seq in (got, reference)]
    return GreedyAgreement(False, position, max(behind), tolerance)


def all_agree(model, prompts, got, reference) -> bool:
    """Whether each of ``got`` is ``reference``'s greedy continuation of its prompt, or differs from it only
    where the two best logits tie up to the dtype's rounding (:func:`greedy_agreement`): the check for two runs of
    one model that must give the same greedy tokens (batched differently, chunked, preempted and recomputed)."""
    return all(greedy_agreement(model, p, a, b).agrees for p, a, b in zip(prompts, got, reference, strict=True))
