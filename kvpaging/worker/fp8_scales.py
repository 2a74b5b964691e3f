"""The FP8 KV cache's scales, calibrated from the data (``kv_cache_dtype="fp8"``).

An e4m3 number holds at most 448 in magnitude, so each layer's keys and values are stored divided by a scale
(one per KV head): ``amax / 448``, where ``amax`` is the largest magnitude that head's keys (or values) reach
over a calibration pass. Lesson 09 measures what this costs in accuracy (``kv_accuracy.py``).
"""

from __future__ import annotations

import torch

from kvpaging.kernels.fp8 import FP8_MAX, MIN_SCALE
from kvpaging.worker.self_check import not_routed_error
from kvpaging.worker.unpaged_attention import CALIBRATION_KWARG

__all__ = ["calibrate_fp8_scales"]


@torch.inference_mode()
def calibrate_fp8_scales(runner, calibration_tokens: list[list[int]] | None = None, seed: int = 0,
                         vocab_size: int | None = None):
    """Per-layer, per-KV-head FP8 scales from the data: amax / 448 over a calibration pass.

    The model runs once, unpaged, over a few calibration sequences (by
    default 4 x 256 random token ids from a fixed seed, since nothing is
    downloaded), while the attention function records the largest |key| and
    |value| of every KV head in every layer. Values beyond the calibrated
    range are clamped to +-448 when stored (saturation), never turned to NaN.
    ``vocab_size``: the range of the random ids (default: the LM head's rows; a tensor-parallel rank
    holds only a share of them and passes the whole model's, so every rank draws the same ids).
    """
    if calibration_tokens is None:
        vocab = vocab_size or runner.model.get_output_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(seed)
        calibration_tokens = torch.randint(0, vocab, (4, 256), generator=g).tolist()
    amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for tokens in calibration_tokens:
        ids = torch.tensor([tokens], dtype=torch.int64, device=runner.device)
        runner.model(input_ids=ids, use_cache=False, logits_to_keep=1, **{CALIBRATION_KWARG: amax})
    missing = [i for i in range(runner.num_layers) if i not in amax and runner.kv_layout[i].num_kv_heads]
    if missing:  # those layers' attention never came to our function (self_check.not_routed_error names it)
        raise not_routed_error(type(runner.model).__name__, missing, runner.num_layers)
    # (a layer's further calls, in caches after the layers', take its scales: calibrated over all its calls)
    return [((amax[i][0] / FP8_MAX).clamp(min=MIN_SCALE), (amax[i][1] / FP8_MAX).clamp(min=MIN_SCALE))
            if i in amax else (None, None) for i in (kv.of_layer if kv.of_layer >= 0 else j
                                                      for j, kv in enumerate(runner.kv_layout))]
